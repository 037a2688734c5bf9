"""DeepSpeed engine: distributed setup, the config sao derives, weight gathering, recovery from a failed pass.

Several ranks (or an offloaded optimizer, or a GPU) train with ZeRO-3. One CPU rank has nothing to
partition: there DeepSpeed runs without ZeRO (stage 0) and without its all-reduce of a world of one,
and `ClippedAdamW` clips and skips a non-finite step as ZeRO's optimizer does, so the guarantees hold
and the step costs what a plain PyTorch step costs. `trainer.deepspeed` may still ask for a stage.

On CPU: gloo, fp32, and no JIT-compiled ops (the shm comm op and DeepSpeed's own Adam each
cost minutes of compilation on a fresh machine, so torch's AdamW is passed in). On GPU: NCCL and
bf16. The user's `trainer.deepspeed` table is merged over what sao derives.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from sao.config import TrainerConfig
from sao.policy.lora import trainable_state
from sao.policy.precision import uses_bf16
from sao.policy.weights import unique_state_dict
from sao.transport.broker import free_port


def init_distributed() -> None:
    """Join (or, when launched alone, create) the process group DeepSpeed needs."""
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    # Launched without torchrun/deepspeed: a world of one. Without these DeepSpeed tries MPI.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if not torch.cuda.is_available():
        # Written through vars(), never read first: reading it probes every DeepSpeed op for buildability
        # (compiler subprocesses), and on CPU sao builds none.
        vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def batch_layout(trainer: TrainerConfig, world_size: int) -> tuple[int, int]:
    """(trajectories per optimizer step, gradient-accumulation micro-batches).

    DeepSpeed's own keys in `trainer.deepspeed` win, so batch settings live in one place:
    train_batch_size (else trainer.batch_size) and gradient_accumulation_steps (else 1). Each
    rank scores about train_batch_size / (accumulation * world_size) trajectories per
    micro-batch; sao splits uneven batches itself and normalises the loss accordingly.
    """
    user = user_deepspeed_config(trainer)
    return int(user.get("train_batch_size", trainer.batch_size)), int(user.get("gradient_accumulation_steps", 1))


def user_deepspeed_config(trainer: TrainerConfig) -> dict[str, Any]:
    """The user's DeepSpeed settings: the JSON file, then the inline table over it."""
    from_file: dict[str, Any] = {}
    if trainer.deepspeed_config:
        path = Path(trainer.deepspeed_config).expanduser()
        try:
            from_file = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"trainer.deepspeed_config {path}: cannot read a JSON object ({err})") from err
    return _merge(from_file, trainer.deepspeed)


def _uses_zero(trainer: TrainerConfig, world_size: int) -> bool:
    """Whether the engine uses ZeRO (stage 3 unless `trainer.deepspeed` names another): several ranks to share the
    state among, an optimizer to offload or bf16 on a GPU; else (one CPU rank) there is nothing to partition."""
    zero = user_deepspeed_config(trainer).get("zero_optimization", {})
    if "stage" in zero:
        return zero["stage"] > 0
    offloads = trainer.offload_optimizer or "offload_optimizer" in zero or "offload_param" in zero
    return world_size > 1 or offloads or torch.cuda.is_available()


def deepspeed_config(trainer: TrainerConfig, world_size: int) -> dict[str, Any]:
    batch, accumulation = batch_layout(trainer, world_size)
    micro = -(-batch // (accumulation * world_size))  # ceil: DeepSpeed only uses these for bookkeeping
    zero = _uses_zero(trainer, world_size)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world_size,
        # Without ZeRO, ClippedAdamW clips (DeepSpeed's own clipping would not skip a non-finite step).
        "gradient_clipping": trainer.grad_clip if zero else 0.0,
        "zero_optimization": {"stage": 3 if zero else 0, "stage3_gather_16bit_weights_on_model_save": True},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if torch.cuda.is_available() and resolved_precision(trainer) == "bf16":
        config["bf16"] = {"enabled": True}
    if trainer.offload_optimizer:
        # torch's AdamW steps the offloaded state on the CPU (zero_force_ds_cpu_optimizer above allows it);
        # DeepSpeedCPUAdam, DeepSpeed's usual choice here, is a JIT-compiled op (see the docstring).
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return _merge(config, user_deepspeed_config(trainer))


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips the gradients' norm first and skips a step whose norm is not finite, reporting both
    as ZeRO's optimizer does (`_global_grad_norm`, `overflow`: DeepSpeed's engine reads them after a step,
    keeps the learning-rate schedule still and says the step was not applied). For an engine without ZeRO."""

    def __init__(self, params, max_norm: float, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.max_norm, self.overflow, self._global_grad_norm = max_norm, False, None

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)  # trainer.grad_clip is > 0
        self._global_grad_norm = float(norm)
        self.overflow = not torch.isfinite(norm)
        return None if self.overflow else super().step(closure)


def resolved_precision(trainer: TrainerConfig) -> str:
    """trainer.precision with auto resolved on this machine, "bf16" or "fp32": the trajectory log records it, so a
    replay recomputes in the run's precision."""
    return "bf16" if uses_bf16(trainer.precision, "cuda" if torch.cuda.is_available() else "cpu") else "fp32"


