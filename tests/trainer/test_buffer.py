"""Replay buffer: oldest-first by default, priority sampling by |advantage|, reuse up to max_reuse."""

from collections import Counter

import numpy as np
import pytest

from sao.schema import Memory, Step, Trajectory
from sao.trainer.buffer import BufferEntry, ReplayBuffer


def entry(index: int, version: int = 0, partition: int = 0) -> BufferEntry:
    """Entry `index` arrived index-th (created_at) at offset `index` of its partition."""
    step = Step(np.zeros(2, np.int32), np.ones(3, np.int32), np.full(3, -1.0, np.float32), 0.0, True, 0)
    trajectory = Trajectory(f"t{index}#0", f"t{index}", "arithmetic", "s", version, np.zeros(4, np.int32), [step],
                            Memory.empty(8), 1.0, "enc", 0, created_at=1000.0 + index)
    return BufferEntry(trajectory, b"", partition, index)


def filled(buffer: ReplayBuffer, count: int, **kwargs) -> ReplayBuffer:
    for index in range(count):
        buffer.add(entry(index, **kwargs))
    return buffer


def ids(entries: list[BufferEntry]) -> list[str]:
    return [e.trajectory.task_id for e in entries]


def advantages(by_task: dict[str, float]):
    return lambda trajectory: by_task.get(trajectory.task_id, 0.0)


def test_without_priority_batches_are_oldest_first_and_each_entry_trains_once():
    buffer = ReplayBuffer(max_reuse=1)
    for index in (2, 0, 1):  # arrival order in the buffer does not matter, creation time does
        buffer.add(entry(index))
    assert ids(buffer.take(2, 0)) == ["t0", "t1"]
    assert len(buffer) == 1 and buffer.low_water_marks() == {0: 2}
    assert ids(buffer.take(2, 0)) == ["t2"]
    assert len(buffer) == 0 and buffer.take(2, 0) == []


def test_max_reuse_trains_an_entry_that_many_times_then_drops_it():
    buffer = filled(ReplayBuffer(max_reuse=3), 2)
    for use in (1, 2, 3):
        taken = buffer.take(2, 0)
        assert ids(taken) == ["t0", "t1"] and [e.uses for e in taken] == [use, use]
        # Until its last use an entry is still needed: its offset must not be committed.
        assert buffer.low_water_marks() == ({0: 0} if use < 3 else {})
    assert len(buffer) == 0 and buffer.take(2, 0) == []


def test_priority_takes_the_largest_absolute_advantages_first():
    # Oldest-first would take t0 and t1; signed priorities would never draw t2.
    buffer = filled(ReplayBuffer(priority_exponent=1.0), 6)
    taken = buffer.take(2, 0, advantages({"t2": -4.0, "t4": 4.0}))
    assert sorted(ids(taken)) == ["t2", "t4"]
    assert sorted(ids(buffer.entries())) == ["t0", "t1", "t3", "t5"]


def test_priority_sampling_is_seeded():
    def draws(seed: int) -> list[str]:
        buffer = filled(ReplayBuffer(max_reuse=100, priority_exponent=1.0, seed=seed), 5)
        by_task = {f"t{i}": float(i) for i in range(5)}
        return [ids(buffer.take(1, 0, advantages(by_task)))[0] for _ in range(30)]

    assert draws(0) == draws(0)
    assert draws(0) != draws(1)


@pytest.mark.parametrize("exponent, decay, ratio", [
    (1.0, 1.0, 3.0),  # |advantage| 3 vs 1
    (2.0, 1.0, 9.0),  # squared by the exponent
    (1.0, 0.5, 3.0 / 8),  # the high-advantage entry is 3 versions older: 0.5 ** 3
])
def test_priority_draw_frequencies_follow_the_weights(exponent, decay, ratio):
    buffer = ReplayBuffer(max_reuse=10_000, priority_exponent=exponent, freshness_decay=decay)
    buffer.add(entry(0, version=3))  # advantage 1, fresh at policy version 3
    buffer.add(entry(1, version=0))  # advantage 3, staleness 3
    by_task = {"t0": 1.0, "t1": 3.0}
    counts = Counter(ids(buffer.take(1, 3, advantages(by_task)))[0] for _ in range(4000))
    assert counts["t1"] / counts["t0"] == pytest.approx(ratio, rel=0.15)
