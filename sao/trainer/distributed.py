"""What ranks share: each batch from rank 0 (the only Kafka consumer), and each step's loss figures.

Rank 0 consumes; every rank needs the same trajectories. The raw msgpack bytes travel as a
uint8 tensor (torch's broadcast_object_list would pickle, which sao never does across
processes), and every rank decodes them with the same validating codec.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from sao.schema import Trajectory, decode
from sao.trainer.buffer import BufferEntry
from sao.trainer.objectives import LossStats

# LossStats fields that are means over tokens: merged weighted by each part's token count.
_PER_TOKEN = ("ratio_mean", "ratio_abs_dev", "clip_fraction", "kl_k3", "token_nll", "kl_to_base")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def agreed_max(value: int, device: torch.device) -> int:
    """The largest `value` over the ranks (every rank calls it at the same point)."""
    if world_size() == 1:
        return value
    agreed = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed)


def from_leader(values: list[int], device: torch.device) -> list[int]:
    """Rank 0's integers, on every rank (every rank calls it at the same point)."""
    if world_size() == 1:
        return values
    agreed = torch.tensor(values, dtype=torch.long, device=device)
    dist.broadcast(agreed, src=0)
    return agreed.tolist()


def broadcast_batch(entries: list[BufferEntry] | None, stop: bool, device: torch.device) -> tuple[list[Trajectory], bool]:
    """Rank 0 passes its buffer entries and whether training should stop; every rank gets both back.

    Rank 0 keeps the trajectories it already decoded; the other ranks decode the raw bytes.
    """
    if world_size() == 1:
        return [entry.trajectory for entry in entries or []], stop
    leader = rank() == 0
    raw_messages = [entry.raw for entry in entries or []]  # rank 0's: the other ranks have none
    header = torch.tensor([len(raw_messages), int(stop)], dtype=torch.long, device=device)
    dist.broadcast(header, src=0)
    count, stop = int(header[0]), bool(header[1])
    sizes = [len(raw) for raw in raw_messages] if leader else [0] * count
    lengths = torch.tensor(sizes, dtype=torch.long, device=device)
    dist.broadcast(lengths, src=0)
    total = int(lengths.sum())
    payload = torch.frombuffer(bytearray(b"".join(raw_messages)), dtype=torch.uint8).to(device) if leader and total \
        else torch.zeros(total, dtype=torch.uint8, device=device)
    if total:
        dist.broadcast(payload, src=0)
    if leader:
        return [entry.trajectory for entry in entries or []], stop
    data = payload.cpu().numpy().tobytes()
    ends = list(itertools.accumulate(lengths.tolist()))
    return [decode(data[start:end], Trajectory) for start, end in zip([0, *ends], ends)], stop


def all_reduce_stats(parts: list[LossStats], shards: int, device: torch.device) -> LossStats:
    """Merge the LossStats of every accumulation chunk on every rank into the step's figures.

    `loss` and `value_loss` are each shard's share of a batch mean, so their sum over the
    `shards` (chunks x ranks) is averaged; the per-token means are weighted by token counts.
    """
    sums = torch.tensor([[p.loss, p.value_loss, p.tokens, *(getattr(p, name) * p.tokens for name in _PER_TOKEN)]
                         for p in parts], dtype=torch.float64).sum(dim=0)
    if world_size() > 1:  # on the engine's device: NCCL reduces only GPU tensors
        sums = sums.to(device)
        dist.all_reduce(sums)
    loss, value_loss, tokens, *per_token = sums.tolist()
    return LossStats(loss=loss / shards, value_loss=value_loss / shards, tokens=int(tokens),
                     **{name: total / max(tokens, 1.0) for name, total in zip(_PER_TOKEN, per_token)})
