"""The policy topic, both ends: the trainer announces a version, samplers follow the newest.

The announcement names the weights: a file in the trainer's policy folder, or (policy.transport =
"kafka") chunks on the weights topic (sao/transport/weights.py), sent before it. A
version may be a delta on an earlier one: the follower remembers the announcements it read, so a
sampler can walk a delta's chain back to its snapshot.
Following never blocks a rollout. Announcements are untrusted input: a version that is negative,
absurdly large or a huge jump over the newest one read is refused here, so that one bad message
can neither shadow every later version nor overflow the trainer's version counter on resume.
The first version a reader meets has nothing to jump from (the topic's retention may have dropped
the early ones), so only the sign and the ceiling apply to it.

Anyone who can write to the topic can announce, so announcements carry proof of their author: an
HMAC-SHA256 under a per-run key that the trainer keeps beside its weights (RUN_DIR/policy/.announce-key,
mode 0600), where only whoever can read the weights can read it; a sampler without the folder is given a
copy (sampler.announce_key_file). A follower given the key ignores, and
counts, every announcement without a valid signature. A version refused because its file is not there
(yet) is offered again later, and a new announcement of a refused version is a new candidate: no number
of announcements can make a follower pass over a real version for good.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from sao.config import SamplerConfig
from sao.metrics import record_announcement_refused, record_delivery
from sao.schema import PolicyAnnouncement, SchemaError, decode, encode
from sao.transport.kafka import DEFAULT_FETCH_WAIT_MS, assign_from_start, deliver_and_wait, make_consumer

log = logging.getLogger(__name__)

# Far beyond any run, and safe as an int64 (the trainer broadcasts versions in an int64 tensor).
MAX_POLICY_VERSION = 2**62
DEFAULT_MAX_VERSION_JUMP: int = SamplerConfig.model_fields["max_version_jump"].default
# A reader only ever wants the newest few; this bounds memory against a flood of announcements.
_MAX_CANDIDATES = 256
# How long a version whose file was missing waits before it is offered again (a shared mount can lag).
MISSING_RETRY_S = 5.0
ANNOUNCE_KEY_NAME = ".announce-key"
_KEY_BYTES = 32
# Ignored announcements are counted (metric) always, logged for the first few and then now and then.
_LOG_FIRST, _LOG_EVERY = 10, 1000


def ensure_announce_key(policy_dir: Path) -> bytes:
    """The run's announcement key in `policy_dir`, made (mode 0600, atomically) if it is not there yet."""
    path = Path(policy_dir) / ANNOUNCE_KEY_NAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f"{ANNOUNCE_KEY_NAME}.{uuid.uuid4().hex}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(_KEY_BYTES))
        try:
            os.link(draft, path)  # fails if another rank or process made it first: theirs is the key
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    key = read_announce_key(policy_dir)
    if key is None:
        raise RuntimeError(f"{path} is not a usable announcement key; remove it and start the trainer again")
    return key


def read_announce_key(policy_dir: Path | str | None) -> bytes | None:
    """The run's announcement key in `policy_dir`, or None while there is none (or it is not readable)."""
    return None if policy_dir is None else read_announce_key_file(Path(policy_dir) / ANNOUNCE_KEY_NAME)


def read_announce_key_file(path: Path) -> bytes | None:
    """The announcement key in the file at `path` (the trainer's .announce-key or a copy), None while not usable."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text.encode() if len(text) == 2 * _KEY_BYTES else None


def signature(announcement: PolicyAnnouncement, key: bytes) -> str:
    return hmac.new(key, announcement.signed_fields(), hashlib.sha256).hexdigest()


def sign(announcement: PolicyAnnouncement, key: bytes) -> PolicyAnnouncement:
    """`announcement` with its signature under `key`."""
    return dataclasses.replace(announcement, signature=signature(announcement, key))


def announce(producer, topic: str, announcement: PolicyAnnouncement) -> None:
    """Produce `announcement` and wait for the broker's acknowledgement (one key: one partition, total order)."""
    deliver_and_wait(producer, topic, encode(announcement), key="policy")


