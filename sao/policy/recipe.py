"""Version 0 of the policy, resolved once from the config: what samplers, scorers and the trainer all build.

The chain is encoder width -> memory bottleneck -> memory width -> projector (composed with the
bottleneck) -> adapters (the trainer adds LoRA adapters; a sampler merges the published ones). Every
process builds its policy from a `PolicyRecipe`, so the trainer and its samplers read memory the
same way by construction, not by care.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sao.compression.bottleneck import Bottleneck, basis_name, describe, memory_width, resolve_bottleneck
from sao.compression.semantic import encoder_dim, encoder_name
from sao.config import SaoConfig
from sao.config.section import Precision
from sao.policy.lora import add_lora, attach_adapter_merge
from sao.policy.model import MemoryPolicy
from sao.policy.weights import build_policy, place_for_sampling


@dataclass(frozen=True)
class PolicyRecipe:
    config: SaoConfig
    encoder_dim: int  # the sentence encoder's width, read from its folder (no model load)
    bottleneck: Bottleneck | None  # memory slots travel as its coordinates; None: the encoder's full width

    @classmethod
    def from_config(cls, config: SaoConfig) -> PolicyRecipe:
        encoder = config.compression.encoder
        return cls(config, encoder_dim(encoder), resolve_bottleneck(config.compression.bottleneck, encoder_name(encoder)))

    @property
    def memory_width(self) -> int:
        """Numbers in a memory slot: the bottleneck's width, else the encoder's."""
        return memory_width(self.bottleneck, self.encoder_dim)

    @property
    def basis(self) -> str:
        """What a trajectory's `memory_basis` must say."""
        return basis_name(self.bottleneck)

    def describe(self) -> str:
        return describe(self.bottleneck, self.encoder_dim)

    def build(self, value_head: bool = False) -> MemoryPolicy:
        """The LM with its projector as `policy.projector` names it, composed with the bottleneck."""
        return build_policy(self.config.policy, self.memory_width, value_head, self.config.compression.encoder,
                            self.bottleneck)

    def add_adapters(self, policy: MemoryPolicy) -> None:
        """The trainer's LoRA adapters (`trainer.lora`), drawn from `policy.seed`: the same in every trainer and replay."""
        if self.config.trainer.lora.rank:
            torch.manual_seed(self.config.policy.seed)
            add_lora(policy, self.config.trainer.lora)

    def for_sampling(self, device: str | None = None, precision: Precision | None = None) -> MemoryPolicy:
        """As a sampler holds it: placed on `device` in `precision` (default sampler.device, sampler.precision), set
        to merge a LoRA run's adapters."""
        sampler = self.config.sampler
        precision = precision or sampler.precision
        on_cpu = (device or sampler.device) == "cpu" or not torch.cuda.is_available()
        if precision == "auto" and sampler.engine.type == "vllm" and on_cpu:
            precision = "fp32"  # vLLM's CPU build in bf16 strays from sao's bf16 loop past its reload probe's tolerance
        policy = place_for_sampling(self.build(), device or sampler.device, precision)
        return attach_adapter_merge(policy, self.config.trainer.lora)
