"""Consume trajectories for the trainer: decode, dedup, gate staleness, dead-letter the rest.

Offsets are tracked per partition as "next offset to read" of everything handed to the trainer
or dead-lettered. The trainer takes whole batches and trains on them before asking again, so
after each step those offsets are exactly what is safe to commit and to store in a checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from confluent_kafka import Message, TopicPartition

from sao.schema import SchemaError, Trajectory, decode
from sao.transport.dlq import DeadLetterQueue
from sao.transport.kafka import make_consumer

log = logging.getLogger(__name__)

TRAINER_GROUP = "sao-trainer"


@dataclass
class StreamCounters:
    consumed: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    too_stale: int = 0
    wait_s: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)


class TrajectoryStream:
    def __init__(self, bootstrap: str, topic: str, dlq: DeadLetterQueue, max_staleness: int,
                 start_offsets: dict[int, int] | None = None, seen_ids: set[str] | None = None):
        self.topic = topic
        self.dlq = dlq
        self.max_staleness = max_staleness
        self.offsets: dict[int, int] = dict(start_offsets or {})
        self.seen_ids: set[str] = set(seen_ids or ())
        self.counters = StreamCounters()
        self.consumer = make_consumer(bootstrap, TRAINER_GROUP)
        self.consumer.subscribe([topic], on_assign=self._on_assign)

    def _on_assign(self, consumer, partitions: list[TopicPartition]) -> None:
        # A resumed trainer starts exactly where its checkpoint says, whatever Kafka committed.
        for tp in partitions:
            if tp.partition in self.offsets:
                tp.offset = self.offsets[tp.partition]
        consumer.assign(partitions)

    def next_batch(self, size: int, policy_version: int, timeout: float) -> list[Trajectory]:
        """Up to `size` fresh trajectories; returns fewer only when `timeout` passes first."""
        batch: list[Trajectory] = []
        deadline = time.monotonic() + timeout
        started = time.perf_counter()
        while len(batch) < size and time.monotonic() < deadline:
            msg = self.consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error() is not None:
                log.warning("trajectories topic: %s", msg.error())
                continue
            trajectory = self._accept(msg, policy_version)
            self.offsets[msg.partition()] = msg.offset() + 1
            if trajectory is not None:
                batch.append(trajectory)
        self.counters.wait_s += time.perf_counter() - started
        return batch

    def _accept(self, msg: Message, policy_version: int) -> Trajectory | None:
        try:
            trajectory = decode(msg.value(), Trajectory)
        except SchemaError as err:
            self._dead_letter(msg, err.reason, str(err))
            return None
        if trajectory.trajectory_id in self.seen_ids:
            self.counters.duplicates += 1  # a redelivered task: trained once already
            return None
        self.seen_ids.add(trajectory.trajectory_id)
        staleness = policy_version - trajectory.behaviour_version
        if staleness > self.max_staleness:
            self.counters.too_stale += 1
            self._dead_letter(msg, "too-stale", f"behaviour v{trajectory.behaviour_version} is {staleness} "
                                                f"versions behind v{policy_version} (max_staleness {self.max_staleness})")
            return None
        self.counters.consumed += 1
        return trajectory

    def _dead_letter(self, msg: Message, reason: str, detail: str) -> None:
        self.counters.dead_lettered += 1
        self.counters.reasons[reason] = self.counters.reasons.get(reason, 0) + 1
        self.dlq.send(msg.value(), reason, source_topic=msg.topic(), partition=msg.partition(),
                      offset=msg.offset(), key=msg.key(), detail=detail)

    def commit(self) -> None:
        """Commit what was handed out: call after the trainer stepped on it (and DLQ flushed)."""
        if not self.offsets:
            return
        self.dlq.flush(10)
        self.consumer.commit(offsets=[TopicPartition(self.topic, p, o) for p, o in self.offsets.items()],
                             asynchronous=False)

    def close(self) -> None:
        self.consumer.close()
