"""ensure_topics: creates missing topics with their partition counts, idempotently."""

from __future__ import annotations

import logging

import pytest

from sao.transport.broker import broker_status, free_port
from sao.transport.topics import TopicSetupError, ensure_topics


def test_ensure_topics_creates_partitions_and_is_idempotent(
    kafka_bootstrap: str, unique_topic_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    wide, narrow = f"{unique_topic_prefix}.wide", f"{unique_topic_prefix}.narrow"
    ensure_topics(kafka_bootstrap, {wide: 3, narrow: 1})
    ensure_topics(kafka_bootstrap, {wide: 3, narrow: 1})  # second call: no error, no change

    with caplog.at_level(logging.WARNING, logger="sao.transport.topics"):
        ensure_topics(kafka_bootstrap, {wide: 5})
    assert "exists with 3 partitions" in caplog.text

    topics = broker_status(kafka_bootstrap)["topics"]
    assert (topics[wide], topics[narrow]) == (3, 1)


@pytest.mark.parametrize(
    ("partitions_by_topic", "replication_factor", "message"),
    [
        ({"bad name!": 1}, 1, "not legal"),
        ({"zero-partitions": 0}, 1, "at least 1 partition"),
        ({"fine": 1}, 0, "replication_factor"),
    ],
)
def test_ensure_topics_refuses_what_kafka_would_refuse(
    kafka_bootstrap: str, partitions_by_topic: dict[str, int], replication_factor: int, message: str
) -> None:
    with pytest.raises(TopicSetupError, match=message):
        ensure_topics(kafka_bootstrap, partitions_by_topic, replication_factor=replication_factor)


def test_ensure_topics_says_when_the_broker_is_missing() -> None:
    with pytest.raises(TopicSetupError, match="is the broker running"):
        ensure_topics(f"127.0.0.1:{free_port()}", {"anything": 1}, timeout=1)
