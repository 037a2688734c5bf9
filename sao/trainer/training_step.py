"""One optimizer step over a batch, keeping out of the weights whatever cannot be trained on.

Two failures end here instead of ending the trainer; each returns the trajectories at fault so
the loop can dead-letter them:
- A trajectory that raises while scored. With one rank the engine is put back in order, each
  trajectory of the batch is scored alone (forward only) to find those that raise, and the
  batch is scored again without them (`scoring-error`). With several ranks the error is raised:
  the other ranks wait in a collective the failing rank never joins, so no rank can recover
  alone. Validation before buffering (`sao/trainer/validation.py`) dead-letters everything known to
  raise here, so this is the net under it, not the filter.
- A non-finite loss or gradient norm. A rank whose loss is not finite back-propagates NaN on
  purpose, so DeepSpeed's global gradient-norm check (all-reduced: every rank decides alike)
  drops the step: weights, optimizer state and learning-rate schedule stay as they were. The
  whole batch is returned (`non-finite-loss` or `non-finite-gradient`) and its rewards must not
  reach the baselines.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sao.config import TrainerConfig
from sao.dead_letters import DeadLetterReason
from sao.schema import Trajectory
from sao.status import StepRecord, attempt_success
from sao.trainer.batch import BatchPlan, Row, all_rows, micro_batches, rank_loss
from sao.trainer.distributed import agreed_max, all_reduce_stats, rank, world_size
from sao.trainer.engine import reset_after_failed_pass
from sao.trainer.objectives import LossStats

log = logging.getLogger(__name__)


@dataclass
class StepOutcome:
    plan: BatchPlan | None  # what was scored: the batch without the trajectories that raised (None: nothing left)
    stats: LossStats | None
    applied: bool  # the optimizer changed the weights
    # (trajectory, reason, detail) of each trajectory dead-lettered
    dead_letters: list[tuple[Trajectory, DeadLetterReason, str]] = field(default_factory=list)
    forward_backward_s: float = 0.0
    optimizer_s: float = 0.0
    interrupted: bool = False  # stopped between two passes: nothing applied, the batch is to be trained later
    passes: list[list[Row]] = field(default_factory=list)  # this rank's micro-batches of (index, turns) rows

    def record(self, step: int, trained_version: int, grad_norm: float | None, learning_rate: float,
               phase_s: dict[str, float], step_s: float) -> StepRecord:
        """An applied step's record for the progress file and Prometheus, its phases' seconds in `phase_s`."""
        plan, stats, now = self.plan, self.stats, time.time()
        attempts = [attempt_success([turn.reward for turn in t.steps]) for t in plan.trajectories]
        return StepRecord(
            step=step, policy_version=trained_version, trained_at=now,
            rewards=[t.total_reward for t in plan.trajectories],
            advantages=[a for turns in plan.advantages for a in turns],
            behaviour_versions=[t.behaviour_version for t in plan.trajectories], staleness=list(plan.staleness),
            compression_ratios=[t.compression.get("ratio", 1.0) for t in plan.trajectories],
            sampling_to_training_s=[now - t.created_at for t in plan.trajectories],
            loss=stats.loss, ratio_mean=stats.ratio_mean, ratio_abs_dev=stats.ratio_abs_dev,
            clip_fraction=stats.clip_fraction, kl_k3=stats.kl_k3, value_loss=stats.value_loss,
            token_nll=stats.token_nll, kl_to_base=stats.kl_to_base if math.isfinite(stats.kl_to_base) else None,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), step_s=step_s,
            learning_rate=learning_rate, wait_s=phase_s["wait"], forward_backward_s=phase_s["forward_backward"],
            optimizer_s=phase_s["optimizer"], publish_s=phase_s["publish"],
            first_attempt_success=[first for first, _ in attempts],
            second_attempt_success=[second for _, second in attempts])

    @property
    def skipped_reason(self) -> DeadLetterReason | None:
        """Why a scored batch was not applied (non-finite-loss or non-finite-gradient)."""
        if self.applied or self.stats is None:
            return None
        if not math.isfinite(self.stats.loss):
            return DeadLetterReason.NON_FINITE_LOSS
        return DeadLetterReason.NON_FINITE_GRADIENT


def train_step(engine, plan: BatchPlan, replan: Callable[[list[Trajectory]], BatchPlan], cfg: TrainerConfig,
               memory_width: int, accumulation: int, stop_requested: Callable[[], bool] = lambda: False,
               base_policy: torch.nn.Module | None = None) -> StepOutcome:
    """Score `plan` and step; `replan` makes the plan of a smaller batch (advantages depend on the batch).
    `base_policy`: a frozen copy of the base, for the KL to it (`TrainerConfig.keeps_base_policy`).

    `stop_requested` is asked between forward passes: a stop (SIGTERM) then waits for one pass at
    most, and the step is abandoned with nothing applied.
    """
    dead_letters: list[tuple[Trajectory, DeadLetterReason, str]] = []
    while True:
        try:
            outcome = _forward_backward_step(engine, plan, cfg, memory_width, accumulation, stop_requested, base_policy)
            if outcome.interrupted:
                return outcome
            break
        except Exception as err:  # whatever one trajectory triggers must not stop the trainer
            if world_size() > 1:
                raise
            reset_after_failed_pass(engine)
            unscorable = _unscorable(engine, plan, cfg, memory_width)
            if not unscorable:  # not one trajectory's fault but the batch's (its memory, say), or the trainer's
                raise RuntimeError(f"training on a batch of {len(plan.trajectories)} failed ({type(err).__name__}: {err}), "
                                   "yet each of its trajectories scores alone; if it ran out of memory, lower "
                                   "trainer.micro_batch_tokens") from err
            dead_letters += unscorable
            failed = {id(t) for t, _, _ in unscorable}
            kept = [t for t in plan.trajectories if id(t) not in failed]
            if not kept:
                return StepOutcome(None, None, False, dead_letters)
            plan = replan(kept)
    outcome.dead_letters = dead_letters
    if outcome.skipped_reason:
        detail = (f"the batch's loss was {outcome.stats.loss}; the step was skipped" if
                  outcome.skipped_reason == DeadLetterReason.NON_FINITE_LOSS else
                  f"the batch's gradient norm was {engine.get_global_grad_norm()}; the step was skipped")
        outcome.dead_letters += [(t, outcome.skipped_reason, detail) for t in outcome.plan.trajectories]
    elif not math.isfinite(outcome.stats.loss):
        raise RuntimeError("DeepSpeed applied a step whose loss was not finite; sao relies on ZeRO's gradient-norm "
                           "check to skip such steps (DeepSpeed 0.19 does). The weights may now hold NaN.")
    return outcome


def _forward_backward_step(engine, plan: BatchPlan, cfg: TrainerConfig, memory_width: int, accumulation: int,
                           stop_requested: Callable[[], bool], base_policy: torch.nn.Module | None) -> StepOutcome:
    """Forward, backward and optimizer step over the batch: `accumulation` chunks of trajectories,
    shared among the ranks, each scored in passes of at most `trainer.micro_batch_tokens` positions."""
    ranks, count = world_size(), len(plan.trajectories)
    normaliser = count / (accumulation * ranks)  # DeepSpeed divides each pass's loss by `accumulation`
    passes = []
    for first in range(accumulation):
        mine = list(range(count))[first::accumulation][rank()::ranks]
        passes += micro_batches(plan, mine, cfg.micro_batch_tokens, cfg.sequence_level_ratio)
    # ZeRO-3 gathers parameters collectively in every pass: each rank makes as many, idle ones at weight 0.
    passes += [[]] * (agreed_max(len(passes), engine.device) - len(passes))
    parts, forward_backward_s, optimizer_s = [], 0.0, 0.0
    for index, rows in enumerate(passes):
        # Said outright rather than counted by DeepSpeed: after a pass that raised half-way its
        # count of micro-steps is off, and the retried batch would step in the middle.
        engine.set_gradient_accumulation_boundary(index == len(passes) - 1)
        t0 = time.perf_counter()
        loss, stats = rank_loss(engine, plan, rows, normaliser, cfg, memory_width, base_policy)
        if not torch.isfinite(loss):
            # A NaN seed gradient makes every gradient it reaches NaN: DeepSpeed then skips the
            # step on all ranks, and the gradients of earlier passes go with it.
            loss = loss * float("nan")
        engine.backward(loss)
        forward_backward_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        engine.step()
        optimizer_s += time.perf_counter() - t1
        if rows or not parts:
            parts.append(stats)
        if index < len(passes) - 1 and agreed_max(int(stop_requested()), engine.device):
            reset_after_failed_pass(engine)  # drops the gradients of the passes so far
            return StepOutcome(plan, None, False, interrupted=True)
    stats = all_reduce_stats(parts, accumulation * ranks, engine.device)
    return StepOutcome(plan, stats, bool(engine.was_step_applied()), forward_backward_s=forward_backward_s,
                       optimizer_s=optimizer_s, passes=[rows for rows in passes if rows])


def _unscorable(engine, plan: BatchPlan, cfg: TrainerConfig,
                memory_width: int) -> list[tuple[Trajectory, DeadLetterReason, str]]:
    """The trajectories of `plan` that raise when scored alone (forward only), with their errors."""
    failed = []
    for index, trajectory in enumerate(plan.trajectories):
        alone = plan.alone(index)
        try:
            with torch.no_grad():
                rank_loss(engine, alone, all_rows(alone, [0]), 1.0, cfg, memory_width)
        except Exception as err:  # noqa: BLE001 - the error is the finding: it goes to the DLQ with the trajectory
            reset_after_failed_pass(engine)
            log.warning("trajectory %s raises when scored: %s: %s", trajectory.trajectory_id, type(err).__name__, err)
            failed.append((trajectory, DeadLetterReason.SCORING_ERROR, f"{type(err).__name__}: {err}"[:2000]))
    return failed
