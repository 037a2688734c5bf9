"""The policy topic, both ends: the trainer announces a version, samplers follow the newest.

Only the small announcement travels through Kafka; the weights it names stay on a shared disk.
Following never blocks a rollout. Announcements are untrusted input: a version that is negative,
absurdly large or a huge jump over the newest one read is refused here, so that one bad message
can neither shadow every later version nor overflow the trainer's version counter on resume.
The first version a reader meets has nothing to jump from (the topic's retention may have dropped
the early ones), so only the sign and the ceiling apply to it.
"""

from __future__ import annotations

import logging
import time
import uuid

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from sao.config import SamplerConfig
from sao.metrics import record_announcement_refused, record_delivery
from sao.schema import PolicyAnnouncement, SchemaError, decode, encode
from sao.transport.kafka import deliver_and_wait, make_consumer

log = logging.getLogger(__name__)

# Far beyond any run, and safe as an int64 (the trainer broadcasts versions in an int64 tensor).
MAX_POLICY_VERSION = 2**62
DEFAULT_MAX_VERSION_JUMP: int = SamplerConfig.model_fields["max_version_jump"].default
# A reader only ever wants the newest few; this bounds memory against a flood of announcements.
_MAX_CANDIDATES = 256


def announce(producer, topic: str, announcement: PolicyAnnouncement) -> None:
    """Produce `announcement` and wait for the broker's acknowledgement (one key: one partition, total order)."""
    deliver_and_wait(producer, topic, encode(announcement), key="policy")


class PolicyFollower:
    """Reads every announcement from the beginning (the topic is tiny) and offers the newest usable one.

    Partitions are assigned, not subscribed: each sampler must see every announcement, so it
    joins no consumer group and commits nothing. The reader reports back what it did with an
    offered version (`loaded`, `refused`); a refused version is never offered again, and the
    newest one below it that is still above the loaded version is offered instead.
    """

    def __init__(self, bootstrap: str, topic: str, max_version_jump: int = DEFAULT_MAX_VERSION_JUMP):
        self.consumer = make_consumer(bootstrap, f"sao-policy-follower-{uuid.uuid4().hex[:8]}")
        metadata = self.consumer.list_topics(topic, timeout=10).topics.get(topic)
        partitions = sorted(metadata.partitions) if metadata is not None and metadata.error is None else [0]
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        self.max_version_jump = max_version_jump
        self.newest_read: int | None = None  # newest plausible version read: the base of the jump rule
        self.messages_read = 0
        self.started_at = time.time()
        self._candidates: dict[int, PolicyAnnouncement] = {}  # plausible, above `_done_up_to`, not refused
        self._done_up_to = 0  # versions at or below it are loaded (or older than what is)
        self._refused: set[int] = set()

    @property
    def latest(self) -> PolicyAnnouncement | None:
        """The newest version on offer: read, plausible, above the loaded one and not refused."""
        return self._candidates[max(self._candidates)] if self._candidates else None

    def poll(self, timeout: float = 0.0) -> PolicyAnnouncement | None:
        """Drain what has arrived; return the newest version on offer (or None)."""
        while (msg := self.consumer.poll(timeout)) is not None:
            timeout = 0.0
            self.messages_read += 1
            if msg.error() is not None:
                log.warning("policy topic: %s", msg.error())
                continue
            try:
                announcement = decode(msg.value(), PolicyAnnouncement)
            except SchemaError as err:
                log.warning("ignoring a bad policy announcement at offset %s: %s", msg.offset(), err)
                record_announcement_refused(err.reason)
                continue
            problem = self.implausible(announcement.policy_version)
            if problem is not None:
                log.warning("refusing policy announcement v%d at offset %s: %s",
                            announcement.policy_version, msg.offset(), problem)
                record_announcement_refused("version")
                continue
            if announcement.created_at >= self.started_at:  # older ones were announced before we listened
                record_delivery(msg.topic(), announcement.created_at, len(msg.value()))
            self._note(announcement)
        return self.latest

    def implausible(self, version: int) -> str | None:
        """Why `version` cannot be a real one given what was read before it (None: plausible)."""
        if version < 0:
            return "a negative version"
        if version > MAX_POLICY_VERSION:
            return f"above the largest version sao accepts ({MAX_POLICY_VERSION})"
        if self.newest_read is not None and version > self.newest_read + self.max_version_jump:
            return (f"a jump of more than sampler.max_version_jump = {self.max_version_jump} over v{self.newest_read}, "
                    "the newest version read so far")
        return None

    def loaded(self, version: int) -> None:
        """The reader now uses `version`: nothing at or below it is offered any more."""
        self._done_up_to = max(self._done_up_to, version)
        self._candidates = {v: a for v, a in self._candidates.items() if v > self._done_up_to}
        self._refused = {v for v in self._refused if v > self._done_up_to}

    def refused(self, version: int) -> None:
        """The reader could not use `version` (its file is unsafe, wrong or gone): never offer it again."""
        self._candidates.pop(version, None)
        if len(self._refused) < _MAX_CANDIDATES:
            self._refused.add(version)

    def close(self) -> None:
        self.consumer.close()

    def _note(self, announcement: PolicyAnnouncement) -> None:
        version = announcement.policy_version
        self.newest_read = version if self.newest_read is None else max(self.newest_read, version)
        if version <= self._done_up_to or version in self._refused:
            return
        self._candidates[version] = announcement
        if len(self._candidates) > _MAX_CANDIDATES:
            del self._candidates[min(self._candidates)]


def latest_announced_version(bootstrap: str, topic: str, max_version_jump: int = DEFAULT_MAX_VERSION_JUMP) -> int:
    """The highest plausible version ever announced on `topic` (0 if none); reads the whole (tiny) topic.

    Never above MAX_POLICY_VERSION, so a resumed trainer can count on from it without overflow.
    """
    follower = PolicyFollower(bootstrap, topic, max_version_jump)
    try:
        deadline = time.monotonic() + 10.0
        quiet_since = time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - quiet_since < 1.0:
            before = follower.messages_read
            follower.poll(0.2)
            if follower.messages_read != before:
                quiet_since = time.monotonic()
        return follower.newest_read or 0
    finally:
        follower.close()
