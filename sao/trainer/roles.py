"""The trainer's two roles: rank 0 leads, every other rank follows.

The `Leader` (rank 0) is the one rank that talks to Kafka (its `LeaderIO`): it fills the replay
buffer from the trajectory stream and takes each batch from it, dead-letters what cannot be
trained on, commits offsets, and keeps the ledger (`trained.jsonl`) and the trajectory log. A
`Follower` gets each batch from rank 0 (`broadcast_batch`) and does none of that: its methods do
nothing. The loop calls either alike and never asks which rank it is on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict

from sao.config import SaoConfig
from sao.dead_letters import DeadLetterReason
from sao.run_dir import RunDir
from sao.schema import PolicyAnnouncement, Trajectory
from sao.status import TrainerProgress
from sao.trainer.archive import TrajectoryArchive
from sao.trainer.buffer import BufferEntry, ReplayBuffer
from sao.trainer.checkpoint import TrainerState
from sao.trainer.leader_io import LeaderIO
from sao.trainer.publisher import PolicyPublisher
from sao.trainer.training_step import StepOutcome

DeadLetters = list[tuple[Trajectory, DeadLetterReason, str]]


class Follower:
    """Rank > 0: trains on what rank 0 broadcasts; no broker, ledger, log or offsets of its own."""

    status_name = "trainer-rank"  # its progress file: trainer-rankN.json
    producer = None

    def next_batch(self, own: TrainerProgress, expected: int | None, version: int, stop: Callable[[], bool],
                   advantage_of: Callable[[Trajectory], float]) -> list[BufferEntry] | None:
        return None  # the batch, and whether to stop, come from rank 0

    def put_back(self, entries: list[BufferEntry] | None) -> None:
        pass

    def dead_letter(self, entries: list[BufferEntry] | None, dead_letters: DeadLetters) -> None:
        pass

    def trained(self, outcome: StepOutcome, entries: list[BufferEntry] | None, step: int, trained_version: int,
                learning_rate: float) -> None:
        pass

    def published(self, version: int, step: int, publisher: PolicyPublisher,
                  announcement: PolicyAnnouncement | None) -> None:
        pass

    def ledger(self, record: dict) -> None:
        pass

    def rolled_back(self, event: dict) -> None:
        pass

    def commit(self) -> None:
        pass

    def note_in(self, state: TrainerState) -> None:
        pass

    def handled_since(self, state: TrainerState) -> bool:
        return False

    def progress(self, own: TrainerProgress, expected: int | None = None) -> TrainerProgress:
        return own

    def finished(self, own: TrainerProgress, expected: int | None) -> bool:
        return False  # rank 0 says whether the run finished

    def in_flight(self) -> str:
        return "nothing buffered here (rank 0 holds the stream)"

    def status(self) -> dict:
        return {"wait_s": 0.0, "trajectory_log": None}

    def close(self) -> None:
        pass


class Leader(Follower):
    """Rank 0: the stream, the buffer, dead letters, commits, the ledger and the trajectory log."""

    status_name = "trainer"

    def __init__(self, config: SaoConfig, io: LeaderIO, buffer: ReplayBuffer, run_dir: RunDir,
                 archive: TrajectoryArchive | None, batch_size: int):
        self.config, self.io, self.buffer, self.run_dir = config, io, buffer, run_dir
        self.archive = archive  # None with trainer.keep_trajectory_log off
        self.batch_size = batch_size
        self.producer = io.producer
        if archive is not None:
            io.stream.on_message = archive.trajectory

    # --- consuming ------------------------------------------------------------------------

    def next_batch(self, own: TrainerProgress, expected: int | None, version: int, stop: Callable[[], bool],
                   advantage_of: Callable[[Trajectory], float]) -> list[BufferEntry]:
        """The next batch's buffer entries; empty when training should stop (`stop()`, or all expected handled)."""
        cfg, io = self.config.trainer, self.io
        while not (stop() or self.progress(own, expected).done(expected)):
            io.broker_watch.check()  # a broker gone for good (or replaced by an empty one) ends the run
            for entry in self.buffer.evict_stale(version, cfg.max_staleness):
                io.stream.dead_letter_stale(entry, version)
            progress = self.progress(own, expected)
            # sync: the feeder released one batch; once all of it is handled, nothing more comes before its step.
            released = self.config.run.mode == "sync" and progress.released_batch_handled(cfg.batch_size)
            entries = self._take(progress.all_handled(expected) or released, version, advantage_of)
            if entries:
                return entries
            for entry in io.stream.poll(self.batch_size, version, timeout=1.0):
                self.buffer.add(entry)
        return []

    def _take(self, all_arrived: bool, version: int, advantage_of: Callable[[Trajectory], float]) -> list[BufferEntry]:
        cfg, buffer = self.config.trainer, self.buffer
        if cfg.algorithm.group_baseline:
            copies = cfg.algorithm.copies_per_task
            entries = buffer.take_groups(self.batch_size // copies, copies, allow_fewer=all_arrived)
            if entries or not all_arrived:
                return entries
            # Everything arrived, yet no group is whole (a member was dead-lettered): train the rest.
            return buffer.take_groups(len(buffer), 1, allow_fewer=True)
        if len(buffer) >= self.batch_size or (all_arrived and len(buffer)):
            return buffer.take(self.batch_size, version, advantage_of)
        return []

    def put_back(self, entries: list[BufferEntry] | None) -> None:
        """A step stopped half-way: its batch goes back to the buffer, to be trained later."""
        self.buffer.put_back(entries)

    def dead_letter(self, entries: list[BufferEntry] | None, dead_letters: DeadLetters) -> None:
        """Dead-letter what the step could not train on, and drop it from the buffer for good."""
        by_id = {entry.trajectory.trajectory_id: entry for entry in entries or []}
        for trajectory, reason, detail in dead_letters:
            entry = by_id[trajectory.trajectory_id]
            self.io.stream.dead_letter_entry(entry, reason, detail)
            self.buffer.discard(entry)

    # --- the record of what trained -------------------------------------------------------

    def trained(self, outcome: StepOutcome, entries: list[BufferEntry] | None, step: int, trained_version: int,
                learning_rate: float) -> None:
        """A step taken (or skipped): into the trajectory log by partition and offset, and, applied, the ledger."""
        trajectories = outcome.plan.trajectories if outcome.plan is not None else []
        if self.archive is not None:
            where = {entry.trajectory.trajectory_id: (entry.partition, entry.offset) for entry in entries or []}
            self.archive.step(step if outcome.applied else None, trained_version,
                              [(entry.partition, entry.offset) for entry in entries or []],
                              [where[t.trajectory_id] for t in trajectories], outcome.applied, learning_rate,
                              outcome.passes, outcome.skipped_reason)
        if outcome.applied:
            self.ledger({"step": step, "policy_version": trained_version,
                         "trajectory_ids": [t.trajectory_id for t in trajectories]})

    def published(self, version: int, step: int, publisher: PolicyPublisher,
                  announcement: PolicyAnnouncement | None) -> None:
        if self.archive is not None:
            self.archive.published(version, step, publisher.last_state_sha256, announcement.sha256,
                                   publisher.last_tensor_sha256)

    def ledger(self, record: dict) -> None:
        """Append-only record of what each step trained on (audits exactly-once delivery)."""
        self.run_dir.root.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir.ledger, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def rolled_back(self, event: dict) -> None:
        self.ledger({"rollback": event})
        if self.archive is not None:
            self.archive.rollback(event)

    # --- where the stream stands ----------------------------------------------------------

    def commit(self) -> None:
        self.io.commit(self.buffer)

    def note_in(self, state: TrainerState) -> None:
        """Offsets, counts and the log's length into `state`: what a resume restarts from."""
        self.io.note_in(state, self.buffer)
        if self.archive is not None:
            state.trajectory_log_bytes = self.archive.durable_length()

    def handled_since(self, state: TrainerState) -> bool:
        """Messages were handled (dead-lettered: no step came after) since `state` was checkpointed."""
        return self.progress(TrainerProgress()).handled_since(state.handled)

    def progress(self, own: TrainerProgress, expected: int | None = None) -> TrainerProgress:
        return self.io.progress(len(self.buffer), own, expected)

    def finished(self, own: TrainerProgress, expected: int | None) -> bool:
        return self.progress(own, expected).done(expected)

    def in_flight(self) -> str:
        return (f"{len(self.buffer)} trajectories buffered and not trained on; last committed offsets "
                f"{self.io.committed_offsets or 'none in this life'}")

    def status(self) -> dict:
        # Seconds spent polling the trajectory topic.
        return {"wait_s": self.io.stream.counters.wait_s,
                "trajectory_log": asdict(self.archive.stats) if self.archive is not None else None}

    def close(self) -> None:
        self.io.close()
        if self.archive is not None:
            self.archive.close()
