"""`sao replay`: rebuild a run's published versions from its base weights and its trajectory log, without a broker.

The log (sao/trainer/archive.py) says what each step trained on, in which order, and where a shadow
rollback returned; replay trains on exactly that with the trainer's own code (the same engine set-up,
batch plan, loss and step) and the same torch threads, and does what the log says rather than
deciding again: a rollback restores the optimizer state replay saved at the version it returns to.
Each version it rebuilds is hashed as the publisher hashes it and checked against the hash the run
published; the first difference stops it, naming the step, the version, the tensor and, while the
run still keeps that version's file, the largest absolute difference.

A run trained on several ranks replays on as many (`sao replay` launches them under
torch.distributed.run): each rank scores the share of each batch it scored in the run, so the same
gradients meet in the same reductions. The log holds rank 0's micro-batches, checked on rank 0; any
check that fails on one rank stops every rank, since the others would wait in a collective.

With overrides (`--set trainer.KNOB=VALUE`) the same trajectories train another setting: nothing is
checked (the versions are meant to differ) and each version is written to `out`, as the publisher
writes whole files. The importance ratios are then against the new policy, recomputed as the
trainer always does; the behaviour log-probs stay those the samplers recorded.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sao.config import SaoConfig, load_config
from sao.envs.registry import turn_credit
from sao.policy.chain import read_version_state
from sao.policy.deltas import PUBLISH_DTYPES, cast_state, state_sha256, tensor_sha256s
from sao.run_dir import RunDir
from sao.schema import Trajectory, decode
from sao.trainer.archive import Position, TrajectoryLog, logged_passes
from sao.trainer.baselines import RewardBaseline
from sao.trainer.batch import plan_batch, record_rewards
from sao.trainer.distributed import agreed_max
from sao.trainer.engine import learning_rate_at, set_learning_rate, shutdown
from sao.trainer.policy_engine import PolicyEngine, build_policy_engine
from sao.trainer.publisher import PolicyPublisher, policy_state
from sao.trainer.snapshots import OptimizerSnapshots
from sao.trainer.training_step import train_step

log = logging.getLogger(__name__)


class ReplayMismatch(RuntimeError):
    """A rebuilt version, or a step's inputs, differ from what the run recorded."""


class CannotReplay(ValueError):
    """The log does not start at the base weights, or the run is one replay cannot rebuild."""


@dataclass
class ReplayResult:
    steps: int = 0  # optimizer steps replayed
    versions: int = 0  # versions rebuilt
    checked: int = 0  # of those, checked against the run's hashes
    seconds: float = 0.0


def replay_config(log_record: dict[str, Any], overrides: list[str]) -> SaoConfig:
    """The run's trainer config as its log recorded it, with `overrides` (section.knob=value) applied."""
    with tempfile.TemporaryDirectory(prefix="sao-replay-") as folder:
        path = Path(folder) / "config.toml"
        path.write_text(log_record["config"])
        config = load_config(path, overrides, environ={})
    update: dict[str, Any] = {"turn_credit": turn_credit(config)}
    if "precision" in log_record and not any(o.startswith("trainer.precision") for o in overrides):
        update["precision"] = log_record["precision"]  # what `auto` resolved to on the run's machine
    resolved = config.trainer.model_copy(update=update)
    return config.model_copy(update={"trainer": resolved})


