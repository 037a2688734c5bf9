"""A run directory is bound to the Kafka cluster it first started on (issue 27): `sao trainer --resume` on
another cluster is refused even when the run lost its broker before its first checkpoint."""

from __future__ import annotations

import subprocess

import pytest

from sao.run_dir import RunDir
from sao.trainer.run_cluster import bind_run_to_cluster
from sao.transport.health import BrokerReplaced, BrokerWatch
from sao.transport.topics import ensure_topics
from support.trainer_runs import trainer_command, write_config


@pytest.fixture
def watch(kafka_bootstrap):
    watch = BrokerWatch(kafka_bootstrap, "test", loss_timeout_s=30)
    yield watch
    watch.close()


def test_the_first_start_records_the_cluster_and_a_resume_elsewhere_is_refused(watch, tmp_path):
    run_dir = RunDir(tmp_path / "run")
    bind_run_to_cluster(run_dir, watch, resume=False)
    assert run_dir.recorded_cluster_id() == watch.cluster_id is not None
    bind_run_to_cluster(run_dir, watch, resume=True)  # the same cluster: nothing to refuse

    run_dir.cluster_id.write_text("gone-cluster\n")  # as if this broker were a restarted in-memory one
    with pytest.raises(BrokerReplaced, match="'gone-cluster'"):
        bind_run_to_cluster(run_dir, watch, resume=True)
    bind_run_to_cluster(run_dir, watch, resume=False)  # a fresh start binds the directory anew
    assert run_dir.recorded_cluster_id() == watch.cluster_id


@pytest.mark.slow
def test_sao_trainer_resume_without_a_checkpoint_on_another_cluster_is_refused(kafka_bootstrap, unique_topic_prefix,
                                                                              tmp_path):
    """Before: with no checkpoint yet, a resume on the new cluster waited on its empty topics as if nothing was
    lost."""
    prefix = unique_topic_prefix
    ensure_topics(kafka_bootstrap, {f"{prefix}.traj": 1, f"{prefix}.policy": 1, f"{prefix}.dlq": 1})
    config, run_dir = tmp_path / "sao.toml", RunDir(tmp_path / "run")
    write_config(config, prefix)
    run_dir.root.mkdir()
    run_dir.cluster_id.write_text("gone-cluster\n")
    resumed = subprocess.run(trainer_command(config, kafka_bootstrap, run_dir.root, "--resume", expect=1),
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 3, resumed.stderr[-3000:]
    refusal = " ".join(resumed.stderr.split())
    assert "'gone-cluster'" in refusal and "resuming would silently skip" in refusal
    assert not run_dir.ledger.exists()  # nothing trained, not even a resume marker
