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


class Env(Protocol):
    """One episode at a time. `reset` returns the task prompt (kept in every step's context)."""

    name: str

    def reset(self, spec: dict[str, Any]) -> str: ...

    def step(self, action: str) -> Feedback: ...
