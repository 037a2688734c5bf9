"""Find environment classes by name: built-ins, or any `package.module:Class` a user provides.

An environment class implements the `Env` protocol (reset/step over text) plus two
classmethods: `from_config(config: EnvConfig)` builds an instance in a sampler, and
`make_tasks(config, count, start_index, split="train")` lists tasks for the feeder
(`split="eval"`: held-out tasks for `sao eval`).
"""

from __future__ import annotations

import importlib
import re

from sao.config import EnvConfig
from sao.envs.base import Env
from sao.schema import Task

BUILTIN_ENVS = {
    "arithmetic": "sao.envs.arithmetic:ArithmeticEnv",
    "textworld": "sao.envs.textworld:TextWorldEnv",
}

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
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UnknownEnv(f"env.name {name!r}: cannot import {module_name} ({err})") from err
    cls = getattr(module, class_name, None)
    if cls is None:
        raise UnknownEnv(f"env.name {name!r}: {module_name} has no {class_name}")
    return cls


def make_env(config: EnvConfig) -> Env:
    return env_class(config.name).from_config(config)


def make_tasks(config: EnvConfig, count: int, start_index: int = 0, split: str = "train") -> list[Task]:
    """Tasks of the `train` split (what the feeder sends) or the held-out `eval` split."""
    if split == "train":
        return env_class(config.name).make_tasks(config, count, start_index)
    return env_class(config.name).make_tasks(config, count, start_index, split=split)
