"""`sao audit` against the real broker: a clean run audits clean; twice-trained, lost and dead-lettered
copies are named; garbage anywhere is counted, never a crash; rolled-back steps are not double training."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from sao.audit import audit, read_ledger
from sao.config import SaoConfig, to_toml
from sao.run_dir import RunDir
from sao.schema import Task, encode
from sao.status import write_status
from sao.transport.dlq import DeadLetterQueue
from sao.transport.kafka import make_producer
from sao.transport.topics import ensure_topics
from support.trainer_runs import synthetic_trajectory


def _config_on_own_topics(base: SaoConfig, prefix: str) -> SaoConfig:
    config = base.model_copy(deep=True)
    topics = config.topics
    topics.tasks, topics.trajectories, topics.policy, topics.dlq = (f"{prefix}.tasks", f"{prefix}.traj",
                                                                    f"{prefix}.policy", f"{prefix}.dlq")
    topics.sampler_group, topics.trainer_group = f"{prefix}-samplers", f"{prefix}-trainer"
    config.metrics.sampler_port = config.metrics.trainer_port = 0
    ensure_topics_of(config)
    return config


def ensure_topics_of(config: SaoConfig) -> None:
    t = config.topics
    ensure_topics(config.broker.bootstrap_servers, {t.tasks: 2, t.trajectories: 2, t.policy: 1, t.dlq: 1})


def _sao_audit(config_path: Path, bootstrap: str, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "sao.cli", "audit", "--config", str(config_path), "--bootstrap-servers",
               bootstrap, "--run-dir", str(run_dir), "--quiet-s", "1", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def finished_run(kafka_bootstrap, tiny_config, tmp_path_factory):
    """6 tasks and one garbage task message, a sampler, then a trainer that trains all 6: (config path, run dir)."""
    from sao.feeder import feed_tasks
    from sao.sampler.loop import Sampler

    root = tmp_path_factory.mktemp("audited-run")
    base = tiny_config.model_copy(deep=True)
    base.broker.bootstrap_servers = kafka_bootstrap
    base.policy.max_new_tokens, base.trainer.batch_size = 4, 3
    config = _config_on_own_topics(base, f"audit{uuid.uuid4().hex[:8]}")
    config_path, run_dir = root / "sao.toml", root / "run"
    config_path.write_text(to_toml(config))
    feed_tasks(config, kafka_bootstrap, 6)
    producer = make_producer(kafka_bootstrap)
    producer.produce(config.topics.tasks, b"\x93not a task", key="garbage")
    assert producer.flush(10) == 0
    counters = Sampler(config, kafka_bootstrap, "s-audit").run(max_tasks=7)
    assert counters["produced"] == 6 and counters["dead_lettered"] == 1
    trainer = subprocess.run([sys.executable, "-m", "sao.cli", "trainer", "--config", str(config_path),
                              "--bootstrap-servers", kafka_bootstrap, "--run-dir", str(run_dir), "--expect", "6"],
                             capture_output=True, text=True, timeout=300)
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    return config_path, run_dir


@pytest.mark.slow
def test_a_clean_run_audits_clean(finished_run, kafka_bootstrap, tmp_path):
    config_path, run_dir = finished_run
    result = _sao_audit(config_path, kafka_bootstrap, run_dir, "--json", str(tmp_path / "audit.json"))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads((tmp_path / "audit.json").read_text())
    assert report["clean"] and report["finished"]  # the trainer's status file says it stopped
    assert report["fed"] == report["trained"] == 6 and not report["trained_twice"]
    assert report["lost_produced"] == report["lost_not_produced"] == []
    tasks_topic = next(name for name in report["undecodable"] if name.endswith(".tasks"))
    assert report["undecodable"][tasks_topic] == {"messages": 1, "dead_lettered": 1}  # the sampler dead-lettered it
    assert report["ledger"]["steps"] == 2 and report["trained_after_checkpoint"] == 0
    assert "trained exactly once" in result.stdout


@pytest.mark.slow
def test_a_trajectory_in_two_steps_of_one_history_fails_the_audit_naming_it(finished_run, kafka_bootstrap, tmp_path):
    config_path, run_dir = finished_run
    steps = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    twice = steps[0]["trajectory_ids"][0]
    copied = tmp_path / "run"
    copied.mkdir()
    with open(copied / "trained.jsonl", "w") as ledger:
        for step in steps + [{"step": len(steps) + 1, "policy_version": len(steps), "trajectory_ids": [twice]}]:
            ledger.write(json.dumps(step) + "\n")

    result = _sao_audit(config_path, kafka_bootstrap, copied, "--finished", "--json", str(tmp_path / "audit.json"))
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert twice in next(line for line in result.stdout.splitlines() if "trained twice" in line)
    report = json.loads((tmp_path / "audit.json").read_text())
    assert report["trained_twice"] == {twice: 2} and report["trained"] == 5 and not report["clean"]


def test_steps_rolled_back_by_a_resume_are_not_double_training(tmp_path):
    ledger = tmp_path / "trained.jsonl"
    ledger.write_text("\n".join([
        json.dumps({"step": 1, "trajectory_ids": ["a#0", "b#0"]}),
        json.dumps({"step": 2, "trajectory_ids": ["c#0"]}),  # crashed before its checkpoint
        json.dumps({"resumed_from_step": 1}),
        json.dumps({"step": 2, "trajectory_ids": ["c#0"]}),  # trained again after the resume: its only survivor
        "{not json", json.dumps(["a list"]), json.dumps({"step": 3, "trajectory_ids": "d#0"}),
        json.dumps({"step": 3, "trajectory_ids": ["d#0", "a#0"]}),  # a#0 again in the same history: twice
    ]) + "\n")
    history = read_ledger(ledger)
    assert history.times_trained() == {"a#0": 2, "b#0": 1, "c#0": 1, "d#0": 1}
    assert (history.resumes, history.rolled_back_steps, history.undecodable_lines) == (1, 1, 3)


def _produce(bootstrap: str, topic: str, *values: bytes) -> None:
    """Onto partition 0, in order, so a test knows each message's offset."""
    producer = make_producer(bootstrap)
    for value in values:
        producer.produce(topic, value, partition=0)
    assert producer.flush(10) == 0


