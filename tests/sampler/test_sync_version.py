"""run.mode = sync, sampler side, through the real broker: a task released for a policy version is
sampled with that version even when the task arrives before the version's announcement, and a
version that never comes fails its tasks (dead letters, said loudly) instead of sampling them with
an older one."""

import hashlib
import os
import threading
import time

import torch

from sao.feeder import feed_tasks
from sao.policy.weights import unique_state_dict, write_weights
from sao.run_dir import RunDir
from sao.sampler.loop import Sampler
from sao.schema import PolicyAnnouncement, Trajectory, decode
from sao.transport.announcements import announce, ensure_announce_key, sign
from sao.transport.dlq import describe_dlq_message
from sao.transport.kafka import make_producer, read_all
from sao.transport.topics import ensure_topics


def _sampler(bootstrap: str, prefix: str, tiny_config, tmp_path, version_wait_s: float = 120.0) -> Sampler:
    config = tiny_config.model_copy(deep=True)
    config.topics.tasks, config.topics.trajectories = f"{prefix}.tasks", f"{prefix}.traj"
    config.topics.policy, config.topics.dlq, config.topics.sampler_group = f"{prefix}.policy", f"{prefix}.dlq", f"{prefix}-s"
    config.policy.max_new_tokens, config.metrics.sampler_port = 3, 0
    config.sampler.policy_dir = str(RunDir(tmp_path / "run").policy_dir)
    config.sampler.version_wait_s = version_wait_s
    ensure_topics(bootstrap, {config.topics.tasks: 1, config.topics.trajectories: 1, config.topics.policy: 1,
                              config.topics.dlq: 1})
    return Sampler(config, bootstrap, "s-sync")


def _announce_once_held(sampler: Sampler, bootstrap: str, version: int, run_dir) -> None:
    """Publish `version` only after the sampler has taken (and is holding) the task released for it."""
    deadline = time.monotonic() + 60
    while not sampler.admission.held and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the sampler is now waiting, on the old version
    state = unique_state_dict(sampler.policy.state_dict())
    state["projector.bias"] = torch.full_like(state["projector.bias"], 0.5)
    path = RunDir(run_dir).weights(version)
    write_weights(state, path)
    announcement = PolicyAnnouncement(version, str(path), hashlib.sha256(path.read_bytes()).hexdigest(),
                                      os.stat(path).st_size, version)
    key = ensure_announce_key(RunDir(run_dir).policy_dir)  # as the trainer does: the sampler reads only signed ones
    announce(make_producer(bootstrap), sampler.config.topics.policy, sign(announcement, key))


def test_a_task_that_arrives_before_its_version_waits_for_it(kafka_bootstrap, unique_topic_prefix, tiny_config,
                                                             tmp_path):
    sampler = _sampler(kafka_bootstrap, unique_topic_prefix, tiny_config, tmp_path)
    feed_tasks(sampler.config, kafka_bootstrap, 2, policy_version=1)
    publisher = threading.Thread(target=_announce_once_held, args=(sampler, kafka_bootstrap, 1, tmp_path / "run"))
    publisher.start()
    counters = sampler.run(max_tasks=2)
    publisher.join()

    assert counters["produced"] == 2 and counters["reloads"] == 1
    trajectories = [decode(m.value(), Trajectory) for m in read_all(kafka_bootstrap, sampler.config.topics.trajectories)]
    assert [t.behaviour_version for t in trajectories] == [1, 1]


def test_a_version_that_never_comes_fails_its_task_naming_it(kafka_bootstrap, unique_topic_prefix, tiny_config,
                                                             tmp_path, caplog):
    sampler = _sampler(kafka_bootstrap, unique_topic_prefix, tiny_config, tmp_path, version_wait_s=2.0)
    feed_tasks(sampler.config, kafka_bootstrap, 1, policy_version=7)
    feed_tasks(sampler.config, kafka_bootstrap, 1, start_index=1, policy_version=2**62 + 1)  # implausible: at once
    started = time.monotonic()
    counters = sampler.run(max_tasks=2)

    assert counters["produced"] == 0 and counters["dead_lettered"] == 2
    assert time.monotonic() - started < 60  # each waited version_wait_s at most, not sampler-long
    assert read_all(kafka_bootstrap, sampler.config.topics.trajectories, timeout=3) == []
    letters = [describe_dlq_message(m) for m in read_all(kafka_bootstrap, sampler.config.topics.dlq, timeout=10)]
    assert [letter["reason"] for letter in letters] == ["version-not-loaded"] * 2
    assert any("policy v7 was not loadable within sampler.version_wait_s" in letter["detail"] for letter in letters)
    assert "tasks released for policy v7 are dead-lettered" in caplog.text
