"""Progress files: each process of a run writes its counters as JSON; `sao run` reads them.

The trainer's file also holds its typed `StepRecord`s, the history of the run.

Files keep the processes independent of the launcher (a sampler started by hand on another
machine works the same) and survive a crash for the post-mortem. Writes are atomic.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def write_status(path: Path, fields: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**fields, "updated_at": time.time()}, indent=1, default=float))
    os.replace(tmp, path)


def read_status(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def read_all_status(directory: Path, prefix: str) -> dict[str, dict[str, Any]]:
    return {p.stem: read_status(p) for p in sorted(directory.glob(f"{prefix}*.json"))}


@dataclass
class StepRecord:
    """One optimizer step as the trainer's progress file keeps it (rank 0 writes; `sao run` reads).

    The per-trajectory lists hold one entry per trajectory of the batch, in batch order.
    """

    step: int
    policy_version: int  # the version that was trained (a publish after the step makes the next)
    trained_at: float  # unix time at the end of the step
    rewards: list[float]
    advantages: list[float]
    behaviour_versions: list[int]
    staleness: list[int]
    compression_ratios: list[float]
    sampling_to_training_s: list[float]  # from a trajectory's creation in a sampler to this step
    loss: float
    ratio_mean: float
    ratio_abs_dev: float
    clip_fraction: float
    kl_k3: float
    value_loss: float
    grad_norm: float  # before clipping; NaN when the engine reports none
    step_s: float  # forward/backward and optimizer, all accumulation chunks
    wait_s: float  # waiting for a batch before the step
    forward_backward_s: float
    optimizer_s: float
    publish_s: float  # gathering and announcing weights after the step (0 when it did not publish)

    @property
    def batch_size(self) -> int:
        return len(self.rewards)

    @property
    def busy_fraction(self) -> float:
        """Share of the step's wall time not spent waiting for data (1 = samplers keep up)."""
        total = self.wait_s + self.forward_backward_s + self.optimizer_s + self.publish_s
        return (total - self.wait_s) / total if total > 0 else 1.0


def trainer_steps(status: dict[str, Any]) -> list[StepRecord]:
    """The step records in a trainer progress file (oldest first)."""
    return [StepRecord(**record) for record in status.get("steps", [])]


def per_trajectory(steps: list[StepRecord], field_name: str) -> list:
    """One per-trajectory series of a run, in training order: e.g. `per_trajectory(steps, "rewards")`."""
    return [value for record in steps for value in getattr(record, field_name)]
