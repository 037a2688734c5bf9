"""Find environment classes by name: built-ins, or any `package.module:Class` a user provides.

An environment class implements the `Env` protocol (`sao.envs.base`): reset/step over text plus
two classmethods, `from_config(config: EnvConfig)` to build an instance in a sampler and
`make_tasks(config, count, start_index, split="train")` to list tasks for the feeder
(`split="eval"`: held-out tasks for `sao eval` and `trainer.eval_every`).
"""

from __future__ import annotations

import logging
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sao.config import EnvConfig, SaoConfig
from sao.envs.base import Env, GenerationDefaults, check_split, first_attempt_success
from sao.schema import Task

logger = logging.getLogger(__name__)

BUILTIN_ENVS = {"arithmetic": "sao.envs.arithmetic:ArithmeticEnv", "humaneval": "sao.envs.humaneval:HumanEvalEnv",
                "recall": "sao.envs.recall:RecallEnv", "textworld": "sao.envs.textworld:TextWorldEnv"}

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class UnknownEnv(ValueError):
    """env.name is neither a built-in nor an importable `module:Class`."""


def env_class(name: str) -> type:
    target = BUILTIN_ENVS.get(name, name)
    if not _IMPORT_PATH.match(target):
        raise UnknownEnv(f"env.name {name!r}: not a built-in ({', '.join(sorted(BUILTIN_ENVS))}) "
                         "and not of the form package.module:Class")
    module_name, class_name = target.split(":")
    try:
        return pkgutil.resolve_name(target)
    except ImportError as err:
        raise UnknownEnv(f"env.name {name!r}: cannot import {module_name} ({err})") from err
    except AttributeError as err:
        raise UnknownEnv(f"env.name {name!r}: {module_name} has no {class_name}") from err


def check_env_config(config: EnvConfig) -> None:
    """Refuse at start what the env would refuse later: a bad env.name (UnknownEnv), or settings its class's
    `check_config` refuses (ConfigError, naming the field), for the envs that define one."""
    check = getattr(env_class(config.name), "check_config", None)
    if check is not None:
        check(config)


def make_env(config: EnvConfig) -> Env:
    return env_class(config.name).from_config(config)


def make_tasks(config: EnvConfig, count: int, start_index: int = 0, split: str = "train") -> list[Task]:
    """Tasks of the `train` split (what the feeder sends) or the held-out `eval` split.

    The split is checked here too, for plugin envs that do not check it themselves.
    """
    check_split(config.name, split)
    return env_class(config.name).make_tasks(config, count, start_index, split=split)


@dataclass(frozen=True)
class GenerationSettings:
    """How the policy generates actions: `policy.*` where set, else the env's defaults."""

    system_prompt: str
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]


def task_env(name: str) -> str | None:
    """The `env` that tasks of env.name carry (the class's `name`); None if the class cannot be imported here."""
    try:
        return getattr(env_class(name), "name", None)
    except UnknownEnv:  # a plugin may be installed only where the samplers run
        return None


def turn_credit(config: SaoConfig) -> str:
    """`trainer.turn_credit` with `auto` resolved by the env: own_reward for retries of one question."""
    if config.trainer.turn_credit != "auto":
        return config.trainer.turn_credit
    try:
        attempts = turns_are_attempts(config.env.name)
    except UnknownEnv as err:  # the trainer never runs the env: a plugin may be installed only where samplers run
        logger.warning("trainer.turn_credit auto: %s; crediting reward_to_go (set trainer.turn_credit to choose)", err)
        return "reward_to_go"
    return "own_reward" if attempts else "reward_to_go"


def turns_are_attempts(name: str) -> bool:
    """Whether env `name`'s turns retry one question (its class's `turns_are_attempts`): a second turn is a retry."""
    return bool(getattr(env_class(name), "turns_are_attempts", False))


def episode_success(name: str) -> Callable[[dict[str, Any], list[float]], float]:
    """How env `name` scores a held-out episode in [0, 1]: its class's `success`, else the first turn's reward."""
    return getattr(env_class(name), "success", first_attempt_success)


def task_skills(name: str) -> Callable[[dict[str, Any]], set[str]]:
    """How env `name` tags a task with the skills it exercises: its class's `skills(spec)`, else no skill."""
    return getattr(env_class(name), "skills", lambda spec: set())


def scores_first_turn_only(name: str) -> bool:
    """Whether a held-out episode of env `name` is decided by its first turn, so a scorer may stop there."""
    return episode_success(name) is first_attempt_success


def generation_settings(config: SaoConfig) -> GenerationSettings:
    defaults = getattr(env_class(config.env.name), "generation_defaults", GenerationDefaults())
    policy = config.policy
    return GenerationSettings(
        system_prompt=policy.system_prompt if policy.system_prompt is not None else defaults.system_prompt,
        max_new_tokens=policy.max_new_tokens if policy.max_new_tokens is not None else defaults.max_new_tokens,
        temperature=policy.temperature, top_p=policy.top_p,
        stop=tuple(policy.stop) if policy.stop is not None else tuple(defaults.stop))