def cpu_autocast(trainer: TrainerConfig) -> bool:
    """Whether the policy's decoder runs under bf16 autocast (`MemoryPolicy.cpu_autocast_bf16`): bf16 on a CPU. A
    GPU's bf16 is DeepSpeed's (`deepspeed_config`)."""
    return not torch.cuda.is_available() and resolved_precision(trainer) == "bf16"


def build_engine(model: torch.nn.Module, trainer: TrainerConfig):
    """Wrap `model` in a DeepSpeed engine with AdamW over its trainable parameters (a LoRA policy's adapters and
    projector); returns the engine."""
    import deepspeed

    if trainer.warmup_steps and "scheduler" in user_deepspeed_config(trainer):
        raise ValueError("trainer.warmup_steps: set it or a DeepSpeed scheduler in trainer.deepspeed, not both "
                         "(each would set the learning rate)")
    init_distributed()
    world = torch.distributed.get_world_size()
    config = deepspeed_config(trainer, world)
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    settings = {"lr": trainer.optimizer_learning_rate, "weight_decay": trainer.weight_decay,
                "fused": trainer.fused_adamw or None}
    zero = config["zero_optimization"]["stage"] > 0
    optimizer = (torch.optim.AdamW(trainable, **settings) if zero
                 else ClippedAdamW(trainable, max_norm=trainer.grad_clip, **settings))
    with _without_setup_waste():
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if zero:
        _skip_reduce_scatter_onto_itself()
    elif world == 1:
        engine.enable_backward_allreduce = False  # an all-reduce over one rank copies every gradient for nothing
    return engine


