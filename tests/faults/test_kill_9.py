"""kill -9 of a sampler, of the trainer and of a durable broker, then a restart: each run ends with a
clean `sao audit --finished` (issue 12, items 4 and 5): every task fed was trained exactly once, none
lost, none twice.

(An in-memory broker loses everything by design: that its processes then exit with code 3 and a
`broker gone:` line is tested in tests/transport/test_broker_loss.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from sao.feeder import feed_tasks
from sao.run_dir import RunDir
from sao.schema import PolicyAnnouncement, Task, encode
from sao.transport.broker import free_port, start_detached, stop_detached
from sao.transport.kafka import deliver_and_wait, make_producer
from support.fault_runs import audit, on_own_topics, sampler_command, trainer_status, wait_for, write_toml
from support.gated_env import GATE
from support.trainer_runs import TOTAL, produce, synthetic_trajectory, trainer_command, wait_for_step


def _assert_clean(report: dict, fed: int) -> None:
    assert report["exit_code"] == 0, report["table"]
    assert report["clean"] and report["finished"], report["table"]
    assert report["fed"] == report["trained"] == fed, report["table"]
    assert report["trained_twice"] == {} and report["lost_produced"] == report["lost_not_produced"] == []


def _synthetic_run(tiny_config, bootstrap: str, prefix: str, tmp_path: Path, **trainer):
    """Tasks task-0 .. task-17 fed (for the audit) and the trainer's config; trajectories come from the test."""
    config = on_own_topics(tiny_config, bootstrap, prefix)
    config.trainer.batch_size, config.trainer.max_staleness = 3, 1000
    for knob, value in trainer.items():
        setattr(config.trainer, knob, value)
    producer = make_producer(bootstrap)
    for i in range(TOTAL):
        producer.produce(config.topics.tasks, encode(Task(task_id=f"task-{i}", env="arithmetic", spec={})))
    assert producer.flush(30) == 0
    rng = np.random.default_rng(0)
    return config, write_toml(config, tmp_path / "sao.toml"), [synthetic_trajectory(i, rng) for i in range(TOTAL)]


def _finish(config, bootstrap: str, trajectories: list) -> None:
    """The rest of the trajectories, one of them again (a redelivery) and one that does not decode; one
    batch (Tansu's s3 engine lists the bucket many times before it serves a new batch)."""
    producer = make_producer(bootstrap)
    for trajectory in trajectories + trajectories[:1]:
        producer.produce(config.topics.trajectories, encode(trajectory), key=trajectory.task_id)
    producer.produce(config.topics.trajectories, b"\x93not a trajectory", key="garbage")
    assert producer.flush(30) == 0


@pytest.mark.slow
def test_a_sampler_killed_mid_episode_leaves_its_tasks_to_the_next_and_nothing_is_trained_twice(
        kafka_bootstrap, unique_topic_prefix, tiny_config, tmp_path, spawn):
    from sao.sampler.loop import Sampler

    config = on_own_topics(tiny_config, kafka_bootstrap, unique_topic_prefix)
    config.env.name, config.env.max_turns, config.env.turn_timeout_s = "support.gated_env:GatedEnv", 5, 120
    config.policy.max_new_tokens, config.sampler.rollout_batch, config.trainer.batch_size = 3, 2, 3
    # Handed on as it ends, task 2's trajectory is produced before task 1's: the window this test is about
    # (produced, not committed). In start order it would wait for task 1 instead (tests/sampler/test_sampler.py).
    config.sampler.publish_in_order = False
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    config.sampler.policy_dir = str(RunDir(run_dir).policy_dir)
    config_path = write_toml(config, tmp_path / "sao.toml")
    feed_tasks(config, kafka_bootstrap, 8)  # task 1 takes three turns, the others one
    gate.touch()
    tests = str(Path(__file__).resolve().parents[1])  # where `support.gated_env` is found
    python_path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, GATE: str(gate), "PYTHONPATH": python_path}
    first = spawn(sampler_command(config_path, run_dir, "s-first"), tmp_path / "first.log", env=environment)
    wait_for(Path(f"{gate}.reached").exists, "episode of task 1 at its last turn", 120, first)
    # It holds task 1 (and 3) live: task 2, which started after task 1, is produced but not committed.
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    gate.unlink()

    trainer = spawn(trainer_command(config_path, kafka_bootstrap, run_dir, expect=8), tmp_path / "trainer.log")
    counters = Sampler(config, kafka_bootstrap, "s-second").run(max_tasks=7)  # tasks 1-7, from the committed offset
    assert counters["produced"] == 7 and counters["dead_lettered"] == 0
    assert trainer.wait(180) == 0, (tmp_path / "trainer.log").read_text()[-3000:]

    report = audit(config_path, run_dir, tmp_path / "audit.json")
    _assert_clean(report, fed=8)
    assert report["ledger"]["steps"] == 3
    assert trainer_status(run_dir)["duplicates"] == 1  # task 2's trajectory, from both samplers


