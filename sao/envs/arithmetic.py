"""Multi-turn reasoning-gym tasks (arithmetic by default): a wrong answer gets feedback and another try.

Any reasoning-gym dataset works by name (`env.dataset`); `env.answer_format` says what part of
the reply is scored: its last number (numeric datasets) or its last line (words, lists).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import reasoning_gym

from sao.config import EnvConfig
from sao.envs.base import Feedback, GenerationDefaults, check_split
from sao.schema import Task

EVAL_SEED_OFFSET = 1_000_003  # held-out tasks: a seed no training run uses by default
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@lru_cache(maxsize=8)
def _dataset(name: str, size: int, seed: int, options: tuple[tuple[str, Any], ...]):
    kwargs = {key: tuple(value) if isinstance(value, list) else value for key, value in options}
    return reasoning_gym.create_dataset(name, size=size, seed=seed, **kwargs)


def _options_key(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


def last_line(text: str) -> str | None:
    """The answer is the last non-empty line of the completion (words, lists, expressions)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def last_number(text: str) -> str | None:
    """The answer is the last number in the completion (a model may reason before it)."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


class ArithmeticEnv:
    """Up to `max_turns` attempts; a right answer at attempt k earns score * retry_discount**k."""

    name = "arithmetic"
    generation_defaults = GenerationDefaults(
        system_prompt="You are a calculator. Reply with only the final answer as a single number.", max_new_tokens=24)

    @classmethod
    def from_config(cls, config: EnvConfig) -> ArithmeticEnv:
        return cls(max_turns=config.max_turns, retry_discount=config.retry_discount,
                   answer_format=config.answer_format)

    @classmethod
    def make_tasks(cls, config: EnvConfig, count: int, start_index: int = 0, split: str = "train") -> list[Task]:
        """`count` tasks, dataset indices [start_index, start_index + count) of the split.

        The eval split is the same generator under another seed (`seed + EVAL_SEED_OFFSET`), so
        its entries are drawn independently of training; tiny domains (1-digit sums) can still
        repeat a question text across splits.
        """
        check_split(cls.name, split)
        seed = config.seed + (EVAL_SEED_OFFSET if split == "eval" else 0)
        size = start_index + count
        spec = {"dataset": config.dataset, "size": size, "seed": seed, "options": config.dataset_options}
        return [Task(task_id=f"{split}/{config.dataset}/{seed}/{index}", env=cls.name, spec={**spec, "index": index})
                for index in range(start_index, size)]

    def __init__(self, max_turns: int = 3, retry_discount: float = 0.5, answer_format: str = "last_number"):
        self.extract = {"last_number": last_number, "last_line": last_line}[answer_format]
        self.max_turns = max_turns
        self.retry_discount = retry_discount
        self._entry: dict[str, Any] | None = None
        self._dataset = None
        self._turn = 0

    def reset(self, spec: dict[str, Any]) -> str:
        self._dataset = _dataset(spec["dataset"], spec["size"], spec["seed"], _options_key(spec["options"]))
        self._entry = self._dataset[spec["index"]]
        self._turn = 0
        return self._entry["question"]

    def step(self, action: str) -> Feedback:
        if self._entry is None:
            raise RuntimeError("step() before reset()")
        answer = self.extract(action)
        score = float(self._dataset.score_answer(answer, self._entry)) if answer is not None else 0.0
        attempt, self._turn = self._turn, self._turn + 1
        info = {"answer": answer, "score": score, "attempt": attempt}
        if score >= 1.0:
            return Feedback("Correct.", score * self.retry_discount ** attempt, True, info)
        if self._turn >= self.max_turns:
            return Feedback("Incorrect.", 0.0, True, info)
        missing = "That is not a number." if self.extract is last_number else "That is not an answer."
        hint = missing if answer is None else f"{answer} is incorrect."
        return Feedback(f"{hint} Try again: reply with only the final answer.", 0.0, False, info)
