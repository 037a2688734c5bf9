"""A minimal plugin env that declares no generation defaults (the docs' template, trimmed)."""

from sao.envs.base import Feedback
from sao.schema import Task


class EchoEnv:
    name = "echo"

    @classmethod
    def from_config(cls, config):
        return cls()

    @classmethod
    def make_tasks(cls, config, count, start_index=0, split="train"):
        return [Task(task_id=f"{split}/echo/{i}", env=cls.name, spec={"word": "apple"})
                for i in range(start_index, start_index + count)]

    def reset(self, spec):
        self.word = spec["word"]
        return f"Repeat the word {self.word}."

    def step(self, action):
        return Feedback("", float(self.word in action), True)
