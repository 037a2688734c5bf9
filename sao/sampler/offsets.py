"""Which task offsets a sampler may commit when its episodes finish out of order, and which
re-delivered tasks it may skip because their trajectory was already delivered.

A partition's offset can only be committed up to its oldest task still running, so a task that
finished above a running one would be redone by the partition's next owner. The commit therefore
carries the finished offsets above it in the offset commit's `metadata` string (a standard Kafka
field, stored with the offset), and whoever is assigned the partition next skips them. Metadata
is untrusted input: anything that does not parse exactly is ignored, which only costs a redo.
The embedded Tansu 0.6 broker accepts the metadata but returns none (measured), so there the
cross-process skip does not happen; the same sampler re-reading its own partitions (an eager
rebalance) still skips what it finished or is running, from its own memory.
"""

from __future__ import annotations

import logging
import re

from confluent_kafka import TopicPartition

log = logging.getLogger(__name__)

Partition = tuple[str, int]

_METADATA_PREFIX = "sao1:"
# Kafka's default offset.metadata.max.bytes is 4096; stay well inside it. Offsets that do not fit
# are left out (the newest first): they are merely redone.
MAX_METADATA_CHARS = 1024
_METADATA_PATTERN = re.compile(r"sao1:(?:[1-9][0-9]{0,8}(?:,[1-9][0-9]{0,8})*)?")


def encode_done(position: int, done: set[int]) -> str:
    """Finished offsets above the committed `position`, as distances from it: "sao1:1,3,4"."""
    text = _METADATA_PREFIX
    for offset in sorted(o for o in done if o > position):
        item = f"{',' if text != _METADATA_PREFIX else ''}{offset - position}"
        if len(text) + len(item) > MAX_METADATA_CHARS:
            break
        text += item
    return text


def decode_done(position: int, metadata: object) -> set[int]:
    """The finished offsets that a commit at `position` recorded; empty for anything malformed."""
    if not isinstance(metadata, str) or not metadata or position < 0:
        return set()
    if len(metadata) > MAX_METADATA_CHARS or not _METADATA_PATTERN.fullmatch(metadata):
        log.warning("ignoring task offset commit metadata that sao did not write: %r", metadata[:80])
        return set()
    body = metadata[len(_METADATA_PREFIX):]
    return {position + int(distance) for distance in body.split(",")} if body else set()


class OffsetTracker:
    """A partition's committable offset is its oldest task still in flight, or else one past the
    newest task handled: committing past an unfinished task would lose it if this sampler died.
    The tasks finished above that offset travel with the commit (`encode_done`).
    """

    def __init__(self) -> None:
        self._in_flight: dict[Partition, set[int]] = {}
        self._next: dict[Partition, int] = {}
        self._done: dict[Partition, set[int]] = {}  # finished here or by a former owner, above the commit
        self._floor: dict[Partition, int] = {}  # the group's committed offset when last assigned
        self._committed: dict[Partition, tuple[int, str]] = {}
        self._revoked: set[Partition] = set()  # owned by another sampler now: its commits are its own

    def assigned(self, topic: str, partition: int, committed: int, metadata: object) -> None:
        """This sampler now owns the partition; `committed` and its `metadata` are the group's."""
        key = (topic, partition)
        self._revoked.discard(key)
        done = self._done.setdefault(key, set())
        done.update(decode_done(committed, metadata))
        if committed >= 0:
            self._floor[key] = max(self._floor.get(key, -1), committed)
            self._committed[key] = (committed, encode_done(committed, done))  # nothing new to commit yet

    def revoked(self, topic: str, partition: int) -> None:
        """Another sampler owns the partition now; this one stops committing it (it would move the new
        owner's offset back). Its episodes still running there finish; the new owner redoes them."""
        key = (topic, partition)
        self._revoked.add(key)
        self._floor.pop(key, None)
        self._committed.pop(key, None)

    def already_done(self, topic: str, partition: int, offset: int) -> bool:
        """The task at `offset` was delivered already, or runs here now: do not run it again."""
        key = (topic, partition)
        return offset in self._done.get(key, ()) or offset in self._in_flight.get(key, ())

    def started(self, topic: str, partition: int, offset: int) -> None:
        self._in_flight.setdefault((topic, partition), set()).add(offset)

    def finished(self, topic: str, partition: int, offset: int) -> None:
        """The task's trajectory is acknowledged (or its dead letter queued)."""
        key = (topic, partition)
        self._in_flight[key].discard(offset)
        self._done.setdefault(key, set()).add(offset)
        self._next[key] = max(self._next.get(key, 0), offset + 1)

    def committable(self) -> list[TopicPartition]:
        """Offsets (with the finished tasks above them) that changed since the last `committed` call."""
        moved = []
        for key in (self._next.keys() | self._floor.keys()) - self._revoked:
            position = self._position(key)
            done = self._done.get(key, set())
            done -= {offset for offset in done if offset < position}  # the commit covers those
            metadata = encode_done(position, done)
            last_position, last_metadata = self._committed.get(key, (-1, ""))
            if position > last_position or (position == last_position and metadata != last_metadata):
                moved.append(TopicPartition(key[0], key[1], position, metadata=metadata))
        return moved

    def committed(self, offsets: list[TopicPartition]) -> None:
        for offset in offsets:
            self._committed[(offset.topic, offset.partition)] = (offset.offset, offset.metadata or "")

    def _position(self, key: Partition) -> int:
        """Oldest task running here, else one past the newest handled; never below what the group
        committed (a former owner handled what lies below it)."""
        waiting = self._in_flight.get(key)
        position = min(waiting) if waiting else self._next.get(key, -1)
        done = self._done.get(key, set())
        while position in done and not waiting:  # finished by a former owner: contiguous, so covered
            position += 1
        return max(position, self._floor.get(key, -1))
