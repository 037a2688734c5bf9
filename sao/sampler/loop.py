"""The sampler process: consume tasks, roll out one trajectory each, compress, produce, commit.

A task offset is committed only after its trajectory is acknowledged by the broker (and only
below the oldest task still running on that partition), so a sampler that dies mid-task leaves
the task to another member of the "sao-samplers" group (the trainer drops the duplicate by
trajectory_id if both finish). Tasks finished above that offset travel in the commit's metadata,
and the partition's next owner skips them (sao/sampler/offsets.py). New policy versions are loaded between trajectories, never
during one.
"""

from __future__ import annotations

import logging
import signal
import time
import zlib
from pathlib import Path

import torch
from confluent_kafka import KafkaException

from sao.config import SaoConfig
from sao.dead_letters import DeadLetterReason
from sao.envs.guard import EnvFailure
from sao.envs.registry import task_env
from sao.metrics import (
    SAMPLER_VERSIONS_BEHIND,
    record_announcement_refused,
    record_delivery,
    record_policy_reload,
    record_rollout,
    record_sampler_start,
)
from sao.policy.weights import WeightsMismatch
from sao.sampler.admission import Admission
from sao.sampler.offsets import OffsetTracker
from sao.sampler.ordering import StartOrder
from sao.sampler.outbox import Outbox
from sao.sampler.rollout import LiveEpisode, Roller
from sao.sampler.weight_source import announce_key_reader, weight_source
from sao.sampler.weight_sync import Resync, WeightSync
from sao.schema import PolicyAnnouncement, SchemaError, Task, Trajectory, decode, encode
from sao.status import process_usage, write_status
from sao.transport.announcements import PolicyFollower
from sao.transport.dlq import DeadLetterQueue
from sao.transport.health import BrokerGone, BrokerWatch
from sao.transport.kafka import MAX_MESSAGE_BYTES, TASK_CONSUMER_SETTINGS, RenewingProducer, make_consumer
from sao.transport.lag import LagReporter

log = logging.getLogger(__name__)

# Room for the record framing and sao's headers in a message the sampler produces.
_PRODUCE_HEADROOM_BYTES = 64 * 1024


def sampling_seed(sampler_id: str, seed: int) -> int:
    """The seed of a sampler's draws: stable across processes (unlike hash()), its own per sampler id and per
    `sampler.seed`, and at seed 0 the id's crc32 alone. 32 bits: torch's CPU generator uses no more."""
    return zlib.crc32(sampler_id.encode(), seed)


