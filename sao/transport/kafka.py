"""Kafka producer and consumer factories with sao's settings, a producer that survives a broker
restart, and blocking helpers (deliver one message, read a whole topic).

The settings work on the embedded Tansu broker and on Apache Kafka alike; nothing here relies
on a Tansu quirk. Overrides are librdkafka property names, passed as a dict splat:
`make_producer(bootstrap, **{"linger.ms": 0})`.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, Producer, TopicPartition

from sao.config import BrokerConfig
from sao.transport.health import BrokerWatch, client_log

log = logging.getLogger(__name__)

# Largest message sao sends: a long trajectory (a weights chunk, with policy.transport = 'kafka', is far smaller).
# Real Kafka also needs the topic's `max.message.bytes` raised to match; `ensure_topics` does that.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Record-batch framing and headers on top of the payload.
_FETCH_HEADROOM_BYTES = 1024 * 1024
_READ_ALL_FETCH_WAIT_MS = 100  # see iter_all
DEFAULT_FETCH_WAIT_MS: int = BrokerConfig.model_fields["fetch_wait_ms"].default

Headers = dict[str, str | bytes] | list[tuple[str, str | bytes]]

# For the sampler task group only (every member of a group must use one protocol). A sampler holds
# tasks for minutes; under the default eager protocol a joining sampler takes every partition
# away mid-rollout and the others re-read their running tasks. Cooperative-sticky moves only the
# partitions the newcomer gets (works on Tansu 0.6: measured, a join revoked one of two).
TASK_CONSUMER_SETTINGS = {"partition.assignment.strategy": "cooperative-sticky"}


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
        # One request in flight per broker connection. An idempotent librdkafka (2.16) sends nothing more to a
        # partition holding 5 unacknowledged messages, yet wakes for its next ready batch at once: with a backlog
        # its broker thread spins until the answer comes, burning CPU per message (measured: benchmarks/README.md).
        # A request waiting for the connection keeps it asleep; one partition with all the backlog still spins.
        "max.in.flight.requests.per.connection": 1,
        "message.max.bytes": MAX_MESSAGE_BYTES,
        # A few ms of batching costs little latency; the trainer waits on whole batches anyway.
        "linger.ms": 5,
        # sao sends every message uncompressed: trajectories, announcements and weights chunks alike.
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
        # A group join waits about half the session timeout (Kafka's default is 45 s); a short
        # timeout keeps joins short. Tansu drops sessions when it is much shorter than this, so do not go lower.
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 1000,
        # broker.fetch_wait_ms; on Kafka it merely bounds how long an empty fetch waits.
        "fetch.wait.max.ms": DEFAULT_FETCH_WAIT_MS,
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
    return Producer({**producer_config(bootstrap, **overrides), "logger": client_log})


def make_consumer(bootstrap: str, group_id: str, topics: list[str] | None = None,
                  fetch_wait_ms: int = DEFAULT_FETCH_WAIT_MS, **overrides: Any) -> Consumer:
    """A consumer with `consumer_config` settings and `broker.fetch_wait_ms`, subscribed to `topics` if given."""
    settings = consumer_config(bootstrap, group_id, **{"fetch.wait.max.ms": fetch_wait_ms, **overrides})
    consumer = Consumer({**settings, "logger": client_log})
    if topics:
        consumer.subscribe(topics)
    return consumer


class RenewingProducer:
    """A `make_producer` producer that a fresh one replaces after a broker outage or a fatal error.

    An idempotent producer keeps its producer id across reconnects. A broker that restarted
    without its state (an in-memory one) no longer knows that id and refuses every produce with
    UnknownProducerId, which librdkafka retries until `message.timeout.ms`. So once the `watch`
    saw the broker come back (its `generation` grew), or after a fatal error, the next call builds
    a new producer and sends again what the old one had not seen acknowledged. A message that the
    old producer did write without hearing back is then written twice: the trainer drops
    duplicate trajectories by trajectory_id, and announcements and dead letters bear a repeat.
    It offers the part of `confluent_kafka.Producer` sao uses: produce, poll, flush, len.
    """

    def __init__(self, bootstrap: str, watch: BrokerWatch, **overrides: Any) -> None:
        self.watch = watch
        self._config = {**producer_config(bootstrap, **overrides), "logger": client_log, "error_cb": self._on_error}
        self._unacknowledged: dict[int, _Outgoing] = {}
        self._next_id = 0
        self._fatal: KafkaError | None = None
        self._generation = watch.generation
        self._producer = Producer(self._config)

    def produce(self, topic: str, value: bytes | None = None, key: bytes | str | None = None,
                headers: Headers | None = None, on_delivery: DeliveryCallback | None = None) -> None:
        self._renew_if_stale()
        self._send(_Outgoing(topic, value, key, headers, on_delivery))

    def poll(self, timeout: float = 0) -> int:
        self._renew_if_stale()
        return self._producer.poll(timeout)

    def flush(self, timeout: float = -1) -> int:
        """Wait for acknowledgements; return how many are missing. Returns at once once the broker is
        gone for good: the owner's BrokerGone error names what was left."""
        self._renew_if_stale()
        if self.watch.gone:
            return len(self._unacknowledged)
        return self._producer.flush(timeout)

    def __len__(self) -> int:
        return len(self._unacknowledged)

    def unacknowledged(self) -> list[tuple[str, str]]:
        """(topic, key) of every message handed over and not yet acknowledged, oldest first."""
        return [(m.topic, m.key.decode(errors="replace") if isinstance(m.key, bytes) else str(m.key))
                for m in self._unacknowledged.values()]

    def _send(self, message: _Outgoing) -> None:
        ident = self._next_id
        self._next_id += 1
        extra: dict[str, Any] = {} if message.headers is None else {"headers": message.headers}
        self._producer.produce(message.topic, value=message.value, key=message.key,
                               on_delivery=lambda error, msg: self._delivered(ident, error, msg), **extra)
        self._unacknowledged[ident] = message  # only once queued: a BufferError leaves nothing behind

    def _delivered(self, ident: int, error: KafkaError | None, msg: Message) -> None:
        message = self._unacknowledged.pop(ident, None)
        if message is None:
            return  # handed to a newer producer, whose report counts
        if message.on_delivery is not None:
            message.on_delivery(error, msg)

    def _on_error(self, error: KafkaError) -> None:
        self.watch.on_error(error)
        if error.fatal():
            self._fatal = error

    def _renew_if_stale(self) -> None:
        if self._fatal is None and self.watch.generation == self._generation:
            return
        reason = f"fatal error: {self._fatal.str()}" if self._fatal is not None else "the broker answers again"
        old, resend = self._producer, list(self._unacknowledged.values())
        self._unacknowledged.clear()
        old.purge()
        old.poll(0)  # serves the purged messages' reports; nobody waits for them any more
        self._producer = Producer(self._config)
        self._generation, self._fatal = self.watch.generation, None
        log.warning("%s: a new Kafka producer replaces the old one (%s); %d unacknowledged message(s) sent again",
                    self.watch.process, reason, len(resend))
        for message in resend:
            self._send(message)


