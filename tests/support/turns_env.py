"""A plugin env whose episodes last a scripted number of turns, logging every reset and step."""

from sao.envs.base import Feedback
from sao.schema import Task

EVENTS: list[tuple[str, int]] = []  # (what, task index), in call order, across all instances
TURNS = [1, 3, 1, 1]  # turns of task i: TURNS[i % len(TURNS)]


class TurnsEnv:
    name = "turns"

    @classmethod
    def from_config(cls, config):
        return cls()

    @classmethod
    def make_tasks(cls, config, count, start_index=0, split="train"):
        return [Task(task_id=f"{split}/turns/{i}", env=cls.name, spec={"index": i, "turns": TURNS[i % len(TURNS)]})
                for i in range(start_index, start_index + count)]

    def reset(self, spec):
        self.index, self.left = spec["index"], spec["turns"]
        EVENTS.append(("reset", self.index))
        return f"Task {self.index}: say anything."

    def step(self, action):
        EVENTS.append(("step", self.index))
        self.left -= 1
        return Feedback("Go on.", float(self.left == 0), self.left == 0)
