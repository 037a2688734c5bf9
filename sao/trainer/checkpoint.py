"""Checkpoints: the DeepSpeed checkpoint plus sao's state (Kafka offsets, baselines, version), trusted only as written.

sao's own state is JSON next to DeepSpeed's files (never pickled). DeepSpeed's files are pickles,
loaded with `torch.load(weights_only=False)`: loading one runs whatever code it names. So sao
loads only a checkpoint it wrote itself, unchanged: after DeepSpeed has saved a tag, rank 0
records the sha256 of every file in it in `sao_state.json`, then writes `latest` (last, so a
crash mid-save leaves the previous checkpoint as the latest one). Before DeepSpeed reads
anything, every file of the tag `latest` names is checked against that record; an extra,
missing or changed file refuses the resume. Whoever can rewrite `sao_state.json` itself is
beyond this check: the checkpoint folder must be writable by the trainer alone.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from sao.policy.weights import sha256_file
from sao.run_dir import CHECKPOINT_STATE
from sao.status import write_atomically
from sao.trainer.distributed import from_leader, rank

log = logging.getLogger(__name__)

_LATEST_FILE = "latest"
_TAG = re.compile(r"step-\d{8}")  # the only tags sao writes


class UntrustedCheckpoint(RuntimeError):
    """A checkpoint's files are not exactly those sao recorded when writing it: it is not loaded."""


# Keys that checkpoints written under an earlier name hold: read under the current one.
_RENAMED_KEYS = {"refused_offsets": "dead_lettered_offsets"}


@dataclass
class TrainerState:
    step: int = 0
    policy_version: int = 0
    offsets: dict[int, int] = field(default_factory=dict)  # next offset to read, per partition
    baseline: dict = field(default_factory=dict)
    seen_trajectory_ids: list[str] = field(default_factory=list)  # trained or dead-lettered, never again
    handled: int = 0  # trajectories trained or dead-lettered up to this checkpoint
    dead_lettered_offsets: dict[int, list[int]] = field(default_factory=dict)  # dead-lettered at or above `offsets`
    rng: dict = field(default_factory=dict)  # torch and replay-sampling RNG states, as plain lists
    broker_cluster_id: str | None = None  # the Kafka cluster `offsets` point into (sao/transport/health.py)
    trajectory_log_bytes: int = 0  # the trajectory log's length at this checkpoint (sao/trainer/archive.py)

    @classmethod
    def from_json(cls, data: dict) -> TrainerState:
        data = {_RENAMED_KEYS.get(k, k): v for k, v in data.items() if k != "files"}
        data["offsets"] = {int(p): int(o) for p, o in data.get("offsets", {}).items()}
        data["dead_lettered_offsets"] = {int(p): [int(o) for o in positions]
                                         for p, positions in data.get("dead_lettered_offsets", {}).items()}
        return cls(**data)


def save_checkpoint(engine, directory: Path, state: TrainerState) -> Path:
    """Collective: all ranks call it. Returns the tag directory."""
    tag = f"step-{state.step:08d}"
    tag_dir = directory / tag
    leader = not dist.is_initialized() or dist.get_rank() == 0
    if leader and tag_dir.exists():
        # Left by a life that crashed mid-save (`latest` never named it): nothing in it is vouched for.
        if _read_latest(directory) == tag:
            raise RuntimeError(f"{tag_dir} is the latest checkpoint; refusing to overwrite it")
        shutil.rmtree(tag_dir)
    _barrier()
    engine.save_checkpoint(str(directory), tag=tag, save_latest=False)
    _barrier()  # every rank's shards are on disk before rank 0 hashes them
    if leader:
        files = {name: sha256_file(path) for name, path in _files_of(tag_dir).items()}
        write_atomically(tag_dir / CHECKPOINT_STATE, json.dumps({**asdict(state), "files": files}))
        write_atomically(directory / _LATEST_FILE, tag)  # only now does this checkpoint count
    _barrier()
    return tag_dir


def update_checkpoint_state(directory: Path, state: TrainerState) -> None:
    """Rank 0: rewrite the latest checkpoint's sao state in place, its DeepSpeed files untouched.

    For a trainer that stops having dead-lettered messages since its last step's checkpoint: the
    weights are those the tag holds, but its offsets and counts are behind. The file hashes stay
    as recorded (the files did not change), so the checkpoint stays trusted.
    """
    tag = _read_latest(directory)
    if tag != f"step-{state.step:08d}":
        raise RuntimeError(f"{directory / _LATEST_FILE} names {tag!r}, not step {state.step}: only the state of "
                           "the checkpoint of the current step may be rewritten")
    # The hashes are copied, not recomputed: a resume still checks the files against them.
    files = json.loads((directory / tag / CHECKPOINT_STATE).read_text())["files"]
    write_atomically(directory / tag / CHECKPOINT_STATE, json.dumps({**asdict(state), "files": files}))


