"""Sampler admission without a broker or a model: how many tasks to take, the sync-mode version gate,
and that every task taken leaves once."""

import random

from sao.sampler.admission import Admission
from sao.schema import Task


def _tasks(count: int, version: int = 0, first: int = 0) -> list[tuple[Task, object]]:
    """`count` tasks released for policy `version` (0: any), each with a stand-in for its message."""
    return [(Task(task_id=f"t{i}", env="arithmetic", spec={}, policy_version=version), f"message {i}")
            for i in range(first, first + count)]


def _ids(held: list[tuple[Task, object]]) -> list[str]:
    return [task.task_id for task, _ in held]


def test_async_mode_takes_up_to_the_free_slots_and_starts_at_once():
    admission = Admission(capacity=4)
    assert admission.room(live=0, stopping=False, version_pending=False) == 4
    assert admission.room(live=3, stopping=False, version_pending=False) == 1
    assert admission.room(live=4, stopping=False, version_pending=False) == 0
    admission.took(4, _tasks(4))
    assert _ids(admission.release(loaded=0)) == ["t0", "t1", "t2", "t3"]  # in the order taken
    assert admission.held == [] and admission.versions_to_await(live=0, loaded=0) == []


def test_max_tasks_caps_what_is_taken_counting_messages_that_did_not_decode():
    admission = Admission(capacity=4, max_tasks=6)
    admission.took(4, _tasks(3))  # one of the four messages failed to decode: it still counts
    admission.release(loaded=0)
    assert admission.room(live=0, stopping=False, version_pending=False) == 2
    assert admission.is_open(stopping=False)
    admission.took(2, _tasks(2, first=3))
    assert admission.room(live=0, stopping=False, version_pending=False) == 0
    assert not admission.is_open(stopping=False)


def test_nothing_is_taken_while_stopping_while_a_version_waits_to_load_or_while_tasks_are_held():
    admission = Admission(capacity=4)
    assert admission.room(live=0, stopping=True, version_pending=False) == 0
    assert not admission.is_open(stopping=True)
    assert admission.room(live=0, stopping=False, version_pending=True) == 0
    admission.took(1, _tasks(1, version=2))
    admission.release(loaded=1)  # v2 is not loaded: the task stays held
    assert admission.room(live=0, stopping=False, version_pending=False) == 0  # free slots, but held tasks go first
    assert admission.is_open(stopping=False)  # no max_tasks: admission stays open


def test_sync_mode_holds_a_task_until_its_version_is_loaded():
    admission = Admission(capacity=4)
    admission.took(2, _tasks(2, version=1))
    assert admission.release(loaded=0) == [] and _ids(admission.held) == ["t0", "t1"]
    assert admission.versions_to_await(live=1, loaded=0) == []  # episodes live: no version can load yet
    assert admission.versions_to_await(live=0, loaded=0) == [1]
    assert _ids(admission.release(loaded=1)) == ["t0", "t1"] and admission.held == []


def test_a_newer_loaded_version_releases_tasks_for_older_ones_and_for_any():
    admission = Admission(capacity=4)
    admission.took(3, _tasks(1, version=0) + _tasks(1, version=2, first=1) + _tasks(1, version=5, first=2))
    assert _ids(admission.release(loaded=3)) == ["t0", "t1"] and _ids(admission.held) == ["t2"]


def test_versions_are_awaited_oldest_first_and_only_those_not_loaded():
    admission = Admission(capacity=8)
    admission.took(5, _tasks(1, 3) + _tasks(1, 1, first=1) + _tasks(2, 2, first=2) + _tasks(1, 0, first=4))
    assert admission.versions_to_await(live=0, loaded=1) == [2, 3]


def test_a_version_that_cannot_come_gives_up_only_its_own_tasks():
    admission = Admission(capacity=8)
    admission.took(3, _tasks(1, 7) + _tasks(1, 2, first=1) + _tasks(1, 7, first=2))
    assert _ids(admission.give_up(7)) == ["t0", "t2"] and _ids(admission.held) == ["t1"]
    assert admission.give_up(7) == []  # given up once
    assert _ids(admission.release(loaded=2)) == ["t1"]


def test_every_task_taken_is_started_or_given_up_once_and_no_more_than_max_tasks_are_taken():
    """Drive admission the way the sampler loop does, with episodes ending and versions arriving at random."""
    rng = random.Random(31)
    capacity, max_tasks = 3, 40
    admission = Admission(capacity, max_tasks)
    live: list[Task] = []
    loaded, announced, next_index, taken = 0, 0, 0, []
    left: list[str] = []  # started or given up, in order
    rounds = 0
    while live or admission.is_open(stopping=False):
        rounds += 1
        assert rounds < 10_000, "admission never closed: tasks stuck held"
        announced += rng.random() < 0.2
        room = admission.room(len(live), stopping=False, version_pending=False)
        assert len(live) + room <= capacity
        if room:
            count = rng.randint(0, room)
            tasks = _tasks(count, version=rng.choice([0, announced, announced + 1]), first=next_index)
            next_index += count
            taken += tasks
            admission.took(count, tasks)
        for version in admission.versions_to_await(len(live), loaded):
            if version <= announced:
                loaded = version
            else:  # never announced in time: its tasks fail
                left += _ids(admission.give_up(version))
        started = admission.release(loaded)
        assert all(task.policy_version <= loaded for task, _ in started)
        live += [task for task, _ in started]
        left += _ids(started)
        assert len(live) <= capacity
        live = [task for task in live if rng.random() < 0.5]  # some episodes end
    assert admission.taken == max_tasks == len(taken)
    assert sorted(left + _ids(admission.held)) == sorted(_ids(taken))  # nothing lost, nothing twice
    assert len(set(left)) == len(left)
