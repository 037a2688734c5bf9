"""Kafka producer and consumer factories with sao's settings, plus two blocking helpers.

The settings work on the embedded Tansu broker and on Apache Kafka alike; nothing here relies
on a Tansu quirk. Overrides are librdkafka property names, passed as a dict splat:
`make_producer(bootstrap, **{"linger.ms": 0})`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, Producer, TopicPartition

log = logging.getLogger(__name__)

# Largest message sao sends (a compressed weight shard or a long trajectory). Real Kafka also
# needs the topic's `max.message.bytes` raised to match; `ensure_topics` does that.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Record-batch framing and headers on top of the payload.
_FETCH_HEADROOM_BYTES = 1024 * 1024

Headers = dict[str, str | bytes] | list[tuple[str, str | bytes]]


class DeliveryFailed(RuntimeError):
    """The broker did not acknowledge a produced message."""

    def __init__(self, message: str, error: KafkaError | None = None) -> None:
        super().__init__(message)
        self.error = error


def producer_config(bootstrap: str, **overrides: Any) -> dict[str, Any]:
    """Producer settings: durable, idempotent, low latency, large messages."""
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        # acks=all + idempotence: a retried send is neither lost nor written twice.
        "acks": "all",
        "enable.idempotence": True,
        "message.max.bytes": MAX_MESSAGE_BYTES,
        # A few ms of batching costs little latency; the trainer waits on whole batches anyway.
        "linger.ms": 5,
        # Payloads are compressed by sao itself where it pays (weights); double work otherwise.
        "compression.type": "none",
    }
    config.update(overrides)
    return config


def consumer_config(bootstrap: str, group_id: str, **overrides: Any) -> dict[str, Any]:
    """Consumer settings: manual commits, start at the beginning, fast group joins and fetches."""
    max_partition_fetch = MAX_MESSAGE_BYTES + _FETCH_HEADROOM_BYTES
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": group_id,
        # sao commits only after a message is safely handled (buffered or DLQ'd).
        "enable.auto.commit": False,
        # A new group reads everything. "latest" is also unsafe on Tansu, whose reported
        # high watermarks are wrong.
        "auto.offset.reset": "earliest",
        # A group join waits about half the session timeout (23 s at Kafka's default 45 s);
        # 6 s keeps joins near 3 s. Tansu drops sessions at 2 s, so do not go lower.
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 1000,
        # Tansu answers a waiting fetch only when this expires, so it is the latency floor;
        # on Kafka it merely bounds how long an empty fetch waits.
        "fetch.wait.max.ms": 20,
        # A trainer step between polls can take minutes on CPU.
        "max.poll.interval.ms": 600_000,
        # One message may be MAX_MESSAGE_BYTES; the fetch and socket limits must admit it.
        "max.partition.fetch.bytes": max_partition_fetch,
        "fetch.max.bytes": 2 * max_partition_fetch,
        "receive.message.max.bytes": 2 * max_partition_fetch + _FETCH_HEADROOM_BYTES,
        "enable.partition.eof": False,
    }
    config.update(overrides)
    return config


def make_producer(bootstrap: str, **overrides: Any) -> Producer:
    """A producer with `producer_config` settings whose client logs go to `logging`."""
    return Producer({**producer_config(bootstrap, **overrides), "logger": log})


def make_consumer(bootstrap: str, group_id: str, topics: list[str] | None = None, **overrides: Any) -> Consumer:
    """A consumer with `consumer_config` settings, subscribed to `topics` if given."""
    consumer = Consumer({**consumer_config(bootstrap, group_id, **overrides), "logger": log})
    if topics:
        consumer.subscribe(topics)
    return consumer


def deliver_and_wait(
    producer: Producer,
    topic: str,
    value: bytes | None,
    key: bytes | str | None = None,
    headers: Headers | None = None,
    timeout: float = 30,
) -> Message:
    """Produce one message and block until the broker acknowledges it; return the acked message."""
    reports: list[tuple[KafkaError | None, Message]] = []
    deadline = time.monotonic() + timeout
    extra: dict[str, Any] = {} if headers is None else {"headers": headers}
    _produce(producer, deadline, topic, value, key, on_delivery=lambda err, msg: reports.append((err, msg)), **extra)
    while not reports:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeliveryFailed(
                f"No acknowledgement for a message to topic {topic!r} within {timeout:.0f} s; "
                "is the broker reachable and the topic created?"
            )
        producer.poll(min(0.1, remaining))
    error, message = reports[0]
    if error is not None:
        raise DeliveryFailed(f"Delivery to topic {topic!r} failed: {error.str()}", error)
    return message


def _produce(
    producer: Producer, deadline: float, topic: str, value: bytes | None, key: bytes | str | None, **kwargs: Any
) -> None:
    # BufferError means the local queue is full; serving delivery reports frees room.
    while True:
        try:
            producer.produce(topic, value=value, key=key, **kwargs)
            return
        except BufferError as err:
            if time.monotonic() > deadline:
                raise DeliveryFailed(f"The producer queue stayed full; could not enqueue a message to {topic!r}.") from err
            producer.poll(0.1)


def read_all(
    bootstrap: str,
    topic: str,
    timeout: float = 5.0,
    max_messages: int | None = None,
    quiet_period: float = 1.0,
) -> list[Message]:
    """Read a topic from the beginning of every partition until it stays quiet.

    Stops when no message arrived for `quiet_period` seconds, after `timeout` seconds in all,
    or at `max_messages`. It does not stop at high watermarks because Tansu reports them
    wrong. Order is kept within each partition only. A missing topic reads as empty.
    """
    group_id = f"sao-read-all-{uuid.uuid4().hex[:12]}"  # assign() never joins it; nothing is committed
    consumer = make_consumer(bootstrap, group_id)
    try:
        partitions = _partitions(consumer, topic, timeout)
        if not partitions:
            return []
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        return _drain(consumer, timeout, max_messages, quiet_period)
    finally:
        consumer.close()


def _partitions(consumer: Consumer, topic: str, timeout: float) -> list[int]:
    metadata = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
    if metadata is None or metadata.error is not None:
        return []
    return sorted(metadata.partitions)


def _drain(consumer: Consumer, timeout: float, max_messages: int | None, quiet_period: float) -> list[Message]:
    messages: list[Message] = []
    deadline = time.monotonic() + timeout
    last_arrival = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - last_arrival < quiet_period:
        if max_messages is not None and len(messages) >= max_messages:
            break
        msg = consumer.poll(0.1)
        if msg is None:  # an empty value is falsy, so compare with None
            continue
        if msg.error() is not None:
            log.warning("Error while reading %s: %s", msg.topic(), msg.error())
            continue
        messages.append(msg)
        last_arrival = time.monotonic()
    return messages
