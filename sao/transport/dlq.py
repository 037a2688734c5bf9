"""Send messages sao cannot use to a dead-letter topic, unchanged, with the reason in headers.

Nothing is dropped silently: every message a consumer cannot use goes here with its reason (a
`DeadLetterReason`), is logged, and is counted in `sao_dlq_messages_total{reason=...}`.
`DeadLetteredTasks` reads it back: the task messages samplers dead-lettered, whose trajectories
will never come.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Container
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer

from sao.dead_letters import NO_REASON, DeadLetterReason
from sao.metrics import DLQ_MESSAGES
from sao.schema import SchemaError, Task, Trajectory, decode
from sao.transport.kafka import assign_from_start, make_consumer

log = logging.getLogger(__name__)

REASON_HEADER = "sao-dlq-reason"
DETAIL_HEADER = "sao-dlq-detail"
SOURCE_TOPIC_HEADER = "sao-source-topic"
SOURCE_PARTITION_HEADER = "sao-source-partition"
SOURCE_OFFSET_HEADER = "sao-source-offset"


class DeadLetterQueue:
    """Produces unusable messages to one dead-letter topic through a shared producer."""

    def __init__(self, producer: Producer, topic: str) -> None:
        self.producer = producer
        self.topic = topic
        self.pending = 0  # dead letters queued and not yet acknowledged (or refused)

    def send(self, value: bytes | None, reason: DeadLetterReason, *, source_topic: str | None = None,
             partition: int | None = None, offset: int | None = None, key: bytes | str | None = None,
             detail: str = "") -> None:
        """Queue `value` for the dead-letter topic, saying why (`reason`) and what was wrong (`detail`).

        A reason outside the vocabulary raises ValueError: readers and docs know only those codes."""
        reason = DeadLetterReason(reason)
        headers = [(name, str(text).encode()) for name, text in (
            (REASON_HEADER, reason), (DETAIL_HEADER, detail), (SOURCE_TOPIC_HEADER, source_topic),
            (SOURCE_PARTITION_HEADER, partition), (SOURCE_OFFSET_HEADER, offset)) if text is not None]
        log.warning("Dead-lettering a message from %s[%s]@%s to %s: %s %s",
                    source_topic, partition, offset, self.topic, reason, detail)
        self.producer.produce(self.topic, value=value, key=key, headers=headers, on_delivery=self._on_delivery)
        self.pending += 1
        self.producer.poll(0)  # serve earlier delivery reports without waiting
        DLQ_MESSAGES.labels(reason=reason).inc()

    def flush(self, timeout: float = 10.0) -> int:
        """Wait until this queue's dead letters are acknowledged; return how many are not.

        Without any pending it returns at once: the shared producer's other messages (a sampler's
        trajectories in flight) are not waited for.
        """
        if self.pending:
            self.producer.flush(timeout)
        return self.pending

    def _on_delivery(self, error: KafkaError | None, msg: Message) -> None:
        self.pending -= 1
        if error is not None:
            log.error("Could not write to dead-letter topic %s: %s; the message is lost", self.topic, error.str())


def describe_dlq_message(msg: Message) -> dict[str, Any]:
    """Read a dead-letter message back: why it was dead-lettered, where it came from, its size."""
    headers = {name: value.decode(errors="replace") for name, value in (msg.headers() or []) if value is not None}
    value = msg.value()
    return {
        "reason": headers.get(REASON_HEADER, ""),
        "detail": headers.get(DETAIL_HEADER, ""),
        "source_topic": headers.get(SOURCE_TOPIC_HEADER),
        "source_partition": _int_or_none(headers.get(SOURCE_PARTITION_HEADER)),
        "source_offset": _int_or_none(headers.get(SOURCE_OFFSET_HEADER)),
        "key": msg.key(),
        "value_bytes": None if value is None else len(value),
        "dlq_topic": msg.topic(),
        "dlq_partition": msg.partition(),
        "dlq_offset": msg.offset(),
    }


class DeadLetteredTasks:
    """The task messages samplers dead-lettered, so that whoever waits for their trajectories stops waiting.

    A sampler dead-letters a task (undecodable, its policy version not loadable, its env failed)
    instead of producing a trajectory, so `handled` must count it. Each task message counts once,
    by its source partition and offset, however often it was dead-lettered (a redelivered task can
    be). A group-less consumer (assign, never a group, no commits) reads the DLQ from its beginning,
    so after any restart the count is rebuilt from the topic alone, with nothing in a checkpoint.
    It reads what has arrived and stops, instead of reading up to the high watermarks: Tansu
    reports those wrong (1 for a partition holding 5 messages, measured), so the count is a lower
    bound that catches up within a refresh or two, never an overcount. Like `sao audit`, it takes
    every dead letter on the topics it is given as the run's own.
    """

    def __init__(self, bootstrap: str, dlq_topic: str, tasks_topic: str, every_s: float = 2.0) -> None:
        self.bootstrap, self.dlq_topic, self.tasks_topic, self.every_s = bootstrap, dlq_topic, tasks_topic, every_s
        self.consumer: Consumer | None = None  # made at the first refresh: a trainer that never waits needs none
        # (source partition, source offset) -> (the task's trajectory id, None if undecodable; the first reason)
        self.letters: dict[tuple[int, int], tuple[str | None, str]] = {}
        self._refreshed_at = float("-inf")

    def refresh(self, now: bool = False) -> None:
        """Take in the dead letters that arrived since the last refresh; at most once every `every_s`
        seconds unless `now`. It never waits: the consumer fetches in the background."""
        if not now and time.monotonic() - self._refreshed_at < self.every_s:
            return
        self._refreshed_at = time.monotonic()
        if self.consumer is None:
            self.consumer = self._assigned_consumer()
        if self.consumer is None:
            return
        while messages := self.consumer.consume(num_messages=1000, timeout=0):
            for msg in messages:
                if msg.error() is None:
                    self._note(msg)
                else:
                    log.warning("dead-letter topic %s: %s", self.dlq_topic, msg.error())

    def count(self, handled_ids: Container[str] = ()) -> int:
        """Task messages dead-lettered, less those whose trajectory is in `handled_ids` (see `reasons`)."""
        return sum(self.reasons(handled_ids).values())

    def reasons(self, handled_ids: Container[str] = ()) -> dict[str, int]:
        """Task messages dead-lettered, by reason, less those whose trajectory is in `handled_ids`.

        A sampler that dead-letters a task and dies before committing its offset leaves the task to
        be delivered again, and the next sampler may produce its trajectory after all. Counted both
        ways, that task would end the wait one trajectory early, so a task whose trajectory the
        caller already counts (trained or dead-lettered by the trainer) is left out here. An
        undecodable task has no trajectory id, and can never be produced either. What stays open:
        a wait that ends on this count before such a redone trajectory arrives does not wait for
        it; the task then stays dead-lettered (as `sao audit` classes it), not lost.
        """
        return dict(Counter(reason for tid, reason in self.letters.values() if tid is None or tid not in handled_ids))

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None

    def _assigned_consumer(self) -> Consumer | None:
        # The group id is never joined (assign) and nothing is committed. A count needs no low latency: the
        # long fetch wait set here keeps the idle consumer's fetches rare.
        consumer = make_consumer(self.bootstrap, f"sao-dlq-count-{uuid.uuid4().hex[:12]}", **{"fetch.wait.max.ms": 500})
        try:
            partitions = assign_from_start(consumer, self.dlq_topic, 5)
        except KafkaException as err:
            partitions = []
            log.warning("could not read the partitions of dead-letter topic %s (%s); trying again later",
                        self.dlq_topic, err)
        if not partitions:
            consumer.close()
            return None
        return consumer

    def _note(self, msg: Message) -> None:
        letter = describe_dlq_message(msg)
        where = (letter["source_partition"], letter["source_offset"])
        if letter["source_topic"] != self.tasks_topic or None in where or where in self.letters:
            return  # not a task (a trajectory the trainer dead-lettered counts there), not saying where from, or counted
        self.letters[where] = (trajectory_id_of(msg.value()), letter["reason"] or NO_REASON)


def trajectory_id_of(value: bytes | None, kind: type[Task] | type[Trajectory] = Task) -> str | None:
    """The trajectory id a task copy's or a trajectory's message stands for; None when it does not decode."""
    try:
        message = decode(value, kind)
    except SchemaError:
        return None
    return message.trajectory_id if isinstance(message, Trajectory) else Trajectory.make_id(message.task_id,
                                                                                             message.copy)


def _int_or_none(text: str | None) -> int | None:
    return None if text is None or not text.strip().lstrip("-").isdigit() else int(text)
