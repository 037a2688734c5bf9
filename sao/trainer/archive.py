"""The trajectory log: what the trainer consumed, how each step used it, and what it published, in one file.

Rank 0 appends to RUN_DIR/trajectory-log.bin as it goes: every trajectory message it read (the raw
msgpack bytes, with topic, partition and offset), each optimizer step (which messages made the
batch, in which order, which were trained on, the micro-batch packing, the learning rate), each
shadow rollback at the step it took effect, and each published version's hashes (the whole state's
and each tensor's). Together with the base weights this is what `sao replay` (sao/trainer/replay.py)
needs to rebuild every version without a broker.

The file is a magic line, then frames: a little-endian uint32 length and a msgpack map with a
`kind` (never pickle). It only grows while a trainer lives. A resumed trainer continues the lineage
its checkpoint belongs to: the file is cut back to the length the checkpoint recorded (what later
steps of the dead life wrote is void, as their steps are), and a message already in the file is not
written again when a resume reads it a second time. So the file holds each message once, in the
order the surviving lineage consumed and trained it.
"""

from __future__ import annotations

import logging
import os
import platform
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

log = logging.getLogger(__name__)

MAGIC = b"sao-trajectory-log 1\n"
_LENGTH = struct.Struct("<I")

Position = tuple[int, int]  # (partition, offset) of a message on the trajectories topic


class ArchiveError(ValueError):
    """The trajectory log cannot be read (not one, or cut short before its first record)."""


@dataclass
class ArchiveStats:
    bytes: int = 0  # the file's length
    trajectories: int = 0  # messages written by this life
    trajectory_bytes: int = 0  # their frames' bytes
    write_s: float = 0.0  # seconds this life spent encoding and writing records


