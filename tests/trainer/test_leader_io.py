"""Rank 0's I/O without a broker: what it counts, when it rereads the dead-letter topic, what a checkpoint stores."""

import numpy as np

from sao.status import TrainerProgress
from sao.trainer.buffer import BufferEntry, ReplayBuffer
from sao.trainer.checkpoint import TrainerState
from sao.trainer.leader_io import LeaderIO
from sao.trainer.trajectory_stream import StreamCounters
from support.trainer_runs import synthetic_trajectory


class FakeStream:
    """The trajectory stream's bookkeeping: counters, ids met, the next offsets, dead-lettered positions."""

    def __init__(self, counters: StreamCounters, seen_ids: set[str], next_offsets: dict[int, int]):
        self.counters, self.seen_ids, self.next_offsets = counters, seen_ids, next_offsets
        self.committed: list[dict[int, int]] = []

    def safe_offsets(self, low_water_marks: dict[int, int]) -> dict[int, int]:
        return {p: min(o, low_water_marks.get(p, o)) for p, o in self.next_offsets.items()}

    def dead_lettered_above(self, offsets: dict[int, int]) -> dict[int, list[int]]:
        return {0: [offsets[0] + 1]}

    def commit(self, offsets: dict[int, int]) -> None:
        self.committed.append(offsets)


class FakeDeadTasks:
    """Task dead letters: `arrived` become visible only at a refresh."""

    def __init__(self, arrived: dict[str | None, str]):
        self.arrived, self.letters, self.refreshes = arrived, {}, 0

    def refresh(self) -> None:
        self.refreshes += 1
        self.letters = dict(self.arrived)

    def reasons(self, handled_ids) -> dict[str, int]:
        counts: dict[str, int] = {}
        for trajectory_id, reason in self.letters.items():
            if trajectory_id not in handled_ids:
                counts[reason] = counts.get(reason, 0) + 1
        return counts


class FakeBrokerWatch:
    cluster_id = "cluster-a"

    def retry(self, call, what: str):
        return call()


def _io(seen: set[str], dead_tasks: FakeDeadTasks) -> LeaderIO:
    # This life accepted 4 and dead-lettered 2 (one of them from the buffer); earlier lives handled 7.
    counters = StreamCounters(consumed=4, dead_lettered=2, dead_lettered_from_buffer=1, reasons={"too-stale": 2})
    return LeaderIO(FakeBrokerWatch(), producer=None, stream=FakeStream(counters, seen, {0: 20}),
                    dead_tasks=dead_tasks, handled_before_start=7)


def _buffer_holding(*offsets: int) -> ReplayBuffer:
    buffer, rng = ReplayBuffer(), np.random.default_rng(0)
    for offset in offsets:
        buffer.add(BufferEntry(synthetic_trajectory(offset, rng), b"", 0, offset))
    return buffer


def test_progress_adds_the_stream_the_tasks_samplers_dead_lettered_and_the_loops_own_counts():
    io = _io({"task-3#0"}, FakeDeadTasks({"task-9#0": "env-error", "task-3#0": "env-error"}))
    io.dead_tasks.refresh()
    progress = io.progress(buffered=1, own=TrainerProgress(step=2, trajectories_trained=3))
    assert progress.handled == 7 + 4 + 2 - 1
    # task-3's trajectory was met here after all: it counts as that trajectory only.
    assert progress.tasks_dead_lettered == 1 and progress.task_dlq_reasons == {"env-error": 1}
    assert (progress.step, progress.trajectories_trained, progress.buffered) == (2, 3, 1)
    assert progress.dlq_reasons == {"too-stale": 2}


def test_the_dead_letter_topic_is_reread_only_while_the_expected_count_is_not_reached():
    io = _io(set(), FakeDeadTasks({"task-9#0": "env-error"}))
    assert not io.progress(buffered=0).all_handled(13)
    assert io.dead_tasks.refreshes == 0  # no expectation, no reading
    assert io.progress(buffered=0, expected=13).all_handled(13)  # 12 handled + the dead-lettered task
    assert io.dead_tasks.refreshes == 1
    io.progress(buffered=0, expected=13)
    assert io.dead_tasks.refreshes == 1  # reached: nothing more to wait for


def test_a_checkpoint_stores_the_settled_count_and_the_ids_a_resume_must_not_meet_again():
    buffer = _buffer_holding(15)
    buffered_id = buffer.entries()[0].trajectory.trajectory_id
    io = _io({"task-1#0", buffered_id}, FakeDeadTasks({}))
    state = TrainerState()
    io.note_in(state, buffer)
    assert state.handled == 7 + 4 + 2 - 1 - 1  # the buffered trajectory is read again after a resume
    assert state.offsets == {0: 15} and state.dead_lettered_offsets == {0: [16]}
    assert state.seen_trajectory_ids == ["task-1#0"] and state.broker_cluster_id == "cluster-a"


def test_a_commit_stops_below_what_is_still_buffered_and_is_remembered():
    io = _io(set(), FakeDeadTasks({}))
    io.commit(_buffer_holding(12, 17))
    assert io.stream.committed == [{0: 12}] and io.committed_offsets == {0: 12}
