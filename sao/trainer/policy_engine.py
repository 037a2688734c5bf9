"""Version 0 of the trainer's policy wrapped in its DeepSpeed engine: what the trainer and `sao replay` both start from."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sao.config import SaoConfig
from sao.policy.recipe import PolicyRecipe
from sao.policy.weights import frozen_copy
from sao.trainer.batch import HindsightReply
from sao.trainer.distributed import world_size
from sao.trainer.engine import batch_layout, build_engine, cpu_autocast
from sao.trainer.hindsight import hindsight_replies
from sao.trainer.validation import TrajectoryValidator

log = logging.getLogger(__name__)


@dataclass
class PolicyEngine:
    engine: object  # the DeepSpeed engine
    validator: TrajectoryValidator  # what a trajectory must be to fit this policy
    base_policy: torch.nn.Module | None  # a frozen copy of version 0 (trainer.keeps_base_policy), else None
    memory_width: int
    batch_size: int  # trajectories per step (DeepSpeed's train_batch_size)
    accumulation: int  # gradient-accumulation chunks per step on each rank
    hindsight_reply: HindsightReply | None  # a hindsight row's answer where not the retry's (trainer.hindsight_reply)


def build_policy_engine(config: SaoConfig, started: Callable[[str], None] = lambda phase: None) -> PolicyEngine:
    """The policy (and its frozen base copy), then the DeepSpeed engine. `started(phase)` closes the phases
    "model" and "engine" of a caller timing its start-up."""
    recipe = PolicyRecipe.from_config(config)
    log.info(recipe.describe())
    policy = recipe.build(config.trainer.value_head)
    validator = TrajectoryValidator.for_model(policy, recipe.memory_width, config, recipe.basis)  # before DeepSpeed wraps it
    # Copied before ZeRO-3 (several ranks) partitions the policy's parameters in place: the weights of version 0.
    base_policy = frozen_copy(policy) if config.trainer.keeps_base_policy else None
    recipe.add_adapters(policy)
    for model in (policy, base_policy):
        if model is not None:
            model.cpu_autocast_bf16 = cpu_autocast(config.trainer)
    started("model")
    # What exists now (modules, the model) lives as long as the process: frozen out of the cyclic
    # collector's sight, it is not rescanned by ZeRO-3's set-up gc.collect() or later full collections.
    gc.freeze()
    engine = build_engine(policy, config.trainer)
    if base_policy is not None:  # rows are scored on the engine's device: a GPU's, where there is one
        base_policy.to(engine.device)
    batch_size, accumulation = batch_layout(config.trainer, world_size())
    started("engine")
    return PolicyEngine(engine, validator, base_policy, recipe.memory_width, batch_size, accumulation,
                        hindsight_replies(config))
