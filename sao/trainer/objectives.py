"""Policy-gradient objectives with off-policy correction, and single-trajectory advantages.

rho = pi_theta(a | c) / mu(a | c) comes from the per-token behaviour log-probs the sampler
recorded. Three objectives, selected by `trainer.objective.type`:
- tis: truncated importance sampling. Each token's log-likelihood gradient is weighted by
  min(rho, clip), detached, so stale samples neither vanish nor explode.
- ppo: decoupled PPO. The clipped surrogate takes rho against the behaviour policy (the
  sampler's log-probs), with a dual clip that bounds the loss for negative advantages.
- masked: like tis, but tokens whose rho leaves [low, high] are dropped, not truncated.
A row holds one or more turns of a trajectory (each token weighted by its own turn's advantage);
losses are summed over tokens and averaged over trajectories, so long answers do not weigh more
per trajectory.

With the base policy's log-probs (`trainer.kl_to_base_coef` or `measure_kl_to_base`), the k3
estimate of KL(pi_theta || pi_base) over the sampled tokens is reported, and with a coefficient
added to the loss the same way (GRPO's KL term).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sao.config import MaskedObjective, PpoObjective, TisObjective, TrainerConfig


@dataclass(frozen=True)
class LossStats:
    loss: float
    ratio_mean: float
    ratio_abs_dev: float  # mean |rho - 1|
    clip_fraction: float  # tokens truncated (tis), clipped (ppo) or masked out (masked)
    kl_k3: float  # k3 estimate of KL(mu || pi): E_mu[(rho - 1) - log rho]
    tokens: int
    value_loss: float = 0.0  # squared error of the value head, when it is on
    token_nll: float = 0.0  # mean -log pi_theta of the sampled tokens (the current policy's entropy, estimated under mu)
    kl_to_base: float = float("nan")  # k3 estimate of KL(pi_theta || pi_base); NaN when the base is not scored


@dataclass(frozen=True)
class LossInputs:
    logprobs: torch.Tensor  # [rows, L] log pi_theta, with grad
    behaviour_logprobs: torch.Tensor  # [rows, L] log mu
    mask: torch.Tensor  # [rows, L] bool: action tokens
    token_weights: torch.Tensor  # [rows, L] advantage x freshness of each token's turn (0 off the action tokens)
    row_trajectory: torch.Tensor  # [rows] long: which trajectory of the batch the row belongs to
    num_trajectories: int  # the normaliser (the whole batch, across ranks)
    base_logprobs: torch.Tensor | None = None  # [rows, L] log pi_base, no grad; None: the base is not scored


def _sequence_log_ratio(log_ratio: torch.Tensor, row_trajectory: torch.Tensor, count: int) -> torch.Tensor:
    """Every token of a trajectory gets the trajectory's summed log-ratio (one rho per sequence)."""
    per_row = log_ratio.sum(dim=-1)
    per_trajectory = torch.zeros(count, dtype=per_row.dtype, device=per_row.device).index_add(0, row_trajectory, per_row)
    return per_trajectory[row_trajectory].unsqueeze(-1).expand_as(log_ratio)


def _tis(objective: TisObjective, ratio: torch.Tensor, advantage: torch.Tensor,
         logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weight = ratio.detach()
    return -torch.clamp(weight, max=objective.clip) * advantage * logprobs, weight > objective.clip


def _ppo(objective: PpoObjective, ratio: torch.Tensor, advantage: torch.Tensor,
         logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    high = objective.clip_high if objective.clip_high is not None else objective.clip
    clipped = torch.clamp(ratio, 1 - objective.clip, 1 + high)
    surrogate = torch.minimum(ratio * advantage, clipped * advantage)
    if objective.dual_clip is not None:
        surrogate = torch.where(advantage < 0, torch.maximum(surrogate, objective.dual_clip * advantage), surrogate)
    return -surrogate, clipped != ratio


def _masked(objective: MaskedObjective, ratio: torch.Tensor, advantage: torch.Tensor,
            logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weight = ratio.detach()
    dropped = (weight < objective.low) | (weight > objective.high)
    return -weight * ~dropped * advantage * logprobs, dropped


# Each objective's per-token loss and which tokens its correction touched (truncated, clipped or dropped).
TOKEN_LOSSES = {"tis": _tis, "ppo": _ppo, "masked": _masked}


def policy_loss(inputs: LossInputs, cfg: TrainerConfig) -> tuple[torch.Tensor, LossStats]:
    mask = inputs.mask.to(inputs.logprobs.dtype)
    token_log_ratio = (inputs.logprobs - inputs.behaviour_logprobs) * mask
    log_ratio = token_log_ratio
    if cfg.sequence_level_ratio:
        count = int(inputs.row_trajectory.max()) + 1 if inputs.row_trajectory.numel() else 0
        log_ratio = _sequence_log_ratio(token_log_ratio, inputs.row_trajectory, count) * mask
    ratio = torch.exp(log_ratio)
    per_token, affected = TOKEN_LOSSES[cfg.objective.type](cfg.objective, ratio, inputs.token_weights, inputs.logprobs)
    affected = affected.to(mask.dtype)
    kl_to_base = None
    if inputs.base_logprobs is not None:
        # k3 = r - log r - 1 with r = pi_base / pi_theta: non-negative, unbiased for KL(pi_theta || pi_base)
        # on tokens drawn from pi_theta (here from mu, which the importance ratios keep close to it).
        log_r = (inputs.base_logprobs - inputs.logprobs) * mask
        kl_to_base = (torch.exp(log_r) - log_r - 1) * mask
        if cfg.kl_to_base_coef > 0:
            per_token = per_token + cfg.kl_to_base_coef * kl_to_base
    loss = (per_token * mask).sum() / inputs.num_trajectories
    with torch.no_grad():
        token_ratio = torch.exp(token_log_ratio)
        tokens = mask.sum().clamp(min=1)
        stats = LossStats(loss=float(loss), ratio_mean=float((token_ratio * mask).sum() / tokens),
                          ratio_abs_dev=float(((token_ratio - 1).abs() * mask).sum() / tokens),
                          clip_fraction=float((affected * mask).sum() / tokens),
                          kl_k3=float((((token_ratio - 1) - token_log_ratio) * mask).sum() / tokens),
                          tokens=int(mask.sum()), token_nll=float((-inputs.logprobs * mask).sum() / tokens),
                          kl_to_base=float(kl_to_base.sum() / tokens) if kl_to_base is not None else float("nan"))
    return loss, stats


def whiten(values: torch.Tensor, center: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Unit size over the batch: mean 0 and std 1 (`center`), else root mean square 1 with every sign kept.

    Centred, a batch of one (or all equal) is only centred; not centred, all zeros stay zeros.
    """
    if not center:
        rms = values.pow(2).mean().sqrt() if values.numel() else values.new_zeros(())
        return values / (rms + eps) if rms > 0 else values
    centred = values - values.mean()
    if values.numel() < 2:
        return centred
    return centred / (values.std() + eps)
