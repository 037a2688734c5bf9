"""Objectives and advantages on hand-computed cases."""

import math

import pytest
import torch

from sao.config import TrainerConfig
from sao.trainer.objectives import LossInputs, policy_loss, whiten


def _loss(logprobs, behaviour, mask, weights, rows_to_traj=None, n=None, **cfg):
    rows = logprobs.shape[0]
    token_weights = torch.tensor(weights, dtype=torch.float32).unsqueeze(-1).expand(mask.shape)  # one a row
    inputs = LossInputs(logprobs, behaviour, mask, token_weights,
                        torch.tensor(rows_to_traj if rows_to_traj is not None else list(range(rows))),
                        n if n is not None else rows)
    return policy_loss(inputs, TrainerConfig(**cfg))


def test_on_policy_loss_is_minus_advantage_weighted_logprob_sum():
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    for objective in ("tis", "ppo", "masked"):
        logprobs.grad = None
        loss, stats = _loss(logprobs, logprobs.detach().clone(), mask, [2.0, -1.0], objective=objective)
        if objective != "ppo":
            # -(2 * (-1 - 2) + (-1) * (-0.5)) / 2 = 2.75
            assert loss.item() == pytest.approx(2.75)
        else:
            # rho = 1: -(2 * 1 * 2 tokens + (-1) * 1 * 1 token) / 2 = -1.5
            assert loss.item() == pytest.approx(-1.5)
        assert stats.ratio_mean == pytest.approx(1.0) and stats.clip_fraction == 0 and stats.kl_k3 == pytest.approx(0)
        loss.backward()
        # On policy every objective has the same gradient: -A / N per action token, 0 elsewhere.
        torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -1.0, 0.0], [0.5, 0.0, 0.0]]))


def test_tis_ratios_are_truncated_and_detached():
    logprobs = torch.tensor([[math.log(0.9), math.log(0.2)]], requires_grad=True)
    behaviour = torch.tensor([[math.log(0.3), math.log(0.4)]])  # rho = 3.0 and 0.5
    loss, stats = _loss(logprobs, behaviour, torch.ones(1, 2, dtype=torch.bool), [1.0], objective={"type": "tis", "clip": 2.0})
    assert loss.item() == pytest.approx(-(2.0 * math.log(0.9) + 0.5 * math.log(0.2)), rel=1e-6)
    assert stats.clip_fraction == pytest.approx(0.5)
    assert stats.ratio_mean == pytest.approx((3.0 + 0.5) / 2, rel=1e-6)
    assert stats.ratio_abs_dev == pytest.approx((2.0 + 0.5) / 2, rel=1e-6)
    k3 = ((3.0 - 1 - math.log(3.0)) + (0.5 - 1 - math.log(0.5))) / 2
    assert stats.kl_k3 == pytest.approx(k3, rel=1e-5)
    loss.backward()
    # the gradient carries the truncated weight, not the weight's own gradient
    assert logprobs.grad.tolist()[0] == pytest.approx([-2.0, -0.5], rel=1e-6)


def test_sequence_level_tis_uses_one_ratio_per_trajectory():
    # Two rows (steps) of one trajectory: rho_seq = 1.5 * 0.8 * 2.0 = 2.4 -> truncated to 2.0 (clip 2)
    logprobs = torch.log(torch.tensor([[0.3, 0.4], [0.2, 1.0]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.2, 0.5], [0.1, 1.0]]))
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = _loss(logprobs, behaviour, mask, [1.0, 1.0], rows_to_traj=[0, 0], n=1,
                        importance_level="sequence", objective={"type": "tis", "clip": 2.0})
    assert loss.item() == pytest.approx(-2.0 * math.log(0.3 * 0.4 * 0.2), rel=1e-5)
    assert stats.clip_fraction == 1.0
    loss, _ = _loss(logprobs, behaviour, mask, [1.0, 1.0], rows_to_traj=[0, 0], n=1,
                    importance_level="sequence", objective={"type": "tis", "clip": 5.0})
    assert loss.item() == pytest.approx(-2.4 * math.log(0.3 * 0.4 * 0.2), rel=1e-5)