DeliveryCallback = Callable[[KafkaError | None, Message], None]


@dataclass(frozen=True)
class _Outgoing:
    """A message handed to a RenewingProducer, kept until acknowledged so a new producer can send it again."""

    topic: str
    value: bytes | None
    key: bytes | str | None
    headers: Headers | None
    on_delivery: DeliveryCallback | None


def deliver_and_wait(producer: Producer | RenewingProducer, topic: str, value: bytes | None,
                     key: bytes | str | None = None, headers: Headers | None = None, timeout: float = 30) -> Message:
    """Produce one message and block until the broker acknowledges it; return the acked message.

    With a RenewingProducer, an outage does not count against `timeout`: its watch bounds it
    (`broker.loss_timeout_s`) and raises BrokerLost or BrokerReplaced from here.
    """
    reports: list[tuple[KafkaError | None, Message]] = []
    deadline = time.monotonic() + timeout
    extra: dict[str, Any] = {} if headers is None else {"headers": headers}
    produce_when_room(producer, deadline, topic, value, key, on_delivery=lambda err, msg: reports.append((err, msg)), **extra)
    hint = ("the broker answers, so is the topic created?" if isinstance(producer, RenewingProducer)
            else "is the broker reachable and the topic created?")
    await_acknowledgements(producer, lambda: bool(reports), deadline, timeout,
                           lambda: f"No acknowledgement for a message to topic {topic!r} within {timeout:.0f} s; {hint}")
    error, message = reports[0]
    if error is not None:
        raise DeliveryFailed(f"Delivery to topic {topic!r} failed: {error.str()}", error)
    return message


