"""Turn a batch of trajectories into one rank's loss: advantages, rows, importance correction.

Every rank receives the same batch (rank 0 consumed it and broadcast the raw bytes), computes
the same advantages, and scores only its own share of trajectories; the baselines learn the
batch's rewards only once its step was applied (`record_rewards`). The
loss normaliser makes DeepSpeed's average over ranks and gradient-accumulation micro-batches
equal the full-batch loss: 1 rank and 2 ranks follow the same curve.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sao.config import TrainerConfig
from sao.policy.context import training_inputs
from sao.policy.model import collate_steps
from sao.schema import Trajectory
from sao.trainer.baselines import RewardBaseline
from sao.trainer.objectives import LossInputs, LossStats, policy_loss, whiten


@dataclass(frozen=True)
class BatchPlan:
    trajectories: list[Trajectory]
    advantages: list[float]
    staleness: list[int]


def plan_batch(batch: list[Trajectory], baseline: RewardBaseline, cfg: TrainerConfig, policy_version: int,
               group_size: int = 1) -> BatchPlan:
    """Advantages for the whole batch against the baselines as they stand (`record_rewards` updates them).

    SAO: reward minus the task's running-mean baseline (never a group mean, which is zero at
    group size 1). GRPO (group_size > 1): reward minus the mean of its group of attempts.
    """
    rewards = torch.tensor([t.total_reward for t in batch])
    if cfg.algorithm == "grpo":
        group_means = {}
        for task_id in {t.task_id for t in batch}:
            group_means[task_id] = rewards[[i for i, t in enumerate(batch) if t.task_id == task_id]].mean()
        advantages = rewards - torch.stack([group_means[t.task_id] for t in batch])
    else:
        advantages = rewards - torch.tensor([baseline.value(t.task_id, t.env) for t in batch])
    if cfg.whiten_advantages:
        advantages = whiten(advantages)
    return BatchPlan(batch, advantages.tolist(), [policy_version - t.behaviour_version for t in batch])


def record_rewards(plan: BatchPlan, baseline: RewardBaseline) -> None:
    """After a step was applied: the running baselines learn the rewards of what it trained on.

    Never before: a step skipped for a non-finite loss must not leave its rewards behind.
    """
    for trajectory in plan.trajectories:
        baseline.update(trajectory.task_id, trajectory.env, trajectory.total_reward)


def rank_loss(engine, plan: BatchPlan, indices: list[int], normaliser: float, cfg: TrainerConfig,
              memory_dim: int) -> tuple[torch.Tensor, LossStats]:
    """Forward the given trajectories of the plan; rows with weight 0 keep idle ranks in step."""
    inputs, row_weights, behaviour, temperatures, row_trajectory, returns, freshness = [], [], [], [], [], [], []
    for local, index in enumerate(indices if indices else [0]):
        trajectory = plan.trajectories[index]
        fresh = cfg.freshness_decay ** plan.staleness[index] if indices else 0.0
        to_go = float(sum(step.reward for step in trajectory.steps))
        for step_input, step in zip(training_inputs(trajectory), trajectory.steps):
            inputs.append(step_input)
            row_weights.append(plan.advantages[index] * fresh)
            behaviour.append(torch.from_numpy(step.behaviour_logprobs.copy()))
            temperatures.append(trajectory.temperature)
            row_trajectory.append(local)
            returns.append(to_go)  # return-to-go of this step: the value head's target
            freshness.append(fresh)
            to_go -= step.reward
    device = engine.device
    scoring = collate_steps(inputs, memory_dim, temperatures).to(device)
    behaviour_logprobs = torch.zeros(scoring.token_ids.shape, device=device)
    for row, row_logprobs in enumerate(behaviour):
        behaviour_logprobs[row, scoring.action_mask[row]] = row_logprobs.to(device)
    if not cfg.value_head:
        logprobs = engine(scoring)
        return policy_loss(LossInputs(logprobs, behaviour_logprobs, scoring.action_mask,
                                      torch.tensor(row_weights, device=device),
                                      torch.tensor(row_trajectory, device=device), normaliser), cfg)
    logprobs, values = engine(scoring, with_values=True)
    targets = torch.tensor(returns, device=device)
    weights = (targets - values.detach()) * torch.tensor(freshness, device=device)  # A_t = G_t - V(s_t)
    loss, stats = policy_loss(LossInputs(logprobs, behaviour_logprobs, scoring.action_mask, weights,
                                         torch.tensor(row_trajectory, device=device), normaliser), cfg)
    live = torch.tensor(freshness, device=device) > 0  # idle-rank padding rows do not train the value head
    value_loss = ((values - targets) ** 2 * live).sum() / normaliser
    total = loss + cfg.value_coef * value_loss
    return total, replace(stats, loss=float(total.detach()), value_loss=float(value_loss.detach()))
