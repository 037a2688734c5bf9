"""Reward baselines for single-trajectory advantages: running means by env, task id or prompt, or leave-one-out.

With one trajectory per task a group-mean advantage is identically zero; instead a baseline
estimates the reward a trajectory should have earned (`trainer.baseline_key`):

- `env`: one running mean per env. Every trajectory of a batch gets the same value, so if the
  batch mean is subtracted too (`trainer.center_advantages`) it changes nothing.
- `task_id`: one per task id, else the env's. Built-in envs name train tasks by stream position
  (`train/<dataset>/<seed>/<position>`), so an id never recurs and this is `env` in practice.
- `prompt`: one per prompt, the token ids the policy is first shown (system prompt + question),
  else the env's. A recurring question gets its own history, as V(s0) would: a question the
  policy always solves earns ~0 advantage instead of the batch's most positive one. The prompt,
  not the task spec, because the trainer has it for every env without a schema change, and the
  policy cannot tell two tasks with the same prompt apart anyway.
- `leave_one_out`: the mean return of the batch's other trajectories at the same turn (no state).
  On one-turn batches with `center_advantages` it is exactly no baseline (n/(n-1) times the
  centring).

Every turn of an episode has its own baselines: what turn 2 of a retry env can still earn is not
what turn 1 could. Turn 0 keeps the plain keys (`env:arithmetic`), so older checkpoints still
load; turn k > 0 adds `:turn<k>`.

Each running mean is a plain mean of its first 1/(1 - momentum) rewards, then an EMA, so a key seen
twice is not stuck near its first reward. Saved in checkpoints; an old state dict (no counts)
loads with its values taken as fully warmed up.
"""

from __future__ import annotations

import hashlib

import numpy as np

from sao.schema import Trajectory

# Per-task keys kept (least recently updated dropped first): ~100 bytes each in memory and in
# the checkpoint's JSON. A key that has not recurred among this many has little left to say.
MAX_KEYS = 100_000


def prompt_digest(prompt_ids: np.ndarray) -> str:
    """The identity of what a trajectory was asked: a 64-bit blake2b of its prompt token ids, hex."""
    return hashlib.blake2b(np.ascontiguousarray(prompt_ids, dtype="<i4").tobytes(), digest_size=8).hexdigest()


def mean_at_turn(returns: list[list[float]], turn: int) -> float:
    """The mean return at `turn` over the trajectories (their per-turn returns) that reached it; 0 if none did."""
    reached = [own[turn] for own in returns if len(own) > turn]
    return sum(reached) / len(reached) if reached else 0.0


class RewardBaseline:
    """Per-trajectory reward baselines (see the module doc); `update` only once a step was applied."""

    def __init__(self, key: str = "env", momentum: float = 0.9, max_keys: int = MAX_KEYS):
        self.key = key
        self.momentum = momentum
        self.max_keys = max_keys
        self.values: dict[str, float] = {}  # insertion order = least recently updated first
        self.counts: dict[str, int] = {}  # rewards seen per key, up to the warm-up length

    def _keys(self, trajectory: Trajectory, turn: int = 0) -> list[str]:
        """The keys a trajectory's turn updates, the fallback first and the most specific last."""
        suffix = f":turn{turn}" if turn else ""
        keys = [f"env:{trajectory.env}{suffix}"]
        if self.key == "task_id":
            keys.append(f"task:{trajectory.task_id}{suffix}")
        elif self.key == "prompt":
            keys.append(f"prompt:{trajectory.env}:{prompt_digest(trajectory.prompt_ids)}{suffix}")
        return keys

    def value(self, trajectory: Trajectory, turn: int = 0) -> float:
        """The most specific running mean known for this trajectory's turn (0 before any return)."""
        for key in reversed(self._keys(trajectory, turn)):
            if key in self.values:
                return self.values[key]
        return 0.0

    def values_for(self, batch: list[Trajectory], returns: list[list[float]]) -> list[list[float]]:
        """One baseline per turn of each trajectory of the batch, as `plan_batch` subtracts them."""
        if self.key == "leave_one_out" and len(batch) > 1:
            return [[mean_at_turn(returns[:i] + returns[i + 1:], turn) for turn in range(len(own))]
                    for i, own in enumerate(returns)]
        return [[self.value(t, turn) for turn in range(len(own))] for t, own in zip(batch, returns)]

    def update(self, trajectory: Trajectory, returns: list[float]) -> None:
        """Learn the returns of each of the trajectory's turns (`plan_batch` computed them)."""
        for turn, reward in enumerate(returns):
            self._learn(self._keys(trajectory, turn), reward)
        while len(self.values) > self.max_keys:
            oldest = next((k for k in self.values if not k.startswith("env:")), None)
            if oldest is None:  # only env keys left: those are the fallbacks, never dropped
                break
            del self.values[oldest]
            self.counts.pop(oldest, None)

    def _learn(self, keys: list[str], reward: float) -> None:
        for key in keys:
            count = min(self.counts.get(key, 0) + 1, self._warmed_up)
            rate = max(1 - self.momentum, 1 / count)  # a plain mean until the EMA's window is full
            previous = self.values.pop(key, 0.0)  # re-inserted last: most recently updated
            self.values[key] = previous + rate * (reward - previous)
            self.counts[key] = count

    @property
    def _warmed_up(self) -> int:
        """The count from which a running mean is a plain EMA (1/count <= 1 - momentum)."""
        return int(np.ceil(1 / (1 - self.momentum) - 1e-9))

    def state_dict(self) -> dict:
        return {"key": self.key, "momentum": self.momentum, "values": dict(self.values), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.values = {str(k): float(v) for k, v in state["values"].items()}
        counts = state.get("counts", {})  # absent before counts were saved: values were plain EMAs
        self.counts = {k: int(counts.get(k, self._warmed_up)) for k in self.values}
