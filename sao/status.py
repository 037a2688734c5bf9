"""Progress files: each process of a run writes its counters as JSON; `sao run` reads them.

The trainer's file holds its typed `TrainerProgress` (what it handled, asked by the trainer itself,
the feeder, the launcher and the report) and its `StepRecord`s, the history of the run.

Files keep the processes independent of the launcher (a sampler started by hand on another
machine works the same) and survive a crash for the post-mortem. Writes are atomic.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from sao.processes import process_started_at


def write_atomically(path: Path, text: str) -> None:
    """Write `text` beside `path`, then rename it there: a reader sees the old file or the new, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_status(path: Path, fields: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({**fields, "updated_at": time.time()}, indent=1, default=float))


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all its threads included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of another live process (the embedded broker); None if it cannot be read."""
    import psutil  # a DeepSpeed dependency, so always installed

    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def process_usage() -> dict[str, float]:
    """`cpu_s`, `wall_s` and `peak_rss_mb` (resident memory at its highest) of this process since it
    started, for its progress file.

    `sao run` divides each role's CPU seconds by the run's wall time to say how many cores it
    kept busy (sao/report.py).
    """
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"cpu_s": own_cpu_seconds(), "wall_s": time.time() - process_started_at(), "peak_rss_mb": peak_kib / 1024}


def read_status(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def read_all_status(directory: Path, prefix: str) -> dict[str, dict[str, Any]]:
    return {p.stem: read_status(p) for p in sorted(directory.glob(f"{prefix}*.json"))}


@dataclass(frozen=True)
class TrainerProgress:
    """What the trainer has handled, as counts: the one place that says whether it is done.

    A trajectory is handled once the trainer has taken it into its buffer (to be trained on) or
    dead-lettered it; a task a sampler dead-lettered is done with too, since its trajectory never
    comes (sao/transport/dlq.py). Rank 0 counts the stream's messages; other ranks write only their
    steps. The trainer asks it when to stop and what a checkpoint stores; the feeder, the launcher,
    the report and `sao audit` read it back from the trainer's progress file (`from_status`),
    whose keys are its field names.
    """

    step: int = 0
    policy_version: int = 0  # the newest published (the progress file is written after a step's publish)
    trajectories_trained: int = 0  # in this life's applied steps
    consumed: int = 0  # this life: accepted into the buffer
    duplicates: int = 0  # this life: trajectory ids met before, dropped
    dead_lettered: int = 0  # this life: dead-lettered by the trainer, at intake or later from the buffer
    dead_lettered_from_buffer: int = 0  # of those, trajectories accepted first (counted in `consumed` too)
    too_stale: int = 0  # of those, dead-lettered as too stale
    tasks_dead_lettered: int = 0  # distinct task messages samplers dead-lettered whose trajectory never came here
    handled_before_start: int = 0  # handled by earlier lives of this run (the checkpoint's count)
    buffered: int = 0  # consumed, in the replay buffer, not trained on yet
    dlq_reasons: dict[str, int] = field(default_factory=dict)  # this life's dead letters, by reason
    task_dlq_reasons: dict[str, int] = field(default_factory=dict)  # `tasks_dead_lettered`, by reason
    finished: bool = False  # the run ended with every expected trajectory handled (what `sao audit` trusts)

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> TrainerProgress:
        """From a trainer progress file's fields; a missing field (no file yet) counts as zero."""
        return cls(**{f.name: status[f.name] for f in fields(cls) if f.name in status})

    @classmethod
    def read(cls, path: Path) -> TrainerProgress:
        return cls.from_status(read_status(path))

    def as_status(self) -> dict[str, Any]:
        """The fields of the progress file, under their own names."""
        return asdict(self)

    @property
    def handled(self) -> int:
        """Trajectories trained on, buffered or dead-lettered by the trainer, in every life; each
        counted once, however late it was dead-lettered."""
        return self.handled_before_start + self.consumed + self.dead_lettered - self.dead_lettered_from_buffer

    @property
    def done_with(self) -> int:
        """Trajectories handled, plus those that never come (their task was dead-lettered)."""
        return self.handled + self.tasks_dead_lettered

    def all_handled(self, expected: int | None) -> bool:
        """Every one of `expected` trajectories was handled, or never comes; never with no expectation."""
        return expected is not None and self.done_with >= expected

    def done(self, expected: int | None) -> bool:
        """All handled and nothing left in the buffer: the trainer stops, and the run is finished."""
        return self.all_handled(expected) and self.buffered == 0

    def released_batch_handled(self, batch_size: int) -> bool:
        """run.mode = sync: all of the batch the feeder released is here or dead-lettered, so the
        buffer is trained as it is.

        The feeder releases `batch_size` task copies at a time, the next only after this batch's
        step; so once the count done with is a whole multiple of it, nothing more is coming.
        """
        return self.buffered > 0 and self.done_with % batch_size == 0

    @property
    def settled(self) -> int:
        """Handled, less what is still buffered (a resume reads that again): what a checkpoint stores."""
        return self.handled - self.buffered

    def handled_since(self, checkpointed: int) -> bool:
        """Messages were settled (dead-lettered, with no step after) since a checkpoint that stored
        `checkpointed` as its count."""
        return self.settled > checkpointed

    @property
    def out_of_flight(self) -> int:
        """Task copies the feeder counts as no longer in flight: trained on or dead-lettered by the
        trainer in this life, or dead-lettered as a task by a sampler. A buffered trajectory is
        still in flight, so a sync batch is released only after the step that trained it."""
        return self.trajectories_trained + self.dead_lettered + self.tasks_dead_lettered


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
    token_nll: float | None = None  # mean -log pi of the sampled tokens (entropy estimate); None in older records
    kl_to_base: float | None = None  # k3 KL(current || base) on the sampled tokens; None: the base was not scored
    learning_rate: float | None = None  # the rate this step used; None in older records
    # Per trajectory, from `attempt_success`; empty in records written before they existed.
    first_attempt_success: list[float] = field(default_factory=list)  # 1.0 when the first attempt was right
    second_attempt_success: list[float | None] = field(default_factory=list)  # None: no second attempt

    @property
    def batch_size(self) -> int:
        return len(self.rewards)

    @property
    def busy_fraction(self) -> float:
        """Share of the step's wall time not spent waiting for data (1 = samplers keep up)."""
        total = self.wait_s + self.forward_backward_s + self.optimizer_s + self.publish_s
        return (total - self.wait_s) / total if total > 0 else 1.0


def attempt_success(step_rewards: list[float]) -> tuple[float, float | None]:
    """(first attempt right, second attempt right) of an episode, from its steps' rewards.

    In the retry envs (arithmetic, humaneval) only a right answer earns a positive reward (a retry
    with no new answer may earn a negative one: env.repeat_penalty), and a right answer ends the
    episode. The second is None when there was no second attempt: the first
    was right, or the episode had one step.
    """
    first = float(step_rewards[0] > 0) if step_rewards else 0.0
    if first or len(step_rewards) < 2:
        return first, None
    return first, float(step_rewards[1] > 0)


def trainer_steps(status: dict[str, Any]) -> list[StepRecord]:
    """The step records in a trainer progress file (oldest first)."""
    return [StepRecord(**record) for record in status.get("steps", [])]


def per_trajectory(steps: list[StepRecord], field_name: str) -> list:
    """One per-trajectory series of a run, in training order: e.g. `per_trajectory(steps, "rewards")`."""
    return [value for record in steps for value in getattr(record, field_name)]
