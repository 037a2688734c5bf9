"""TIS policy-gradient loss and advantages on hand-computed cases."""

import math

import pytest
import torch

from sao.trainer.baselines import RewardBaseline
from sao.trainer.objectives import tis_policy_gradient_loss, whiten


def test_on_policy_loss_is_minus_advantage_weighted_logprob_sum():
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, stats = tis_policy_gradient_loss(logprobs, logprobs.detach().clone(), mask,
                                           torch.tensor([2.0, -1.0]), num_trajectories=2, clip=2.0)
    # -(2 * (-1 - 2) + (-1) * (-0.5)) / 2 = -(-6 + 0.5) / 2 = 2.75
    assert loss.item() == pytest.approx(2.75)
    assert stats.ratio_mean == pytest.approx(1.0) and stats.clip_fraction == 0 and stats.kl_k3 == pytest.approx(0)
    loss.backward()
    # d loss / d logprob = -w / N per unmasked token, 0 elsewhere
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -1.0, 0.0], [0.5, 0.0, 0.0]]))


def test_ratios_are_truncated_and_detached():
    logprobs = torch.tensor([[math.log(0.9), math.log(0.2)]], requires_grad=True)
    behaviour = torch.tensor([[math.log(0.3), math.log(0.4)]])  # rho = 3.0 and 0.5
    loss, stats = tis_policy_gradient_loss(logprobs, behaviour, torch.ones(1, 2, dtype=torch.bool),
                                           torch.tensor([1.0]), num_trajectories=1, clip=2.0)
    expected = -(2.0 * math.log(0.9) + 0.5 * math.log(0.2))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats.clip_fraction == pytest.approx(0.5)
    assert stats.ratio_mean == pytest.approx((3.0 + 0.5) / 2, rel=1e-6)
    assert stats.ratio_abs_dev == pytest.approx((2.0 + 0.5) / 2, rel=1e-6)
    k3 = ((3.0 - 1 - math.log(3.0)) + (0.5 - 1 - math.log(0.5))) / 2
    assert stats.kl_k3 == pytest.approx(k3, rel=1e-5)
    loss.backward()
    # gradient carries the truncated weight, not the weight's own gradient
    assert logprobs.grad.tolist()[0] == pytest.approx([-2.0, -0.5], rel=1e-6)


def test_whiten():
    out = whiten(torch.tensor([1.0, 2.0, 3.0]))
    assert out.mean().item() == pytest.approx(0, abs=1e-6) and out.std().item() == pytest.approx(1, rel=1e-4)
    assert whiten(torch.tensor([5.0])).tolist() == [0.0]
    assert whiten(torch.tensor([2.0, 2.0])).tolist() == [0.0, 0.0]


def test_baseline_ema_and_fallback_to_env():
    baseline = RewardBaseline(key="task_id", momentum=0.5)
    assert baseline.value("t1", "arith") == 0.0
    baseline.update("t1", "arith", 1.0)
    baseline.update("t1", "arith", 0.0)
    assert baseline.value("t1", "arith") == pytest.approx(0.5)
    assert baseline.value("unseen", "arith") == pytest.approx(0.5)  # env-level fallback
    restored = RewardBaseline(key="task_id", momentum=0.5)
    restored.load_state_dict(baseline.state_dict())
    assert restored.value("t1", "arith") == baseline.value("t1", "arith")


def test_single_trajectory_advantages_are_not_zero():
    # One trajectory per task: a group mean would give zero advantage; the running baseline does not.
    baseline = RewardBaseline(key="env", momentum=0.9)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    baseline.update("warm", "arith", 0.3)
    advantages = whiten(rewards - torch.tensor([baseline.value(f"t{i}", "arith") for i in range(4)]))
    assert advantages.abs().sum() > 0
