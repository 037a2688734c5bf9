"""The environment protocol: text in, text out, with a verifiable reward."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from sao.config import EnvConfig
from sao.schema import Task

logger = logging.getLogger(__name__)

SPLITS = ("train", "eval")  # `eval` is held out: disjoint from what the feeder sends for training


def check_split(env_name: str, split: str) -> None:
    """Refuse a split that is not train or eval; an env that only tests `split == "eval"` would
    otherwise hand out training tasks under another name."""
    if split not in SPLITS:
        raise ValueError(f"{env_name} has the splits {' and '.join(map(repr, SPLITS))}, not {split!r}")


def warn_if_turns_cut(config: EnvConfig, option: str, turns: int) -> None:
    """Warn at start when env.max_turns would stop every episode before the `turns` its `option` asks for."""
    if config.max_turns < turns:
        logger.warning("env.max_turns=%d is below %s's %s=%d: a sampler stops each episode after %d turns; set "
                       "env.max_turns to %d", config.max_turns, config.name, option, turns, config.max_turns, turns)


class InvalidTask(ValueError):
    """A task spec the env refuses before building anything (DLQ reason invalid-task): options beyond its limits,
    or of the wrong type. Task specs are untrusted input; what they make an env build must be bounded."""


@dataclass(frozen=True)
class Feedback:
    """What an environment answers to one action."""

    observation: str  # shown to the policy as the next user turn when not done
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationDefaults:
    """What an env suggests to the policy; any `policy.*` knob the user sets wins."""

    system_prompt: str = "You are a helpful assistant."
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()


class Env(Protocol):
    """One episode at a time. `reset` returns the task prompt (kept in every turn's context).

    The class also provides two classmethods: `from_config` builds an instance in each sampler,
    and `make_tasks` lists tasks for the feeder (`split="train"`) or for evaluation (`split="eval"`:
    held-out tasks, disjoint from training; any other split is a ValueError).
    An env class may set `generation_defaults = GenerationDefaults(...)` (see the registry), and
    `turns_are_attempts = True` when every turn answers the same question again (a retry), not a
    move in a longer task: `trainer.turn_credit = "auto"` then credits each turn with its own reward.
    Held-out scoring asks the class for an episode's success in [0, 1]: `success(spec, step_rewards)` if it
    defines one, else the first turn's (`first_attempt_success`), right for envs whose turns are attempts.
    A class may define `skills(spec) -> set[str]`: the skills a task exercises (arithmetic: the sign of the
    answer), by which held-out success is broken down (sao/sampler/skills.py); without it a task has none.
    A class may define `check_config(config)` to refuse bad settings at start (ConfigError naming the field).
    """

    name: str

    @classmethod
    def from_config(cls, config: EnvConfig) -> Env: ...

    @classmethod
    def make_tasks(cls, config: EnvConfig, count: int, start_index: int = 0, split: str = "train") -> list[Task]: ...

    def reset(self, spec: dict[str, Any]) -> str: ...

    def step(self, action: str) -> Feedback: ...


def first_attempt_success(spec: dict[str, Any], step_rewards: list[float]) -> float:
    """1 when the episode's first turn earned a full reward: a retry env's first try."""
    return float(bool(step_rewards) and step_rewards[0] >= 1.0)