def await_acknowledgements(producer: Producer | RenewingProducer, done: Callable[[], bool], deadline: float,
                           timeout: float, failure: Callable[[], str]) -> None:
    """Serve delivery reports until `done()`; raise DeliveryFailed(`failure()`) past `deadline` (monotonic).

    With a RenewingProducer an outage does not count: while its watch sees the broker down the
    deadline moves to `timeout` seconds ahead, and the watch itself (`broker.loss_timeout_s`)
    raises BrokerLost or BrokerReplaced from here.
    """
    watch = producer.watch if isinstance(producer, RenewingProducer) else None
    while not done():
        if watch is not None:
            watch.check()
            if not watch.is_up:
                deadline = max(deadline, time.monotonic() + timeout)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeliveryFailed(failure())
        # flush, not poll: it sends at once instead of lingering `linger.ms` for company that a
        # caller blocked on its messages never brings (measured: benchmarks/README.md).
        producer.flush(min(0.1, remaining))


def produce_when_room(producer: Producer | RenewingProducer, deadline: float, topic: str, value: bytes | None,
                      key: bytes | str | None, **kwargs: Any) -> None:
    """`producer.produce`, waiting (until `deadline`, a monotonic time) while the local queue is full."""
    # BufferError means the local queue is full; serving delivery reports frees room.
    while True:
        try:
            producer.produce(topic, value=value, key=key, **kwargs)
            return
        except BufferError as err:
            if time.monotonic() > deadline:
                raise DeliveryFailed(f"The producer queue stayed full; could not enqueue a message to {topic!r}.") from err
            producer.poll(0.1)


def read_all(bootstrap: str, topic: str, timeout: float = 5.0, max_messages: int | None = None,
             quiet_period: float = 1.0) -> list[Message]:
    """Read a topic from the beginning of every partition until it stays quiet.

    Stops when no message arrived for `quiet_period` seconds, after `timeout` seconds in all,
    or at `max_messages`. It does not stop at high watermarks because Tansu reports them
    wrong. Order is kept within each partition only. A missing topic reads as empty.
    """
    messages = iter_all(bootstrap, topic, timeout, quiet_period)
    try:
        return list(itertools.islice(messages, max_messages))
    finally:
        messages.close()  # closes the consumer now, not whenever the generator is collected


def iter_all(bootstrap: str, topic: str, timeout: float = 5.0, quiet_period: float = 1.0) -> Iterator[Message]:
    """`read_all` one message at a time, for topics too large to hold in memory at once."""
    group_id = f"sao-read-all-{uuid.uuid4().hex[:12]}"  # assign() never joins it; nothing is committed
    # Reading a whole topic needs no low latency. At the pipeline's short wait, Tansu's s3 engine (which
    # lists the bucket on each fetch) often returned nothing for longer than any quiet period.
    consumer = make_consumer(bootstrap, group_id, **{"fetch.wait.max.ms": _READ_ALL_FETCH_WAIT_MS})
    try:
        if not assign_from_start(consumer, topic, timeout):
            return
        deadline = time.monotonic() + timeout
        last_arrival = time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - last_arrival < quiet_period:
            msg = consumer.poll(0.1)
            if msg is None:  # an empty value is falsy, so compare with None
                continue
            if msg.error() is not None:
                log.warning("Error while reading %s: %s", msg.topic(), msg.error())
                continue
            last_arrival = time.monotonic()
            yield msg
    finally:
        consumer.close()


def assign_from_start(consumer: Consumer, topic: str, timeout: float, if_unknown: tuple[int, ...] = ()) -> list[int]:
    """Assign `consumer` every partition of `topic` from its first offset (assign joins no group); the partitions,
    `if_unknown` where the broker does not know the topic."""
    metadata = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
    partitions = sorted(metadata.partitions) if metadata is not None and metadata.error is None else list(if_unknown)
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    return partitions
