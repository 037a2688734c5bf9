"""The environment protocol: text in, text out, with a verifiable reward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


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
    """One episode at a time. `reset` returns the task prompt (kept in every step's context).

    An env class may set `generation_defaults = GenerationDefaults(...)` (see the registry).
    """

    name: str

    def reset(self, spec: dict[str, Any]) -> str: ...

    def step(self, action: str) -> Feedback: ...
