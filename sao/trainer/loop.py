"""The trainer process: consume -> buffer -> batch -> loss -> ZeRO-3 step -> (publish) -> commit -> (checkpoint).

`Trainer.run` reads top to bottom; every arrow is one call. Rank 0 is the only Kafka consumer
and broadcasts each batch to the other ranks. The trainer never waits for a particular
sampler: it trains on whatever fresh trajectories Kafka holds, in arrival order (or by priority).
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sao.compression.semantic import load_encoder
from sao import metrics
from sao.config import SaoConfig, to_toml
from sao.consumers.buffer import BufferEntry, ReplayBuffer
from sao.consumers.trajectory_stream import TrajectoryStream
from sao.policy.weights import build_policy
from sao.producers.policy_follow import latest_announced_version
from sao.schema import Trajectory
from sao.status import write_status
from sao.trainer.baselines import RewardBaseline
from sao.trainer.batch import BatchPlan, plan_batch, rank_loss
from sao.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from sao.trainer.distributed import broadcast_batch, rank, world_size
from sao.trainer.engine import batch_layout, build_engine, memory_per_rank, shutdown
from sao.trainer.publisher import PolicyPublisher
from sao.transport.dlq import DeadLetterQueue
from sao.transport.kafka import make_producer

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, config: SaoConfig, bootstrap: str, run_dir: Path, resume: bool = False):
        torch.set_num_threads(config.trainer.torch_threads)
        self.config = config
        self.run_dir = run_dir
        self.checkpoint_dir = run_dir / "checkpoints"
        self.memory_dim = load_encoder(config.compression.encoder).dim
        self.engine = build_engine(build_policy(config.policy, self.memory_dim, config.trainer.value_head),
                                   config.trainer)
        self.batch_size, self.accumulation = batch_layout(config.trainer, world_size())
        restored = load_checkpoint(self.engine, self.checkpoint_dir) if resume else None
        self.state = restored or TrainerState()
        if restored:
            self.state.policy_version = self._next_free_version(bootstrap, config.topics.policy)
        self.handled_before_start = self.state.handled  # trained or dead-lettered by earlier lives
        self.baseline = RewardBaseline(config.trainer.baseline_key, config.trainer.baseline_momentum)
        if self.state.baseline:
            self.baseline.load_state_dict(self.state.baseline)
        self.is_leader = rank() == 0
        self.producer = make_producer(bootstrap) if self.is_leader else None
        self.publisher = PolicyPublisher(self.producer, config.topics.policy, run_dir / "policy",
                                         config.trainer.keep_versions)
        self.buffer = ReplayBuffer(config.trainer.max_reuse, config.trainer.priority_exponent,
                                   config.trainer.freshness_decay)
        if self.state.rng:  # a resumed run draws the same random numbers it would have drawn
            torch.set_rng_state(torch.tensor(self.state.rng["torch"], dtype=torch.uint8))
            self.buffer.rng.setstate(_tupled(self.state.rng["replay"]))
        self.stream = TrajectoryStream(bootstrap, config.topics.trajectories,
                                       DeadLetterQueue(self.producer, config.topics.dlq),
                                       config.trainer.max_staleness, self.state.offsets if restored else None,
                                       set(self.state.seen_trajectory_ids),
                                       config.topics.trainer_group) if self.is_leader else None
        self.history: dict[str, list] = {key: [] for key in (
            "reward", "behaviour_version", "staleness", "compression_ratio", "loss", "ratio_mean", "ratio_abs_dev",
            "clip_fraction", "kl_k3", "value_loss", "grad_norm", "step_s", "trained_at")}
        self.evaluations: list[subprocess.Popen] = []
        self.stopping = False
        signal.signal(signal.SIGTERM, self._stop)
        if self.is_leader:
            metrics.record_trainer_start(max_staleness=config.trainer.max_staleness,
                                         policy_version=self.state.policy_version)
        if resume and self.is_leader:
            self._ledger({"resumed_from_step": self.state.step})

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _next_free_version(self, bootstrap: str, topic: str) -> int:
        """After a resume, continue above every version ever announced, not at the checkpoint's.

        A crashed run may have announced versions after its last checkpoint; reusing their
        numbers would leave samplers that loaded them on the abandoned weights.
        """
        version = torch.tensor([self.state.policy_version], dtype=torch.long, device=self.engine.device)
        if rank() == 0:
            version[0] = max(self.state.policy_version, latest_announced_version(bootstrap, topic))
        if world_size() > 1:
            dist.broadcast(version, src=0)
        if int(version) != self.state.policy_version:
            log.info("resuming at policy v%d: versions up to it were announced before the crash", int(version))
        return int(version)

    def run(self, expected_trajectories: int | None = None) -> dict:
        """Train until `max_steps`, until `expected_trajectories` are handled, or until stopped."""
        cfg = self.config.trainer
        checkpointed_at = self.state.step
        try:
            while True:
                waited = time.perf_counter()
                entries = self._collect(expected_trajectories)  # rank 0 only; empty means stop
                batch, stop = broadcast_batch(entries, self.is_leader and not entries, self.engine.device)
                self.phase_s = {"wait": time.perf_counter() - waited, "forward_backward": 0.0, "optimizer": 0.0,
                                "publish": 0.0}
                if stop:
                    break
                plan = plan_batch(batch, self.baseline, cfg, self.state.policy_version)
                step_metrics = self._train_step(plan)
                self.state.step += 1
                self._ledger({"step": self.state.step, "policy_version": self.state.policy_version,
                              "trajectory_ids": [t.trajectory_id for t in batch]})
                if self.state.step % cfg.sync_every == 0:
                    self._publish()
                self._export(plan, step_metrics)
                self._commit()
                if self.state.step % cfg.checkpoint_every == 0:
                    checkpointed_at = self._checkpoint()
                self._write_status()
            if self.state.step > checkpointed_at:
                self._checkpoint()  # a clean stop always leaves a resumable checkpoint
        finally:
            self._write_status(finished=True)
            if self.is_leader:
                self.stream.close()
                self.producer.flush(10)
            for evaluation in self.evaluations:
                evaluation.wait()  # their results belong to this run
            shutdown()
        return self.status()

    # --- consuming (rank 0) -------------------------------------------------------------

    def _handled(self) -> int:
        c = self.stream.counters
        return self.handled_before_start + c.consumed + c.dead_lettered

    def _should_stop(self, expected: int | None) -> bool:
        if not self.is_leader:
            return False  # only rank 0's answer is broadcast
        max_steps = self.config.trainer.max_steps
        return (self.stopping or (max_steps is not None and self.state.step >= max_steps)
                or (expected is not None and self._handled() >= expected and len(self.buffer) == 0))

    def _collect(self, expected: int | None) -> list[BufferEntry] | None:
        """Rank 0: the next batch's buffer entries (empty when training should stop)."""
        if not self.is_leader:
            return None
        cfg = self.config.trainer
        while not self._should_stop(expected):
            for entry in self.buffer.evict_stale(self.state.policy_version, cfg.max_staleness):
                self.stream.reject_stale(entry, self.state.policy_version)
            all_arrived = expected is not None and self._handled() >= expected
            entries = self._take(all_arrived)
            if entries:
                return entries
            for entry in self.stream.poll(self.batch_size, self.state.policy_version, timeout=1.0):
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
        return trajectory.total_reward - self.baseline.value(trajectory.task_id, trajectory.env)

    # --- training (every rank) ------------------------------------------------------------

    def _train_step(self, plan: BatchPlan) -> dict[str, float]:
        started = time.perf_counter()
        ranks, count = world_size(), len(plan.trajectories)
        normaliser = count / (self.accumulation * ranks)
        chunks = [list(range(count))[i::self.accumulation] for i in range(self.accumulation)]
        totals = torch.zeros(7, dtype=torch.float64)
        for chunk in chunks:
            t0 = time.perf_counter()
            loss, stats = rank_loss(self.engine, plan, chunk[rank()::ranks], normaliser, self.config.trainer,
                                    self.memory_dim)
            self.engine.backward(loss)
            t1 = time.perf_counter()
            self.engine.step()
            self.phase_s["forward_backward"] += t1 - t0
            self.phase_s["optimizer"] += time.perf_counter() - t1
            totals += torch.tensor([stats.loss, stats.tokens, stats.ratio_mean * stats.tokens,
                                    stats.ratio_abs_dev * stats.tokens, stats.clip_fraction * stats.tokens,
                                    stats.kl_k3 * stats.tokens, stats.value_loss], dtype=torch.float64)
        if dist.is_initialized() and ranks > 1:
            dist.all_reduce(totals)
        grad_norm = self.engine.get_global_grad_norm()
        tokens = max(float(totals[1]), 1.0)
        step_metrics = {"loss": float(totals[0]) / (self.accumulation * ranks),
                        "ratio_mean": float(totals[2]) / tokens, "ratio_abs_dev": float(totals[3]) / tokens,
                        "clip_fraction": float(totals[4]) / tokens, "kl_k3": float(totals[5]) / tokens,
                        "value_loss": float(totals[6]) / (self.accumulation * ranks)}
        self._record(plan, step_metrics, grad_norm, time.perf_counter() - started)
        return {**step_metrics, "grad_norm": self.history["grad_norm"][-1]}

    def _export(self, plan: BatchPlan, step_metrics: dict[str, float]) -> None:
        """Prometheus (rank 0 serves /metrics) and the per-step timing split in the history."""
        if not self.is_leader:
            return
        now = time.time()
        kept = metrics.record_trainer_step(
            wait_s=self.phase_s["wait"], forward_backward_s=self.phase_s["forward_backward"],
            optimizer_s=self.phase_s["optimizer"], publish_s=self.phase_s["publish"], loss=step_metrics["loss"],
            rewards=[t.total_reward for t in plan.trajectories], advantages=plan.advantages,
            grad_norm=step_metrics["grad_norm"], ratio_mean=step_metrics["ratio_mean"],
            ratio_abs_dev=step_metrics["ratio_abs_dev"], clip_fraction=step_metrics["clip_fraction"],
            kl_k3=step_metrics["kl_k3"], staleness=plan.staleness,
            sampling_to_training_s=[now - t.created_at for t in plan.trajectories],
            policy_version=self.state.policy_version)
        for key, value in kept.items():
            self.history.setdefault(key, []).append(value)

    def _record(self, plan: BatchPlan, step_metrics: dict[str, float], grad_norm, step_s: float) -> None:
        h = self.history
        h["reward"] += [t.total_reward for t in plan.trajectories]
        h["behaviour_version"] += [t.behaviour_version for t in plan.trajectories]
        h["staleness"] += plan.staleness
        h["compression_ratio"] += [t.compression.get("ratio", 1.0) for t in plan.trajectories]
        for name, value in step_metrics.items():
            h[name].append(value)
        h["grad_norm"].append(float(grad_norm) if grad_norm is not None else float("nan"))
        h["step_s"].append(step_s)
        h["trained_at"].append(time.time())
        log.info("step %d: loss %.4f reward %.3f rho %.4f |rho-1| %.2e clip %.3f grad %.2f (%.1f s)",
                 self.state.step + 1, step_metrics["loss"],
                 sum(h["reward"][-len(plan.trajectories):]) / len(plan.trajectories), step_metrics["ratio_mean"],
                 step_metrics["ratio_abs_dev"], step_metrics["clip_fraction"], h["grad_norm"][-1], step_s)

    # --- after a step ---------------------------------------------------------------------

    def _publish(self) -> None:
        started = time.perf_counter()
        self.state.policy_version += 1
        self.publisher.publish(self.engine, self.state.policy_version, self.state.step)
        self.phase_s["publish"] = time.perf_counter() - started
        log.info("published policy v%d in %.1f s", self.state.policy_version, self.phase_s["publish"])
        every = self.config.trainer.eval_every
        if self.is_leader and every and self.state.policy_version % every == 0:
            self._evaluate_in_background(self.state.policy_version)

    def _evaluate_in_background(self, version: int) -> None:
        """`sao eval` in its own process: training never waits for an evaluation."""
        config_path = self.run_dir / "trainer-config.toml"
        config_path.write_text(to_toml(self.config))
        log_path = self.run_dir / "logs" / f"eval-v{version:06d}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.evaluations.append(subprocess.Popen(
            [sys.executable, "-m", "sao.cli", "eval", "--config", str(config_path), "--run-dir", str(self.run_dir),
             "--version", str(version), "--num-tasks", str(self.config.trainer.eval_tasks)],
            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT))

    def _safe_offsets(self) -> dict[int, int]:
        return self.stream.safe_offsets(self.buffer.low_water_marks())

    def _commit(self) -> None:
        if self.is_leader:
            self.stream.commit(self._safe_offsets())

    def _checkpoint(self) -> int:
        if self.is_leader:
            held = self.buffer.held_ids()
            self.state.offsets = self._safe_offsets()
            # Buffered trajectories will be re-read after a resume, so they must not count as seen.
            self.state.seen_trajectory_ids = sorted(self.stream.seen_ids - held)
            self.state.handled = self._handled() - len(self.buffer)
        self.state.baseline = self.baseline.state_dict()
        self.state.rng = {"torch": torch.get_rng_state().tolist(), "replay": _jsonable(self.buffer.rng.getstate())}
        started = time.perf_counter()
        save_checkpoint(self.engine, self.checkpoint_dir, self.state)
        if self.is_leader:
            metrics.record_checkpoint(time.perf_counter() - started)
        return self.state.step

    def _ledger(self, record: dict) -> None:
        """Append-only record of what each step trained on (audits exactly-once delivery)."""
        if self.is_leader:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / "trained.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")

    def status(self) -> dict:
        counters = self.stream.counters if self.is_leader else None
        return {"step": self.state.step, "policy_version": self.state.policy_version,
                "trajectories_trained": len(self.history["reward"]),
                "consumed": counters.consumed if counters else 0, "duplicates": counters.duplicates if counters else 0,
                "dead_lettered": counters.dead_lettered if counters else 0,
                "too_stale": counters.too_stale if counters else 0, "dlq_reasons": counters.reasons if counters else {},
                "wait_s": counters.wait_s if counters else 0.0, "rank": rank(), "world_size": world_size(),
                "memory": memory_per_rank(self.engine),
                "history": self.history}

    def _write_status(self, finished: bool = False) -> None:
        name = "trainer.json" if self.is_leader else f"trainer-rank{rank()}.json"
        write_status(self.run_dir / "status" / name, {**self.status(), "finished": finished})


def _jsonable(state):
    """random.Random state (nested tuples) as JSON lists."""
    return [_jsonable(item) for item in state] if isinstance(state, tuple) else state


def _tupled(state):
    return tuple(_tupled(item) for item in state) if isinstance(state, list) else state
