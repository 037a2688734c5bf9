"""Per-task running-mean reward baselines: the single-trajectory answer to a group mean.

With one trajectory per task a group-mean advantage is identically zero; instead each task
(or task family) keeps an exponential moving average of its past rewards. Saved in checkpoints.
"""

from __future__ import annotations


class RewardBaseline:
    """EMA of rewards per key. A task id never seen before falls back to its env's baseline."""

    def __init__(self, key: str = "env", momentum: float = 0.9):
        self.key = key
        self.momentum = momentum
        self.values: dict[str, float] = {}

    def _keys(self, task_id: str, env: str) -> list[str]:
        return [f"env:{env}"] + ([f"task:{task_id}"] if self.key == "task_id" else [])

    def value(self, task_id: str, env: str) -> float:
        for key in reversed(self._keys(task_id, env)):
            if key in self.values:
                return self.values[key]
        return 0.0

    def update(self, task_id: str, env: str, reward: float) -> None:
        for key in self._keys(task_id, env):
            previous = self.values.get(key)
            self.values[key] = reward if previous is None else self.momentum * previous + (1 - self.momentum) * reward

    def state_dict(self) -> dict:
        return {"key": self.key, "momentum": self.momentum, "values": dict(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.values = {str(k): float(v) for k, v in state["values"].items()}
