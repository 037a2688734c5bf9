"""The policy topic, both ends: the trainer announces a version, samplers follow the newest.

Only the small announcement travels through Kafka; the weights it names stay on a shared disk.
Following never blocks a rollout.
"""

from __future__ import annotations

import logging
import time
import uuid

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from sao.metrics import record_delivery
from sao.schema import PolicyAnnouncement, SchemaError, decode, encode
from sao.transport.kafka import deliver_and_wait, make_consumer

log = logging.getLogger(__name__)


def announce(producer, topic: str, announcement: PolicyAnnouncement) -> None:
    """Produce `announcement` and wait for the broker's acknowledgement (one key: one partition, total order)."""
    deliver_and_wait(producer, topic, encode(announcement), key="policy")


class PolicyFollower:
    """Reads every announcement from the beginning (the topic is tiny) and keeps the newest.

    Partitions are assigned, not subscribed: each sampler must see every announcement, so it
    joins no consumer group and commits nothing.
    """

    def __init__(self, bootstrap: str, topic: str):
        self.consumer = make_consumer(bootstrap, f"sao-policy-follower-{uuid.uuid4().hex[:8]}")
        metadata = self.consumer.list_topics(topic, timeout=10).topics.get(topic)
        partitions = sorted(metadata.partitions) if metadata is not None and metadata.error is None else [0]
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        self.latest: PolicyAnnouncement | None = None
        self.started_at = time.time()

    def poll(self, timeout: float = 0.0) -> PolicyAnnouncement | None:
        """Drain what has arrived; return the newest announcement seen so far (or None)."""
        while (msg := self.consumer.poll(timeout)) is not None:
            timeout = 0.0
            if msg.error() is not None:
                log.warning("policy topic: %s", msg.error())
                continue
            try:
                announcement = decode(msg.value(), PolicyAnnouncement)
            except SchemaError as err:
                log.warning("ignoring a bad policy announcement at offset %s: %s", msg.offset(), err)
                continue
            if announcement.created_at >= self.started_at:  # older ones were announced before we listened
                record_delivery(msg.topic(), announcement.created_at, len(msg.value()))
            if self.latest is None or announcement.policy_version > self.latest.policy_version:
                self.latest = announcement
        return self.latest

    def close(self) -> None:
        self.consumer.close()


def latest_announced_version(bootstrap: str, topic: str) -> int:
    """The highest version ever announced on `topic` (0 if none); reads the whole (tiny) topic."""
    follower = PolicyFollower(bootstrap, topic)
    try:
        latest, deadline = None, time.monotonic() + 10.0
        quiet_since = time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - quiet_since < 1.0:
            before = follower.latest
            latest = follower.poll(0.2)
            if latest is not before:
                quiet_since = time.monotonic()
        return latest.policy_version if latest is not None else 0
    finally:
        follower.close()