def has_checkpoint(directory: Path) -> bool:
    """Whether `directory` names a latest checkpoint (trusted or not: `verify_checkpoint` decides that)."""
    return (directory / _LATEST_FILE).is_file()


def load_checkpoint(engine, directory: Path, verified: Future[tuple[str, dict]] | None = None) -> TrainerState | None:
    """Restore the newest checkpoint in `directory` once its files are verified; None if there is none.

    `verified`, if given, is `verify_checkpoint(directory)` already under way (the trainer hashes the
    files on a thread while it builds the engine); its result is awaited here.
    Raises UntrustedCheckpoint, before anything is unpickled, when the files differ from the record.
    """
    if not has_checkpoint(directory):
        return None
    tag, recorded_state = verified.result() if verified is not None else verify_checkpoint(directory)
    load_path, _ = engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        return None
    return TrainerState.from_json(recorded_state)


def verify_checkpoint(directory: Path) -> tuple[str, dict]:
    """The tag `latest` names and its recorded state, if every file of it is as sao wrote it."""
    latest = directory / _LATEST_FILE
    tag = _read_latest(directory)
    if latest.is_symlink() or tag is None or not _TAG.fullmatch(tag):
        raise UntrustedCheckpoint(_refusal(directory, f"{latest} names {tag!r}, not a checkpoint sao writes "
                                                      "(step-NNNNNNNN)"))
    tag_dir = directory / tag
    state_path = tag_dir / CHECKPOINT_STATE
    try:
        if tag_dir.is_symlink() or state_path.is_symlink():
            raise ValueError("a symbolic link")
        recorded = json.loads(state_path.read_text())
        files = recorded["files"]
        if not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
            raise ValueError("no file hashes")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UntrustedCheckpoint(_refusal(directory, f"{state_path} holds no record of the files sao wrote ({err})")
                                  ) from err
    present = _files_of(tag_dir)
    for name in sorted(present.keys() | files.keys()):
        path = tag_dir / name
        if name not in files:
            problem = f"{path} was not written by sao"
        elif name not in present:
            problem = f"{path} is missing"
        elif path.is_symlink() or not path.is_file():
            problem = f"{path} is not a regular file"
        elif sha256_file(path) != files[name]:
            problem = f"{path} changed since sao wrote it (sha256 differs)"
        else:
            continue
        raise UntrustedCheckpoint(_refusal(directory, problem))
    return tag, recorded


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _refusal(directory: Path, problem: str) -> str:
    return (f"refusing to resume from {directory}: {problem}. DeepSpeed checkpoints are pickles and loading one "
            "runs code, so sao loads only files it wrote itself, unchanged. Do not resume from this folder: start a "
            "fresh run directory, or restore the checkpoints from a copy you trust.")


def _read_latest(directory: Path) -> str | None:
    try:
        return (directory / _LATEST_FILE).read_text(errors="replace").strip()
    except OSError:
        return None


def _files_of(tag_dir: Path) -> dict[str, Path]:
    """Every entry under the tag directory but sao's state file, by relative path (links included)."""
    return {path.relative_to(tag_dir).as_posix(): path for path in tag_dir.rglob("*")
            if not path.is_dir() or path.is_symlink()
            if path.relative_to(tag_dir).as_posix() != CHECKPOINT_STATE}


def rng_state(replay_rng: random.Random) -> dict:
    """torch's and the replay buffer's RNG states, as JSON for `TrainerState.rng`."""
    return {"torch": torch.get_rng_state().tolist(), "replay": _jsonable(replay_rng.getstate())}


def restore_rng(state: TrainerState, replay_rng: random.Random) -> None:
    """Set both RNGs as `state` recorded them (a fresh state records none): a resumed run draws what it would have."""
    if state.rng:
        torch.set_rng_state(torch.tensor(state.rng["torch"], dtype=torch.uint8))
        replay_rng.setstate(_tupled(state.rng["replay"]))


def _jsonable(state):
    """random.Random state (nested tuples) as JSON lists."""
    return [_jsonable(item) for item in state] if isinstance(state, tuple) else state


def _tupled(state):
    return tuple(_tupled(item) for item in state) if isinstance(state, list) else state


def next_free_version(state: TrainerState, announced: Future[int] | None, device) -> int:
    """After a resume, the version to go on from: above every version ever announced (`announced`, read by rank 0
    and broadcast), not the checkpoint's. A crashed run may have announced versions after its last checkpoint;
    reusing their numbers would leave samplers that loaded them on the abandoned weights."""
    version = max(state.policy_version, announced.result()) if rank() == 0 else state.policy_version
    [version] = from_leader([version], device)
    if version != state.policy_version:
        log.info("resuming at policy v%d: versions up to it were announced before the crash", version)
    return version
