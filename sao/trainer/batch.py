"""Turn a batch of trajectories into one rank's loss: advantages, rows, importance correction.

Every rank receives the same batch (rank 0 consumed it and broadcast the raw bytes), computes
the same advantages, and scores only its own share of trajectories; the baselines learn the
batch's rewards only once its step was applied (`record_rewards`). The
loss normaliser makes DeepSpeed's average over ranks and gradient-accumulation micro-batches
equal the full-batch loss: 1 rank and 2 ranks follow the same curve.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from sao.config import TrainerConfig
from sao.policy.context import TurnInput, training_inputs
from sao.policy.model import ScoringBatch, collate_turns
from sao.schema import Trajectory
from sao.trainer.baselines import RewardBaseline, mean_at_turn
from sao.trainer.distributed import world_size
from sao.trainer.objectives import LossInputs, LossStats, policy_loss, whiten

if TYPE_CHECKING:
    from sao.trainer.hindsight import HindsightAnswer


@dataclass(frozen=True)
class BatchPlan:
    trajectories: list[Trajectory]
    advantages: list[list[float]]  # per trajectory: one per turn, then its hindsight row's if it has one
    staleness: list[int]
    returns: list[list[float]]  # per trajectory, what each turn is credited with (`turn_returns`)
    # trajectory index -> the retry whose answer is also trained as the first try's (`retry_hindsight`)
    hindsight: dict[int, int] = field(default_factory=dict)
    # trajectory index -> the hindsight row's action ids, where not the retry's own (`hindsight_reply`)
    hindsight_actions: dict[int, np.ndarray] = field(default_factory=dict)
    # Score a turn inside the next turn's row when that row begins with it (`sequences`). Off with a
    # value head, which reads one state per row.
    merge_turns: bool = True

    def alone(self, index: int) -> BatchPlan:
        """The plan of one of its trajectories on its own, with the advantages this batch gave it."""
        hindsight = {0: self.hindsight[index]} if index in self.hindsight else {}
        actions = {0: self.hindsight_actions[index]} if index in self.hindsight_actions else {}
        return BatchPlan([self.trajectories[index]], [self.advantages[index]], [self.staleness[index]],
                         [self.returns[index]], hindsight, actions, self.merge_turns)


def plan_rows(plan: BatchPlan, index: int) -> list[TurnInput]:
    """What a trajectory of the plan trains on: each turn as sampled, then its hindsight row if it has one.

    The hindsight row is the first turn's context answered with the better retry's answer: the
    answer the env's feedback led to, taught as the answer the question itself should get (in the
    retry's reply, or the first reply corrected: sao/trainer/hindsight.py).
    """
    inputs = training_inputs(plan.trajectories[index])
    retry = plan.hindsight.get(index)
    if retry is None:
        return inputs
    return inputs + [_hindsight_row(inputs, plan.hindsight_actions.get(index, inputs[retry].action_ids))]


def _hindsight_row(inputs: list[TurnInput], action_ids: np.ndarray) -> TurnInput:
    return replace(inputs[0], action_ids=action_ids)


def sequences(plan: BatchPlan, index: int) -> list[tuple[int, ...]]:
    """A trajectory's rows grouped into the forward passes' sequences: each a run of turns scored in one row.

    A turn whose whole row (prompt, memory, context and action) is where the next turn's row
    begins is scored inside that row: attention is causal, so its action tokens get the same
    log-probs there as in a row of their own, and the prefix is computed once (a retry's row holds
    the first try whole when the recent window keeps it and the memory has not changed). The
    hindsight row never shares: its action was not what came next.
    """
    rows = plan_rows(plan, index)
    sampled = len(plan.trajectories[index].steps)
    groups: list[list[int]] = []
    for turn in range(len(rows)):
        if groups and turn < sampled and plan.merge_turns and _begins_with(rows[turn], rows[turn - 1]):
            groups[-1].append(turn)
        else:
            groups.append([turn])
    return [tuple(group) for group in groups]


def _begins_with(row: TurnInput, earlier: TurnInput) -> bool:
    """`row` starts with the whole of `earlier`: same prompt and memory, its context opens with earlier's text."""
    head = np.concatenate([earlier.context_ids, earlier.action_ids])
    return (np.array_equal(row.prompt_ids, earlier.prompt_ids) and np.array_equal(row.memory, earlier.memory)
            and len(row.context_ids) >= len(head) and np.array_equal(row.context_ids[:len(head)], head))


def better_retry(returns: list[float]) -> int | None:
    """The retry to teach the first turn: the best-credited later turn, if it earned more than 0 and the first try."""
    if len(returns) < 2:
        return None
    best = max(range(1, len(returns)), key=lambda turn: returns[turn])
    return best if returns[best] > max(0.0, returns[0]) else None


