"""Losing the broker: samplers and the trainer retry for `broker.loss_timeout_s`, then exit naming what
they held; a broker that comes back empty (a new cluster) is detected at once, and a resume against it
is refused. Each test kills a broker of its own, never the session's."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition
from prometheus_client import REGISTRY

from sao.transport.broker import EmbeddedBroker, free_port, start_detached, stop_detached
from sao.transport.health import BrokerLost, BrokerWatch
from sao.transport.kafka import RenewingProducer, deliver_and_wait, make_consumer, read_all
from sao.transport.topics import ensure_topics
from support.trainer_runs import produce_trajectories, trainer_command, wait_for_step, write_config


@pytest.fixture
def own_broker(tmp_path: Path):
    broker = EmbeddedBroker(log_path=tmp_path / "own-broker.log")
    broker.start()
    yield broker
    broker.stop(timeout=1)


@pytest.mark.slow
def test_a_producer_outlives_a_broker_restart_that_forgot_its_producer_id(tmp_path: Path) -> None:
    # Same cluster id, empty memory: the old producer id is unknown to the new broker, which refuses
    # it until message.timeout.ms; only a fresh producer gets through.
    broker = EmbeddedBroker(log_path=tmp_path / "fixed.log", cluster_id="fixed-cluster")
    bootstrap = broker.start()
    watch = BrokerWatch(bootstrap, "test", loss_timeout_s=60, probe_interval_s=0.5)
    try:
        ensure_topics(bootstrap, {"restart.x": 1})
        producer = RenewingProducer(bootstrap, watch)
        deliver_and_wait(producer, "restart.x", b"before", key="a")
        broker.kill()
        broker.start()
        ensure_topics(bootstrap, {"restart.x": 1})
        acked = deliver_and_wait(producer, "restart.x", b"after", key="b", timeout=20)
        assert acked.error() is None
        assert [m.value() for m in read_all(bootstrap, "restart.x")] == [b"after"]
        assert watch.generation >= 1 and watch.cluster_id == "fixed-cluster"
    finally:
        watch.close()
        broker.stop(timeout=1)


@pytest.mark.slow
def test_a_durable_broker_comes_back_as_the_same_cluster_with_its_log(tmp_path: Path) -> None:
    pytest.importorskip("localbucket")  # `sao broker start --storage s3` needs it; not a dependency of sao
    port = free_port()
    first = start_detached(tmp_path, port, storage="s3")
    bootstrap = first["bootstrap"]
    watch = BrokerWatch(bootstrap, "test", loss_timeout_s=60, probe_interval_s=0.5)
    try:
        ensure_topics(bootstrap, {"durable.x": 1})
        producer = RenewingProducer(bootstrap, watch)
        for i in range(5):
            deliver_and_wait(producer, "durable.x", f"before-{i}".encode())
        group = make_consumer(bootstrap, "durable-group")
        group.commit(offsets=[TopicPartition("durable.x", 0, 3)], asynchronous=False)
        group.close()
        os.kill(first["pid"], signal.SIGKILL)
        second = start_detached(tmp_path, port, storage="s3")  # over the same files
        assert second["cluster_id"] == first["cluster_id"] and second["pid"] != first["pid"]
        # The log goes on where it was (an empty broker would put this at offset 0), and the
        # group's offset is still there. (Reading old batches back is slow on this engine.)
        assert deliver_and_wait(producer, "durable.x", b"after", timeout=30).offset() == 5
        group = make_consumer(bootstrap, "durable-group")
        assert group.committed([TopicPartition("durable.x", 0)], timeout=20)[0].offset == 3
        group.close()
        watch.check()  # the same cluster came back: nothing to refuse
    finally:
        watch.close()
        stop_detached(tmp_path)


@pytest.mark.slow
def test_a_sampler_gives_up_after_the_loss_timeout_naming_its_live_tasks(own_broker, unique_topic_prefix, tiny_config,
                                                                         tmp_path, monkeypatch):
    from sao.feeder import feed_tasks
    from sao.sampler.loop import Sampler

    config = tiny_config.model_copy(deep=True)
    p = unique_topic_prefix
    config.topics.tasks, config.topics.trajectories = f"{p}.tasks", f"{p}.traj"
    config.topics.policy, config.topics.dlq, config.topics.sampler_group = f"{p}.policy", f"{p}.dlq", f"{p}-s"
    config.policy.max_new_tokens, config.metrics.sampler_port, config.sampler.rollout_batch = 4, 0, 2
    config.broker.loss_timeout_s = 4
    bootstrap = own_broker.bootstrap_servers
    ensure_topics(bootstrap, {config.topics.tasks: 1, config.topics.trajectories: 1, config.topics.policy: 1,
                              config.topics.dlq: 1})
    feed_tasks(config, bootstrap, 2)
    sampler = Sampler(config, bootstrap, "s-loss", tmp_path / "status.json")
    killed_at = []
    real_turn = sampler.roller.take_turn

    def turn_after_killing_the_broker(episodes):
        if not killed_at:  # both tasks are live now: the broker dies under them
            own_broker.kill()
            killed_at.append(time.monotonic())
        return real_turn(episodes)

    monkeypatch.setattr(sampler.roller, "take_turn", turn_after_killing_the_broker)
    with pytest.raises(BrokerLost) as raised:
        sampler.run()
    elapsed = time.monotonic() - killed_at[0]

    message = str(raised.value)
    # Counted from the broker's last answer, which came up to one probe interval (2 s) before the kill.
    assert 4 - 2.5 <= elapsed < 4 + 15, message
    assert "has not answered for" in message and "broker.loss_timeout_s = 4" in message
    assert "train/basic_arithmetic/0/0" in message and "train/basic_arithmetic/0/1" in message
    assert f"('{p}.traj', 'train/basic_arithmetic/0/" in message  # the trajectory that was never acknowledged
    assert REGISTRY.get_sample_value("sao_transport_broker_up", {"bootstrap": bootstrap}) == 0


def _start_trainer(own_broker, prefix: str, tmp_path: Path, loss_timeout_s: float) -> tuple[subprocess.Popen, Path, Path]:
    """A trainer (batch 4, checkpoint every step) on 18 trajectories, waiting for more when they are trained."""
    produce_trajectories(own_broker.bootstrap_servers, prefix)
    config, run_dir = tmp_path / "sao.toml", tmp_path / "run"
    write_config(config, prefix, batch_size=4)
    command = trainer_command(config, own_broker.bootstrap_servers, run_dir, "--expect", "1000",
                              "--set", f"broker.loss_timeout_s={loss_timeout_s}")
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "trainer.log", "w"))
    wait_for_step(run_dir / "status" / "trainer.json", 4, proc)  # 16 trained, 2 wait for a full batch
    return proc, config, run_dir


def _wait_for_exit(proc: subprocess.Popen, timeout: float) -> float:
    started = time.monotonic()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return time.monotonic() - started


@pytest.mark.slow
def test_the_trainer_exits_within_the_bound_naming_what_it_held(own_broker, unique_topic_prefix, tmp_path):
    proc, _, _ = _start_trainer(own_broker, unique_topic_prefix, tmp_path, loss_timeout_s=5)
    own_broker.kill()
    elapsed = _wait_for_exit(proc, 60)

    log = (tmp_path / "trainer.log").read_text()
    assert proc.returncode == 3, log[-3000:]
    assert elapsed < 5 + 20, log[-3000:]
    assert log.count("does not answer") == 1  # said once, when it happened, not only at the end
    gone = log[log.index("broker gone:"):]
    assert "has not answered for" in gone
    assert "2 trajectories buffered" in gone and "step 4" in gone
    assert "last committed offsets {" in gone and "last checkpoint at step 4" in gone


@pytest.mark.slow
def test_the_trainer_stops_on_a_new_empty_broker_and_refuses_to_resume_on_it(own_broker, unique_topic_prefix,
                                                                             tmp_path):
    proc, config, run_dir = _start_trainer(own_broker, unique_topic_prefix, tmp_path, loss_timeout_s=120)
    old_cluster = own_broker.cluster_id
    own_broker.kill()
    own_broker.start()  # same port, empty log, new cluster id
    elapsed = _wait_for_exit(proc, 60)

    log = (tmp_path / "trainer.log").read_text()
    assert proc.returncode == 3, log[-3000:]
    assert elapsed < 60  # detected, not timed out (broker.loss_timeout_s is 120)
    gone = log[log.index("broker gone:"):]
    assert f"is now Kafka cluster {own_broker.cluster_id!r}, not {old_cluster!r}" in " ".join(gone.split())

    ledger = (run_dir / "trained.jsonl").read_text()
    resumed = subprocess.run(trainer_command(config, own_broker.bootstrap_servers, run_dir, "--resume"),
                             capture_output=True, text=True, timeout=150)
    assert resumed.returncode == 3, resumed.stderr[-3000:]
    refusal = " ".join(resumed.stderr.split())
    assert f"checkpoint step 4 was taken against Kafka cluster {old_cluster!r}" in refusal
    assert (run_dir / "trained.jsonl").read_text() == ledger  # nothing trained, not even a resume marker
