"""The trainer process: consume -> batch -> loss -> ZeRO-3 step -> (publish) -> commit -> (checkpoint).

Reads top to bottom in `Trainer.run`; every arrow is one call. The trainer never waits for a
particular sampler: it takes whatever fresh trajectories Kafka holds, in arrival order.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import torch

from sao.compression.semantic import load_encoder
from sao.config import SaoConfig
from sao.consumers.trajectory_stream import TrajectoryStream
from sao.policy.context import training_inputs
from sao.policy.model import collate_steps
from sao.policy.weights import build_policy
from sao.schema import Trajectory
from sao.status import write_status
from sao.trainer.baselines import RewardBaseline
from sao.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from sao.trainer.engine import build_engine, shutdown
from sao.trainer.objectives import tis_policy_gradient_loss, whiten
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
        self.engine = build_engine(build_policy(config.policy, self.memory_dim), config.trainer)
        self.state = (load_checkpoint(self.engine, self.checkpoint_dir) if resume else None) or TrainerState()
        self.baseline = RewardBaseline(config.trainer.baseline_key, config.trainer.baseline_momentum)
        if self.state.baseline:
            self.baseline.load_state_dict(self.state.baseline)
        self.producer = make_producer(bootstrap)
        self.stream = TrajectoryStream(bootstrap, config.topics.trajectories,
                                       DeadLetterQueue(self.producer, config.topics.dlq),
                                       config.trainer.max_staleness, self.state.offsets,
                                       set(self.state.seen_trajectory_ids))
        self.publisher = PolicyPublisher(self.producer, config.topics.policy, run_dir / "policy",
                                         config.trainer.keep_versions)
        self.history: dict[str, list] = {"reward": [], "behaviour_version": [], "staleness": [], "compression_ratio": [],
                                         "loss": [], "ratio_mean": [], "ratio_abs_dev": [], "clip_fraction": [],
                                         "kl_k3": [], "grad_norm": [], "step_s": [], "trained_at": []}
        self.stopping = False
        signal.signal(signal.SIGTERM, self._stop)

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def run(self, expected_trajectories: int | None = None) -> dict:
        """Train until `max_steps`, until `expected_trajectories` are handled, or until stopped."""
        cfg = self.config.trainer
        try:
            while not self._finished(expected_trajectories):
                batch = self._collect_batch(expected_trajectories)
                if not batch:
                    continue
                self._train_step(batch)
                self.state.step += 1
                if self.state.step % cfg.sync_every == 0:
                    self._publish()
                self.stream.commit()
                if self.state.step % cfg.checkpoint_every == 0:
                    self._checkpoint()
                self._write_status()
            if self.state.step % cfg.checkpoint_every != 0 and self.state.step > 0:
                self._checkpoint()  # a clean stop always leaves a resumable checkpoint
        finally:
            self._write_status(finished=True)
            self.stream.close()
            self.producer.flush(10)
            shutdown()
        return self.status()

    def _finished(self, expected: int | None) -> bool:
        handled = self.stream.counters.consumed + self.stream.counters.dead_lettered
        return (self.stopping or (self.config.trainer.max_steps is not None and self.state.step >= self.config.trainer.max_steps)
                or (expected is not None and handled >= expected))

    def _collect_batch(self, expected: int | None) -> list[Trajectory]:
        """A full batch, or the last partial one when the expected total is almost reached."""
        batch: list[Trajectory] = []
        while not self.stopping:
            handled = self.stream.counters.consumed + self.stream.counters.dead_lettered
            remaining = None if expected is None else expected - handled
            want = self.config.trainer.batch_size - len(batch)
            if remaining is not None:
                want = min(want, remaining)
            if want <= 0:
                break
            batch += self.stream.next_batch(want, self.state.policy_version, timeout=1.0)
        return batch

    def _train_step(self, batch: list[Trajectory]) -> None:
        cfg = self.config.trainer
        started = time.perf_counter()
        rewards = torch.tensor([t.total_reward for t in batch])
        advantages = rewards - torch.tensor([self.baseline.value(t.task_id, t.env) for t in batch])
        if cfg.whiten_advantages:
            advantages = whiten(advantages)
        for trajectory in batch:
            self.baseline.update(trajectory.task_id, trajectory.env, trajectory.total_reward)
        staleness = [self.state.policy_version - t.behaviour_version for t in batch]
        inputs, row_weights, behaviour, temperatures = [], [], [], []
        for trajectory, advantage, stale in zip(batch, advantages.tolist(), staleness):
            for step_input, step in zip(training_inputs(trajectory), trajectory.steps):
                inputs.append(step_input)
                row_weights.append(advantage * cfg.freshness_decay ** stale)
                behaviour.append(torch.from_numpy(step.behaviour_logprobs.copy()))
                temperatures.append(trajectory.temperature)
        scoring = collate_steps(inputs, self.memory_dim, temperatures).to(self.engine.device)
        behaviour_logprobs = torch.zeros(scoring.token_ids.shape, device=self.engine.device)
        for row, row_logprobs in enumerate(behaviour):
            behaviour_logprobs[row, scoring.action_mask[row]] = row_logprobs.to(self.engine.device)
        logprobs = self.engine(scoring)
        loss, stats = tis_policy_gradient_loss(logprobs, behaviour_logprobs, scoring.action_mask,
                                               torch.tensor(row_weights, device=self.engine.device), len(batch),
                                               cfg.tis_clip)
        self.engine.backward(loss)
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        self._record(batch, staleness, stats, grad_norm, time.perf_counter() - started)

    def _record(self, batch, staleness, stats, grad_norm, step_s: float) -> None:
        h = self.history
        h["reward"] += [t.total_reward for t in batch]
        h["behaviour_version"] += [t.behaviour_version for t in batch]
        h["staleness"] += staleness
        h["compression_ratio"] += [t.compression.get("ratio", 1.0) for t in batch]
        for name in ("loss", "ratio_mean", "ratio_abs_dev", "clip_fraction", "kl_k3"):
            h[name].append(getattr(stats, name))
        h["grad_norm"].append(float(grad_norm) if grad_norm is not None else float("nan"))
        h["step_s"].append(step_s)
        h["trained_at"].append(time.time())
        log.info("step %d: loss %.4f reward %.3f rho %.4f |rho-1| %.2e grad %.2f (%.1f s)", self.state.step + 1,
                 stats.loss, sum(t.total_reward for t in batch) / len(batch), stats.ratio_mean, stats.ratio_abs_dev,
                 h["grad_norm"][-1], step_s)

    def _publish(self) -> None:
        started = time.perf_counter()
        self.state.policy_version += 1
        self.publisher.publish(self.engine, self.state.policy_version, self.state.step)
        log.info("published policy v%d in %.1f s", self.state.policy_version, time.perf_counter() - started)

    def _checkpoint(self) -> None:
        self.state.offsets = dict(self.stream.offsets)
        self.state.baseline = self.baseline.state_dict()
        self.state.seen_trajectory_ids = sorted(self.stream.seen_ids)
        save_checkpoint(self.engine, self.checkpoint_dir, self.state)

    def status(self) -> dict:
        c = self.stream.counters
        return {"step": self.state.step, "policy_version": self.state.policy_version,
                "trajectories_trained": len(self.history["reward"]), "consumed": c.consumed,
                "duplicates": c.duplicates, "dead_lettered": c.dead_lettered, "too_stale": c.too_stale,
                "dlq_reasons": c.reasons, "wait_s": c.wait_s, "history": self.history}

    def _write_status(self, finished: bool = False) -> None:
        write_status(self.run_dir / "status" / "trainer.json", {**self.status(), "finished": finished})