def test_ppo_clips_against_behaviour_and_dual_clips_negative_advantages():
    # rho = 1.5 with A = +1: clipped to 1.2 (eps 0.2) and no gradient flows.
    logprobs = torch.tensor([[math.log(0.6)]], requires_grad=True)
    behaviour = torch.tensor([[math.log(0.4)]])
    loss, stats = _loss(logprobs, behaviour, torch.ones(1, 1, dtype=torch.bool), [1.0], objective="ppo")
    assert loss.item() == pytest.approx(-1.2) and stats.clip_fraction == 1.0
    loss.backward()
    assert logprobs.grad.item() == 0.0
    # rho = 5 with A = -1: PPO's min picks -5; the dual clip bounds it at 3 * A = -3.
    logprobs = torch.tensor([[math.log(0.5)]], requires_grad=True)
    behaviour = torch.tensor([[math.log(0.1)]])
    loss, _ = _loss(logprobs, behaviour, torch.ones(1, 1, dtype=torch.bool), [-1.0], objective={"type": "ppo", "dual_clip": 3.0})
    assert loss.item() == pytest.approx(3.0)
    loss, _ = _loss(logprobs, behaviour, torch.ones(1, 1, dtype=torch.bool), [-1.0], objective={"type": "ppo", "dual_clip": None})
    assert loss.item() == pytest.approx(5.0, rel=1e-5)
    # rho = 0.9, A = +2: inside the band, surrogate = rho * A with gradient rho * A wrt log pi.
    logprobs = torch.tensor([[math.log(0.9)]], requires_grad=True)
    loss, _ = _loss(logprobs, torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), [2.0], objective="ppo")
    loss.backward()
    assert loss.item() == pytest.approx(-1.8, rel=1e-6) and logprobs.grad.item() == pytest.approx(-1.8, rel=1e-6)


def test_masked_drops_tokens_outside_the_band():
    logprobs = torch.log(torch.tensor([[0.9, 0.5, 0.05]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.3, 0.5, 0.5]]))  # rho = 3.0 (out), 1.0 (in), 0.1 (out)
    loss, stats = _loss(logprobs, behaviour, torch.ones(1, 3, dtype=torch.bool), [1.0],
                        objective={"type": "masked", "low": 0.5, "high": 2.0})
    assert loss.item() == pytest.approx(-math.log(0.5), rel=1e-6)
    assert stats.clip_fraction == pytest.approx(2 / 3)
    loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -1.0, 0.0])


def test_whiten():
    out = whiten(torch.tensor([1.0, 2.0, 3.0]))
    assert out.mean().item() == pytest.approx(0, abs=1e-6) and out.std().item() == pytest.approx(1, rel=1e-4)
    assert whiten(torch.tensor([5.0])).tolist() == [0.0]
    assert whiten(torch.tensor([2.0, 2.0])).tolist() == [0.0, 0.0]


def test_whiten_without_centring_keeps_every_sign():
    out = whiten(torch.tensor([-0.2, -0.4, 0.0, 0.8]), center=False)
    assert out.tolist() == pytest.approx((torch.tensor([-0.2, -0.4, 0.0, 0.8]) / 0.4583).tolist(), rel=1e-3)
    assert out.pow(2).mean().item() == pytest.approx(1.0, rel=1e-4)
    assert whiten(torch.tensor([0.0, 0.0]), center=False).tolist() == [0.0, 0.0]
    assert whiten(torch.tensor([-3.0]), center=False).tolist() == pytest.approx([-1.0])


def test_kl_to_base_is_measured_and_penalised_only_with_a_coefficient():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.8)]], requires_grad=True)
    base = torch.tensor([[math.log(0.25), math.log(0.8)]])  # r = base / pi = 0.5 on the first token, 1 on the second
    mask = torch.ones(1, 2, dtype=torch.bool)
    k3 = 0.5 - math.log(0.5) - 1  # the second token's k3 is 0
    inputs = LossInputs(logprobs, logprobs.detach().clone(), mask, torch.zeros(1, 2), torch.tensor([0]), 1, base)
    loss, stats = policy_loss(inputs, TrainerConfig())
    assert loss.item() == pytest.approx(0.0)  # measured only: advantage 0 leaves no loss
    assert stats.kl_to_base == pytest.approx(k3 / 2, rel=1e-5)
    assert stats.token_nll == pytest.approx(-(math.log(0.5) + math.log(0.8)) / 2, rel=1e-6)
    loss, stats = policy_loss(inputs, TrainerConfig(kl_to_base_coef=0.1))
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-5)  # summed over the trajectory's tokens
    loss.backward()
    # d/dlogpi of (r - log r - 1) with log r = base - logpi: 1 - r; pulls pi towards the base.
    assert logprobs.grad.tolist()[0] == pytest.approx([0.1 * (1 - 0.5), 0.0], abs=1e-6)
    # Without the base's log-probs nothing is measured.
    _, stats = _loss(logprobs.detach(), logprobs.detach(), mask, [1.0])
    assert math.isnan(stats.kl_to_base)
