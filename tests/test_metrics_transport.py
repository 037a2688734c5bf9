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
    # Values are only checked for sanity: Tansu's high watermarks are wrong (Kafka's are not).
    assert set(lags) == {(topic, 0), (topic, 1)}
    for (_, partition), lag in lags.items():
        assert lag >= 0
        assert REGISTRY.get_sample_value("sao_transport_consumer_lag",
                                         {"group": "g-test", "topic": topic, "partition": str(partition)}) == lag
