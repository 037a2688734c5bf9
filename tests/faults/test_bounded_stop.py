"""A stop is bounded (issue 27): SIGTERM ends a `sao sampler` within a turn, even with long episodes live.

Before, a stopped sampler played every live episode to its end: with long-horizon episodes that is
hundreds of turns after the signal. Now it abandons them after the current turn, and leaves their
task offsets uncommitted so the group rolls them out again: nothing is lost.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from confluent_kafka import Consumer, TopicPartition

from sao.feeder import feed_tasks
from sao.run_dir import RunDir
from sao.transport.kafka import read_all
from support.fault_runs import on_own_topics, sampler_command, write_toml

STOP_BOUND_S = 30  # one turn of the tiny model, then leaving the group; the episodes alone need minutes
START_BOUND_S = 240


def _live_episodes(status) -> list:
    try:
        return json.loads(status.read_text()).get("live_episodes", [])
    except (OSError, ValueError):
        return []


@pytest.mark.slow
def test_sigterm_stops_a_sampler_within_a_turn_and_its_live_tasks_stay_uncommitted(
        kafka_bootstrap, unique_topic_prefix, tiny_config, tmp_path, spawn):
    config = on_own_topics(tiny_config, kafka_bootstrap, unique_topic_prefix)
    config.env.name, config.env.max_turns = "textworld", 2000
    config.env.options = {"max_steps": 2000}
    config.sampler.rollout_batch = 2
    fed = feed_tasks(config, kafka_bootstrap, 2)
    run_dir = RunDir(tmp_path / "run")
    run_dir.policy_dir.mkdir(parents=True)
    log = tmp_path / "sampler.log"
    process = spawn(sampler_command(write_toml(config, tmp_path / "sao.toml"), run_dir.root, "s-stop"), log)
    status = run_dir.status("s-stop")
    deadline = time.time() + START_BOUND_S
    while len(_live_episodes(status)) < fed and process.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert len(_live_episodes(status)) == fed, log.read_text()[-3000:]
    time.sleep(3)  # a few turns in

    signalled = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(STOP_BOUND_S) == 0, log.read_text()[-3000:]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the sampler did not stop within {STOP_BOUND_S} s of SIGTERM: {log.read_text()[-2000:]}")
    stopped_s = time.perf_counter() - signalled
    assert "abandoned" in log.read_text(), log.read_text()[-2000:]
    assert read_all(kafka_bootstrap, config.topics.trajectories, timeout=5) == []  # no episode was finished

    # Nothing was committed past the abandoned tasks: the group starts them again.
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": config.topics.sampler_group})
    try:
        committed = consumer.committed([TopicPartition(config.topics.tasks, 0)], timeout=30)
    finally:
        consumer.close()
    assert committed[0].offset < 1, (committed, stopped_s)  # unset (negative) or 0
