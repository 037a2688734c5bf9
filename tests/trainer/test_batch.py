"""Advantages per algorithm: group means for the GRPO baseline, running baselines for SAO."""

import numpy as np
import pytest
import torch

from sao.config import TrainerConfig
from sao.schema import Memory, Step, Trajectory
from sao.trainer.baselines import RewardBaseline
from sao.trainer.batch import plan_batch, record_rewards
from sao.trainer.objectives import LossInputs, policy_loss


def trajectory(task_id: str, reward: float, attempt: int = 0, version: int = 0, prompt_token: int = 0) -> Trajectory:
    step = Step(np.zeros(2, np.int32), np.ones(3, np.int32), np.full(3, -1.0, np.float32), reward, True, 0)
    return Trajectory(f"{task_id}#{attempt}", task_id, "arithmetic", "s", version,
                      np.full(4, prompt_token, np.int32), [step],
                      Memory.empty(8), 1.0, "enc", 0)


def test_grpo_uses_group_means():
    batch = [trajectory("a", 1.0, 0), trajectory("a", 0.0, 1), trajectory("b", 1.0, 0), trajectory("b", 1.0, 1)]
    cfg = TrainerConfig(algorithm="grpo", group_size=2, batch_size=4, whiten_advantages=False)
    plan = plan_batch(batch, RewardBaseline(), cfg, policy_version=3)
    assert plan.advantages == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert plan.staleness == [3, 3, 3, 3]


def test_sao_uses_the_running_baseline_and_updates_it_only_once_the_step_is_applied():
    baseline = RewardBaseline(key="env", momentum=0.5)
    baseline.update("warmup", "arithmetic", 0.5)
    cfg = TrainerConfig(whiten_advantages=False)
    plan = plan_batch([trajectory("a", 1.0), trajectory("b", 0.0)], baseline, cfg, policy_version=0)
    assert plan.advantages == pytest.approx([0.5, -0.5])
    assert baseline.value("c", "arithmetic") == 0.5  # planning leaves it alone: the step may yet be skipped
    record_rewards(plan, baseline)
    assert baseline.value("c", "arithmetic") == pytest.approx(0.5 * (0.5 * 0.5 + 0.5 * 1.0) + 0.5 * 0.0)


def _gradient(cfg: TrainerConfig, baseline: RewardBaseline) -> torch.Tensor:
    # One trajectory per task, as SAO samples: rewards differ, but every group has size 1.
    batch = [trajectory(f"t{i}", r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    plan = plan_batch(batch, baseline, cfg, policy_version=0)
    logprobs = torch.full((4, 3), -1.0, requires_grad=True)
    loss, _ = policy_loss(LossInputs(logprobs, torch.full((4, 3), -1.0), torch.ones(4, 3, dtype=torch.bool),
                                     torch.tensor(plan.advantages), torch.arange(4), 4), cfg)
    loss.backward()
    return logprobs.grad


def test_single_trajectory_gradient_is_zero_with_group_means_but_not_with_sao():
    baseline = RewardBaseline(key="env", momentum=0.9)
    baseline.update("seen-before", "arithmetic", 0.3)
    assert _gradient(TrainerConfig(), baseline).abs().sum() > 0
    grpo = TrainerConfig.model_construct(**{**TrainerConfig().model_dump(), "algorithm": "grpo", "group_size": 1})
    assert _gradient(grpo, RewardBaseline()).abs().sum() == 0


def test_value_head_learns_returns_and_sets_advantages(tiny_config):
    from sao.policy.weights import build_policy
    from sao.trainer.batch import rank_loss

    class Engine:  # rank_loss needs only a callable module and its device
        def __init__(self, module):
            self.module, self.device = module, torch.device("cpu")

        def __call__(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    policy = build_policy(tiny_config.policy, 8, value_head=True)
    cfg = TrainerConfig(value_head=True, value_coef=1.0, whiten_advantages=False)
    batch = [trajectory("a", 1.0, prompt_token=100), trajectory("b", 0.0, prompt_token=200)]  # different states
    plan = plan_batch(batch, RewardBaseline(), cfg, policy_version=0)
    optimizer = torch.optim.Adam(policy.value_head.parameters(), lr=0.05)
    first = None
    for _ in range(60):
        loss, stats = rank_loss(Engine(policy), plan, [0, 1], 2, cfg, 8)
        first = stats.value_loss if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # V starts at 0 (zero-initialised head): squared errors 1 and 0 over 2 trajectories.
    assert first == pytest.approx(0.5)
    assert stats.value_loss < 0.05 * first
