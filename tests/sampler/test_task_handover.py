"""Handing task partitions between samplers on the real broker: a joining sampler takes only the
partitions it gets (cooperative-sticky), and tasks delivered above a running one are not redone
by the next owner where the broker keeps commit metadata, and redone (never skipped) where it
does not (Tansu 0.6, the suite's broker, accepts the metadata but returns none)."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import TopicPartition

from sao.sampler.offsets import OffsetTracker
from sao.transport.kafka import TASK_CONSUMER_SETTINGS, make_consumer, make_producer
from sao.transport.topics import ensure_topics


def _poll_until(consumers, done, timeout: float, received: list | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        for consumer in consumers:
            msg = consumer.poll(0.1)
            if msg is not None and msg.error() is None and received is not None:
                received.append(msg)
    assert done(), "timed out"


def _topic(bootstrap: str, prefix: str, partitions: int, messages: int) -> str:
    topic = f"{prefix}.tasks"
    ensure_topics(bootstrap, {topic: partitions})
    producer = make_producer(bootstrap)
    for i in range(messages):
        producer.produce(topic, value=b"task-%d" % i, partition=i % partitions)
    assert producer.flush(30) == 0
    return topic


@pytest.mark.slow
def test_a_joining_sampler_takes_only_the_partitions_it_gets(kafka_bootstrap, unique_topic_prefix):
    topic = _topic(kafka_bootstrap, unique_topic_prefix, partitions=2, messages=0)
    group = f"{unique_topic_prefix}-samplers"
    revoked: list[int] = []
    first = make_consumer(kafka_bootstrap, group, **TASK_CONSUMER_SETTINGS)
    first.subscribe([topic], on_revoke=lambda _, parts: revoked.extend(p.partition for p in parts))
    _poll_until([first], lambda: len(first.assignment()) == 2, 30)
    second = make_consumer(kafka_bootstrap, group, **TASK_CONSUMER_SETTINGS)
    second.subscribe([topic])
    try:
        _poll_until([first, second], lambda: len(second.assignment()) == 1 and len(first.assignment()) == 1, 60)
        # Eager rebalancing would have revoked both (and the survivor would re-read its running tasks).
        assert revoked == [second.assignment()[0].partition]
    finally:
        first.close()
        second.close()


def _broker_keeps_commit_metadata(bootstrap: str, topic: str) -> bool:
    consumer = make_consumer(bootstrap, f"probe-{uuid.uuid4().hex[:8]}")
    try:
        consumer.commit(offsets=[TopicPartition(topic, 0, 0, metadata="sao1:")], asynchronous=False)
        (committed,) = consumer.committed([TopicPartition(topic, 0)], timeout=10)
        return committed.metadata == "sao1:"
    finally:
        consumer.close()


def test_tasks_delivered_above_a_running_one_are_skipped_only_with_the_broker_s_word(kafka_bootstrap,
                                                                                   unique_topic_prefix):
    """The next owner skips the finished tasks above a running one only where the commit metadata
    comes back; where the broker drops it, it redoes them: work done twice, never a task lost."""
    topic = _topic(kafka_bootstrap, unique_topic_prefix, partitions=1, messages=6)
    keeps_metadata = _broker_keeps_commit_metadata(kafka_bootstrap, topic)
    group = f"{unique_topic_prefix}-samplers"
    first, first_offsets, received = make_consumer(kafka_bootstrap, group, [topic]), OffsetTracker(), []
    _poll_until([first], lambda: len(received) == 4, 30, received)
    for msg in received:
        first_offsets.started(topic, 0, msg.offset())
    for offset in (1, 3):  # delivered while task 0 (and 2) still ran
        first_offsets.finished(topic, 0, offset)
    first.commit(offsets=first_offsets.committable(), asynchronous=False)
    first.close()  # as after kill -9: tasks 0 and 2 never finish

    second_offsets, received = OffsetTracker(), []
    second = make_consumer(kafka_bootstrap, group)

    def assigned(consumer, partitions):
        for tp in consumer.committed(partitions, timeout=10):
            second_offsets.assigned(tp.topic, tp.partition, tp.offset, tp.metadata)

    second.subscribe([topic], on_assign=assigned)
    try:
        _poll_until([second], lambda: len(received) == 6, 30, received)  # from the committed offset, 0
    finally:
        second.close()
    redone = [msg.offset() for msg in received if not second_offsets.already_done(topic, 0, msg.offset())]
    assert redone == ([0, 2, 4, 5] if keeps_metadata else [0, 1, 2, 3, 4, 5]), f"keeps metadata: {keeps_metadata}"