def turn_returns(trajectory: Trajectory, credit: str) -> list[float]:
    """What each turn's tokens are credited with (`trainer.turn_credit`; `auto` unresolved = reward_to_go).

    own_reward: the turn's own reward. In a retry env a wrong first answer followed by a right one
    would otherwise earn the retry's reward, and the policy learns to answer wrong first (measured:
    benchmarks/README.md). reward_to_go: the rewards from the turn to the episode's end.
    """
    rewards = [float(step.reward) for step in trajectory.steps]
    if credit == "own_reward":
        return rewards
    return list(itertools.accumulate(reversed(rewards)))[::-1]


HindsightReply = Callable[[Trajectory, int], "HindsightAnswer | None"]  # (trajectory, retry) -> the row's answer


def plan_batch(batch: list[Trajectory], baseline: RewardBaseline, cfg: TrainerConfig, policy_version: int,
               hindsight_reply: HindsightReply | None = None) -> BatchPlan:
    """Per-turn advantages for the whole batch against the baselines as they stand (`record_rewards` updates them).

    SAO: a turn's return minus that turn's baseline (`trainer.baseline_key`; never a group mean, which
    is zero at group size 1). GRPO: minus the mean return at that turn of its group's copies.
    Whitening scales over every turn of the batch and keeps each advantage's sign; only with
    `center_advantages` does it subtract the batch mean too (then a baseline equal for the whole
    batch, `env`, cancels).
    """
    returns = [turn_returns(t, cfg.turn_credit) for t in batch]
    grouped = cfg.algorithm.group_baseline
    baselines = _group_means(batch, returns) if grouped else baseline.values_for(batch, returns)
    advantages = [[g - b for g, b in zip(own, base)] for own, base in zip(returns, baselines)]
    hindsight, actions = {}, {}
    # own_reward: the turns are attempts at one question; GRPO stays the plain comparison baseline.
    if cfg.retry_hindsight and cfg.turn_credit == "own_reward" and not grouped:
        hindsight = {index: retry for index, own in enumerate(returns) if (retry := better_retry(own)) is not None}
        for index, retry in list(hindsight.items()):
            inputs = training_inputs(batch[index])
            answer = hindsight_reply(batch[index], retry) if hindsight_reply is not None else None
            row = _hindsight_row(inputs, inputs[retry].action_ids if answer is None else answer.action_ids)
            # Validation bounds the sampled rows by the pass budget; a hindsight row that would not fit is left out.
            if row.positions > cfg.micro_batch_tokens:
                del hindsight[index]
            elif answer is not None:  # the question's own answer: judged as a first try, against turn 0's baseline
                actions[index] = answer.action_ids
                advantages[index].append(answer.first_try_return - baselines[index][0])
            else:  # the retry's own reply, worded for its feedback: taught as strongly as the retry itself
                advantages[index].append(advantages[index][retry])
    if cfg.scale_advantages:
        flat = iter(whiten(torch.tensor([a for rows in advantages for a in rows]), cfg.center_advantages).tolist())
        advantages = [list(itertools.islice(flat, len(rows))) for rows in advantages]
    return BatchPlan(batch, advantages, [policy_version - t.behaviour_version for t in batch], returns, hindsight,
                     actions, merge_turns=not cfg.value_head)


def _group_means(batch: list[Trajectory], returns: list[list[float]]) -> list[list[float]]:
    """GRPO's baseline: the mean return at each turn over the copies of the same task that reached it."""
    groups: dict[str, list[int]] = {}
    for index, trajectory in enumerate(batch):
        groups.setdefault(trajectory.task_id, []).append(index)
    return [[mean_at_turn([returns[j] for j in groups[trajectory.task_id]], turn) for turn in range(len(own))]
            for trajectory, own in zip(batch, returns)]


def record_rewards(plan: BatchPlan, baseline: RewardBaseline) -> None:
    """After a step was applied: the running baselines learn the returns of what it trained on.

    Never before: a step skipped for a non-finite loss must not leave its rewards behind.
    """
    for trajectory, returns in zip(plan.trajectories, plan.returns):
        baseline.update(trajectory, returns)


Row = tuple[int, tuple[int, ...]]  # (trajectory's index in the plan, its turns scored in this row): see `sequences`


