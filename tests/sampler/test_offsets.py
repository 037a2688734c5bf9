"""Out-of-order task completion: a partition is committed only below its oldest unfinished task."""

from sao.sampler.offsets import OffsetTracker


def _positions(tracker):
    return {(tp.topic, tp.partition): tp.offset for tp in tracker.committable()}


def test_commit_stops_at_the_oldest_task_still_running():
    tracker = OffsetTracker()
    for offset in (10, 11, 12):
        tracker.started("tasks", 0, offset)
    tracker.started("tasks", 1, 4)
    assert _positions(tracker) == {}  # nothing finished yet
    tracker.finished("tasks", 0, 12)  # the newest finishes first
    assert _positions(tracker) == {("tasks", 0): 10}  # 10 and 11 still run: nothing past them
    tracker.committed(tracker.committable())
    assert _positions(tracker) == {}  # no movement, nothing to commit again
    tracker.finished("tasks", 0, 10)
    assert _positions(tracker) == {("tasks", 0): 11}
    tracker.finished("tasks", 0, 11)
    tracker.finished("tasks", 1, 4)
    assert _positions(tracker) == {("tasks", 0): 13, ("tasks", 1): 5}


def test_a_new_task_behind_the_committed_position_does_not_move_it_back():
    tracker = OffsetTracker()
    tracker.started("tasks", 0, 0)
    tracker.finished("tasks", 0, 0)
    tracker.committed(tracker.committable())
    tracker.started("tasks", 0, 1)
    assert _positions(tracker) == {}  # position 1 == committed 1
    tracker.finished("tasks", 0, 1)
    assert _positions(tracker) == {("tasks", 0): 2}