class Replay:
    def __init__(self, run_dir: Path, overrides: list[str] | None = None, out: Path | None = None):
        self.run_dir = RunDir(run_dir)
        self.log = TrajectoryLog.read(self.run_dir.trajectory_log)
        first = self.log.first_life()
        if first["step"] != 0:
            raise CannotReplay(f"{self.run_dir.trajectory_log} starts at step {first['step']}, not at the base "
                                 "weights (its trainer resumed after the log was lost): nothing to replay from")
        ranks, launched = self.log.world_size(), int(os.environ.get("WORLD_SIZE", "1"))
        if ranks != launched:
            raise CannotReplay(f"the run trained on {ranks} ranks and this replay has {launched}: replay it on as "
                               "many (`sao replay` launches them itself)")
        self.leader = os.environ.get("RANK", "0") == "0"
        self.overrides = list(overrides or [])
        # Another setting written elsewhere is meant to give other versions; alone, it shows where they part.
        self.check = out is None or not self.overrides
        self.config = replay_config(first, self.overrides)
        self.out = RunDir(out) if out is not None else None
        self.result = ReplayResult()
        # Where each rollback returns (its target's optimizer state is saved on the way), by the version it published.
        self.rollbacks = {event["published_as"]: event for event in self.log.events if event["kind"] == "rollback"}
        self.targets = {event["to_version"] for event in self.rollbacks.values()}

    def run(self) -> ReplayResult:
        """Replay the run (see the module docstring); raises ReplayMismatch at the first difference."""
        started = time.perf_counter()
        torch.set_num_threads(self.log.first_life()["torch_threads"])
        built = build_policy_engine(self.config)
        folder = tempfile.TemporaryDirectory(prefix="sao-replay-snapshots-")
        snapshots = OptimizerSnapshots(Path(folder.name))
        publisher = self._publisher()
        try:
            self._replay(built, snapshots, publisher)
        finally:
            snapshots.close()
            folder.cleanup()
            shutdown()
        self.result.seconds = time.perf_counter() - started
        return self.result

    def _publisher(self) -> PolicyPublisher | None:
        """Writes each rebuilt version whole to `out` (nothing is announced)."""
        if self.out is None or not self.leader:
            return None
        cfg = self.config.trainer
        return PolicyPublisher(None, "", self.out, keep_versions=1 << 30, publish_dtype=cfg.publish_dtype,
                               lora=cfg.lora.rank > 0)

    def _replay(self, built: PolicyEngine, snapshots: OptimizerSnapshots, publisher: PolicyPublisher | None) -> None:
        cfg = self.config.trainer
        baseline = RewardBaseline(cfg.baseline_key, cfg.baseline_momentum)
        first = self.log.first_life()
        step, version = 0, first["policy_version"]
        if version in self.targets:  # a rollback to the base weights, as the run kept them before its first step
            snapshots.take(built.engine, version)
        for event in self.log.events:
            kind = event["kind"]
            if kind == "life":
                if event["step"] != step:
                    raise ReplayMismatch(f"a trainer life starts at step {event['step']} in the log, yet replay "
                                         f"stands at step {step}: the log is not one lineage")
                version = event["policy_version"]
                torch.set_num_threads(event["torch_threads"])
                if event["config"] != first["config"]:
                    log.warning("the trainer resumed at step %d with another config than the run started with; "
                                "replay goes on with the first one", step)
            elif kind == "step" and event["applied"]:
                self._step(built, baseline, event, step, version)
                step += 1
            elif kind == "published":
                if event["version"] in self.rollbacks:
                    to_version = self.rollbacks[event["version"]]["to_version"]
                    snapshots.restore(built.engine, to_version)
                    log.info("step %d: rolled back to v%d's weights and optimizer state, as the run did", step,
                             to_version)
                version = event["version"]
                self._publish(built, event, step, publisher)
                if version in self.targets:
                    snapshots.take(built.engine, version)

    def _step(self, built: PolicyEngine, baseline: RewardBaseline, event: dict[str, Any], step: int,
              version: int) -> None:
        """Train the step `event` records, on the messages it names in their order; check it went as recorded."""
        cfg = self.config.trainer
        if event["step"] != step + 1:
            raise ReplayMismatch(f"the log's step {event['step']} follows step {step}")
        batch = [self._trajectory(tuple(position)) for position in event["batch"]]
        if cfg.warmup_steps:
            set_learning_rate(built.engine, learning_rate_at(cfg, step + 1))
        learning_rate = built.engine.optimizer.param_groups[0]["lr"]
        if self.check and learning_rate != event["learning_rate"]:
            raise ReplayMismatch(f"step {step + 1}: learning rate {learning_rate}, the run's {event['learning_rate']}")
        outcome = train_step(built.engine, plan_batch(batch, baseline, cfg, version, built.hindsight_reply),
                             lambda kept: plan_batch(kept, baseline, cfg, version, built.hindsight_reply), cfg,
                             built.memory_width, built.accumulation, base_policy=built.base_policy)
        if not outcome.applied:
            raise ReplayMismatch(f"step {step + 1}: applied in the run, not in replay "
                                 f"({outcome.skipped_reason or 'every trajectory raised when scored'})")
        if self.check:
            where = {id(trajectory): tuple(position) for trajectory, position in zip(batch, event["batch"])}
            trained = [list(where[id(t)]) for t in outcome.plan.trajectories]
            if trained != event["trained"]:
                raise ReplayMismatch(f"step {step + 1}: trained on {trained}, the run on {event['trained']}")
            # The log holds rank 0's passes; a rank raising alone would leave the others in a collective.
            passes = logged_passes(outcome.passes)
            differs = self.leader and passes != event["passes"]
            if agreed_max(int(differs), built.engine.device):
                raise ReplayMismatch(f"step {step + 1}: rank 0's micro-batches differ from the run's"
                                     + (f": {passes}, the run's {event['passes']}" if differs else ""))
        record_rewards(outcome.plan, baseline)
        self.result.steps += 1

    def _trajectory(self, position: Position) -> Trajectory:
        if position not in self.log.messages:
            raise ReplayMismatch(f"the log names message {position} (partition, offset) but does not hold it")
        return decode(self.log.messages[position], Trajectory)

    def _publish(self, built: PolicyEngine, event: dict[str, Any], step: int, publisher: PolicyPublisher | None
                 ) -> None:
        """Rebuild the version `event` records; check its hash, or write it to `out`."""
        cfg = self.config.trainer
        state = policy_state(built.engine, cfg.lora.rank > 0)
        self.result.versions += 1
        if publisher is not None:
            publisher.write_version(state, event["version"], step)
        if not self.check:
            return
        published = cast_state(state, PUBLISH_DTYPES[cfg.publish_dtype])
        digests = tensor_sha256s(published)
        if state_sha256(published, digests) != event["state_sha256"]:
            raise ReplayMismatch(self._difference(published, digests, event, step))
        self.result.checked += 1
        log.info("step %d: v%d rebuilt, state sha256 %s matches", step, event["version"], event["state_sha256"][:12])

    def _difference(self, published: dict[str, torch.Tensor], digests: dict[str, bytes], event: dict[str, Any],
                    step: int) -> str:
        """Where a rebuilt version differs from the published one: the step, the tensor, and by how much."""
        version = event["version"]
        recorded = event.get("tensor_sha256") or {}
        differing = sorted(name for name in published if recorded.get(name) != digests[name])
        where = f"step {step}, v{version}: the rebuilt state's sha256 differs from the published one"
        if not differing:
            return where + " (the log holds no per-tensor hashes to say where)"
        tensor = differing[0]
        try:
            original = read_version_state(self.run_dir, version)[tensor]
            amount = (published[tensor].double() - original.double()).abs().max().item()
            by = f"max abs difference {amount:.3g}"
        except (OSError, KeyError, ValueError) as err:
            by = f"by how much is unknown: the run no longer keeps v{version}'s file ({err})"
        return f"{where}; first tensor {tensor} ({len(differing)} of {len(published)} differ), {by}"