@pytest.fixture
def hand_made(kafka_bootstrap, tiny_config, unique_topic_prefix, tmp_path):
    """Own topics holding the tasks task-0..task-3 (task-1 fed twice), and a finished trainer that trained task-0."""
    base = tiny_config.model_copy(deep=True)
    base.broker.bootstrap_servers = kafka_bootstrap
    config = _config_on_own_topics(base, unique_topic_prefix)
    run_dir = RunDir(tmp_path / "run")
    tasks = [Task(task_id=f"task-{i}", env="arithmetic", spec={}) for i in (0, 1, 1, 2, 3)]
    _produce(kafka_bootstrap, config.topics.tasks, *(encode(task) for task in tasks))
    run_dir.ledger.parent.mkdir(parents=True)
    run_dir.ledger.write_text(json.dumps({"step": 1, "trajectory_ids": ["task-0#0"]}) + "\nnot json\n")
    write_status(run_dir.status("trainer"), {"step": 1, "finished": True})
    return config, run_dir


def test_a_fed_task_never_trained_is_lost_once_the_trainer_finished(hand_made, kafka_bootstrap):
    config, run_dir = hand_made
    trajectory = synthetic_trajectory(1, np.random.default_rng(0))  # task-1#0: produced, never trained
    dlq = DeadLetterQueue(make_producer(kafka_bootstrap), config.topics.dlq)
    dlq.send(encode(synthetic_trajectory(2, np.random.default_rng(0))), "too-stale",
             source_topic=config.topics.trajectories, partition=0, offset=7)
    assert dlq.flush(10) == 0
    _produce(kafka_bootstrap, config.topics.trajectories, encode(trajectory))

    report = audit(config, run_dir, kafka_bootstrap, timeout=30, quiet_period=1)
    assert report.finished and not report.clean
    assert (report.fed, report.fed_messages, report.trained) == (4, 5, 1)
    assert report.dead_lettered == {"too-stale": 1}  # task-2's trajectory
    assert report.lost_produced == ["task-1#0"] and report.lost_not_produced == ["task-3#0"]
    assert report.ledger["undecodable_lines"] == 1

    running = audit(config, run_dir, kafka_bootstrap, finished=False, timeout=30, quiet_period=1)
    assert running.clean and running.in_flight_produced == ["task-1#0"] and running.in_flight_not_produced == ["task-3#0"]


