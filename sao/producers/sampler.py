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
from confluent_kafka import KafkaException

from sao.compression.semantic import load_encoder
from sao.compression.temporal import load_temporal_filter
from sao.config import SaoConfig
from sao.envs.guard import EnvFailure
from sao.envs.registry import make_env
from sao.metrics import record_delivery, record_policy_reload, record_rollout
from sao.policy.loading import load_tokenizer
from sao.policy.weights import WeightsMismatch, build_policy, read_weights_into
from sao.producers.policy_follow import PolicyFollower
from sao.producers.rollout import ChatFormat, Roller
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
        self.policy = build_policy(config.policy, encoder.dim).eval()
        chat = ChatFormat(load_tokenizer(config.policy.model, config.policy.cache_dir), config.policy.system_prompt)
        seed = zlib.crc32(sampler_id.encode())  # stable across processes, unlike hash()
        self.roller = Roller(config, make_env(config.env), self.policy, chat, encoder, temporal_filter, sampler_id, seed)
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
                msg = self.tasks.poll(0.5)
                self.task_lag.maybe_report()
                if msg is None:
                    continue
                if msg.error() is not None:
                    log.warning("tasks topic: %s", msg.error())
                    continue
                # Between trajectories, right before the next one: a version announced while
                # this sampler waited for a task is used for that task.
                self._maybe_reload()
                self._handle(msg)
                handled += 1
                self._write_status()
        finally:
            self._write_status(finished=True)
            self.tasks.close()
            self.policy_follower.close()
            self.producer.flush(10)
        return self.counters

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _handle(self, msg) -> None:
        try:
            task = decode(msg.value(), Task)
            record_delivery(msg.topic(), task.created_at, len(msg.value()))
            trajectory = self.roller.rollout(task, self.version)
        except (SchemaError, EnvFailure) as err:
            # A malformed task, or an env that raised or hung: this task ends here, the sampler goes on.
            self.dlq.send(msg.value(), err.reason, source_topic=msg.topic(), partition=msg.partition(),
                          offset=msg.offset(), key=msg.key(), detail=str(err))
            self.counters["dead_lettered"] += 1
        else:
            produce_started = time.perf_counter()
            deliver_and_wait(self.producer, self.config.topics.trajectories, encode(trajectory), key=task.task_id)
            record_rollout(trajectory, time.perf_counter() - produce_started)
            self.counters["produced"] += 1
            self.counters["reward_sum"] += trajectory.total_reward
            self.counters["tokens"] += sum(len(s.action_ids) for s in trajectory.steps)
            self.counters["rollout_s"] += trajectory.timings["rollout_s"]
        # Only now is the task safely handed on (trajectory acked, or dead letter queued).
        self.dlq.flush(10)
        try:
            self.tasks.commit(message=msg, asynchronous=False)
        except KafkaException as err:
            # The partition moved to another sampler during the rollout (a rebalance): the task
            # will run again there, and the trainer drops the duplicate by trajectory_id.
            log.warning("%s could not commit task offset %s: %s", self.sampler_id, msg.offset(), err)

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
