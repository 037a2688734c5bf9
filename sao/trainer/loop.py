"""The trainer process: consume -> buffer -> batch -> loss -> ZeRO-3 step -> (publish) -> commit -> (checkpoint).

`Trainer.run` reads top to bottom; every arrow is one call. Rank 0 is the only Kafka consumer
and broadcasts each batch to the other ranks; its broker I/O is one `LeaderIO`
(sao/trainer/leader_io.py), None on the other ranks. What it has handled, and so when it stops,
is one `TrainerProgress` (sao/status.py). The trainer never waits for a particular sampler: it
trains on whatever fresh trajectories Kafka holds, in arrival order (or by priority).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from sao import metrics
from sao.config import SaoConfig, to_toml
from sao.dead_letters import DeadLetterReason
from sao.envs.registry import turn_credit
from sao.run_dir import RunDir
from sao.schema import Trajectory
from sao.status import StepRecord, TrainerProgress, attempt_success, process_usage, write_status
from sao.trainer.archive import TrajectoryArchive
from sao.trainer.baselines import RewardBaseline
from sao.trainer.batch import plan_batch, record_rewards, turn_returns
from sao.trainer.buffer import BufferEntry, ReplayBuffer
from sao.trainer.checkpoint import (
    TrainerState,
    has_checkpoint,
    load_checkpoint,
    save_checkpoint,
    update_checkpoint_state,
    verify_checkpoint,
)
from sao.trainer.distributed import broadcast_batch, rank, world_size
from sao.trainer.engine import (
    learning_rate_at,
    memory_per_rank,
    set_learning_rate,
    shutdown,
)
from sao.trainer.leader_io import LeaderIO
from sao.trainer.policy_engine import build_policy_engine
from sao.trainer.publisher import PolicyPublisher
from sao.trainer.shadow import background_cpus
from sao.trainer.shadow_validation import ShadowValidation
from sao.trainer.training_step import StepOutcome, train_step
from sao.trainer.validation import TrajectoryValidator
from sao.transport.announcements import latest_announced_version, read_announce_key
from sao.transport.health import BrokerGone
from sao.transport.weights import WeightsSender

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, config: SaoConfig, bootstrap: str, run_dir: Path, resume: bool = False):
        torch.set_num_threads(config.trainer.threads())
        # `auto` resolved once, by the env: every turn of every batch is credited the same way.
        resolved = config.trainer.model_copy(update={"turn_credit": turn_credit(config)})
        self.config = config = config.model_copy(update={"trainer": resolved})
        self.run_dir = RunDir(run_dir)
        self.bootstrap = bootstrap
        # Shadow validation (sao/trainer/shadow_validation.py). Its scorer loads its model while this process
        # builds the engine, not after (RANK: torch.distributed is not up yet).
        self.shadow = self._start_shadow_validation(os.environ.get("RANK", "0") == "0", resume) \
            if config.trainer.shadow_every else None
        # Where start-up time goes (a restart's cost, benchmarks/recovery.py): phase -> seconds.
        self.startup_s: dict[str, float] = {}
        self._phase_started = time.perf_counter()
        resuming = resume and has_checkpoint(self.run_dir.checkpoints)
        # Hashing every checkpoint file (GBs) needs no engine: it runs on a thread while the engine is built.
        verified = _in_background(verify_checkpoint, self.run_dir.checkpoints) if resuming else None
        validator = self._build_engine()
        restored = self._restore(bootstrap, resume, resuming, verified)
        self.baseline = self._reward_baseline()
        # Rank 0 alone talks to the broker: the other ranks get each batch from it.
        self.io = LeaderIO.open(config, bootstrap, self.run_dir, self.state, restored, resume, validator) \
            if rank() == 0 else None
        self.publisher = self._policy_publisher()
        self.archive = self._open_trajectory_log(restored)  # rank 0, unless trainer.keep_trajectory_log is off
        self.buffer = self._replay_buffer()
        self.steps: list[StepRecord] = []  # this life's steps, in the progress file
        self.idle_s = 0.0  # seconds `run` waited for a batch (the trainer idle ratio's numerator)
        self.step_learning_rate = config.trainer.optimizer_learning_rate  # the rate the latest step used
        self.run_started: float | None = None  # perf_counter at the start of `run`
        self.skipped_steps: dict[str, int] = {}  # this life's steps not applied, by reason
        self.stopping = False
        self.finished = False
        signal.signal(signal.SIGTERM, self._stop)
        if self.is_leader:
            metrics.record_trainer_start(max_staleness=config.trainer.max_staleness,
                                         policy_version=self.state.policy_version)
            if resume:
                self._ledger({"resumed_from_step": self.state.step})
        self._started("kafka_clients")
        log.info("trainer ready in %.1f s since its process started (%s)", time.time() - _process_started_at(),
                 ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.startup_s.items()))

    def _build_engine(self) -> TrajectoryValidator:
        """The policy (and its frozen base copy), then the ZeRO-3 engine; returns the policy's validator."""
        built = build_policy_engine(self.config, self._started)
        self.engine, self.base_policy, self.memory_width = built.engine, built.base_policy, built.memory_width
        self.batch_size, self.accumulation = built.batch_size, built.accumulation
        self.hindsight_reply = built.hindsight_reply
        return built.validator

    def _restore(self, bootstrap: str, resume: bool, resuming: bool, verified: Future | None) -> TrainerState | None:
        """`self.state`: the latest checkpoint's on `resume` (its engine state loaded), else a fresh one.
        Returns the restored state, None without one."""
        config = self.config
        # The policy topic is read to its end (a quiet second) while the checkpoint loads.
        announced = _in_background(latest_announced_version, bootstrap, config.topics.policy,
                                   config.sampler.max_version_jump, read_announce_key(self.run_dir.policy_dir)) \
            if resuming and rank() == 0 else None
        restored = load_checkpoint(self.engine, self.run_dir.checkpoints, verified) if resume else None
        self._started("checkpoint")
        self.state = restored or TrainerState()
        if restored:
            self.state.policy_version = self._next_free_version(announced)
        return restored

    def _reward_baseline(self) -> RewardBaseline:
        baseline = RewardBaseline(self.config.trainer.baseline_key, self.config.trainer.baseline_momentum)
        if self.state.baseline:
            baseline.load_state_dict(self.state.baseline)
        return baseline

    def _policy_publisher(self) -> PolicyPublisher:
        cfg = self.config.trainer
        producer = self.io.producer if self.io is not None else None
        weights = None
        if self.config.policy.transport == "kafka" and producer is not None:
            weights = WeightsSender(producer, self.bootstrap, self.config.topics.weights, self.config.policy.chunk_bytes,
                                    chain_length=cfg.snapshot_every if cfg.publish_deltas else 1)
        publisher = PolicyPublisher(producer, self.config.topics.policy, self.run_dir, cfg.keep_versions,
                                    cfg.publish_dtype, cfg.publish_deltas, cfg.snapshot_every, weights,
                                    lora=cfg.lora.rank > 0)
        if self.shadow is not None:
            publisher.pinned = self.shadow.pinned
        return publisher

    def _open_trajectory_log(self, restored: TrainerState | None) -> TrajectoryArchive | None:
        """Rank 0's trajectory log (sao/trainer/archive.py), continued from where a restored checkpoint left it."""
        if self.io is None or not self.config.trainer.keep_trajectory_log:
            return None
        archive = TrajectoryArchive(self.run_dir.trajectory_log, restored.trajectory_log_bytes if restored else 0)
        archive.life(self.state.step, self.state.policy_version, restored is not None, world_size(),
                     to_toml(self.config))
        self.io.stream.on_message = archive.trajectory
        self.publisher.hash_states = True
        return archive

    def _log_step(self, outcome: StepOutcome, entries: list[BufferEntry] | None, trained_version: int) -> None:
        """Rank 0: the step into the trajectory log, the messages it trained on named by partition and offset."""
        if self.archive is None or outcome.interrupted:
            return
        where = {entry.trajectory.trajectory_id: (entry.partition, entry.offset) for entry in entries}
        trained = [where[t.trajectory_id] for t in outcome.plan.trajectories] if outcome.plan is not None else []
        self.archive.step(self.state.step + 1 if outcome.applied else None, trained_version,
                          [(entry.partition, entry.offset) for entry in entries], trained, outcome.applied,
                          self.step_learning_rate, outcome.passes, outcome.skipped_reason)

    def _replay_buffer(self) -> ReplayBuffer:
        cfg = self.config.trainer
        buffer = ReplayBuffer(cfg.max_reuse, cfg.priority_exponent, cfg.freshness_decay)
        if self.state.rng:  # a resumed run draws the same random numbers it would have drawn
            torch.set_rng_state(torch.tensor(self.state.rng["torch"], dtype=torch.uint8))
            buffer.rng.setstate(_tupled(self.state.rng["replay"]))
        return buffer

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one rank that consumes, commits, dead-letters and writes the ledger."""
        return self.io is not None

    def _started(self, phase: str) -> None:
        """Close start-up phase `phase`: the seconds since the previous one closed."""
        now = time.perf_counter()
        self.startup_s[phase] = now - self._phase_started
        self._phase_started = now

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _next_free_version(self, announced: Future[int] | None) -> int:
        """After a resume, continue above every version ever announced, not at the checkpoint's.

        A crashed run may have announced versions after its last checkpoint; reusing their
        numbers would leave samplers that loaded them on the abandoned weights.
        """
        version = torch.tensor([self.state.policy_version], dtype=torch.long, device=self.engine.device)
        if rank() == 0:
            version[0] = max(self.state.policy_version, announced.result())
        if world_size() > 1:
            dist.broadcast(version, src=0)
        if int(version) != self.state.policy_version:
            log.info("resuming at policy v%d: versions up to it were announced before the crash", int(version))
        return int(version)

    def run(self, expected_trajectories: int | None = None) -> dict:
        """Train until `max_steps`, until `expected_trajectories` are handled, or until stopped."""
        cfg = self.config.trainer
        checkpointed_at = self.state.step
        self.run_started = time.perf_counter()
        try:
            if self.shadow is not None:
                self.shadow.offer(self.engine, self.state.policy_version)  # the base model, or where a resume starts
            while True:
                waited = time.perf_counter()
                entries = self._collect(expected_trajectories)  # rank 0 only; empty means stop
                batch, stop = broadcast_batch(entries, self.is_leader and not entries, self.engine.device)
                self.phase_s = {"wait": time.perf_counter() - waited, "forward_backward": 0.0, "optimizer": 0.0,
                                "publish": 0.0}
                self.idle_s += self.phase_s["wait"]
                if stop:
                    break
                self._follow_shadow()  # a version that fell below the best is rolled back before this step
                trained_version = self.state.policy_version
                outcome = self._train(batch, entries)  # what could not be trained on is dead-lettered
                self._log_step(outcome, entries, trained_version)
                if outcome.applied:
                    self.state.step += 1
                    self._ledger({"step": self.state.step, "policy_version": trained_version,
                                  "trajectory_ids": [t.trajectory_id for t in outcome.plan.trajectories]})
                    if self.state.step % cfg.sync_every == 0:
                        self._publish()
                    self._record(outcome, trained_version)
                self._commit()
                if outcome.applied and self.state.step % cfg.checkpoint_every == 0:
                    checkpointed_at = self._checkpoint()
                self._write_status()
            self._commit()  # what was dead-lettered since the last step is done with too
            if self.state.step > checkpointed_at:
                self._checkpoint()  # a clean stop always leaves a resumable checkpoint
            elif self._handled_since_checkpoint():
                self._record_dead_letters()
            if self.shadow is not None:
                self.shadow.finish(self.state.policy_version)
            # Finished means every expected trajectory was handled: what an audit may then call lost.
            # A stop by signal, max_steps or an error leaves the rest in flight, resumable.
            self.finished = self.is_leader and self._progress(expected_trajectories).done(expected_trajectories)
        except BrokerGone as gone:
            gone.in_flight = self._in_flight(checkpointed_at)
            raise
        finally:
            self._write_status(finished=self.finished)
            if self.io is not None:
                self.io.close()
            if self.archive is not None:
                self.archive.close()
            if self.shadow is not None:
                self.shadow.stop()
            shutdown()
        return self.status(finished=self.finished)

    # --- consuming (rank 0) -------------------------------------------------------------

    def _progress(self, expected: int | None = None, finished: bool = False) -> TrainerProgress:
        """What this trainer handled (sao/status.py). Rank 0 counts the stream; other ranks only their steps.

        While `expected` trajectories are not all handled, rank 0 first reads the tasks samplers
        dead-lettered since it last looked.
        """
        own = TrainerProgress(step=self.state.step, policy_version=self.state.policy_version,
                              trajectories_trained=sum(record.batch_size for record in self.steps), finished=finished)
        return self.io.progress(len(self.buffer), own, expected) if self.io is not None else own

    def _should_stop(self, expected: int | None) -> bool:
        if not self.is_leader:
            return False  # only rank 0's answer is broadcast
        max_steps = self.config.trainer.max_steps
        return (self.stopping or (max_steps is not None and self.state.step >= max_steps)
                or self._progress(expected).done(expected))

    def _collect(self, expected: int | None) -> list[BufferEntry] | None:
        """Rank 0: the next batch's buffer entries (empty when training should stop)."""
        if not self.is_leader:
            return None
        cfg, io = self.config.trainer, self.io
        while not self._should_stop(expected):
            io.broker_watch.check()  # a broker gone for good (or replaced by an empty one) ends the run
            for entry in self.buffer.evict_stale(self.state.policy_version, cfg.max_staleness):
                io.stream.dead_letter_stale(entry, self.state.policy_version)
            progress = self._progress(expected)
            # sync: the feeder released one batch; once all of it is handled, nothing more comes before its step.
            released = self.config.run.mode == "sync" and progress.released_batch_handled(cfg.batch_size)
            entries = self._take(all_arrived=progress.all_handled(expected) or released)
            if entries:
                return entries
            for entry in io.stream.poll(self.batch_size, self.state.policy_version, timeout=1.0):
                self.buffer.add(entry)
        return []

    def _take(self, all_arrived: bool) -> list[BufferEntry]:
        cfg = self.config.trainer
        if cfg.algorithm == "grpo":
            entries = self.buffer.take_groups(self.batch_size // cfg.group_size, cfg.group_size, allow_fewer=all_arrived)
            if entries or not all_arrived:
                return entries
            # Everything arrived, yet no group is whole (a member was dead-lettered): train the rest.
            return self.buffer.take_groups(len(self.buffer), 1, allow_fewer=True)
        if len(self.buffer) >= self.batch_size or (all_arrived and len(self.buffer)):
            return self.buffer.take(self.batch_size, self.state.policy_version, self._advantage_of)
        return []

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
            if self.is_leader:
                self.buffer.put_back(entries)
            return outcome
        self.phase_s.update(forward_backward=outcome.forward_backward_s, optimizer=outcome.optimizer_s)
        self.step_s = time.perf_counter() - started
        self._dead_letter(entries, outcome.dead_letters)
        if outcome.applied:
            record_rewards(outcome.plan, self.baseline)
        elif outcome.skipped_reason:
            self.skipped_steps[outcome.skipped_reason] = self.skipped_steps.get(outcome.skipped_reason, 0) + 1
            log.warning("step skipped (%s): weights, optimizer state and baselines are unchanged; the batch's %d "
                        "trajectories go to the dead-letter topic", outcome.skipped_reason,
                        len(outcome.plan.trajectories))
            if self.is_leader:
                metrics.record_skipped_step(outcome.skipped_reason)
        return outcome

    def _dead_letter(self, entries: list[BufferEntry] | None,
                     dead_letters: list[tuple[Trajectory, DeadLetterReason, str]]) -> None:
        """Rank 0: dead-letter what the step could not train on, and drop it from the buffer for good."""
        if not self.is_leader or not dead_letters:
            return
        by_id = {entry.trajectory.trajectory_id: entry for entry in entries}
        for trajectory, reason, detail in dead_letters:
            entry = by_id[trajectory.trajectory_id]
            self.io.stream.dead_letter_entry(entry, reason, detail)
            self.buffer.discard(entry)

    def _record(self, outcome: StepOutcome, trained_version: int) -> None:
        """Keep the step's record (progress file), log it, and export it to Prometheus (rank 0)."""
        plan, stats, step_s = outcome.plan, outcome.stats, self.step_s
        grad_norm = self.engine.get_global_grad_norm()
        now = time.time()
        trajectories = plan.trajectories
        attempts = [attempt_success([step.reward for step in t.steps]) for t in trajectories]
        record = StepRecord(
            step=self.state.step, policy_version=trained_version, trained_at=now,
            rewards=[t.total_reward for t in trajectories], advantages=[a for turns in plan.advantages for a in turns],
            behaviour_versions=[t.behaviour_version for t in trajectories], staleness=list(plan.staleness),
            compression_ratios=[t.compression.get("ratio", 1.0) for t in trajectories],
            sampling_to_training_s=[now - t.created_at for t in trajectories],
            loss=stats.loss, ratio_mean=stats.ratio_mean, ratio_abs_dev=stats.ratio_abs_dev,
            clip_fraction=stats.clip_fraction, kl_k3=stats.kl_k3, value_loss=stats.value_loss,
            token_nll=stats.token_nll, kl_to_base=stats.kl_to_base if math.isfinite(stats.kl_to_base) else None,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), step_s=step_s,
            learning_rate=self.step_learning_rate,
            wait_s=self.phase_s["wait"], forward_backward_s=self.phase_s["forward_backward"],
            optimizer_s=self.phase_s["optimizer"], publish_s=self.phase_s["publish"],
            first_attempt_success=[first for first, _ in attempts],
            second_attempt_success=[second for _, second in attempts])
        self.steps.append(record)
        log.info("step %d: loss %.4f reward %.3f rho %.4f |rho-1| %.2e clip %.3f grad %.2f (%.1f s)",
                 record.step, record.loss, sum(record.rewards) / record.batch_size, record.ratio_mean,
                 record.ratio_abs_dev, record.clip_fraction, record.grad_norm, step_s)
        if self.is_leader:
            metrics.export_trainer_step(record)

    # --- after a step ---------------------------------------------------------------------

    def _publish(self, offer_to_shadow: bool = True) -> None:
        started = time.perf_counter()
        self.state.policy_version += 1
        announcement = self.publisher.publish(self.engine, self.state.policy_version, self.state.step)
        if self.archive is not None:
            self.archive.published(self.state.policy_version, self.state.step, self.publisher.last_state_sha256,
                                   announcement.sha256, self.publisher.last_tensor_sha256)
        self.phase_s["publish"] = time.perf_counter() - started
        if self.is_leader:
            metrics.record_policy_published(self.state.policy_version)
        log.info("published policy v%d in %.1f s", self.state.policy_version, self.phase_s["publish"])
        if offer_to_shadow and self.shadow is not None:
            self.shadow.offer(self.engine, self.state.policy_version)

    # --- shadow validation (sao/trainer/shadow_validation.py) --------------------------------

    def _start_shadow_validation(self, is_leader: bool, resume: bool) -> ShadowValidation:
        if is_leader:
            self.run_dir.root.mkdir(parents=True, exist_ok=True)
            self.run_dir.trainer_config.write_text(to_toml(self.config))
        cpus = background_cpus(self.config)
        return ShadowValidation.start(self.config.trainer, self.run_dir, self.run_dir.trainer_config, is_leader,
                                      resume, cpus)

    def _follow_shadow(self) -> None:
        """A version that fell below the best is rolled back to the best before the next step."""
        back_to = self.shadow.verdict(self.engine) if self.shadow is not None else None
        if back_to is None:
            return

        def publish() -> int:
            self._publish(offer_to_shadow=False)
            return self.state.policy_version

        event = self.shadow.roll_back(self.engine, back_to, publish, self.state.step, self.state.policy_version)
        self._ledger({"rollback": event})
        if self.archive is not None:
            self.archive.rollback(event)

    def _commit(self) -> None:
        if self.io is not None:
            self.io.commit(self.buffer)

    def _in_flight(self, checkpointed_at: int) -> str:
        """What this trainer held when the broker went: buffered data, offsets, and training since the checkpoint."""
        since = self.state.step - checkpointed_at
        committed = self.io.committed_offsets if self.io is not None else {}
        return (f"{len(self.buffer)} trajectories buffered and not trained on; step {self.state.step}, last committed "
                f"offsets {committed or 'none in this life'}; last checkpoint at step {checkpointed_at} "
                f"(offsets {self.state.offsets})" + (f", so a resume retrains the {since} step(s) after it" if since else ""))

    def _handled_since_checkpoint(self) -> bool:
        """Rank 0: messages were handled (dead-lettered: no step came after) since the last checkpoint."""
        return (self.is_leader and has_checkpoint(self.run_dir.checkpoints)
                and self._progress().handled_since(self.state.handled))

    def _record_dead_letters(self) -> None:
        """Rank 0, at a stop with no step since the last checkpoint: bring its offsets and counts up to date.

        Otherwise a resume would read those messages again and dead-letter each a second time.
        """
        self.io.note_in(self.state, self.buffer)
        if self.archive is not None:
            self.state.trajectory_log_bytes = self.archive.durable_length()
        update_checkpoint_state(self.run_dir.checkpoints, self.state)

    def _checkpoint(self) -> int:
        if self.io is not None:
            self.io.note_in(self.state, self.buffer)
        if self.archive is not None:
            self.state.trajectory_log_bytes = self.archive.durable_length()
        self.state.baseline = self.baseline.state_dict()
        self.state.rng = {"torch": torch.get_rng_state().tolist(), "replay": _jsonable(self.buffer.rng.getstate())}
        started = time.perf_counter()
        save_checkpoint(self.engine, self.run_dir.checkpoints, self.state)
        if self.is_leader:
            metrics.record_checkpoint(time.perf_counter() - started)
        return self.state.step

    def _ledger(self, record: dict) -> None:
        """Append-only record of what each step trained on (audits exactly-once delivery)."""
        if self.is_leader:
            self.run_dir.root.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir.ledger, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    def status(self, finished: bool = False) -> dict:
        """The progress file's fields: the trainer's progress, its steps, and what it cost."""
        return {**self._progress(finished=finished).as_status(), "skipped_steps": self.skipped_steps,
                "shadow": self.shadow.status() if self.shadow is not None else None,
                # Seconds rank 0 spent polling the trajectory topic.
                "wait_s": self.io.stream.counters.wait_s if self.io is not None else 0.0,
                "rank": rank(), "world_size": world_size(),
                "memory": memory_per_rank(self.engine), "startup_s": self.startup_s,
                **process_usage(), "idle_s": self.idle_s,
                "run_s": time.perf_counter() - self.run_started if self.run_started is not None else 0.0,
                "trajectory_log": asdict(self.archive.stats) if self.archive is not None else None,
                "steps": [asdict(record) for record in self.steps]}

    def _write_status(self, finished: bool = False) -> None:
        name = "trainer" if self.is_leader else f"trainer-rank{rank()}"
        write_status(self.run_dir.status(name), self.status(finished))


def _in_background(function: Callable, *args) -> Future:
    """`function(*args)` on a thread of its own; `result()` waits for it and raises what it raised."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-start")
    try:
        return pool.submit(function, *args)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its call


def _process_started_at() -> float:
    """Unix time this process started (imports included)."""
    import psutil  # a DeepSpeed dependency, so always installed with the trainer

    return psutil.Process().create_time()


def _jsonable(state):
    """random.Random state (nested tuples) as JSON lists."""
    return [_jsonable(item) for item in state] if isinstance(state, tuple) else state


def _tupled(state):
    return tuple(_tupled(item) for item in state) if isinstance(state, list) else state
