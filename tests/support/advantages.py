"""Small helpers for tests of per-turn advantages and baselines."""

from sao.schema import Trajectory


def one_turn(trajectory: Trajectory) -> tuple[Trajectory, list[float]]:
    """`RewardBaseline.update` arguments for a one-step trajectory: its reward is its only return."""
    return trajectory, [trajectory.total_reward]


def flat(advantages: list[list[float]]) -> list[float]:
    """A plan's per-turn advantages, one list (one-step trajectories: one value each)."""
    return [value for turns in advantages for value in turns]
