"""Tasks a sampler dead-letters count as handled: the trainer (and `sao run`, sync mode included) ends
with `finished` instead of waiting for trajectories that never come; each such task counts once,
and not at all if its trajectory was trained after all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sao.feeder import feed_tasks
from sao.run_dir import RunDir
from sao.sampler.loop import Sampler
from sao.transport.dlq import DeadLetterQueue
from sao.transport.kafka import make_producer, read_all
from support.fault_runs import audit, on_own_topics, trainer_status, write_toml
from support.trainer_runs import trainer_command

TESTS = str(Path(__file__).resolve().parents[1])  # where `support.failing_env` is found
FAILING_ENV = "support.failing_env:FailingEnv"


def _with_tests_importable() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
def test_a_trainer_expecting_tasks_a_sampler_dead_lettered_finishes(
        kafka_bootstrap, unique_topic_prefix, tiny_config, tmp_path, spawn):
    config = on_own_topics(tiny_config, kafka_bootstrap, unique_topic_prefix)
    config.env.name, config.policy.max_new_tokens, config.sampler.rollout_batch = FAILING_ENV, 3, 2
    config.trainer.batch_size, config.trainer.max_staleness = 3, 1000
    run_dir = tmp_path / "run"
    config.sampler.policy_dir = str(RunDir(run_dir).policy_dir)
    config_path = write_toml(config, tmp_path / "sao.toml")
    feed_tasks(config, kafka_bootstrap, 6)  # task 2 fails at reset: an env failure, dead-lettered
    producer = make_producer(kafka_bootstrap)
    producer.produce(config.topics.tasks, b"\x93not a task", key="garbage")  # undecodable, dead-lettered
    assert producer.flush(30) == 0
    # Task 0 as a sampler that dead-lettered it and died before its commit left it: delivered again, it is
    # produced and trained after all, so it must count as trained only (else the count ends a task early).
    first = read_all(kafka_bootstrap, config.topics.tasks)[0]
    dlq = DeadLetterQueue(producer, config.topics.dlq)
    dlq.send(first.value(), "env-timeout", source_topic=first.topic(), partition=first.partition(),
             offset=first.offset(), key=first.key())
    assert dlq.flush(10) == 0

    trainer = spawn(trainer_command(config_path, kafka_bootstrap, run_dir, expect=7), tmp_path / "trainer.log",
                    env=_with_tests_importable())
    counters = Sampler(config, kafka_bootstrap, "s-0").run(max_tasks=7)
    # At least: on a loaded machine the group can time out and hand an uncommitted task over again, produced
    # or dead-lettered twice (measured: 6 produced); the trainer dedups, and the DLQ count keys by source offset.
    assert counters["produced"] >= 5 and counters["dead_lettered"] >= 2
    try:  # before the fix it waited here for ever, for the trajectories of task 2 and of the garbage
        assert trainer.wait(240) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    except subprocess.TimeoutExpired:
        pytest.fail("the trainer still waits for the trajectories of tasks a sampler dead-lettered")

    status = trainer_status(run_dir)
    assert status["finished"] and status["trajectories_trained"] == 5
    assert status["tasks_dead_lettered"] == 2
    assert status["task_dlq_reasons"] == {"env-error": 1, "decode-error": 1}
    # `sao audit` agrees: the other five trained once, task 2 dead-lettered, the garbage undecodable and dead-lettered.
    report = audit(config_path, run_dir, tmp_path / "audit.json")
    assert report["clean"] and report["finished"], report["table"]
    assert report["trained"] == 5 and report["dead_lettered"] == {"env-error": 1}, report["table"]
    assert report["undecodable"][config.topics.tasks] == {"messages": 1, "dead_lettered": 1}


@pytest.mark.slow
def test_sync_run_with_a_dead_lettered_task_trains_the_short_batch_and_goes_on(tmp_path):
    run_dir = tmp_path / "sync"
    command = [sys.executable, "-m", "sao.cli", "run", "--model", "tiny", "--num-tasks", "6", "--samplers", "1",
               "--run-dir", str(run_dir), "--set", 'run.mode="sync"', "--set", "trainer.batch_size=3",
               "--set", f'env.name="{FAILING_ENV}"', "--set", "policy.max_new_tokens=3",
               "--set", "run.timeout_s=240", "--set", "run.heldout_eval=false",
               "--set", "metrics.launcher_port=0", "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=_with_tests_importable())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tasks_dead_lettered"] == 1 and summary["trajectories_trained"] == 5
    status = json.loads((run_dir / "status" / "trainer.json").read_text())
    assert status["finished"] and status["task_dlq_reasons"] == {"env-error": 1}
    # Task 2 (FAILING_TASK) is in the first batch: it is trained short, then the next is released on its version.
    releases = json.loads((run_dir / "status" / "feeder.json").read_text())["releases"]
    assert [(r["trajectories"], r["policy_version"]) for r in releases] == [(3, 0), (3, 1)]
    assert [len(step["rewards"]) for step in status["steps"]] == [2, 3]
    assert all(step["staleness"] == [0] * len(step["rewards"]) for step in status["steps"])
    assert "Samplers dead-lettered 1 task(s)" in (run_dir / "report.md").read_text()
