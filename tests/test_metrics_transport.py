"""Transport metrics against the embedded broker: delivery latency and consumer lag per partition."""

from __future__ import annotations

import time

from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from prometheus_client import REGISTRY

from sao.transport.kafka import deliver_and_wait, make_consumer, make_producer
from sao.transport.lag import LagReporter
from sao.transport.topics import ensure_topics


def test_lag_reporter_exports_one_gauge_per_assigned_partition(kafka_bootstrap, unique_topic_prefix):
    topic = f"{unique_topic_prefix}.lag"
    ensure_topics(kafka_bootstrap, {topic: 2})
    producer = make_producer(kafka_bootstrap)
    for i in range(4):
        deliver_and_wait(producer, topic, b"x", key=str(i))
    consumer = make_consumer(kafka_bootstrap, f"{unique_topic_prefix}-group")
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in (0, 1)])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and consumer.poll(0.2) is None:
        pass
    lags = LagReporter(consumer, "g-test").report()
    consumer.close()
    # Values are not checked here: Tansu's high watermarks are wrong (Kafka's are not); the
    # arithmetic is checked against known watermarks below.
    assert set(lags) == {(topic, 0), (topic, 1)}
    for (_, partition), lag in lags.items():
        assert REGISTRY.get_sample_value("sao_transport_consumer_lag",
                                         {"group": "g-test", "topic": topic, "partition": str(partition)}) == lag


class StubConsumer:
    """The three consumer calls LagReporter makes, answering fixed positions and watermarks."""

    def __init__(self, topic: str, partitions: dict[int, tuple[int, int, int]]):
        self.topic, self.partitions = topic, partitions  # partition -> (low, high, position)

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(self.topic, p) for p in self.partitions]

    def position(self, assignment: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.partitions[tp.partition][2]) for tp in assignment]

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        low, high, _ = self.partitions[tp.partition]
        return low, high


def test_lag_is_high_watermark_minus_position_and_never_negative():
    topic = "stub.lag"
    consumer = StubConsumer(topic, {0: (0, 10, 4), 1: (3, 10, OFFSET_BEGINNING), 2: (0, 10, 12)})
    reporter = LagReporter(consumer, "g-stub")

    def gauge(partition):
        return REGISTRY.get_sample_value("sao_transport_consumer_lag",
                                         {"group": "g-stub", "topic": topic, "partition": str(partition)})

    # 10 - 4; before the first read the position is logical (< 0), so count from the log start
    # (10 - 3); a position past the watermark (a stale watermark) is clamped to 0, not -2.
    assert reporter.report() == {(topic, 0): 6, (topic, 1): 7, (topic, 2): 0}
    assert [gauge(p) for p in (0, 1, 2)] == [6, 7, 0]
    consumer.partitions = {0: (0, 15, 10)}  # a rebalance took partitions 1 and 2 away
    assert reporter.report() == {(topic, 0): 5}
    assert [gauge(p) for p in (0, 1, 2)] == [5, None, None]
