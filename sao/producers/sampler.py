"""The sampler process: consume a task, roll out one trajectory, compress, produce, commit.

A task offset is committed only after its trajectory is acknowledged by the broker, so a
sampler that dies mid-task leaves the task to another member of the "sao-samplers" group
(the trainer drops the duplicate by trajectory_id if both finish). New policy versions are
loaded between trajectories, never during one.
"""

from __future__ import annotations

import logging
import signal
import time
import zlib
from pathlib import Path

import torch
from confluent_kafka import KafkaException, TopicPartition

from sao.compression.semantic import load_encoder
from sao.compression.temporal import load_temporal_filter
from sao.config import SaoConfig
from sao.envs.guard import EnvFailure
from sao.metrics import record_delivery, record_policy_reload, record_rollout
from sao.policy.weights import WeightsMismatch, build_policy, place_for_sampling, read_weights_into
from sao.producers.policy_follow import PolicyFollower
from sao.producers.rollout import Roller
from sao.schema import SchemaError, Task, decode, encode
from sao.status import write_status
from sao.transport.dlq import DeadLetterQueue
from sao.transport.kafka import deliver_and_wait, make_consumer, make_producer
from sao.transport.lag import LagReporter

log = logging.getLogger(__name__)


class Sampler:
    def __init__(self, config: SaoConfig, bootstrap: str, sampler_id: str, status_path: Path | None = None):
        torch.set_num_threads(config.sampler.torch_threads)
        self.config = config
        self.sampler_id = sampler_id
        self.status_path = status_path
        encoder = load_encoder(config.compression.encoder)
        temporal_filter = load_temporal_filter(config.compression.temporal_weights, config.compression.keep_threshold)
        self.policy = place_for_sampling(build_policy(config.policy, encoder.dim), config.sampler.device)
        seed = zlib.crc32(sampler_id.encode())  # stable across processes, unlike hash()
        self.roller = Roller(config, self.policy, encoder, temporal_filter, sampler_id, seed)
        self.version = 0
        self.counters = {"produced": 0, "dead_lettered": 0, "reloads": 0, "reward_sum": 0.0, "tokens": 0,
                         "rollout_s": 0.0, "reload_s": 0.0}
        self.policy_follower = PolicyFollower(bootstrap, config.topics.policy)
        self.producer = make_producer(bootstrap)
        self.dlq = DeadLetterQueue(self.producer, config.topics.dlq)
        self.tasks = make_consumer(bootstrap, config.topics.sampler_group, [config.topics.tasks])
        self.task_lag = LagReporter(self.tasks, config.topics.sampler_group)
        self.stopping = False

    def run(self, max_tasks: int | None = None) -> dict:
        """Loop until stopped (SIGTERM/SIGINT) or `max_tasks` tasks are handled."""
        signal.signal(signal.SIGTERM, self._stop)
        handled = 0
        try:
            while not self.stopping and (max_tasks is None or handled < max_tasks):
                want = self.config.sampler.rollout_batch
                if max_tasks is not None:
                    want = min(want, max_tasks - handled)
                messages = self.tasks.consume(num_messages=want, timeout=0.5)
                self.task_lag.maybe_report()
                for msg in messages:
                    if msg.error() is not None:
                        log.warning("tasks topic: %s", msg.error())
                messages = [msg for msg in messages if msg.error() is None]
                if not messages:
                    continue
                # Between trajectories, right before the next ones: a version announced while
                # this sampler waited for tasks is used for them.
                self._maybe_reload()
                self._handle(messages)
                handled += len(messages)
                self._write_status()
        finally:
            self._write_status(finished=True)
            self.tasks.close()
            self.policy_follower.close()
            self.producer.flush(10)
        return self.counters

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _handle(self, messages: list) -> None:
        """Roll out one trajectory per task (side by side), produce them, then commit the tasks."""
        runnable = []
        for msg in messages:
            try:
                task = decode(msg.value(), Task)
            except SchemaError as err:
                self._dead_letter(msg, err.reason, str(err))
                continue
            record_delivery(msg.topic(), task.created_at, len(msg.value()))
            runnable.append((msg, task))
        results = self.roller.rollout_batch([task for _, task in runnable], self.version) if runnable else []
        for (msg, task), result in zip(runnable, results):
            if isinstance(result, EnvFailure):
                # The env raised or hung: this task ends here, the sampler goes on.
                self._dead_letter(msg, result.reason, str(result))
                continue
            produce_started = time.perf_counter()
            deliver_and_wait(self.producer, self.config.topics.trajectories, encode(result), key=task.task_id)
            record_rollout(result, time.perf_counter() - produce_started)
            self.counters["produced"] += 1
            self.counters["reward_sum"] += result.total_reward
            self.counters["tokens"] += sum(len(s.action_ids) for s in result.steps)
            self.counters["rollout_s"] += result.timings["rollout_s"]
        # Only now are the tasks safely handed on (trajectories acked, or dead letters queued).
        self.dlq.flush(10)
        last = {}
        for msg in messages:
            last[(msg.topic(), msg.partition())] = max(last.get((msg.topic(), msg.partition()), -1), msg.offset())
        try:
            self.tasks.commit(offsets=[TopicPartition(t, p, o + 1) for (t, p), o in last.items()], asynchronous=False)
        except KafkaException as err:
            # A partition moved to another sampler during the rollouts (a rebalance): those tasks
            # run again there, and the trainer drops the duplicates by trajectory_id.
            log.warning("%s could not commit task offsets: %s", self.sampler_id, err)

    def _dead_letter(self, msg, reason: str, detail: str) -> None:
        self.dlq.send(msg.value(), reason, source_topic=msg.topic(), partition=msg.partition(),
                      offset=msg.offset(), key=msg.key(), detail=detail)
        self.counters["dead_lettered"] += 1

    def _maybe_reload(self) -> None:
        announcement = self.policy_follower.poll()
        if announcement is None or announcement.version <= self.version:
            return
        started = time.perf_counter()
        try:
            read_weights_into(self.policy, announcement.weights_path, announcement.sha256)
        except (FileNotFoundError, WeightsMismatch) as err:
            # A lagging sampler may find a pruned file; the next announcement brings a newer one.
            log.warning("%s could not load policy v%d: %s", self.sampler_id, announcement.version, err)
            return
        reload_s = time.perf_counter() - started
        self.version = announcement.version
        self.counters["reloads"] += 1
        self.counters["reload_s"] += reload_s
        record_policy_reload(self.version, reload_s)
        log.info("%s loaded policy v%d in %.1f s", self.sampler_id, self.version, reload_s)

    def _write_status(self, finished: bool = False) -> None:
        if self.status_path is not None:
            write_status(self.status_path, {**self.counters, "sampler_id": self.sampler_id,
                                            "policy_version": self.version, "finished": finished})
