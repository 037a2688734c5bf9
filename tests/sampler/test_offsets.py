"""Out-of-order task completion: a partition is committed only below its oldest unfinished task."""

from sao.sampler.offsets import MAX_METADATA_CHARS, OffsetTracker, decode_done, encode_done


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


def test_tasks_finished_above_a_running_one_travel_with_the_commit_and_the_next_owner_skips_them():
    first = OffsetTracker()
    for offset in (10, 11, 12, 13):
        first.started("tasks", 0, offset)
    first.finished("tasks", 0, 12)
    first.finished("tasks", 0, 11)
    (commit,) = first.committable()
    assert (commit.offset, commit.metadata) == (10, "sao1:1,2")
    first.committed([commit])
    first.finished("tasks", 0, 13)  # the position stays at 10, but what it carries changed: commit again
    (commit,) = first.committable()
    assert (commit.offset, commit.metadata) == (10, "sao1:1,2,3")
    # The first owner dies with task 10 running; the next one learns from the commit.
    second = OffsetTracker()
    second.assigned("tasks", 0, commit.offset, commit.metadata)
    assert [o for o in (10, 11, 12, 13, 14) if not second.already_done("tasks", 0, o)] == [10, 14]
    assert second.committable() == []  # nothing new to say yet
    second.started("tasks", 0, 10)
    second.finished("tasks", 0, 10)
    (commit,) = second.committable()
    assert (commit.offset, commit.metadata) == (14, "sao1:")  # past the skipped ones too


def test_a_sampler_re_reading_its_own_partition_skips_what_it_finished_or_runs():
    tracker = OffsetTracker()
    for offset in (0, 1, 2):
        tracker.started("tasks", 0, offset)
    tracker.finished("tasks", 0, 1)
    assert [tracker.already_done("tasks", 0, o) for o in (0, 1, 2, 3)] == [True, True, True, False]


def test_garbled_or_hostile_metadata_is_ignored():
    for metadata in (None, "", "sao1:x", "sao1:0", "sao1:-3", "sao1:1,,2", "sao2:1", "1,2", "sao1:1 ",
                     "sao1:" + ",".join(["1"] * 600), "sao1:99999999999", b"sao1:1", 7):
        assert decode_done(5, metadata) == set(), metadata
        tracker = OffsetTracker()
        tracker.assigned("tasks", 0, 5, metadata)
        assert not any(tracker.already_done("tasks", 0, o) for o in range(0, 20)), metadata
    assert decode_done(-1001, "sao1:1") == set()  # no committed offset: nothing to be relative to
    assert decode_done(5, "sao1:1,4") == {6, 9}


def test_the_metadata_stays_bounded():
    text = encode_done(0, set(range(1, 100_000)))
    assert len(text) <= MAX_METADATA_CHARS
    assert decode_done(0, text) == set(range(1, len(decode_done(0, text)) + 1))  # the oldest ones are kept


def test_a_revoked_partition_is_no_longer_committed_until_assigned_again():
    tracker = OffsetTracker()
    tracker.started("tasks", 0, 3)
    tracker.started("tasks", 1, 3)
    tracker.revoked("tasks", 0)
    tracker.finished("tasks", 0, 3)  # an episode that ran on when its partition moved
    tracker.finished("tasks", 1, 3)
    assert _positions(tracker) == {("tasks", 1): 4}  # not moving the new owner's offset
    tracker.assigned("tasks", 0, 9, "sao1:")
    tracker.started("tasks", 0, 9)
    tracker.finished("tasks", 0, 9)
    assert _positions(tracker) == {("tasks", 0): 10, ("tasks", 1): 4}
