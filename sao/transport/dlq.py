"""Send messages sao cannot use to a dead-letter topic, unchanged, with the reason in headers.

Nothing is dropped silently: every message a consumer refuses goes here with a short reason
code, is logged, and is counted in `sao_dlq_messages_total{reason=...}`.
"""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from sao.metrics import DLQ_MESSAGES

log = logging.getLogger(__name__)

REASON_HEADER = "sao-dlq-reason"
DETAIL_HEADER = "sao-dlq-detail"
SOURCE_TOPIC_HEADER = "sao-source-topic"
SOURCE_PARTITION_HEADER = "sao-source-partition"
SOURCE_OFFSET_HEADER = "sao-source-offset"


class DeadLetterQueue:
    """Produces refused messages to one dead-letter topic through a shared producer."""

    def __init__(self, producer: Producer, topic: str) -> None:
        self.producer = producer
        self.topic = topic
        self.pending = 0  # dead letters queued and not yet acknowledged (or refused)

    def send(
        self,
        value: bytes | None,
        reason: str,
        *,
        source_topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
        key: bytes | str | None = None,
        detail: str = "",
    ) -> None:
        """Queue `value` for the dead-letter topic; `reason` is a short code like "decode-error"."""
        headers = _headers(reason, detail, source_topic, partition, offset)
        log.warning(
            "Dead-lettering a message from %s[%s]@%s to %s: %s %s",
            source_topic, partition, offset, self.topic, reason, detail,
        )
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


def _headers(
    reason: str, detail: str, source_topic: str | None, partition: int | None, offset: int | None
) -> list[tuple[str, bytes]]:
    headers = [(REASON_HEADER, reason.encode()), (DETAIL_HEADER, detail.encode())]
    if source_topic is not None:
        headers.append((SOURCE_TOPIC_HEADER, source_topic.encode()))
    if partition is not None:
        headers.append((SOURCE_PARTITION_HEADER, str(partition).encode()))
    if offset is not None:
        headers.append((SOURCE_OFFSET_HEADER, str(offset).encode()))
    return headers


def describe_dlq_message(msg: Message) -> dict[str, Any]:
    """Read a dead-letter message back: why it was refused, where it came from, its size."""
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


def _int_or_none(text: str | None) -> int | None:
    return None if text is None or not text.strip().lstrip("-").isdigit() else int(text)
