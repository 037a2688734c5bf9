"""The feeder through a real broker: async tops up to its cap; sync releases one batch at a time,
stamped with the version it must be sampled with, and nothing before the trainer has handled it."""

from sao.config import GrpoAlgorithm
from sao.feeder import Feeder, in_flight_cap
from sao.schema import Task, decode
from sao.transport.kafka import read_all
from sao.transport.topics import ensure_topics


def _config(tiny_config, prefix: str, mode: str):
    config = tiny_config.model_copy(deep=True)
    config.topics.tasks = f"{prefix}.tasks"
    config.run.mode, config.run.num_tasks, config.trainer.batch_size = mode, 10, 4
    return config


def _tasks(bootstrap: str, topic: str) -> list[Task]:
    return sorted((decode(m.value(), Task) for m in read_all(bootstrap, topic, timeout=10)),
                  key=lambda task: int(task.task_id.rsplit("/", 1)[1]))


def test_sync_releases_one_stamped_batch_only_once_the_last_is_handled(kafka_bootstrap, unique_topic_prefix,
                                                                       tiny_config):
    config = _config(tiny_config, unique_topic_prefix, "sync")
    ensure_topics(kafka_bootstrap, {config.topics.tasks: 2})
    feeder = Feeder(config, kafka_bootstrap)
    assert feeder.top_up(handled=0, policy_version=0) == 4
    # Until the trainer has handled the whole batch (trained on it, then published), nothing more.
    for handled in (0, 1, 3):
        assert feeder.top_up(handled=handled, policy_version=0) == 0
    assert feeder.top_up(handled=4, policy_version=1) == 4
    assert feeder.top_up(handled=7, policy_version=1) == 0
    assert feeder.top_up(handled=8, policy_version=2) == 2  # the last, smaller batch
    assert feeder.top_up(handled=10, policy_version=3) == 0  # all fed
    tasks = _tasks(kafka_bootstrap, config.topics.tasks)
    assert [task.policy_version for task in tasks] == [0] * 4 + [1] * 4 + [2] * 2
    assert [(r["trajectories"], r["policy_version"]) for r in feeder.releases] == [(4, 0), (4, 1), (2, 2)]


def test_async_keeps_three_batches_in_flight_and_stamps_no_version(kafka_bootstrap, unique_topic_prefix, tiny_config):
    config = _config(tiny_config, unique_topic_prefix, "async")
    config.run.num_tasks = 20
    ensure_topics(kafka_bootstrap, {config.topics.tasks: 2})
    feeder = Feeder(config, kafka_bootstrap)
    assert feeder.top_up(handled=0, policy_version=5) == 12  # 3 x trainer.batch_size
    assert feeder.top_up(handled=1, policy_version=5) == 1
    assert feeder.top_up(handled=1, policy_version=5) == 0
    assert [task.policy_version for task in _tasks(kafka_bootstrap, config.topics.tasks)] == [0] * 13
    assert feeder.releases == []


def test_the_in_flight_cap_is_three_batches_for_sao_one_for_grpo_and_never_below_a_task(tiny_config):
    config = tiny_config.model_copy(deep=True)
    config.trainer.batch_size = 8
    assert in_flight_cap(config) == 24  # samplers may run two batches ahead of the step in progress
    config.run.max_trajectories_in_flight = 5
    assert in_flight_cap(config) == 5  # the knob wins
    config.run.max_trajectories_in_flight = None
    config.trainer.algorithm = GrpoAlgorithm(group_size=4)
    assert in_flight_cap(config) == 8  # one batch: synchronous
    config.run.max_trajectories_in_flight = 2
    assert in_flight_cap(config) == 4  # never less than one task's group
