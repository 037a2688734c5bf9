"""Finished episodes leave a sampler in the order they started (`sampler.publish_in_order`).

How long an episode runs depends on how it goes: in arithmetic a right first answer ends the
episode after one turn, a wrong one only after its retry. Handed on as they end, the quick
episodes reach the trainer first, so its first batch holds mostly successes and the one after it
mostly the failures left behind: one-sided batches whose updates the baseline cannot balance.
Held until every episode its sampler started before it has left, a trajectory reaches the trainer
in start order instead: a batch is what each sampler started first, whatever its outcome.

The cost is latency, not throughput: generation goes on while a finished trajectory waits, and
it waits at most for the episodes already live beside it (a sampler loads a new policy version
only once none is live, so nothing waits across a version).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

HandOn = Callable[[], None]


class StartOrder:
    """Episodes in the order they started; each finished one's hand-on waits for those before it."""

    def __init__(self) -> None:
        self._episodes: OrderedDict[Hashable, HandOn | None] = OrderedDict()

    def started(self, key: Hashable) -> None:
        self._episodes[key] = None

    def finished(self, key: Hashable, hand_on: HandOn) -> list[HandOn]:
        """Note that `key`'s episode ended; returns the hand-ons now due, in start order."""
        self._episodes[key] = hand_on
        due = []
        while self._episodes and next(iter(self._episodes.values())) is not None:
            due.append(self._episodes.popitem(last=False)[1])
        return due

    def waiting(self) -> list[HandOn]:
        """Take out every finished episode's hand-on whatever the order (a sampler that stops sends them)."""
        due = [hand_on for hand_on in self._episodes.values() if hand_on is not None]
        self._episodes = OrderedDict((key, None) for key, hand_on in self._episodes.items() if hand_on is None)
        return due

    @property
    def held(self) -> int:
        """Finished episodes waiting for one started before them."""
        return sum(hand_on is not None for hand_on in self._episodes.values())