class Sampler:
    """One `sao sampler` process: its policy copy, its live episodes and its Kafka clients."""

    def __init__(self, config: SaoConfig, bootstrap: str, sampler_id: str, status_path: Path | None = None):
        torch.set_num_threads(config.sampler.threads(config.run.mode))
        self.config = config
        self.sampler_id = sampler_id
        self.status_path = status_path
        self.roller = Roller.from_config(config, sampler_id, sampling_seed(sampler_id, config.sampler.seed))
        self.policy = self.roller.policy
        # The version and published state it holds, and how a new version's files (whole or delta) bring it there.
        self.weight_sync = WeightSync(self.policy)
        record_sampler_start()
        self.env_name = task_env(config.env.name)  # the `env` its tasks carry (None: a plugin unknown here)
        self.counters = {"produced": 0, "dead_lettered": 0, "reloads": 0, "refused": 0, "reward_sum": 0.0,
                         "skipped_done": 0, "tokens": 0, "rollout_s": 0.0, "reload_s": 0.0, "engine_push_s": 0.0,
                         "idle_s": 0.0, "run_s": 0.0}  # idle: no live episode (waiting for tasks or a reload)
        # Announced weights come only from here: the policy folder or the weights topic (policy.transport).
        self.weights_source = weight_source(config, bootstrap)
        # Only announcements signed with the run's key are read; the key is read when needed.
        key = announce_key_reader(config, self.weights_source)
        self.policy_follower = PolicyFollower(bootstrap, config.topics.policy, config.sampler.max_version_jump,
                                              key=key, fetch_wait_ms=config.broker.fetch_wait_ms)
        self.missing_refused: set[int] = set()  # versions refused for a missing file (retried; said once)
        self.behind = False  # more than trainer.max_staleness versions behind the newest announced (said once)
        self.broker_watch = BrokerWatch(bootstrap, sampler_id, config.broker.loss_timeout_s)
        self.producer = RenewingProducer(bootstrap, self.broker_watch)
        self.dlq = DeadLetterQueue(self.producer, config.topics.dlq)
        self.outbox = Outbox(self.producer, config.topics.trajectories)
        self.offsets = OffsetTracker()
        self.tasks = make_consumer(bootstrap, config.topics.sampler_group, fetch_wait_ms=config.broker.fetch_wait_ms,
                                   **TASK_CONSUMER_SETTINGS)
        self.tasks.subscribe([config.topics.tasks], on_assign=self._assigned, on_revoke=self._revoked)
        self.task_lag = LagReporter(self.tasks, config.topics.sampler_group)
        self.pending: PolicyAnnouncement | None = None  # announced, loaded once no episode is live
        self.admission = Admission(config.sampler.rollout_batch)  # `run` sets its max_tasks
        self.start_order = StartOrder() if config.sampler.publish_in_order else None
        self.stopping = False

    @property
    def policy_dir(self) -> Path | None:
        """The trainer's policy folder this sampler reads (None: none, as with policy.transport = kafka)."""
        return self.weights_source.policy_dir

    @property
    def policy_version(self) -> int:
        return self.weight_sync.version

    def run(self, max_tasks: int | None = None) -> dict:
        """Loop until stopped (SIGTERM/SIGINT) or `max_tasks` tasks are handled.

        A stop waits for the current turn at most: live episodes are abandoned with their task
        offsets uncommitted, so the group rolls those tasks out again (here after a restart, or
        on another sampler after the rebalance).

        Continuous batching: up to `sampler.rollout_batch` episodes run side by side, one turn of
        each per batched generation, and a slot is refilled with a new task as soon as its
        episode ends. A new policy version is loaded only when no episode is live (admission
        pauses until then), so every trajectory comes from one behaviour version.
        """
        signal.signal(signal.SIGTERM, self._stop)
        self.admission.max_tasks = max_tasks
        live: list[tuple[LiveEpisode, object]] = []  # (episode, its task message)
        run_started = time.perf_counter()
        try:
            while not self.stopping and (live or self.admission.is_open(self.stopping)):
                idle_from = None if live else time.perf_counter()
                self.broker_watch.check()  # a broker gone for good (or replaced by an empty one) ends the loop
                self._follow_policy(reload_now=not live)
                self._admit(live)
                live += self._start(self._ready(live))
                if live and idle_from is not None:  # idle until this iteration's tasks started
                    self.counters["idle_s"] += time.perf_counter() - idle_from
                    idle_from = None
                if live:
                    outcomes = self.roller.take_turn([episode for episode, _ in live])
                    for (episode, msg), outcome in zip(live, outcomes):
                        if outcome is not None:
                            self._finish(msg, episode.task, outcome)
                    live = [entry for entry, outcome in zip(live, outcomes) if outcome is None]
                self.outbox.poll()  # acknowledged trajectories finish their tasks
                self._commit()
                if idle_from is not None:
                    self.counters["idle_s"] += time.perf_counter() - idle_from
                self.counters["run_s"] = time.perf_counter() - run_started
                self._write_status(live=live)
            if live:
                log.warning("stopped: %d live episode(s) abandoned, their tasks left uncommitted for the group to "
                            "roll out again: %s", len(live), [episode.task.task_id for episode, _ in live])
            for hand_on in self.start_order.waiting() if self.start_order is not None else ():
                hand_on()  # finished episodes that waited for an abandoned one
            self.outbox.drain()
            self._commit()
        except BrokerGone as gone:
            gone.in_flight = self._in_flight(live)
            raise
        finally:
            self._write_status(finished=True)
            self.close()
        return self.counters

    def close(self) -> None:
        """Leave the group, flush what is queued, stop the broker probe (its thread outlives us otherwise)."""
        self.tasks.close()
        self.policy_follower.close()
        self.weights_source.close()
        self.producer.flush(10)
        self.broker_watch.close()

    def _in_flight(self, live: list[tuple[LiveEpisode, object]]) -> str:
        """What this sampler held: episodes whose task offsets are uncommitted, messages not acknowledged."""
        held = self.start_order.held if self.start_order is not None else 0
        return (f"{len(live)} live episode(s), tasks {[episode.task.task_id for episode, _ in live]}, and {held} "
                f"finished one(s) waiting for them (their offsets are not committed); {len(self.admission.held)} "
                f"task(s) held for a policy version, not started; "
                f"unacknowledged messages (topic, key): {self.producer.unacknowledged()}")

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _admit(self, live: list[tuple[LiveEpisode, object]]) -> None:
        """Take as many tasks as admission has room for; they are held until `_ready` starts them."""
        room = self.admission.room(len(live), self.stopping, version_pending=self.pending is not None)
        if not room:
            return
        taken, tasks = self._take(room, wait=not live)
        if tasks and not live:
            # A version announced while this sampler waited for tasks is used for them.
            self._follow_policy(reload_now=True)
        self.admission.took(taken, tasks)

    def _take(self, count: int, wait: bool) -> tuple[int, list[tuple[Task, object]]]:
        """Up to `count` task messages: (how many were taken, the decodable tasks with their message)."""
        messages = self.tasks.consume(num_messages=count, timeout=0.5 if wait else 0)
        self.task_lag.maybe_report()
        tasks = []
        taken = 0
        for msg in messages:
            if msg.error() is not None:
                log.warning("tasks topic: %s", msg.error())
                continue
            if self.offsets.already_done(msg.topic(), msg.partition(), msg.offset()):
                self.counters["skipped_done"] += 1  # delivered already (or running here): not run twice
                continue
            taken += 1
            self.offsets.started(msg.topic(), msg.partition(), msg.offset())
            try:
                task = self._decode_task(msg)
            except SchemaError as err:
                self._dead_letter(msg, err.reason, str(err))
                continue
            record_delivery(msg.topic(), task.created_at, len(msg.value()))
            tasks.append((task, msg))
        return taken, tasks

    def _decode_task(self, msg) -> Task:
        """The task of `msg`, dead-lettered (SchemaError) before any work if it is too large or for another env."""
        size = len(msg.value() or b"") + len(msg.key() or b"")
        if size > self.config.sampler.max_task_bytes:  # before decoding: the cost of a huge message is in reading it
            raise SchemaError(DeadLetterReason.TOO_LARGE, "value", f"{size} bytes (value and key) is over "
                              f"sampler.max_task_bytes ({self.config.sampler.max_task_bytes})")
        task = decode(msg.value(), Task)
        if self.env_name is not None and task.env != self.env_name:  # the trainer would dead-letter its trajectory
            raise SchemaError(DeadLetterReason.WRONG_ENV, "env",
                              f"{task.env[:100]!r} is not this sampler's env ({self.env_name!r})")
        return task

    def _ready(self, live: list[tuple[LiveEpisode, object]]) -> list[tuple[Task, object]]:
        """The held tasks whose policy version is loaded; the rest stay held (admission pauses).

        A task released for a newer version (run.mode = sync) is never sampled with an older one:
        once no episode is live, the sampler waits for that version, since the tasks can arrive
        before their announcement does. A version that cannot come fails its tasks (dead letters).
        """
        for version in self.admission.versions_to_await(len(live), self.policy_version):
            problem = self._await_version(version)
            if problem is None:
                continue
            for task, msg in self.admission.give_up(version):
                self._dead_letter(msg, DeadLetterReason.VERSION_NOT_LOADED,
                                  f"task {task.task_id}: policy v{version} {problem}; "
                                  f"{self.sampler_id} has v{self.policy_version}")
        return self.admission.release(self.policy_version)

    def _await_version(self, version: int) -> str | None:
        """Load `version` (or a newer one); None once loaded, else why it cannot be (said loudly).

        Tasks are untrusted input: an implausible version fails at once, any other after
        `sampler.version_wait_s`, so that no task can hold a sampler for longer.
        """
        problem = self.policy_follower.implausible(version) if version > self.policy_version else None
        deadline = time.monotonic() + self.config.sampler.version_wait_s
        while problem is None and self.policy_version < version:
            if time.monotonic() > deadline:
                problem = (f"was not loadable within sampler.version_wait_s = {self.config.sampler.version_wait_s:g} s "
                           f"(is the trainer publishing into {self.policy_dir or self.config.topics.weights}? see its log "
                           "and this sampler's refusals)")
                break
            self.broker_watch.check()
            self.policy_follower.poll(0.1)  # blocks briefly until an announcement arrives
            self._follow_policy(reload_now=True)
        if problem is not None:
            log.error("%s: tasks released for policy v%d are dead-lettered, not sampled with v%d: v%d %s",
                      self.sampler_id, version, self.policy_version, version, problem)
        return problem

    def _start(self, tasks: list[tuple[Task, object]]) -> list[tuple[LiveEpisode, object]]:
        """Episodes of `tasks` under the current policy version; a failed env reset is dead-lettered."""
        started = []
        for task, msg in tasks:
            episode = self.roller.start(task, self.policy_version)
            if isinstance(episode, EnvFailure):
                self._hand_on(msg, task, episode)  # no episode, so nothing to keep in order
                continue
            if self.start_order is not None:
                self.start_order.started(_message_key(msg))
            started.append((episode, msg))
        return started

    def _finish(self, msg, task: Task, outcome: Trajectory | EnvFailure) -> None:
        """An episode ended: hand it on now, or once every episode started before it has left
        (`sampler.publish_in_order`, sao/sampler/ordering.py)."""
        if self.start_order is None:
            self._hand_on(msg, task, outcome)
            return
        for hand_on in self.start_order.finished(_message_key(msg), lambda: self._hand_on(msg, task, outcome)):
            hand_on()

    def _hand_on(self, msg, task: Task, outcome: Trajectory | EnvFailure) -> None:
        """Hand a finished task on: its trajectory to the trainer (queued), or its failure to the DLQ."""
        if isinstance(outcome, EnvFailure):
            # The env raised or hung: this task ends here, the sampler goes on.
            self._dead_letter(msg, outcome.reason, str(outcome))
        else:  # finished once the broker has it (`_delivered`); the live episodes go on meanwhile
            value = encode(outcome)
            size = len(value) + len(task.task_id.encode())
            if size <= MAX_MESSAGE_BYTES - _PRODUCE_HEADROOM_BYTES:
                self.outbox.send(value, task.task_id, lambda ack_s: self._delivered(msg, outcome, ack_s))
                return
            # The producer would refuse it and raise: the task goes to the DLQ instead, and the sampler goes on.
            self._dead_letter(msg, DeadLetterReason.TOO_LARGE,
                              f"task {task.task_id[:100]!r}: its trajectory would be {size} bytes "
                              f"with its key, over the broker's message limit ({MAX_MESSAGE_BYTES})")

    def _delivered(self, msg, trajectory: Trajectory, ack_s: float) -> None:
        """The broker acknowledged `trajectory`: its task is finished and its offset may be committed."""
        record_rollout(trajectory, ack_s)
        self.counters["produced"] += 1
        self.counters["reward_sum"] += trajectory.total_reward
        self.counters["tokens"] += sum(len(s.action_ids) for s in trajectory.steps)
        self.counters["rollout_s"] += trajectory.timings["rollout_s"]
        self.offsets.finished(*_message_key(msg))

    def _assigned(self, consumer, partitions: list) -> None:
        """Learn which tasks of newly assigned partitions a former owner already delivered (the
        commit's metadata, see sao/sampler/offsets.py), so that they are skipped, not redone."""
        if not partitions:  # a cooperative rebalance that gave this sampler nothing new
            return
        try:
            committed = consumer.committed(partitions, timeout=10)
        except KafkaException as err:  # they are merely redone
            log.warning("%s could not read committed task offsets: %s", self.sampler_id, err)
            return
        for tp in committed:
            self.offsets.assigned(tp.topic, tp.partition, tp.offset, tp.metadata)

    def _revoked(self, _consumer, partitions: list) -> None:
        for tp in partitions:
            self.offsets.revoked(tp.topic, tp.partition)

    def _commit(self) -> None:
        """Commit every partition up to its oldest unfinished task (trajectories acked, dead letters flushed),
        with the tasks finished above it in the commit's metadata."""
        offsets = self.offsets.committable()
        if not offsets or not self.broker_watch.is_up:  # while the broker is away they wait for it
            return
        self.dlq.flush(10)
        try:
            self.tasks.commit(offsets=offsets, asynchronous=False)
            self.offsets.committed(offsets)
        except KafkaException as err:
            # A partition moved to another sampler during the rollouts (a rebalance): those tasks
            # run again there, and the trainer drops the duplicates by trajectory_id.
            log.warning("%s could not commit task offsets: %s", self.sampler_id, err)

    def _dead_letter(self, msg, reason: DeadLetterReason, detail: str) -> None:
        """Send a task message to the DLQ: its task is finished, so its offset may be committed."""
        value, key = msg.value(), msg.key()
        if len(value or b"") + len(key or b"") > MAX_MESSAGE_BYTES - _PRODUCE_HEADROOM_BYTES:
            # The producer would refuse it (and raise): keep the why and the where instead.
            detail += (f"; the original message is over what the dead-letter topic carries and stays at "
                       f"{msg.topic()}[{msg.partition()}]@{msg.offset()}")
            value = key = None
        self.dlq.send(value, reason, source_topic=msg.topic(), partition=msg.partition(),
                      offset=msg.offset(), key=key, detail=detail)
        self.counters["dead_lettered"] += 1
        self.offsets.finished(*_message_key(msg))

    def _follow_policy(self, reload_now: bool) -> None:
        """Note the newest version on offer; load it once no episode is live (`reload_now`).

        Its path is checked on arrival (a refused one never pauses admission), its file at load.
        A refused announcement is logged once and not read again (a missing file is tried again
        later); the follower offers the newest version below it instead, and meanwhile the sampler
        goes on with its current policy.
        """
        announcement = self.policy_follower.poll()
        self._check_lag()
        if (announcement is not None and announcement.policy_version > self.policy_version
                and announcement is not self.pending):
            try:
                self.weights_source.check(announcement, self.config.sampler.max_weights_bytes)
                self.pending = announcement
            except WeightsMismatch as err:
                self._refuse(announcement, err)
        if self.pending is None or not reload_now:
            return
        target, self.pending = self.pending, None
        try:
            chain = self.weight_sync.chain_to(target, self.policy_follower.announced)
        except WeightsMismatch as err:
            self._refuse(target, err)
            return
        loaded = []
        for announcement in chain:  # a snapshot or the held version first, then deltas in order
            if not self._load(announcement):
                break
            loaded.append(announcement)
        if loaded:  # a vLLM engine follows the policy once per chain, to the version the policy now holds
            engine_s = self.roller.weights_changed()
            self.counters["reload_s"] += engine_s  # reload_s: everything a version costs, the push included
            self.counters["engine_push_s"] += engine_s
            if self.roller.engine is not None:
                log.info("%s pushed policy v%d into its vLLM engine in %.2f s", self.sampler_id, self.policy_version,
                         engine_s)

    def _load(self, announcement: PolicyAnnouncement) -> bool:
        """Bring the policy to `announcement`'s version with its file (whole, or a delta in place); whether it did."""
        started = time.perf_counter()
        max_bytes = self.config.sampler.max_weights_bytes
        try:
            with self.weights_source.opened(announcement, max_bytes) as path:
                self.weight_sync.apply(announcement, path, max_bytes=max_bytes)
        except Resync as err:  # not refused: offered again, after the snapshot it now needs
            record_announcement_refused(err.reason)
            self.counters["refused"] += 1
            log.warning("%s dropped its weights for policy v%d (%s): %s", self.sampler_id,
                        announcement.policy_version, err.reason, err)
            return False
        except (OSError, WeightsMismatch) as err:
            self._refuse(announcement, err)
            return False
        self.policy_follower.loaded(announcement.policy_version)
        self.missing_refused = {v for v in self.missing_refused if v > announcement.policy_version}
        reload_s = time.perf_counter() - started
        self.counters["reloads"] += 1
        self.counters["reload_s"] += reload_s
        record_policy_reload(self.policy_version, reload_s)
        log.info("%s loaded policy v%d (%s) in %.1f s", self.sampler_id, self.policy_version, announcement.kind,
                 reload_s)
        return True

    def _check_lag(self) -> None:
        """Say loudly (log, metric) when this sampler is more than trainer.max_staleness versions behind the newest
        authentic announcement: everything it produces then is dead-lettered as too-stale."""
        newest = self.policy_follower.newest_read
        behind = 0 if newest is None else max(0, newest - self.policy_version)
        SAMPLER_VERSIONS_BEHIND.labels(sampler=self.sampler_id).set(behind)
        limit = self.config.trainer.max_staleness
        if behind > limit and not self.behind:
            log.error("%s is %d policy versions behind the newest announced (v%d, it has v%d), over "
                      "trainer.max_staleness = %d: the trainer will dead-letter its trajectories as too-stale. "
                      "See this sampler's refusals above (weights folder readable? files pruned too soon?)",
                      self.sampler_id, behind, newest, self.policy_version, limit)
        elif behind <= limit and self.behind:
            log.warning("%s caught up: v%d, %d behind the newest announced", self.sampler_id, self.policy_version,
                        behind)
        self.behind = behind > limit

    def _refuse(self, announcement: PolicyAnnouncement, err: OSError | WeightsMismatch) -> None:
        """Skip an announcement: its file unreadable or unsafe (for good), or not there (tried again later: not
        written yet where this sampler reads it, or pruned before this lagging sampler got to it)."""
        reason = getattr(err, "reason", "missing" if isinstance(err, FileNotFoundError) else "unreadable")
        self.policy_follower.refused(announcement.policy_version, missing=reason == "missing")
        record_announcement_refused(reason)
        said = reason == "missing" and announcement.policy_version in self.missing_refused
        if reason == "missing":
            self.missing_refused.add(announcement.policy_version)
        if said or (reason == "no-policy-dir" and self.counters["refused"]):  # said once is enough
            log.debug("%s refused policy v%d: %s", self.sampler_id, announcement.policy_version, err)
        else:
            log.warning("%s refused policy v%d (%s): %s; it goes on with policy v%d%s", self.sampler_id,
                        announcement.policy_version, reason, err, self.policy_version,
                        ", and will refuse every later version too" if reason == "no-policy-dir" else "")
        self.counters["refused"] += 1

    def _write_status(self, finished: bool = False, live: list[tuple[LiveEpisode, object]] = ()) -> None:
        if self.status_path is not None:
            write_status(self.status_path, {**self.counters, **process_usage(), "sampler_id": self.sampler_id,
                                            "policy_version": self.policy_version, "finished": finished,
                                            "live_episodes": _live_episodes(live)})


def _live_episodes(live: list[tuple[LiveEpisode, object]]) -> list[dict]:
    """The episodes running now and when each started (unix time): what a crash now would throw away
    (benchmarks/recovery.py measures it)."""
    now, clock = time.time(), time.perf_counter()
    return [{"task_id": episode.task.task_id, "copy": episode.task.copy,
             "started_at": now - (clock - episode.started)} for episode, _ in live]


def _message_key(msg) -> tuple[str, int, int]:
    """A task message's place in the log: what tells one started episode from another."""
    return msg.topic(), msg.partition(), msg.offset()
