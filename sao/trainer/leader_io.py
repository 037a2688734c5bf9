"""Rank 0's broker I/O: trajectory stream, dead letters, producer, broker watch, commits, stream state.

Only rank 0 of the trainer talks to Kafka; the other ranks receive each batch from it
(`broadcast_batch`). So the loop holds one `LeaderIO` on rank 0 and None elsewhere. It also
counts what came from the broker (`progress`) and writes where the stream stands into the
trainer's checkpoint state (`note_in`), since both are read from the stream.
"""

from __future__ import annotations

from dataclasses import replace

from sao.config import SaoConfig
from sao.run_dir import RunDir
from sao.status import TrainerProgress
from sao.trainer.buffer import ReplayBuffer
from sao.trainer.checkpoint import TrainerState
from sao.trainer.run_cluster import bind_run_to_cluster
from sao.trainer.trajectory_stream import TrajectoryStream
from sao.trainer.validation import TrajectoryValidator
from sao.transport.dlq import DeadLetteredTasks, DeadLetterQueue
from sao.transport.health import BrokerWatch
from sao.transport.kafka import RenewingProducer


class LeaderIO:
    def __init__(self, broker_watch: BrokerWatch, producer: RenewingProducer, stream: TrajectoryStream,
                 dead_tasks: DeadLetteredTasks, handled_before_start: int):
        self.broker_watch = broker_watch
        self.producer = producer
        self.stream = stream
        # Tasks samplers dead-lettered: their trajectories never come, yet they count as handled.
        self.dead_tasks = dead_tasks
        self.handled_before_start = handled_before_start  # trained or dead-lettered by earlier lives
        self.committed_offsets: dict[int, int] = {}  # this life's last commit, named if the broker is lost

    @classmethod
    def open(cls, config: SaoConfig, bootstrap: str, run_dir: RunDir, state: TrainerState,
             restored: TrainerState | None, resume: bool, validator: TrajectoryValidator) -> LeaderIO:
        """Rank 0's clients, started from `state` (a restored checkpoint's, or a fresh one)."""
        broker_watch = _watch_broker(bootstrap, config, run_dir, restored, resume)
        producer = RenewingProducer(bootstrap, broker_watch)
        # Resumed where `state` says when it was restored from a checkpoint.
        stream = TrajectoryStream(bootstrap, config.topics.trajectories, DeadLetterQueue(producer, config.topics.dlq),
                                  config.trainer.max_staleness, validator,
                                  state.offsets if restored is not None else None, set(state.seen_trajectory_ids),
                                  config.topics.trainer_group, state.dead_lettered_offsets, config.broker.fetch_wait_ms)
        dead_tasks = DeadLetteredTasks(bootstrap, config.topics.dlq, config.topics.tasks)
        return cls(broker_watch, producer, stream, dead_tasks, state.handled)

    def progress(self, buffered: int, own: TrainerProgress | None = None,
                 expected: int | None = None) -> TrainerProgress:
        """`own` (the loop's steps) with the stream's counts, the tasks samplers dead-lettered and
        `buffered`, what the replay buffer holds.

        While `expected` trajectories are not all handled, the dead letters that arrived since the
        last refresh are read first; the dead-letter topic is read every few seconds at most.
        """
        progress = self._counted(own or TrainerProgress(), buffered)
        if expected is not None and not progress.all_handled(expected):
            self.dead_tasks.refresh()
            progress = self._counted(own or TrainerProgress(), buffered)
        return progress

    def _counted(self, own: TrainerProgress, buffered: int) -> TrainerProgress:
        # A dead-lettered task whose trajectory was met here counts as that trajectory only.
        task_reasons = self.dead_tasks.reasons(self.stream.seen_ids)
        return replace(own, **self.stream.counters.counts(), tasks_dead_lettered=sum(task_reasons.values()),
                       task_dlq_reasons=task_reasons, handled_before_start=self.handled_before_start, buffered=buffered)

    def safe_offsets(self, buffer: ReplayBuffer) -> dict[int, int]:
        return self.stream.safe_offsets(buffer.low_water_marks())

    def commit(self, buffer: ReplayBuffer) -> None:
        """Commit the offsets below which nothing is left in `buffer`."""
        offsets = self.safe_offsets(buffer)
        self.broker_watch.retry(lambda: self.stream.commit(offsets), "commit trajectory offsets")
        self.committed_offsets = offsets

    def note_in(self, state: TrainerState, buffer: ReplayBuffer) -> None:
        """Where the trajectory stream stands, into `state` (what a resume restarts from)."""
        held = buffer.held_ids()
        state.offsets = self.safe_offsets(buffer)
        state.dead_lettered_offsets = self.stream.dead_lettered_above(state.offsets)
        state.broker_cluster_id = self.broker_watch.cluster_id
        # Buffered trajectories will be re-read after a resume, so they must not count as seen.
        state.seen_trajectory_ids = sorted(self.stream.seen_ids - held)
        state.handled = self.progress(len(buffer)).settled

    def close(self) -> None:
        self.stream.close()
        self.dead_tasks.close()
        self.producer.flush(10)
        self.broker_watch.close()


def _watch_broker(bootstrap: str, config: SaoConfig, run_dir: RunDir, restored: TrainerState | None,
                  resume: bool) -> BrokerWatch:
    """The broker watch, once this run is known to belong to the broker's cluster."""
    broker_watch = BrokerWatch(bootstrap, "trainer", config.broker.loss_timeout_s)
    if restored is not None:  # its offsets mean nothing in another cluster's (empty) log
        broker_watch.expect_cluster(restored.broker_cluster_id, f"checkpoint step {restored.step}")
    bind_run_to_cluster(run_dir, broker_watch, resume)  # with or without a checkpoint, another cluster is refused
    return broker_watch
