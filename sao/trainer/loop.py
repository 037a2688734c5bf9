"""The trainer process: consume -> buffer -> batch -> loss -> DeepSpeed step -> (publish) -> commit -> (checkpoint).

`Trainer.run` reads top to bottom; every arrow is one call. Rank 0 leads: it is the only Kafka
consumer and broadcasts each batch to the other ranks, which follow (sao/trainer/roles.py: the
loop calls a `Leader` or a `Follower` alike). What it has handled, and so when it stops, is one
`TrainerProgress` (sao/status.py). The trainer never waits for a particular sampler: it
trains on whatever fresh trajectories Kafka holds, in arrival order (or by priority).
"""

from __future__ import annotations

import logging
import signal
import time
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path

import torch

from sao import metrics
from sao.config import SaoConfig, to_toml
from sao.envs.registry import turn_credit
from sao.processes import in_background, process_started_at
from sao.run_dir import RunDir
from sao.schema import Trajectory
from sao.status import StepRecord, TrainerProgress, process_usage, write_status
from sao.trainer.archive import TrajectoryArchive
from sao.trainer.baselines import RewardBaseline
from sao.trainer.batch import plan_batch, record_rewards, turn_returns
from sao.trainer.buffer import BufferEntry, ReplayBuffer
from sao.trainer.checkpoint import (
    TrainerState,
    has_checkpoint,
    load_checkpoint,
    next_free_version,
    restore_rng,
    rng_state,
    save_checkpoint,
    update_checkpoint_state,
    verify_checkpoint,
)
from sao.trainer.distributed import broadcast_batch, rank, world_size
from sao.trainer.engine import (
    learning_rate_at,
    memory_per_rank,
    resolved_precision,
    set_learning_rate,
    shutdown,
)
from sao.trainer.leader_io import LeaderIO
from sao.trainer.policy_engine import build_policy_engine
from sao.trainer.publisher import PolicyPublisher
from sao.trainer.roles import Follower, Leader
from sao.trainer.shadow import background_cpus
from sao.trainer.shadow_validation import NoShadow, ShadowValidation
from sao.trainer.training_step import StepOutcome, train_step
from sao.trainer.validation import TrajectoryValidator
from sao.transport.announcements import latest_announced_version, read_announce_key
from sao.transport.health import BrokerGone

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, config: SaoConfig, bootstrap: str, run_dir: Path, resume: bool = False):
        torch.set_num_threads(config.trainer.threads())
        # `auto` resolved once, by the env: every turn of every batch is credited the same way.
        resolved = config.trainer.model_copy(update={"turn_credit": turn_credit(config)})
        self.config = config = config.model_copy(update={"trainer": resolved})
        self.run_dir = RunDir(run_dir)
        # Shadow validation (sao/trainer/shadow_validation.py). Its scorer loads its model while this process
        # builds the engine, not after.
        self.shadow = ShadowValidation.start(config, self.run_dir, resume, background_cpus(config)) \
            if config.trainer.shadow_every else NoShadow()
        # Where start-up time goes (a restart's cost, benchmarks/recovery.py): phase -> seconds.
        self.startup_s: dict[str, float] = {}
        self._phase_started = time.perf_counter()
        resuming = resume and has_checkpoint(self.run_dir.checkpoints)
        # Hashing every checkpoint file (GBs) needs no engine: it runs on a thread while the engine is built.
        verified = in_background(verify_checkpoint, self.run_dir.checkpoints) if resuming else None
        # The policy (and its frozen base copy), then the DeepSpeed engine.
        built = build_policy_engine(config, self._started)
        self.engine, self.base_policy, self.memory_width = built.engine, built.base_policy, built.memory_width
        self.batch_size, self.accumulation = built.batch_size, built.accumulation
        self.hindsight_reply = built.hindsight_reply
        restored = self._restore(bootstrap, resume, resuming, verified)
        cfg = config.trainer
        self.baseline = RewardBaseline(cfg.baseline_key, cfg.baseline_momentum)
        if self.state.baseline:
            self.baseline.load_state_dict(self.state.baseline)
        self.buffer = ReplayBuffer(cfg.max_reuse, cfg.priority_exponent, cfg.freshness_decay)
        restore_rng(self.state, self.buffer.rng)  # a resumed run draws the same random numbers it would have drawn
        self.role = self._role(bootstrap, restored, resume, built.validator)
        self.publisher = PolicyPublisher.for_trainer(config, self.role.producer, bootstrap, self.run_dir)
        self.publisher.pinned = self.shadow.pinned
        self.steps: list[StepRecord] = []  # this life's steps, in the progress file
        self.idle_s = 0.0  # seconds `run` waited for a batch (the trainer idle ratio's numerator)
        self.checkpoint_s = 0.0  # seconds spent saving checkpoints
        self.step_learning_rate = config.trainer.optimizer_learning_rate  # the rate the latest step used
        self.run_started: float | None = None  # perf_counter at the start of `run`
        self.skipped_steps: dict[str, int] = {}  # this life's steps not applied, by reason
        self.phase_s: dict[str, float] = {}  # the current step's seconds by phase (wait, forward_backward, ...)
        self.step_s = 0.0  # the latest step's seconds of forward, backward and optimizer
        self.stopping = False
        self.finished = False
        signal.signal(signal.SIGTERM, self._stop)
        metrics.record_trainer_start(max_staleness=config.trainer.max_staleness, policy_version=self.state.policy_version)
        if resume:
            self.role.ledger({"resumed_from_step": self.state.step})
        self._started("kafka_clients")
        log.info("trainer ready in %.1f s since its process started (%s)", time.time() - process_started_at(),
                 ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.startup_s.items()))

    def _restore(self, bootstrap: str, resume: bool, resuming: bool, verified: Future | None) -> TrainerState | None:
        """`self.state`: the latest checkpoint's on `resume` (its engine state loaded), else a fresh one.
        Returns the restored state, None without one."""
        config = self.config
        # The policy topic is read to its end (a quiet second) while the checkpoint loads.
        announced = in_background(latest_announced_version, bootstrap, config.topics.policy,
                                   config.sampler.max_version_jump, read_announce_key(self.run_dir.policy_dir)) \
            if resuming and rank() == 0 else None
        restored = load_checkpoint(self.engine, self.run_dir.checkpoints, verified) if resume else None
        self._started("checkpoint")
        self.state = restored or TrainerState()
        if restored:
            self.state.policy_version = next_free_version(self.state, announced, self.engine.device)
        return restored

    def _role(self, bootstrap: str, restored: TrainerState | None, resume: bool,
              validator: TrajectoryValidator) -> Follower:
        """Rank 0 leads (its broker clients and, unless trainer.keep_trajectory_log is off, the trajectory log,
        continued from where a restored checkpoint left it); the other ranks follow."""
        if rank() != 0:
            return Follower()
        io = LeaderIO.open(self.config, bootstrap, self.run_dir, self.state, restored, resume, validator)
        archive = None
        if self.config.trainer.keep_trajectory_log:
            archive = TrajectoryArchive(self.run_dir.trajectory_log, restored.trajectory_log_bytes if restored else 0)
            archive.life(self.state.step, self.state.policy_version, restored is not None, world_size(),
                         to_toml(self.config), precision=resolved_precision(self.config.trainer))
        return Leader(self.config, io, self.buffer, self.run_dir, archive, self.batch_size)

    def _started(self, phase: str) -> None:
        """Close start-up phase `phase`: the seconds since the previous one closed."""
        now = time.perf_counter()
        self.startup_s[phase] = now - self._phase_started
        self._phase_started = now

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def run(self, expected_trajectories: int | None = None) -> dict:
        """Train until `max_steps`, until `expected_trajectories` are handled, or until stopped."""
        cfg = self.config.trainer
        checkpointed_at = self.state.step
        self.run_started = time.perf_counter()
        try:
            self.shadow.offer(self.engine, self.state.policy_version)  # the base model, or where a resume starts
            while True:
                waited = time.perf_counter()
                entries = self.role.next_batch(self._own_progress(), expected_trajectories, self.state.policy_version,
                                               self._should_stop, self._advantage_of)  # rank 0's; empty: stop
                batch, stop = broadcast_batch(entries, entries == [], self.engine.device)
                self.phase_s = {"wait": time.perf_counter() - waited, "forward_backward": 0.0, "optimizer": 0.0,
                                "publish": 0.0}
                self.idle_s += self.phase_s["wait"]
                if stop:
                    break
                self._follow_shadow()  # a version that dropped is rolled back to the best before this step
                trained_version = self.state.policy_version
                outcome = self._train(batch, entries)  # what could not be trained on is dead-lettered
                if not outcome.interrupted:
                    self.role.trained(outcome, entries, self.state.step + 1, trained_version, self.step_learning_rate)
                if outcome.applied:
                    self.state.step += 1
                    if self.state.step % cfg.sync_every == 0:
                        self._publish()
                    self._record(outcome, trained_version)
                self.role.commit()
                if outcome.applied and self.state.step % cfg.checkpoint_every == 0:
                    checkpointed_at = self._checkpoint()
                self._write_status()
            self.role.commit()  # what was dead-lettered since the last step is done with too
            if self.state.step > checkpointed_at:
                self._checkpoint()  # a clean stop always leaves a resumable checkpoint
            elif has_checkpoint(self.run_dir.checkpoints) and self.role.handled_since(self.state):
                self._record_dead_letters()
            self.shadow.finish(self.state.policy_version)
            # Finished means every expected trajectory was handled: what an audit may then call lost.
            # A stop by signal, max_steps or an error leaves the rest in flight, resumable.
            self.finished = self.role.finished(self._own_progress(), expected_trajectories)
        except BrokerGone as gone:
            gone.in_flight = self._in_flight(checkpointed_at)
            raise
        finally:
            self._write_status(finished=self.finished)
            self.role.close()
            self.shadow.stop()
            shutdown()
        return self.status(finished=self.finished)

    # --- consuming (rank 0, sao/trainer/roles.py) ------------------------------------------

    def _own_progress(self, finished: bool = False) -> TrainerProgress:
        """What this rank's own steps say; rank 0 adds the stream's counts (`Leader.progress`)."""
        return TrainerProgress(step=self.state.step, policy_version=self.state.policy_version,
                               trajectories_trained=sum(record.batch_size for record in self.steps), finished=finished)

    def _should_stop(self) -> bool:
        """Stopped by a signal, or trainer.max_steps reached (rank 0 also stops when every expected one is handled)."""
        max_steps = self.config.trainer.max_steps
        return self.stopping or (max_steps is not None and self.state.step >= max_steps)

    def _advantage_of(self, trajectory: Trajectory) -> float:
        return turn_returns(trajectory, self.config.trainer.turn_credit)[0] - self.baseline.value(trajectory)

    # --- training (every rank) ------------------------------------------------------------

    def _train(self, batch: list[Trajectory], entries: list[BufferEntry] | None) -> StepOutcome:
        """Plan the batch and take one step. Trajectories that could not be trained on are
        dead-lettered; only an applied step's rewards reach the baselines."""
        cfg, version = self.config.trainer, self.state.policy_version
        started = time.perf_counter()
        if cfg.warmup_steps:
            set_learning_rate(self.engine, learning_rate_at(cfg, self.state.step + 1))
        self.step_learning_rate = self.engine.optimizer.param_groups[0]["lr"]  # a DeepSpeed scheduler moves it after
        outcome = train_step(self.engine, plan_batch(batch, self.baseline, cfg, version, self.hindsight_reply),
                             lambda kept: plan_batch(kept, self.baseline, cfg, version, self.hindsight_reply), cfg,
                             self.memory_width, self.accumulation, lambda: self.stopping, self.base_policy)
        if outcome.interrupted:
            log.info("stopped during a step: its batch of %d goes back to the buffer, untrained", len(batch))
            self.role.put_back(entries)
            return outcome
        self.phase_s.update(forward_backward=outcome.forward_backward_s, optimizer=outcome.optimizer_s)
        self.step_s = time.perf_counter() - started
        self.role.dead_letter(entries, outcome.dead_letters)
        if outcome.applied:
            record_rewards(outcome.plan, self.baseline)
        elif outcome.skipped_reason:
            self.skipped_steps[outcome.skipped_reason] = self.skipped_steps.get(outcome.skipped_reason, 0) + 1
            log.warning("step skipped (%s): weights, optimizer state and baselines are unchanged; the batch's %d "
                        "trajectories go to the dead-letter topic", outcome.skipped_reason,
                        len(outcome.plan.trajectories))
            metrics.TRAINER_SKIPPED_STEPS.labels(reason=outcome.skipped_reason).inc()
        return outcome

    def _record(self, outcome: StepOutcome, trained_version: int) -> None:
        """Keep the step's record (progress file), log it, and export it to Prometheus (rank 0)."""
        record = outcome.record(self.state.step, trained_version, self.engine.get_global_grad_norm(),
                                self.step_learning_rate, self.phase_s, self.step_s)
        self.steps.append(record)
        log.info("step %d: loss %.4f reward %.3f rho %.4f |rho-1| %.2e clip %.3f grad %.2f (%.1f s)",
                 record.step, record.loss, sum(record.rewards) / record.batch_size, record.ratio_mean,
                 record.ratio_abs_dev, record.clip_fraction, record.grad_norm, record.step_s)
        metrics.export_trainer_step(record)

    # --- after a step ---------------------------------------------------------------------

    def _publish(self, offer_to_shadow: bool = True) -> None:
        started = time.perf_counter()
        self.state.policy_version += 1
        announcement = self.publisher.publish(self.engine, self.state.policy_version, self.state.step)
        self.role.published(self.state.policy_version, self.state.step, self.publisher, announcement)
        self.phase_s["publish"] = time.perf_counter() - started
        metrics.record_policy_published(self.state.policy_version)
        log.info("published policy v%d in %.1f s", self.state.policy_version, self.phase_s["publish"])
        if offer_to_shadow:
            self.shadow.offer(self.engine, self.state.policy_version)

    # --- shadow validation (sao/trainer/shadow_validation.py) --------------------------------

    def _follow_shadow(self) -> None:
        """A version that dropped (below the top score) is rolled back to the best before the next step."""
        back_to = self.shadow.verdict(self.engine)
        if back_to is None:
            return

        def publish() -> int:
            self._publish(offer_to_shadow=False)
            return self.state.policy_version

        event = self.shadow.roll_back(self.engine, back_to, publish, self.state.step, self.state.policy_version)
        self.role.rolled_back(event)

    def _in_flight(self, checkpointed_at: int) -> str:
        """What this trainer held when the broker went: buffered data, offsets, and training since the checkpoint."""
        since = self.state.step - checkpointed_at
        return (f"{self.role.in_flight()}; step {self.state.step}; last checkpoint at step {checkpointed_at} "
                f"(offsets {self.state.offsets})" + (f", so a resume retrains the {since} step(s) after it" if since else ""))

    def _record_dead_letters(self) -> None:
        """Rank 0, at a stop with no step since the last checkpoint: bring its offsets and counts up to date.

        Otherwise a resume would read those messages again and dead-letter each a second time.
        """
        self.role.note_in(self.state)
        update_checkpoint_state(self.run_dir.checkpoints, self.state)

    def _checkpoint(self) -> int:
        self.role.note_in(self.state)
        self.state.baseline = self.baseline.state_dict()
        self.state.rng = rng_state(self.buffer.rng)
        started = time.perf_counter()
        save_checkpoint(self.engine, self.run_dir.checkpoints, self.state)
        seconds = time.perf_counter() - started
        self.checkpoint_s += seconds
        metrics.record_checkpoint(seconds)
        return self.state.step

    def status(self, finished: bool = False) -> dict:
        """The progress file's fields: the trainer's progress, its steps, and what it cost."""
        return {**self.role.progress(self._own_progress(finished)).as_status(), "skipped_steps": self.skipped_steps,
                "shadow": self.shadow.status(), **self.role.status(), "rank": rank(), "world_size": world_size(),
                "memory": memory_per_rank(self.engine), "startup_s": self.startup_s, **process_usage(),
                "idle_s": self.idle_s, "checkpoint_s": self.checkpoint_s,
                "run_s": time.perf_counter() - self.run_started if self.run_started is not None else 0.0,
                "steps": [asdict(record) for record in self.steps]}

    def _write_status(self, finished: bool = False) -> None:
        name = self.role.status_name + (str(rank()) if rank() else "")
        write_status(self.run_dir.status(name), self.status(finished))