def test_garbage_on_every_topic_is_counted_and_matched_with_its_dead_letters(hand_made, kafka_bootstrap):
    config, run_dir = hand_made
    topics = config.topics
    _produce(kafka_bootstrap, topics.tasks, b"\xc1", b"")
    _produce(kafka_bootstrap, topics.trajectories, b"\x93not a trajectory")
    dlq = DeadLetterQueue(make_producer(kafka_bootstrap), topics.dlq)
    dlq.send(b"\x93not a trajectory", "decode-error", source_topic=topics.trajectories, partition=0, offset=0)
    dlq.send(b"\xc1", "decode-error", source_topic=topics.tasks, partition=0, offset=5)  # after the 5 tasks
    assert dlq.flush(10) == 0
    _produce(kafka_bootstrap, topics.dlq, b"\xff no headers at all")

    report = audit(config, run_dir, kafka_bootstrap, finished=False, timeout=30, quiet_period=1)
    assert report.undecodable[topics.trajectories] == {"messages": 1, "dead_lettered": 1}
    assert report.undecodable[topics.tasks] == {"messages": 2, "dead_lettered": 1}  # b"" was never dead-lettered
    assert report.undecodable[topics.dlq]["messages"] == 1
    assert report.fed == 4  # the decodable tasks are all still accounted for


def test_training_after_the_checkpoint_and_a_foreign_cluster_are_pointed_out(hand_made, kafka_bootstrap):
    config, run_dir = hand_made
    run_dir.checkpoint_state("step-00000000").parent.mkdir(parents=True)
    run_dir.checkpoint_state("step-00000000").write_text(json.dumps({"step": 0, "broker_cluster_id": "gone-cluster"}))
    run_dir.latest_checkpoint.write_text("step-00000000")

    report = audit(config, run_dir, kafka_bootstrap, timeout=30, quiet_period=1)
    assert report.checkpoint_step == 0 and report.trained_after_checkpoint == 1  # task-0#0, in step 1
    assert any("'gone-cluster'" in note and "not the run's log" in note for note in report.notes)


@pytest.mark.parametrize("cluster", ["gone-cluster", None])
def test_a_broker_that_lost_the_run_cannot_audit_clean(kafka_bootstrap, tiny_config, unique_topic_prefix, tmp_path,
                                                       cluster):
    """Issue 27: after the in-memory broker was lost, audit against the new one said "0 fed", clean, exit 0, for a
    run that lost 32 of its 40 tasks. The run's own records (feeder status, ledger, the cluster it started on) now
    say what the broker must account for. Without a recorded cluster (a run from before it was recorded), the
    topics holding fewer tasks than the run fed still fail it."""
    base = tiny_config.model_copy(deep=True)
    base.broker.bootstrap_servers = kafka_bootstrap
    config = _config_on_own_topics(base, unique_topic_prefix)  # empty topics: the new broker's
    run_dir = RunDir(tmp_path / "run")
    run_dir.ledger.parent.mkdir(parents=True)
    run_dir.ledger.write_text("".join(json.dumps({"step": s, "trajectory_ids": [f"train/t/{4 * s + i}#0" for i in
                                                                                  range(4)]}) + "\n" for s in (0, 1)))
    write_status(run_dir.status("trainer"), {"step": 2, "finished": True})
    write_status(run_dir.status("feeder"), {"mode": "async", "fed": 40})
    if cluster:
        run_dir.cluster_id.write_text(cluster + "\n")

    report = audit(config, run_dir, kafka_bootstrap, timeout=30, quiet_period=1)
    assert report.fed == 0 and not report.clean and report.unaccounted == 40
    assert (report.foreign_cluster == cluster) if cluster else report.foreign_cluster is None
    assert any("cannot account for 40 of the 40 task copies" in note for note in report.notes)
    config_path = tmp_path / "sao.toml"
    config_path.write_text(to_toml(config))
    result = _sao_audit(config_path, kafka_bootstrap, run_dir.root)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "lost: not on this broker" in result.stdout and "40" in result.stdout
