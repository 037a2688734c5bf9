"""Consume trajectories for the trainer: decode, drop duplicates, dead-letter what can't be used.

A message is dead-lettered when it is too large, cannot be decoded, does not fit the trainer's model
(`TrajectoryValidator`) or is too stale; the loop dead-letters a buffered one that later raises while
scored or sits in a batch with a non-finite loss. Every dead letter goes to the dead-letter topic
with its reason and counts as handled: its offset moves on and its id is remembered, so a
restart never meets it again. A dead-lettered message above the offsets a checkpoint stores (behind
a trajectory still buffered) is remembered by position too, for those that have no id.

The stream tracks, per partition, the next offset to read. The replay buffer tracks which
consumed trajectories are still waiting. Together they give the offsets that are safe to
commit and to store in a checkpoint (see `ReplayBuffer.low_water_marks`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, Message, TopicPartition

from sao.dead_letters import DeadLetterReason
from sao.metrics import TRANSPORT_DUPLICATES, record_delivery
from sao.schema import SchemaError, Trajectory, decode
from sao.trainer.buffer import BufferEntry
from sao.trainer.validation import TrajectoryValidator
from sao.transport.dlq import DeadLetterQueue
from sao.transport.kafka import DEFAULT_FETCH_WAIT_MS, MAX_MESSAGE_BYTES, make_consumer
from sao.transport.lag import LagReporter

log = logging.getLogger(__name__)

_GROUP_LOST = {KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION, KafkaError.REBALANCE_IN_PROGRESS,
               KafkaError._ASSIGNMENT_LOST}

# Room for the record framing and sao's headers when a dead-lettered message is re-sent whole.
_DLQ_HEADROOM_BYTES = 64 * 1024


@dataclass
class StreamCounters:
    consumed: int = 0  # accepted into the buffer
    duplicates: int = 0  # trajectory_id already trained, dead-lettered or buffered
    dead_lettered: int = 0  # all dead letters, at intake or later from the buffer
    dead_lettered_from_buffer: int = 0  # of those, trajectories that had been accepted (and counted in consumed) first
    too_stale: int = 0
    wait_s: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)

    def counts(self) -> dict[str, Any]:
        """These counters under their names in the trainer's progress (`sao.status.TrainerProgress`)."""
        return {"consumed": self.consumed, "duplicates": self.duplicates, "dead_lettered": self.dead_lettered,
                "dead_lettered_from_buffer": self.dead_lettered_from_buffer,
                "too_stale": self.too_stale, "dlq_reasons": dict(self.reasons)}


