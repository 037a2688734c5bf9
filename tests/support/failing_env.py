"""TurnsEnv whose task 2 cannot be set up: a sampler dead-letters it ("env-error") and no trajectory comes."""

from support.turns_env import TurnsEnv

FAILING_TASK = 2


class FailingEnv(TurnsEnv):
    name = "failing"

    def reset(self, spec):
        if spec["index"] == FAILING_TASK:
            raise RuntimeError(f"task {FAILING_TASK} cannot be set up")
        return super().reset(spec)
