"""Replay buffer: consumed trajectories wait here until a batch takes them.

Entries are kept per Kafka partition, keyed by offset, so the buffer knows for each partition the
lowest offset it still holds (`low_water_marks`): what the trainer may commit and checkpoint.
Nothing below it is still needed; a trajectory above it that was trained already is not trained
again after a resume, since the checkpoint keeps the trained trajectory ids. Batches are taken
oldest first by default: by each trajectory's `created_at` (when its sampler made it), not by
offset or arrival. With `priority_exponent > 0` entries are drawn in proportion to
(freshness_decay ** staleness * (|advantage| + eps)) ** exponent. With `max_reuse > 1` an entry
stays until it has been trained on that many times.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

from sao.schema import Trajectory


@dataclass
class BufferEntry:
    trajectory: Trajectory
    raw: bytes  # the message value, for broadcasting to other ranks and for the DLQ
    partition: int
    offset: int
    uses: int = 0


class ReplayBuffer:
    def __init__(self, max_reuse: int = 1, priority_exponent: float = 0.0, freshness_decay: float = 1.0, seed: int = 0):
        self.max_reuse = max_reuse
        self.priority_exponent = priority_exponent
        self.freshness_decay = freshness_decay
        self.rng = random.Random(seed)
        self.shards: dict[int, OrderedDict[int, BufferEntry]] = {}

    def __len__(self) -> int:
        return sum(len(shard) for shard in self.shards.values())

    def add(self, entry: BufferEntry) -> None:
        self.shards.setdefault(entry.partition, OrderedDict())[entry.offset] = entry

    def entries(self) -> list[BufferEntry]:
        """All entries, oldest first by `created_at` (then partition and offset), across partitions."""
        return sorted((e for shard in self.shards.values() for e in shard.values()),
                      key=lambda e: (e.trajectory.created_at, e.partition, e.offset))

    def evict_stale(self, policy_version: int, max_staleness: int) -> list[BufferEntry]:
        """Remove and return entries that went stale while waiting (they go to the DLQ)."""
        stale = [e for e in self.entries() if policy_version - e.trajectory.behaviour_version > max_staleness]
        for entry in stale:
            del self.shards[entry.partition][entry.offset]
        return stale

    def take(self, count: int, policy_version: int, advantage_of=None) -> list[BufferEntry]:
        """Up to `count` entries, oldest first or by priority; each use counts against max_reuse."""
        candidates = self.entries()
        if self.priority_exponent > 0 and advantage_of is not None and len(candidates) > count:
            chosen = self._weighted_sample(candidates, count, policy_version, advantage_of)
        else:
            chosen = candidates[:count]
        for entry in chosen:
            entry.uses += 1
            if entry.uses >= self.max_reuse:
                del self.shards[entry.partition][entry.offset]
        return chosen

    def put_back(self, entries: list[BufferEntry]) -> None:
        """Undo a `take` whose step did not run to the end (the trainer was stopped during it)."""
        for entry in entries:
            entry.uses -= 1
            self.add(entry)

    def take_groups(self, groups: int, group_size: int, allow_fewer: bool = False) -> list[BufferEntry]:
        """`groups` whole groups (all `group_size` copies of a task), oldest first by each group's first `created_at`.

        Takes nothing unless that many groups are complete, or `allow_fewer` is set.
        """
        by_task: dict[str, list[BufferEntry]] = {}
        for entry in self.entries():
            by_task.setdefault(entry.trajectory.task_id, []).append(entry)
        complete = [members for members in by_task.values() if len(members) >= group_size][:groups]
        if len(complete) < groups and not allow_fewer:
            return []
        chosen = [entry for members in complete for entry in members[:group_size]]
        for entry in chosen:
            entry.uses += 1
            del self.shards[entry.partition][entry.offset]
        return chosen

    def _weighted_sample(self, candidates: list[BufferEntry], count: int, policy_version: int,
                         advantage_of) -> list[BufferEntry]:
        weights = []
        for entry in candidates:
            staleness = policy_version - entry.trajectory.behaviour_version
            priority = self.freshness_decay ** staleness * (abs(advantage_of(entry.trajectory)) + 1e-3)
            weights.append(priority ** self.priority_exponent)
        chosen: list[BufferEntry] = []
        pool = list(zip(candidates, weights))
        for _ in range(count):  # without replacement
            total = sum(w for _, w in pool)
            pick = self.rng.uniform(0, total)
            for index, (entry, weight) in enumerate(pool):
                pick -= weight
                if pick <= 0 or index == len(pool) - 1:
                    chosen.append(entry)
                    pool.pop(index)
                    break
        return chosen

    def discard(self, entry: BufferEntry) -> None:
        """Forget an entry for good (it was dead-lettered), even if it had uses left."""
        self.shards.get(entry.partition, {}).pop(entry.offset, None)

    def low_water_marks(self) -> dict[int, int]:
        """Per partition, the lowest offset still held (not yet fully trained)."""
        return {p: min(shard) for p, shard in self.shards.items() if shard}

    def held_ids(self) -> set[str]:
        return {e.trajectory.trajectory_id for shard in self.shards.values() for e in shard.values()}