def micro_batches(plan: BatchPlan, indices: list[int], budget: int, whole_trajectories: bool) -> list[list[Row]]:
    """The rows of the given trajectories in forward passes of at most `budget` positions each.

    A pass computes (its rows x its longest row) positions, and a training pass's memory grows with
    them, so this is what bounds a step's peak. Rows are packed shortest first, so a pass pads
    little. With `whole_trajectories` (sequence-level importance: one ratio over all of a
    trajectory's rows) a trajectory's rows share a pass. Validation dead-letters a row, or a whole
    trajectory when it must share a pass, longer than the budget, so every pass here fits it.
    """
    units: list[tuple[int, list[Row]]] = []  # (longest row, rows)
    for index in indices:
        inputs = plan_rows(plan, index)
        rows = [(index, turns) for turns in sequences(plan, index)]
        lengths = [inputs[turns[-1]].positions for _, turns in rows]
        units += [(max(lengths), rows)] if whole_trajectories else [(n, [row]) for n, row in zip(lengths, rows)]
    passes: list[list[Row]] = []
    for longest, rows in sorted(units, key=lambda unit: unit[0]):
        if passes and (len(passes[-1]) + len(rows)) * longest <= budget:
            passes[-1] += rows
        else:
            passes.append(list(rows))
    return passes


def all_rows(plan: BatchPlan, indices: list[int]) -> list[Row]:
    return [(index, turns) for index in indices for turns in sequences(plan, index)]


def rank_loss(engine, plan: BatchPlan, rows: list[Row], normaliser: float, cfg: TrainerConfig,
              memory_width: int, base_policy: torch.nn.Module | None = None) -> tuple[torch.Tensor, LossStats]:
    """Forward the given rows of the plan; with none, one row at weight 0 keeps an idle rank in step.

    With `base_policy` (a frozen copy of the base) the rows are scored by it too, for the KL to the base.
    """
    inputs, spans, weights, behaviour, temperatures, row_trajectory, returns, freshness = [], [], [], [], [], [], [], []
    local: dict[int, int] = {}  # trajectory index -> its number within this pass
    steps_of: dict[int, list[TurnInput]] = {}
    for index, turns in rows if rows else [(0, (0,))]:
        trajectory = plan.trajectories[index]
        if index not in steps_of:
            steps_of[index] = plan_rows(plan, index)
        fresh = cfg.freshness_decay ** plan.staleness[index] if rows else 0.0
        inputs.append(steps_of[index][turns[-1]])
        # Each scored turn's action sits where it ends its own row: its start there is its place here too.
        spans.append([(steps_of[index][turn].positions - len(steps_of[index][turn].action_ids),
                       len(steps_of[index][turn].action_ids)) for turn in turns])
        weights.append(torch.cat([torch.full((len(steps_of[index][turn].action_ids),),
                                             plan.advantages[index][turn] * fresh) for turn in turns]))
        # A turn past the sampled ones is the hindsight row: never sampled there, so no behaviour log-probs.
        behaviour.append(torch.cat([
            torch.from_numpy(trajectory.steps[turn].behaviour_logprobs.copy()) if turn < len(trajectory.steps) else
            torch.full((len(steps_of[index][turn].action_ids),), float("nan")) for turn in turns]))
        temperatures.append(trajectory.temperature)
        row_trajectory.append(local.setdefault(index, len(local)))
        turn = turns[-1]  # one turn a row with a value head (merge_turns is off)
        returns.append(plan.returns[index][turn if turn < len(trajectory.steps) else plan.hindsight[index]])
        freshness.append(fresh)
    device = engine.device
    scoring = collate_turns(inputs, memory_width, temperatures, spans).to(device)
    behaviour_logprobs = torch.zeros(scoring.token_ids.shape, device=device)
    token_weights = torch.zeros(scoring.token_ids.shape, device=device)
    for row, (row_logprobs, row_weights) in enumerate(zip(behaviour, weights)):
        behaviour_logprobs[row, scoring.action_mask[row]] = row_logprobs.to(device)
        token_weights[row, scoring.action_mask[row]] = row_weights.to(device)
    base_logprobs = None
    if base_policy is not None:
        with torch.no_grad():
            base_logprobs = _score(base_policy, scoring, cfg.length_buckets)
    scored = _score(engine, scoring, cfg.length_buckets, with_values=cfg.value_head)
    logprobs, values = scored if cfg.value_head else (scored, None)
    # Hindsight rows (NaN behaviour) count as drawn from the current policy: ratio 1, a plain policy gradient.
    behaviour_logprobs = torch.where(torch.isnan(behaviour_logprobs), logprobs.detach(), behaviour_logprobs)
    if cfg.value_head:
        targets = torch.tensor(returns, device=device)
        row_advantages = (targets - values.detach()) * torch.tensor(freshness, device=device)  # A_t = G_t - V(s_t)
        token_weights = row_advantages.unsqueeze(-1).expand_as(logprobs)
    loss, stats = policy_loss(LossInputs(logprobs, behaviour_logprobs, scoring.action_mask, token_weights,
                                         torch.tensor(row_trajectory, device=device), normaliser, base_logprobs), cfg)
    if not cfg.value_head:
        return loss, stats
    live = torch.tensor(freshness, device=device) > 0  # idle-rank padding rows do not train the value head
    value_loss = ((values - targets) ** 2 * live).sum() / normaliser
    total = loss + cfg.value_coef * value_loss
    return total, replace(stats, loss=float(total.detach()), value_loss=float(value_loss.detach()))