@pytest.mark.slow
def test_a_trainer_killed_past_its_checkpoint_resumes_and_trains_each_trajectory_once(
        kafka_bootstrap, unique_topic_prefix, tiny_config, tmp_path, spawn):
    config, config_path, trajectories = _synthetic_run(tiny_config, kafka_bootstrap, unique_topic_prefix, tmp_path,
                                                       checkpoint_every=2)
    run_dir = tmp_path / "run"
    produce(kafka_bootstrap, config.topics.trajectories, trajectories[:9])
    first = spawn(trainer_command(config_path, kafka_bootstrap, run_dir, expect=TOTAL + 1), tmp_path / "first.log")
    wait_for_step(RunDir(run_dir).status("trainer"), 3, first, timeout=180)  # then it waits for trajectories 10-18
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert RunDir(run_dir).latest_checkpoint.read_text().strip() == "step-00000002"
    assert trainer_status(run_dir)["step"] == 3  # past the checkpoint

    _finish(config, kafka_bootstrap, trajectories[9:])
    # Issue 12: an announcement of version 2^64-1 made the resume overflow; it must not count.
    deliver_and_wait(make_producer(kafka_bootstrap), config.topics.policy,
                     encode(PolicyAnnouncement(2**64 - 1, "/etc/passwd", "ab" * 32, 1, 1)), key="policy")
    resumed = subprocess.run(trainer_command(config_path, kafka_bootstrap, run_dir, "--resume", expect=TOTAL + 1),
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert trainer_status(run_dir)["policy_version"] == 3 + 4  # above the crashed life's v3, four steps on

    report = audit(config_path, run_dir, tmp_path / "audit.json")
    _assert_clean(report, fed=TOTAL)
    assert (report["ledger"]["resumes"], report["ledger"]["rolled_back_steps"]) == (1, 1)  # step 3, trained again
    assert report["undecodable"][config.topics.trajectories] == {"messages": 1, "dead_lettered": 1}


@pytest.mark.slow
def test_a_durable_broker_killed_mid_run_comes_back_and_the_run_completes(unique_topic_prefix, tiny_config, tmp_path,
                                                                         spawn):
    broker_dir, port = tmp_path / "broker", free_port()
    broker = start_detached(broker_dir, port, storage="s3")
    try:
        bootstrap = broker["bootstrap"]
        config, config_path, trajectories = _synthetic_run(tiny_config, bootstrap, unique_topic_prefix, tmp_path)
        config.broker.fetch_wait_ms = 100  # what docs/reliability.md asks of this engine's clients
        write_toml(config, config_path)
        run_dir, log = tmp_path / "run", tmp_path / "trainer.log"
        produce(bootstrap, config.topics.trajectories, trajectories[:9])
        trainer = spawn(trainer_command(config_path, bootstrap, run_dir, expect=TOTAL + 1), log)
        wait_for_step(RunDir(run_dir).status("trainer"), 3, trainer, timeout=180)  # then it waits for 10-18
        os.kill(broker["pid"], signal.SIGKILL)
        wait_for(lambda: "does not answer" in log.read_text(), "word of the broker's loss", 30, trainer)
        restarted = start_detached(broker_dir, port, storage="s3")  # same files, same port: the same cluster
        assert restarted["cluster_id"] == broker["cluster_id"] and restarted["pid"] != broker["pid"]

        _finish(config, bootstrap, trajectories[9:])
        assert trainer.wait(180) == 0, log.read_text()[-3000:]
        assert "answers again" in log.read_text()

        report = audit(config_path, run_dir, tmp_path / "audit.json", quiet_s=3)  # the s3 engine answers slower
        _assert_clean(report, fed=TOTAL)
        assert report["undecodable"][config.topics.trajectories] == {"messages": 1, "dead_lettered": 1}
    finally:
        stop_detached(broker_dir, timeout=1)
