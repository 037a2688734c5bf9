"""Producer/consumer factories and helpers against the real embedded broker."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, Message

from sao.transport.broker import free_port
from sao.transport.kafka import (
    MAX_MESSAGE_BYTES,
    DeliveryFailed,
    consumer_config,
    deliver_and_wait,
    make_consumer,
    make_producer,
    producer_config,
    read_all,
)
from sao.transport.topics import ensure_topics


def _consume(consumer: Consumer, count: int, timeout: float = 20.0) -> list[Message]:
    """Poll until `count` messages arrived (group joins take ~3 s on Tansu) or time runs out."""
    messages: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(messages) < count and time.monotonic() < deadline:
        msg = consumer.poll(0.2)
        if msg is not None and msg.error() is None:
            messages.append(msg)
    return messages


def test_configs_hold_the_settings_sao_relies_on() -> None:
    producer = producer_config("b:1", **{"linger.ms": 0})
    assert producer["acks"] == "all" and producer["enable.idempotence"] is True
    assert producer["message.max.bytes"] == MAX_MESSAGE_BYTES and producer["linger.ms"] == 0

    consumer = consumer_config("b:1", "g")
    assert consumer["enable.auto.commit"] is False and consumer["auto.offset.reset"] == "earliest"
    assert consumer["session.timeout.ms"] == 6000 and consumer["fetch.wait.max.ms"] == 20
    assert consumer["max.partition.fetch.bytes"] > MAX_MESSAGE_BYTES
    assert consumer["fetch.max.bytes"] >= consumer["max.partition.fetch.bytes"]
    assert consumer["receive.message.max.bytes"] > consumer["fetch.max.bytes"]
    # librdkafka validates combinations only when a client is built.
    make_consumer("127.0.0.1:1", "g").close()


def test_keys_headers_and_empty_values_arrive_intact(kafka_bootstrap: str, unique_topic_prefix: str) -> None:
    topic = f"{unique_topic_prefix}.intact"
    ensure_topics(kafka_bootstrap, {topic: 1})
    producer = make_producer(kafka_bootstrap)
    acked = deliver_and_wait(producer, topic, b"payload", key="trajectory-1", headers=[("sao-schema", b"3")])
    assert acked.error() is None and acked.offset() == 0
    deliver_and_wait(producer, topic, b"", key=b"\x00\x01", headers={"h": "v"})

    first, empty = read_all(kafka_bootstrap, topic)
    assert (first.key(), first.value(), first.headers()) == (b"trajectory-1", b"payload", [("sao-schema", b"3")])
    assert (empty.key(), empty.value(), empty.headers()) == (b"\x00\x01", b"", [("h", b"v")])


def test_messages_above_kafkas_1_mib_default_pass(kafka_bootstrap: str, unique_topic_prefix: str) -> None:
    topic = f"{unique_topic_prefix}.large"
    ensure_topics(kafka_bootstrap, {topic: 1})
    payload = bytes(range(256)) * (3 * 4096)  # 3 MiB
    deliver_and_wait(make_producer(kafka_bootstrap), topic, payload)
    (received,) = read_all(kafka_bootstrap, topic)
    assert received.value() == payload


def test_second_consumer_resumes_after_committed_offsets(kafka_bootstrap: str, unique_topic_prefix: str) -> None:
    topic, group = f"{unique_topic_prefix}.resume", f"{unique_topic_prefix}-group"
    ensure_topics(kafka_bootstrap, {topic: 2})
    producer = make_producer(kafka_bootstrap)
    sent = {f"m{i}".encode() for i in range(20)}
    for value in sorted(sent):
        producer.produce(topic, value=value, key=value)
    assert producer.flush(10) == 0

    first = make_consumer(kafka_bootstrap, group, [topic])
    seen_first = {m.value() for m in _consume(first, 7)}
    first.commit(asynchronous=False)  # commits the position after each message poll returned
    first.close()
    assert len(seen_first) == 7

    second = make_consumer(kafka_bootstrap, group, [topic])
    seen_second = {m.value() for m in _consume(second, len(sent) - 7)}
    extra = _consume(second, 1, timeout=0.5)
    second.close()
    assert seen_first.isdisjoint(seen_second)
    assert seen_first | seen_second == sent
    assert extra == []


def test_read_all_returns_every_message_of_a_multi_partition_topic(
    kafka_bootstrap: str, unique_topic_prefix: str
) -> None:
    topic = f"{unique_topic_prefix}.many"
    ensure_topics(kafka_bootstrap, {topic: 4})
    producer = make_producer(kafka_bootstrap)
    for i in range(40):
        producer.produce(topic, value=str(i).encode(), key=f"key-{i}")
    assert producer.flush(10) == 0

    messages = read_all(kafka_bootstrap, topic)
    assert sorted(int(m.value()) for m in messages) == list(range(40))
    assert {m.partition() for m in messages} == {0, 1, 2, 3}
    assert len(read_all(kafka_bootstrap, topic, max_messages=5)) == 5
    assert read_all(kafka_bootstrap, f"{unique_topic_prefix}.absent", timeout=2) == []


def test_deliver_and_wait_raises_when_no_broker_acknowledges() -> None:
    producer = make_producer(f"127.0.0.1:{free_port()}", **{"message.timeout.ms": 500})
    with pytest.raises(DeliveryFailed, match="failed: Local: Message timed out") as raised:
        deliver_and_wait(producer, "nowhere", b"x", timeout=10)
    assert raised.value.error is not None