# A split costs one more pass of fixed overhead (ZeRO-3 gathers and hooks per module); below this
# share of the padded positions saved it does not pay.
MIN_SPLIT_SAVING = 0.05


def length_buckets(lengths: list[int], max_buckets: int) -> list[list[int]]:
    """Row indices in at most `max_buckets` groups of similar length, padding as little as possible.

    Rows sorted by length are cut into contiguous groups; a group costs (rows x its longest row)
    positions. The cheapest cut for each number of groups comes from a small dynamic programme
    (rows per batch are few); more groups are taken only while each saves MIN_SPLIT_SAVING.
    """
    order = sorted(range(len(lengths)), key=lambda row: lengths[row])
    sorted_lengths = [lengths[row] for row in order]
    count = len(order)
    # cost[k][j]: fewest positions for the first j sorted rows in k groups; cut[k][j]: where the last group starts.
    cost = [[0.0] + [float("inf")] * count]
    cut: list[list[int]] = [[0] * (count + 1)]
    best_groups = 1
    for groups in range(1, min(max_buckets, max(count, 1)) + 1):
        row_cost, row_cut = [0.0] + [float("inf")] * count, [0] * (count + 1)
        for end in range(1, count + 1):
            for start in range(groups - 1, end):
                candidate = cost[groups - 1][start] + (end - start) * sorted_lengths[end - 1]
                if candidate < row_cost[end]:
                    row_cost[end], row_cut[end] = candidate, start
        cost.append(row_cost)
        cut.append(row_cut)
        if groups > 1 and row_cost[count] <= cost[best_groups][count] * (1 - MIN_SPLIT_SAVING):
            best_groups = groups
    buckets, end = [], count
    for groups in range(best_groups, 0, -1):
        start = cut[groups][end] if groups > 1 else 0
        buckets.append([order[i] for i in range(start, end)])
        end = start
    return [bucket for bucket in reversed(buckets) if bucket]


def _rows(batch: ScoringBatch, rows: torch.Tensor, width: int) -> ScoringBatch:
    """The given rows of a right-padded batch, cut to `width` positions (their longest row)."""
    action_mask = batch.action_mask[rows, :width]
    return ScoringBatch(batch.token_ids[rows, :width], batch.memory_vectors[rows, :width], batch.memory_mask[rows, :width],
                        batch.attention_mask[rows, :width], action_mask, batch.temperatures[rows])


def _score(engine, scoring: ScoringBatch, max_buckets: int, with_values: bool = False):
    """The policy's log-probs [rows, L] (and values [rows]) of a batch, one forward pass per length bucket.

    Rows are right-padded and causal, so a row's outputs do not depend on how far it is padded:
    the passes put together equal one pass over the whole batch, with fewer positions computed.
    The loss is taken once over the reassembled tensors, so nothing else changes.
    """
    lengths = scoring.attention_mask.sum(dim=1).tolist()
    # ZeRO-3 gathers each layer's parameters collectively in every forward pass: ranks scoring their
    # own rows must make the same number of passes, or the collectives pair up wrongly and hang.
    buckets = length_buckets(lengths, max_buckets if world_size() == 1 else 1)
    if len(buckets) <= 1:
        return engine(scoring, with_values=with_values)
    width = scoring.token_ids.shape[1]
    logprobs, values, order = [], [], []
    for bucket in buckets:
        rows = torch.tensor(bucket, device=scoring.token_ids.device)
        bucket_width = max(lengths[row] for row in bucket)
        out = engine(_rows(scoring, rows, bucket_width), with_values=with_values)
        bucket_logprobs, bucket_values = out if with_values else (out, None)
        logprobs.append(F.pad(bucket_logprobs, (0, width - bucket_width)))
        values.append(bucket_values)
        order += bucket
    inverse = torch.tensor(order, device=scoring.token_ids.device).argsort()  # row -> its place in `order`
    if with_values:
        return torch.cat(logprobs)[inverse], torch.cat(values)[inverse]
    return torch.cat(logprobs)[inverse]