class TrajectoryStream:
    def __init__(self, bootstrap: str, topic: str, dlq: DeadLetterQueue, max_staleness: int,
                 validator: TrajectoryValidator, start_offsets: dict[int, int] | None = None,
                 seen_ids: set[str] | None = None, group_id: str = "sao-trainer",
                 dead_lettered_offsets: dict[int, list[int]] | None = None, fetch_wait_ms: int = DEFAULT_FETCH_WAIT_MS):
        self.topic = topic
        self.dlq = dlq
        self.max_staleness = max_staleness
        self.validator = validator
        self.next_offsets: dict[int, int] = dict(start_offsets or {})
        self.seen_ids: set[str] = set(seen_ids or ())
        # Positions dead-lettered (by this life or, above its checkpoint's offsets, an earlier one).
        self.dead_lettered_positions: dict[int, set[int]] = {p: set(o) for p, o in (dead_lettered_offsets or {}).items()}
        self.counters = StreamCounters()
        self.consumer = make_consumer(bootstrap, group_id, fetch_wait_ms=fetch_wait_ms)
        # Exported for dashboards and alerts only: wrong on Tansu, whose high watermarks are wrong.
        self.lag = LagReporter(self.consumer, group_id)
        self._resume_offsets = start_offsets
        # Told of every message read, before anything is decided about it (the trajectory log's writer).
        self.on_message: Callable[[str, int, int, bytes | None], None] | None = None
        self.consumer.subscribe([topic], on_assign=self._on_assign)

    def _on_assign(self, consumer, partitions: list[TopicPartition]) -> None:
        # A resumed trainer starts exactly where its checkpoint says, whatever Kafka committed
        # since: a partition the checkpoint does not know had nothing trained, so it starts at
        # the beginning. Without a checkpoint (start_offsets None) Kafka's committed offsets rule.
        if self._resume_offsets is not None:
            for tp in partitions:
                tp.offset = self._resume_offsets.get(tp.partition, OFFSET_BEGINNING)
        consumer.assign(partitions)

    def poll(self, max_messages: int, policy_version: int, timeout: float) -> list[BufferEntry]:
        """Up to `max_messages` usable trajectories that arrive within `timeout` seconds."""
        accepted: list[BufferEntry] = []
        deadline = time.monotonic() + timeout
        started = time.perf_counter()
        while len(accepted) < max_messages and time.monotonic() < deadline:
            msg = self.consumer.poll(min(0.2, max(0.0, deadline - time.monotonic())))
            self.lag.maybe_report()
            if msg is None:
                continue
            if msg.error() is not None:
                log.warning("trajectories topic: %s", msg.error())
                continue
            self.next_offsets[msg.partition()] = msg.offset() + 1
            if self.on_message is not None:
                self.on_message(self.topic, msg.partition(), msg.offset(), msg.value())
            if msg.offset() in self.dead_lettered_positions.get(msg.partition(), ()):
                self.counters.duplicates += 1  # dead-lettered before a resume re-read it
                continue
            entry = self._accept(msg, policy_version)
            if entry is not None:
                accepted.append(entry)
        self.counters.wait_s += time.perf_counter() - started
        return accepted

    def _accept(self, msg: Message, policy_version: int) -> BufferEntry | None:
        value = msg.value()
        try:
            if value is not None:
                self.validator.check_size(len(value))  # before decoding: the cost of a huge message is in reading it
            trajectory = decode(value, Trajectory)
        except SchemaError as err:
            self.dead_letter(value, msg.partition(), msg.offset(), msg.key(), err.reason, str(err))
            return None
        record_delivery(self.topic, trajectory.created_at, len(value))
        if trajectory.trajectory_id in self.seen_ids:
            self.counters.duplicates += 1  # a redelivered task, or a re-read after resume
            TRANSPORT_DUPLICATES.labels(topic=self.topic).inc()
            return None
        self.seen_ids.add(trajectory.trajectory_id)
        entry = BufferEntry(trajectory, value, msg.partition(), msg.offset())
        try:
            self.validator.validate(trajectory, policy_version)
        except SchemaError as err:
            self.dead_letter_entry(entry, err.reason, str(err), buffered=False)
            return None
        if policy_version - trajectory.behaviour_version > self.max_staleness:
            self.dead_letter_stale(entry, policy_version, buffered=False)
            return None
        self.counters.consumed += 1
        return entry

    def dead_letter_stale(self, entry: BufferEntry, policy_version: int, buffered: bool = True) -> None:
        staleness = policy_version - entry.trajectory.behaviour_version
        self.counters.too_stale += 1
        detail = (f"behaviour v{entry.trajectory.behaviour_version} is {staleness} versions behind v{policy_version} "
                  f"(trainer.max_staleness {self.max_staleness})")
        self.dead_letter_entry(entry, DeadLetterReason.TOO_STALE, detail, buffered)

    def dead_letter_entry(self, entry: BufferEntry, reason: DeadLetterReason, detail: str,
                          buffered: bool = True) -> None:
        """Dead-letter a decoded trajectory; `buffered` if it had been accepted into the buffer first."""
        if buffered:
            self.counters.dead_lettered_from_buffer += 1
        self.dead_letter(entry.raw, entry.partition, entry.offset, entry.trajectory.task_id, reason, detail)

    def dead_letter(self, value: bytes | None, partition: int, offset: int, key, reason: DeadLetterReason,
                    detail: str) -> None:
        self.counters.dead_lettered += 1
        self.dead_lettered_positions.setdefault(partition, set()).add(offset)
        self.counters.reasons[reason] = self.counters.reasons.get(reason, 0) + 1
        if value is not None and len(value) > MAX_MESSAGE_BYTES - _DLQ_HEADROOM_BYTES:
            # The producer would refuse it (and raise): keep the why and the where instead.
            detail += (f"; the original {len(value)} bytes are over what the dead-letter topic carries and stay at "
                       f"{self.topic}[{partition}]@{offset}")
            value = None
        self.dlq.send(value, reason, source_topic=self.topic, partition=partition, offset=offset, key=key,
                      detail=detail)

    def dead_lettered_above(self, offsets: dict[int, int]) -> dict[int, list[int]]:
        """Dead-lettered positions at or above `offsets` (what a resume from them would re-read); forgets the rest."""
        for partition, positions in self.dead_lettered_positions.items():
            positions.difference_update({o for o in positions if o < offsets.get(partition, 0)})
        return {p: sorted(positions) for p, positions in self.dead_lettered_positions.items() if positions}

    def safe_offsets(self, low_water_marks: dict[int, int]) -> dict[int, int]:
        """Per partition: the lowest offset still buffered, else the next offset to read."""
        return {p: min(o, low_water_marks.get(p, o)) for p, o in self.next_offsets.items()}

    def commit(self, offsets: dict[int, int]) -> None:
        """Commit offsets (after the trainer stepped on what lies below them, DLQ flushed)."""
        if not offsets:
            return
        self.dlq.flush(10)
        try:
            self.consumer.commit(offsets=[TopicPartition(self.topic, p, o) for p, o in offsets.items()],
                                 asynchronous=False)
        except KafkaException as err:
            # A step longer than the group's patience (an overloaded machine) costs the consumer its
            # membership; the next poll rejoins. Nothing is lost: the next commit (or the checkpoint's
            # offsets) covers these, and what is read again is dropped as a duplicate.
            if err.args[0].code() not in _GROUP_LOST:
                raise
            log.warning("trajectory offsets not committed: the consumer group dropped this trainer (%s); "
                        "it rejoins at the next poll", err.args[0].str())

    def close(self) -> None:
        self.consumer.close()
