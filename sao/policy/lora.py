"""LoRA on the policy: peft adapters for the trainer, merged into a plain model for the samplers.

With `trainer.lora.rank` > 0 the trainer injects peft LoRA layers into the policy's language model
and trains only them and the memory projector; a published version is just those tensors. A
sampler keeps a plain model (no peft layers: nothing slows sampling, and a vLLM engine pushes the
plain HF model's tensors) and a copy of each adapted layer's base weight W0; each adapter state it
receives sets W = W0 + (alpha / rank) * B @ A in place. Which layers are adapted, and so which
tensors a published file must hold, follows from the config and the base model, never from a file.
"""

from __future__ import annotations

import torch
from torch import nn

from sao.config import LORA_ALL_LINEAR, LoraConfig
from sao.policy.model import MemoryPolicy

ADAPTER = "default"  # peft's adapter name: part of every published tensor's name


def adapted_linears(lm: nn.Module, targets: list[str]) -> dict[str, nn.Linear]:
    """The linear layers of `lm` that LoRA adapts, by module name: every one but the output layer, or those whose
    last name is in `targets`. ValueError naming a target that matches no layer."""
    output = lm.get_output_embeddings()
    linears = {name: module for name, module in lm.named_modules() if isinstance(module, nn.Linear) and module is not output}
    if targets == [LORA_ALL_LINEAR]:
        return linears
    chosen = {name: module for name, module in linears.items() if name.rsplit(".", 1)[-1] in targets}
    unmatched = sorted(set(targets) - {name.rsplit(".", 1)[-1] for name in chosen})
    if unmatched:
        known = sorted({name.rsplit(".", 1)[-1] for name in linears})
        raise ValueError(f"trainer.lora.targets {unmatched} match no linear layer of the model (its layers: {known})")
    return chosen


def adapter_names(module: str) -> tuple[str, str]:
    """The policy's names of the A and B matrices of the adapter on `lm`'s linear layer `module`."""
    return f"lm.{module}.lora_A.{ADAPTER}.weight", f"lm.{module}.lora_B.{ADAPTER}.weight"


def add_lora(policy: MemoryPolicy, lora: LoraConfig) -> None:
    """Inject LoRA adapters into `policy.lm` in place and freeze its base weights; the projector (and a value
    head) stay trainable. B starts at zero, so the policy computes exactly what it did."""
    from peft import LoraConfig as PeftLoraConfig  # imported here: seconds of start-up that only LoRA runs need
    from peft import inject_adapter_in_model

    modules = adapted_linears(policy.lm, lora.targets)
    policy.lm.requires_grad_(False)
    # Exact module names, not peft's own matching: the sampler's AdapterMerge picks the same layers.
    inject_adapter_in_model(PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                                           target_modules=sorted(modules)), policy.lm, adapter_name=ADAPTER)


def trainable_state(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a LoRA policy publishes: what it trains, but the trainer's own value head."""
    return {name: parameter for name, parameter in policy.named_parameters()
            if parameter.requires_grad and not name.startswith("value_head.")}


class AdapterMerge:
    """A sampler's plain policy that takes adapter states: W = W0 + (alpha / rank) * B @ A per adapted layer.

    Attach it once the policy is placed (device and dtype): the copies of W0 are made there.
    """

    def __init__(self, policy: MemoryPolicy, lora: LoraConfig):
        self.policy = policy
        self.rank = lora.rank
        self.scale = lora.alpha / lora.rank
        self.linears = adapted_linears(policy.lm, lora.targets)
        self.base = {name: linear.weight.detach().clone() for name, linear in self.linears.items()}

    def layout(self) -> dict[str, torch.Tensor]:
        """What a published file must hold, as meta tensors of the right names and shapes: A [rank, in] and
        B [out, rank] per adapted layer, and the projector."""
        layout = {}
        for module, linear in self.linears.items():
            a_name, b_name = adapter_names(module)
            layout[a_name] = torch.empty(self.rank, linear.in_features, device="meta")
            layout[b_name] = torch.empty(linear.out_features, self.rank, device="meta")
        for name, tensor in self.policy.projector.state_dict(prefix="projector.").items():
            layout[name] = torch.empty_like(tensor, device="meta")
        return layout

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Merge an adapter state (names and shapes as `layout`, already checked) into the model in place."""
        for module, linear in self.linears.items():
            a_name, b_name = adapter_names(module)
            device = linear.weight.device
            update = state[b_name].to(device, torch.float32) @ state[a_name].to(device, torch.float32)
            linear.weight.copy_(self.base[module].float() + self.scale * update)  # copy_ casts to the model's dtype
        projector = {name.removeprefix("projector."): tensor for name, tensor in state.items()
                     if name.startswith("projector.")}
        self.policy.projector.load_state_dict(projector)


def attach_adapter_merge(policy: MemoryPolicy, lora: LoraConfig) -> MemoryPolicy:
    """`policy`, set to take a LoRA run's published adapters (see `AdapterMerge`) when `lora.rank` > 0."""
    if lora.rank:
        policy.adapters = AdapterMerge(policy, lora)
    return policy
