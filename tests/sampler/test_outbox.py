"""The sampler's outbox: a finished trajectory is queued and the sampler goes on; its task finishes on the
broker's acknowledgement, and a message the broker never takes stops the sampler instead of finishing it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sao.sampler.outbox import Outbox
from sao.transport.broker import EmbeddedBroker
from sao.transport.health import BrokerWatch
from sao.transport.kafka import DeliveryFailed, RenewingProducer, read_all
from sao.transport.topics import ensure_topics


def test_sends_without_waiting_and_finishes_each_on_its_acknowledgement(kafka_bootstrap: str,
                                                                       unique_topic_prefix: str) -> None:
    topic = f"{unique_topic_prefix}.outbox"
    ensure_topics(kafka_bootstrap, {topic: 2})
    watch = BrokerWatch(kafka_bootstrap, "test", loss_timeout_s=30)
    acked: list[tuple[str, float]] = []
    try:
        outbox = Outbox(RenewingProducer(kafka_bootstrap, watch), topic)
        for i in range(20):
            outbox.send(f"trajectory-{i}".encode(), f"task-{i}", lambda s, i=i: acked.append((f"task-{i}", s)))
        assert outbox.in_flight > 0 and len(acked) < 20  # send returned before the broker answered
        outbox.drain(timeout_s=20)
        assert outbox.in_flight == 0
        assert sorted(key for key, _ in acked) == sorted(f"task-{i}" for i in range(20))
        assert all(seconds >= 0 for _, seconds in acked)
        assert sorted(m.value() for m in read_all(kafka_bootstrap, topic)) == sorted(
            f"trajectory-{i}".encode() for i in range(20))
    finally:
        watch.close()


def test_a_message_the_broker_never_takes_raises_instead_of_finishing_its_task(tmp_path: Path) -> None:
    broker = EmbeddedBroker(log_path=tmp_path / "own-broker.log")
    bootstrap = broker.start()
    watch = BrokerWatch(bootstrap, "test", loss_timeout_s=60, probe_interval_s=0.5)
    try:
        ensure_topics(bootstrap, {"outbox.lost": 1})
        # librdkafka gives up on a message after message.timeout.ms: then the task must not count as done.
        outbox = Outbox(RenewingProducer(bootstrap, watch, **{"message.timeout.ms": 1500}), "outbox.lost")
        broker.kill()
        acked: list[float] = []
        outbox.send(b"trajectory", "task-0", acked.append)
        deadline = time.monotonic() + 20
        with pytest.raises(DeliveryFailed, match=r"outbox\.lost"):
            while time.monotonic() < deadline:
                outbox.poll()
                time.sleep(0.1)
        assert acked == [] and outbox.in_flight == 0
    finally:
        watch.close()
        broker.stop(timeout=1)