def learning_rate_at(trainer: TrainerConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (1 = the first): `trainer.optimizer_learning_rate` after a
    linear warm-up over `trainer.warmup_steps`."""
    if step >= trainer.warmup_steps:
        return trainer.optimizer_learning_rate
    return trainer.optimizer_learning_rate * max(step, 1) / trainer.warmup_steps


def set_learning_rate(engine, learning_rate: float) -> None:
    """Set the rate the engine's next optimizer step uses (every parameter group)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = learning_rate


def _skip_reduce_scatter_onto_itself() -> None:
    """Let ZeRO-3's gradient reduce-scatter skip a group of one rank (DeepSpeed 0.19.8).

    ZeRO-3 reduce-scatters every gradient bucket into the calling rank's chunk of it. With one rank
    that chunk is the whole bucket, a view of the same memory, so the result is already there; yet
    gloo still runs the collective over it, a cost that grows with the parameter count (measured:
    benchmarks/README.md). A collective whose group has
    one rank and whose output is its input is skipped; every other call goes to DeepSpeed's own.
    """
    from deepspeed.runtime.comm import coalesced_collectives

    original = coalesced_collectives._torch_reduce_scatter_fn
    if getattr(original, "skips_one_rank", False):
        return

    def reduce_scatter(input_tensor, output_tensor, group=None, async_op=False, prof=False):
        onto_itself = (output_tensor.data_ptr() == input_tensor.data_ptr()
                       and output_tensor.numel() == input_tensor.numel())
        if onto_itself and torch.distributed.get_world_size(group) == 1:
            return None  # DeepSpeed drops the return value of a synchronous call
        return original(input_tensor, output_tensor, group=group, async_op=async_op, prof=prof)

    reduce_scatter.skips_one_rank = True
    coalesced_collectives._torch_reduce_scatter_fn = reduce_scatter


@contextmanager
def _without_setup_waste() -> Iterator[None]:
    """Skip two costs of `deepspeed.initialize` (0.19.8) that buy sao nothing (measured on a restart).

    - ZeRO's optimizer checks import DeepSpeed's Muon optimizer only to compare types with it, and
      that module wraps its kernels in torch.compile on import, which loads torch._inductor (seconds,
      measured: benchmarks/README.md). sao steps torch's AdamW and compiles nothing: meanwhile torch.compile returns the
      function unchanged (TORCHDYNAMO_DISABLE is read by each call).
    - ZeRO-3's optimizer formats all its arguments into a debug message that it then drops
      (stage3.py: `print_rank_0(f"... {locals()}")`), printing the values of every parameter
      (seconds for a 135M model): meanwhile a parameter prints as its shape.
    """
    saved_env, saved_repr = os.environ.get("TORCHDYNAMO_DISABLE"), torch.nn.Parameter.__repr__
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    torch.nn.Parameter.__repr__ = lambda parameter: f"Parameter(shape={tuple(parameter.shape)})"
    try:
        yield
    finally:
        torch.nn.Parameter.__repr__ = saved_repr
        if saved_env is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = saved_env


def gather_full_state(engine) -> dict[str, torch.Tensor]:
    """Every rank joins the gather; the full fp32 state dict is returned (cloned, CPU)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        # Copy inside the context: outside it the partitioned tensors are empty again.
        return unique_state_dict(engine.module.state_dict())


def gather_adapter_state(engine) -> dict[str, torch.Tensor]:
    """A LoRA policy's published tensors (sao/policy/lora.py), gathered alone (cloned fp32, CPU); every rank joins."""
    import deepspeed

    state = trainable_state(engine.module)
    with deepspeed.zero.GatheredParameters(list(state.values()), modifier_rank=None):
        return unique_state_dict(state)


def training_state(engine) -> dict[str, Any]:
    """This rank's weights and AdamW state, to return training to where it stands (live tensors: copy them).
    ZeRO's optimizer state holds its fp32 master partitions; a plain optimizer's holds no weights, so the
    trainable ones go beside it."""
    if engine.zero_optimization():
        return engine.optimizer.state_dict()
    weights = {name: p.detach() for name, p in engine.module.named_parameters() if p.requires_grad}
    return {"optimizer": engine.optimizer.state_dict(), "weights": weights}


def restore_training_state(engine, state: dict[str, Any]) -> None:
    """Put back what `training_state` returned (every rank calls it)."""
    if engine.zero_optimization():
        # DeepSpeed reads the entry of this rank's index: each rank passes its own state there.
        engine.optimizer.load_state_dict([state] * torch.distributed.get_world_size(), load_optimizer_states=True)
        return
    engine.optimizer.load_state_dict(state["optimizer"])
    with torch.no_grad():
        for name, parameter in engine.module.named_parameters():
            if parameter.requires_grad:
                parameter.copy_(state["weights"][name])


_GLOO_SETTLE_S = 0.5  # generous: under load the worker thread waits its turn for a core


def shutdown() -> None:
    import deepspeed

    if torch.distributed.is_initialized():
        deepspeed.comm.barrier()
        torch.distributed.destroy_process_group()
        # A gloo worker thread drops the barrier's work (and with it the last reference to earlier
        # collectives' tensors, which takes the GIL) just after the barrier returns. Should the
        # interpreter already be finalizing, that thread aborts the process (SIGABRT, "terminate called
        # without an active exception") after a run that succeeded. Sleeping hands it the GIL first.
        time.sleep(_GLOO_SETTLE_S)


def memory_per_rank(engine) -> dict[str, int]:
    """Bytes this rank holds for parameters (its ZeRO-3 partitions) and optimizer state."""
    params = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() if hasattr(p, "ds_tensor")
                 else p.numel() * p.element_size() for p in engine.module.parameters())
    zero_optimizer = engine.optimizer
    inner = getattr(zero_optimizer, "optimizer", zero_optimizer)
    state = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
    masters = sum(t.numel() * t.element_size() for t in getattr(zero_optimizer, "fp32_partitioned_groups_flat", []))
    return {"param_bytes": int(params), "optimizer_state_bytes": int(state), "master_weight_bytes": int(masters)}


def reset_after_failed_pass(engine) -> None:
    """Put the engine back in order after a forward or backward raised half-way (one rank only).

    ZeRO-3 leaves the parameters gathered and marked in use by the module that raised, and the
    next pass would refuse to run; this releases them all and drops any partial gradients.
    With several ranks nothing can be recovered: the others wait in a collective.
    """
    engine.empty_partition_cache()
    coordinator = getattr(getattr(engine.optimizer, "parameter_offload", None), "get_param_coordinator", None)
    if coordinator is not None:
        coordinator().reset_step()  # the recorded order of module fetches ended mid-way
    engine.optimizer.zero_grad()
