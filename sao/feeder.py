"""The task feeder of `sao run`: tasks onto `sao.tasks`, under backpressure from the trainer.

`sao feed` sends a fixed number of tasks at once; `sao run` tops up in waves so samplers never
run more than `in_flight_cap` trajectories ahead of the trainer, which bounds staleness instead
of producing work that goes stale. With `run.mode = "sync"` it releases one trainer batch at a
time instead, each stamped with the version it must be sampled with (the synchronous baseline).
"""

from __future__ import annotations

import time
from dataclasses import replace

from sao.config import SaoConfig
from sao.envs.registry import make_tasks
from sao.metrics import record_feed
from sao.schema import encode
from sao.transport.kafka import make_producer


class TasksNotAcknowledged(RuntimeError):
    """The broker did not acknowledge every task in time; the message names the broker."""


def in_flight_cap(config: SaoConfig) -> int:
    """Trajectories fed but not yet trained on, at most (never less than one task's copies).

    SAO: 3 batches. With 2 the samplers run at most one batch ahead, and a batch's sampling and
    training times each vary with what the policy writes, so a slow batch on one side idles the
    other; a third absorbs that, at staleness up to 2 (importance weights correct for it).
    GRPO: one batch, i.e. synchronous - the next batch is sampled only with the new policy.
    """
    default = config.trainer.batch_size * config.trainer.algorithm.batches_in_flight
    return max(config.run.max_trajectories_in_flight or default, config.trainer.algorithm.copies_per_task)


def feed_tasks(config: SaoConfig, bootstrap: str, count: int, start_index: int = 0, producer=None,
               policy_version: int = 0) -> int:
    """Produce tasks [start_index, start_index + count), each `trainer.algorithm.copies_per_task` times (acks=all),
    to be sampled with at least `policy_version`.

    Returns how many task messages (= trajectories to expect) were acknowledged.
    """
    producer = producer or make_producer(bootstrap)
    sent = 0
    for task in make_tasks(config.env, count, start_index):
        for copy in range(config.trainer.algorithm.copies_per_task):
            # the copy index makes the trajectory_id distinct
            message = replace(task, copy=copy, policy_version=policy_version)
            producer.produce(config.topics.tasks, value=encode(message), key=task.task_id)
            producer.poll(0)
            sent += 1
    undelivered = producer.flush(30)
    if undelivered:
        raise TasksNotAcknowledged(f"{undelivered} tasks were not acknowledged by the broker at {bootstrap}")
    return sent


class Feeder:
    """Feeds `run.num_tasks` tasks in waves, whole tasks at a time, as the trainer catches up."""

    def __init__(self, config: SaoConfig, bootstrap: str):
        self.config, self.bootstrap = config, bootstrap
        self.copies = config.trainer.algorithm.copies_per_task  # sao samples a task once, grpo group_size times
        self.total = config.run.num_tasks * self.copies  # trajectories the run will produce
        self.cap = in_flight_cap(config)
        self.producer = make_producer(bootstrap)
        self.fed = 0
        self.sync = config.run.mode == "sync"
        self.releases: list[dict] = []  # sync: each batch's release time, size and version, for the benchmark

    def top_up(self, handled: int, policy_version: int = 0) -> int:
        """Feed as many whole tasks as keep at most `cap` trajectories in flight, given how many
        the trainer has `handled` (`TrainerProgress.out_of_flight`); returns the messages sent.

        sync: the next trainer batch instead, only once all fed so far is handled. The trainer writes its
        progress file after the step's publish, so a file that counts the whole batch as handled also names
        the version that step published (`policy_version`, read together with `handled`): the new batch is
        stamped with it, and samplers wait for that version before they start a task of it.
        """
        if self.sync:
            room = self.config.trainer.batch_size if self.fed <= handled else 0
        else:
            room, policy_version = self.cap - (self.fed - handled), 0  # async stamps no version
        tasks = min(self.total - self.fed, room) // self.copies
        released_at = time.time()
        sent = feed_tasks(self.config, self.bootstrap, tasks, self.fed // self.copies, self.producer,
                          policy_version) if tasks > 0 else 0
        if self.sync and sent:
            self.releases.append({"released_at": released_at, "trajectories": sent, "policy_version": policy_version})
        self.fed += sent
        record_feed(sent, self.fed - handled)
        return sent
