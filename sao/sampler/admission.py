"""Sampler admission: how many tasks to take, which taken tasks may start, which wait for a policy version.

The state is small: how many task messages were taken, and the tasks taken but not started
(held). The sampler loop asks it three questions each round: how many to take now (`room`),
which policy versions to wait for (`versions_to_await`), and which tasks to start (`release`);
a version that cannot come empties its tasks out (`give_up`). It does no I/O: waiting, loading
and dead-lettering stay with the caller (sao/sampler/loop.py).
"""

from __future__ import annotations

from collections.abc import Callable

from sao.schema import Task

# A taken task with its message (the message is the caller's: this module never reads it).
HeldTask = tuple[Task, object]


class Admission:
    """The sampler's admission and version gate.

    The rules it keeps:
    - At most `capacity` (`sampler.rollout_batch`) episodes live at once, and at most `max_tasks`
      task messages taken in all (None: no limit). A message counts once taken, even one that
      then fails to decode.
    - No task is taken while the sampler stops, while an announced version waits to load (it
      loads only once no episode is live, so admission pauses until the live ones finish), or
      while any task is held (held tasks start first).
    - A task starts only once the loaded version is at least its `policy_version` (run.mode =
      sync; 0 = any version), so it is never sampled with an older version than it asks for.
    - Held tasks wait while episodes are live, since a version loads only between episodes. Once
      none is live, the versions they need are awaited oldest first (loading one may bring a
      newer one, which releases those tasks too); the tasks of a version that cannot come are
      given up, never started with an older one.
    - Every task taken leaves once: started (`release`) or given up (`give_up`), in the order it
      was taken. A task still held when the loop ends (the sampler stops, or its `max_tasks` are
      taken and no episode is live) leaves neither way: its offset stays uncommitted, so the task
      is redelivered.
    - The sampler loops while episodes are live or admission is open (`is_open`).
    """

    def __init__(self, capacity: int, max_tasks: int | None = None) -> None:
        self.capacity = capacity
        self.max_tasks = max_tasks
        self.taken = 0  # task messages taken, decodable or not
        self.held: list[HeldTask] = []  # taken, not started: waiting for a policy version not loaded yet

    def is_open(self, stopping: bool) -> bool:
        """Whether more tasks may yet be taken: not stopping, and fewer than `max_tasks` taken."""
        return not stopping and (self.max_tasks is None or self.taken < self.max_tasks)

    def room(self, live: int, stopping: bool, version_pending: bool) -> int:
        """How many task messages to take now, with `live` episodes running (0: take none)."""
        if stopping or version_pending or self.held:
            return 0
        free = self.capacity - live
        if self.max_tasks is not None:
            free = min(free, self.max_tasks - self.taken)
        return max(free, 0)

    def took(self, messages: int, tasks: list[HeldTask]) -> None:
        """`messages` were taken, of which `tasks` decoded: they are held until `release` lets them start."""
        self.taken += messages
        self.held += tasks

    def versions_to_await(self, live: int, loaded: int) -> list[int]:
        """The versions above `loaded` that held tasks need, oldest first; none while episodes are live."""
        if live:
            return []
        return sorted({task.policy_version for task, _ in self.held if task.policy_version > loaded})

    def give_up(self, version: int) -> list[HeldTask]:
        """Take out the held tasks that need `version`, which cannot come: the caller fails them."""
        return self._take_out(lambda task: task.policy_version == version)

    def release(self, loaded: int) -> list[HeldTask]:
        """Take out the held tasks that version `loaded` may sample, to start now; the rest stay held."""
        return self._take_out(lambda task: task.policy_version <= loaded)

    def _take_out(self, leaves: Callable[[Task], bool]) -> list[HeldTask]:
        """The held tasks for which `leaves` holds, in the order taken; the others stay held."""
        out = [held for held in self.held if leaves(held[0])]
        self.held = [held for held in self.held if not leaves(held[0])]
        return out
