"""Plugin environments that misbehave, loaded by import path like a user's env."""

from sao.envs.arithmetic import ArithmeticEnv
from sao.envs.base import Feedback


class RaisingEnv(ArithmeticEnv):
    name = "raising"

    def step(self, action: str) -> Feedback:
        raise ValueError("the grader crashed")


class HangingEnv(ArithmeticEnv):
    name = "hanging"

    def step(self, action: str) -> Feedback:
        while True:  # a grader stuck in a loop, and one that swallows exceptions
            try:
                pass
            except Exception:  # noqa: BLE001 - the point of this hostile env
                pass
