"""Checkpoints: the DeepSpeed checkpoint plus sao's state (Kafka offsets, baselines, version).

sao's own state is JSON next to DeepSpeed's files (never pickled). The DeepSpeed `latest`
marker is written last, so a crash mid-save leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

_STATE_FILE = "sao_state.json"


@dataclass
class TrainerState:
    step: int = 0
    policy_version: int = 0
    offsets: dict[int, int] = field(default_factory=dict)  # next offset to read, per partition
    baseline: dict = field(default_factory=dict)
    seen_trajectory_ids: list[str] = field(default_factory=list)  # trained or dead-lettered, never again
    handled: int = 0  # trajectories trained or dead-lettered up to this checkpoint
    rng: dict = field(default_factory=dict)  # torch and replay-sampling RNG states, as plain lists

    @classmethod
    def from_json(cls, data: dict) -> TrainerState:
        data = dict(data)
        data["offsets"] = {int(p): int(o) for p, o in data.get("offsets", {}).items()}
        return cls(**data)


def save_checkpoint(engine, directory: Path, state: TrainerState) -> Path:
    """Collective: all ranks call it. Returns the tag directory."""
    tag = f"step-{state.step:08d}"
    tag_dir = directory / tag
    if torch.distributed.get_rank() == 0:
        tag_dir.mkdir(parents=True, exist_ok=True)
        tmp = tag_dir / f".{_STATE_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(state)))
        os.replace(tmp, tag_dir / _STATE_FILE)
    # DeepSpeed writes `latest` after its files: only then does this checkpoint count.
    engine.save_checkpoint(str(directory), tag=tag)
    return tag_dir


def load_checkpoint(engine, directory: Path) -> TrainerState | None:
    """Restore the newest complete checkpoint in `directory`; None if there is none."""
    if not (directory / "latest").is_file():
        return None
    load_path, _ = engine.load_checkpoint(str(directory), load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        return None
    tag = (directory / "latest").read_text().strip()
    return TrainerState.from_json(json.loads((directory / tag / _STATE_FILE).read_text()))
