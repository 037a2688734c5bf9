"""Policy-gradient objectives with off-policy correction, and single-trajectory advantages.

rho_t = pi_theta(a_t | c_t) / mu(a_t | c_t) is computed per action token from the behaviour
log-probs the sampler recorded. Truncated importance sampling (TIS) weighs each token's
log-likelihood gradient by min(rho_t, clip), detached, so stale samples neither vanish nor
explode. The loss is averaged over trajectories, not tokens, so long answers do not weigh more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossStats:
    loss: float
    ratio_mean: float
    ratio_abs_dev: float  # mean |rho - 1|
    clip_fraction: float  # tokens whose weight was truncated
    kl_k3: float  # k3 estimate of KL(mu || pi): E_mu[(rho - 1) - log rho]
    tokens: int


def tis_policy_gradient_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                             row_weights: torch.Tensor, num_trajectories: int, clip: float
                             ) -> tuple[torch.Tensor, LossStats]:
    """-(1/N) sum_rows w_row sum_t min(rho_t, clip) log pi(a_t).

    `logprobs`, `behaviour_logprobs`, `mask`: [rows, L]; a row is one step of a trajectory.
    `row_weights`: [rows] = advantage of the row's trajectory x freshness weight.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs.detach() - behaviour_logprobs) * mask
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=clip)
    per_row = (truncated * logprobs * mask).sum(dim=-1)
    loss = -(row_weights * per_row).sum() / num_trajectories
    tokens = mask.sum().clamp(min=1)
    stats = LossStats(
        loss=float(loss.detach()),
        ratio_mean=float((ratio * mask).sum() / tokens),
        ratio_abs_dev=float(((ratio - 1).abs() * mask).sum() / tokens),
        clip_fraction=float(((ratio > clip).to(mask.dtype) * mask).sum() / tokens),
        kl_k3=float((((ratio - 1) - log_ratio) * mask).sum() / tokens),
        tokens=int(mask.sum()),
    )
    return loss, stats


def whiten(values: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Mean 0, std 1 over the batch; a batch of one (or all equal) is only centred."""
    centred = values - values.mean()
    if values.numel() < 2:
        return centred
    return centred / (values.std() + eps)