class TrajectoryArchive:
    """Rank 0's writer. `keep_bytes`: the length to continue from (a resumed checkpoint's), 0 = a fresh log."""

    def __init__(self, path: Path, keep_bytes: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stats = ArchiveStats()
        self.archived: set[Position] = set()
        kept = self._kept(keep_bytes)
        self.handle: BinaryIO = open(self.path, "r+b" if kept else "wb")
        if kept:
            self.handle.truncate(kept)
            self.handle.seek(kept)
        else:
            self.handle.write(MAGIC)
        self.stats.bytes = self.handle.tell()

    def _kept(self, keep_bytes: int) -> int:
        """How much of an existing log continues (0: none); remembers the positions it holds."""
        if not keep_bytes:
            return 0
        size = self.path.stat().st_size if self.path.exists() else 0
        if size < keep_bytes:
            log.warning("trajectory log %s holds %d bytes, fewer than the %d its checkpoint recorded: it starts "
                        "anew, and `sao replay` cannot rebuild this run's earlier versions", self.path, size, keep_bytes)
            return 0
        if size > keep_bytes:
            log.info("trajectory log: %d bytes written after the checkpoint resumed from are void (cut)",
                     size - keep_bytes)
        for record in read_records(self.path, keep_bytes):
            if record["kind"] == "trajectory":
                self.archived.add((record["partition"], record["offset"]))
        return keep_bytes

    def _append(self, record: dict[str, Any], flush: bool = True) -> int:
        started = time.perf_counter()
        payload = msgpack.packb(record, use_bin_type=True)
        self.handle.write(_LENGTH.pack(len(payload)))
        self.handle.write(payload)
        if flush:
            self.handle.flush()
        written = _LENGTH.size + len(payload)
        self.stats.bytes += written
        self.stats.write_s += time.perf_counter() - started
        return written

    def life(self, step: int, policy_version: int, resumed: bool, world_size: int, config_toml: str,
             **facts: Any) -> None:
        """A trainer life starts: where it stands, and what makes its steps come out the same (torch threads...)."""
        import torch

        self._append({"kind": "life", "step": step, "policy_version": policy_version, "resumed": resumed,
                      "world_size": world_size, "torch_threads": torch.get_num_threads(),
                      "torch": torch.__version__, "machine": platform.machine(), "processor": _cpu_model(),
                      "config": config_toml, "started_at": time.time(), **facts})

    def trajectory(self, topic: str, partition: int, offset: int, value: bytes | None) -> None:
        """A message read from the trajectories topic; one already in the log (re-read after a resume) is skipped."""
        if (partition, offset) in self.archived:
            return
        self.archived.add((partition, offset))
        self.stats.trajectories += 1
        self.stats.trajectory_bytes += self._append({"kind": "trajectory", "topic": topic, "partition": partition,
                                                     "offset": offset, "value": value}, flush=False)

    def step(self, step: int | None, policy_version: int, batch: list[Position], trained: list[Position],
             applied: bool, learning_rate: float, passes: list[list[tuple[int, tuple[int, ...]]]],
             skipped_reason: str | None = None) -> None:
        """An optimizer step over `batch` (in the order the loss saw it). `trained`: what was scored in the end
        (the batch less what raised); `passes`: the micro-batches, as (index in trained, turns) rows."""
        self._append({"kind": "step", "step": step, "policy_version": policy_version,
                      "batch": [list(p) for p in batch], "trained": [list(p) for p in trained], "applied": applied,
                      "skipped_reason": str(skipped_reason) if skipped_reason else None,
                      "learning_rate": learning_rate, "passes": logged_passes(passes)})

    def rollback(self, event: dict[str, int]) -> None:
        """A shadow rollback, before the step `event["step"] + 1` trained on the restored weights."""
        self._append({"kind": "rollback", **event})

    def published(self, version: int, step: int, state_sha256: str, sha256: str,
                  tensor_sha256: dict[str, bytes] | None) -> None:
        """A published version: its state's hash (deltas.state_sha256) and, where known, each tensor's."""
        self._append({"kind": "published", "version": version, "step": step, "state_sha256": state_sha256,
                      "sha256": sha256, "tensor_sha256": tensor_sha256})

    def flush(self) -> None:
        started = time.perf_counter()
        self.handle.flush()
        self.stats.write_s += time.perf_counter() - started

    def durable_length(self) -> int:
        """The log's length, flushed and synced: what a checkpoint records, so a resume continues from there."""
        started = time.perf_counter()
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.stats.write_s += time.perf_counter() - started
        return self.stats.bytes

    def close(self) -> None:
        if not self.handle.closed:
            self.flush()
            self.handle.close()


def logged_passes(passes: list[list[tuple[int, tuple[int, ...]]]]) -> list[list[list]]:
    """Micro-batches as the log keeps them (msgpack has no tuples): each row [index in trained, [turns]]."""
    return [[[index, list(turns)] for index, turns in rows] for rows in passes]


def read_records(path: Path, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """The log's records in order, up to `limit` bytes; a torn last frame (a crash mid-write) ends it."""
    with open(path, "rb") as handle:
        if handle.read(len(MAGIC)) != MAGIC:
            raise ArchiveError(f"{path} is not a sao trajectory log (it does not start with {MAGIC!r})")
        position = len(MAGIC)
        while limit is None or position < limit:
            header = handle.read(_LENGTH.size)
            if len(header) < _LENGTH.size:
                return
            (length,) = _LENGTH.unpack(header)
            payload = handle.read(length)
            if len(payload) < length:
                log.warning("%s ends in a torn record at byte %d (a crash mid-write): read up to it", path, position)
                return
            position += _LENGTH.size + length
            record = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            if not isinstance(record, dict) or "kind" not in record:
                raise ArchiveError(f"{path}: the record at byte {position - length} is not a map with a kind")
            yield record


@dataclass
class TrajectoryLog:
    """A log read whole: the messages by position, and every other record in order."""

    messages: dict[Position, bytes | None] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)  # life, step, rollback, published

    @classmethod
    def read(cls, path: Path) -> TrajectoryLog:
        if not Path(path).is_file():
            raise ArchiveError(f"{path} does not exist: the run kept no trajectory log "
                               "(trainer.keep_trajectory_log was off, or the run predates it)")
        read = cls()
        for record in read_records(path):
            if record["kind"] == "trajectory":
                read.messages[(record["partition"], record["offset"])] = record["value"]
            else:
                read.events.append(record)
        if not read.events or read.events[0]["kind"] != "life":
            raise ArchiveError(f"{path} holds no trainer start record: nothing to replay")
        return read

    def first_life(self) -> dict[str, Any]:
        return self.events[0]

    def world_size(self) -> int:
        """How many ranks the run trained on (the most any of its trainer's lives had): as many processes as replay
        starts, so a count that is not a whole number from 1 to this machine's CPUs is refused."""
        counts = [event.get("world_size") for event in self.events if event["kind"] == "life"]
        ranks = max(counts) if all(type(count) is int for count in counts) else None
        cpus = len(os.sched_getaffinity(0))
        if ranks is None or not 1 <= ranks <= cpus:
            raise ArchiveError(f"the log's trainer world_size {ranks!r} is not a rank count this machine can replay "
                               f"(1 to its {cpus} CPUs, one process each)")
        return ranks


def _cpu_model() -> str:
    """The CPU's model name (floating-point kernels may differ between CPU families)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