class PolicyFollower:
    """Reads every announcement from the beginning (the topic is tiny) and offers the newest usable one.

    Partitions are assigned, not subscribed: each sampler must see every announcement, so it
    joins no consumer group and commits nothing. The reader reports back what it did with an
    offered version (`loaded`, `refused`); a refused claim (file, hash, size) is never offered again (one whose
    file was missing is, after MISSING_RETRY_S), and the newest one below it that is still above the
    loaded version is offered instead. With `key` (a function giving the run's key, or None while
    there is none), only announcements signed with it are read at all.
    """

    def __init__(self, bootstrap: str, topic: str, max_version_jump: int = DEFAULT_MAX_VERSION_JUMP,
                 key: Callable[[], bytes | None] | None = None, fetch_wait_ms: int = DEFAULT_FETCH_WAIT_MS):
        self.consumer = make_consumer(bootstrap, f"sao-policy-follower-{uuid.uuid4().hex[:8]}",
                                      fetch_wait_ms=fetch_wait_ms)
        assign_from_start(self.consumer, topic, 10, if_unknown=(0,))
        self.max_version_jump = max_version_jump
        self.newest_read: int | None = None  # newest plausible version read: the base of the jump rule
        self.messages_read = 0
        self.started_at = time.time()
        self._candidates: dict[int, PolicyAnnouncement] = {}  # plausible, above `_done_up_to`, not refused
        self._done_up_to = 0  # versions at or below it are loaded (or older than what is)
        self._refused: set[tuple] = set()  # claims (`_claim`) refused for good
        self._waiting: dict[int, tuple[PolicyAnnouncement, float]] = {}  # file missing: offered again after a while
        # Every plausible announcement not refused, the newest per version, loaded ones too: the links of
        # a delta chain (sao/sampler/weight_sync.py).
        self.announced: dict[int, PolicyAnnouncement] = {}
        self._key_source = key
        self._key: bytes | None = None
        self.ignored = 0  # announcements without a valid signature

    @property
    def latest(self) -> PolicyAnnouncement | None:
        """The newest version on offer: read, plausible, above the loaded one and not refused."""
        now = time.monotonic()
        for version, (announcement, retry_at) in list(self._waiting.items()):
            if retry_at <= now:
                del self._waiting[version]
                if version > self._done_up_to:
                    self._candidates.setdefault(version, announcement)
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
            if not self._authentic(announcement, msg.offset()):
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

    def _authentic(self, announcement: PolicyAnnouncement, offset: int) -> bool:
        """Whether `announcement` is signed with the run's key (always, for a reader not given one)."""
        if self._key_source is None:
            return True
        if self._key is None:
            self._key = self._key_source()
        # As bytes: compare_digest raises on a str with non-ASCII characters, and the signature is untrusted.
        if self._key is not None and announcement.signature and hmac.compare_digest(
                announcement.signature.encode(errors="surrogatepass"), signature(announcement, self._key).encode()):
            return True
        reason = ("no-key" if self._key is None else "unsigned" if not announcement.signature else "bad-signature")
        self.ignored += 1
        record_announcement_refused(reason)
        if self.ignored <= _LOG_FIRST or self.ignored % _LOG_EVERY == 0:
            detail = ("no announcement key to check it with (is the trainer's policy folder, with its .announce-key, "
                      "readable here, or sampler.announce_key_file set?)" if reason == "no-key" else reason)
            log.warning("ignoring policy announcement v%d at offset %s: %s (%d ignored so far)",
                        announcement.policy_version, offset, detail, self.ignored)
        return False

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
        self._refused = {claim for claim in self._refused if claim[0] > self._done_up_to}
        self._waiting = {v: entry for v, entry in self._waiting.items() if v > self._done_up_to}

    def refused(self, version: int, missing: bool = False) -> None:
        """The reader could not use `version`: never offer this announcement of it again, or, if its file was
        `missing` (not there yet, or pruned), not before MISSING_RETRY_S. A new announcement of it is offered."""
        announcement = self._candidates.pop(version, None) or self.announced.get(version)
        if announcement is None:
            return
        if missing:
            if version > self._done_up_to and len(self._waiting) < _MAX_CANDIDATES:
                self._waiting[version] = (announcement, time.monotonic() + MISSING_RETRY_S)
        else:
            self.announced.pop(version, None)  # no chain passes through it
            if len(self._refused) < _MAX_CANDIDATES:
                self._refused.add(_claim(announcement))

    def close(self) -> None:
        self.consumer.close()

    def _note(self, announcement: PolicyAnnouncement) -> None:
        version = announcement.policy_version
        self.newest_read = version if self.newest_read is None else max(self.newest_read, version)
        if _claim(announcement) in self._refused:
            return
        self.announced[version] = announcement
        if len(self.announced) > _MAX_CANDIDATES:
            del self.announced[min(self.announced)]
        if version <= self._done_up_to:
            return
        self._waiting.pop(version, None)  # announced again: offered now
        self._candidates[version] = announcement
        if len(self._candidates) > _MAX_CANDIDATES:
            del self._candidates[min(self._candidates)]


def _claim(announcement: PolicyAnnouncement) -> tuple:
    """What an announcement says about a file (and where its chunks are): the same claim announced again is refused
    again, unread."""
    return (announcement.policy_version, announcement.weights_path, announcement.sha256, announcement.num_bytes,
            announcement.chunks)


def latest_announced_version(bootstrap: str, topic: str, max_version_jump: int = DEFAULT_MAX_VERSION_JUMP,
                             key: bytes | None = None) -> int:
    """The highest plausible version ever announced on `topic` (0 if none); reads the whole (tiny) topic.

    Never above MAX_POLICY_VERSION, so a resumed trainer can count on from it without overflow. With
    `key`, only announcements signed with it count: a forged one cannot push the count up.
    """
    follower = PolicyFollower(bootstrap, topic, max_version_jump, key=None if key is None else lambda: key)
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
