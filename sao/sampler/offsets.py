"""Which task offsets a sampler may commit when its episodes finish out of order."""

from __future__ import annotations

from confluent_kafka import TopicPartition

Partition = tuple[str, int]


class OffsetTracker:
    """A partition's committable offset is its oldest task still in flight, or else one past the
    newest task handled: committing past an unfinished task would lose it if this sampler died.
    """

    def __init__(self) -> None:
        self._in_flight: dict[Partition, set[int]] = {}
        self._next: dict[Partition, int] = {}
        self._committed: dict[Partition, int] = {}

    def started(self, topic: str, partition: int, offset: int) -> None:
        self._in_flight.setdefault((topic, partition), set()).add(offset)

    def finished(self, topic: str, partition: int, offset: int) -> None:
        """The task's trajectory is acknowledged (or its dead letter queued)."""
        key = (topic, partition)
        self._in_flight[key].discard(offset)
        self._next[key] = max(self._next.get(key, 0), offset + 1)

    def committable(self) -> list[TopicPartition]:
        """Offsets that moved forward since the last `committed` call."""
        moved = []
        for key, next_offset in self._next.items():
            waiting = self._in_flight.get(key)
            position = min(waiting) if waiting else next_offset
            if position > self._committed.get(key, -1):
                moved.append(TopicPartition(key[0], key[1], position))
        return moved

    def committed(self, offsets: list[TopicPartition]) -> None:
        for offset in offsets:
            self._committed[(offset.topic, offset.partition)] = offset.offset
