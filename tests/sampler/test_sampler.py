"""The sampler through the real broker: continuous batching refills a slot the moment an
episode ends, task offsets are committed only below unfinished work, and new policy versions
are loaded between trajectories only."""

import pytest
from confluent_kafka import TopicPartition

from sao.feeder import feed_tasks
from sao.sampler.loop import Sampler
from sao.schema import Trajectory, decode
from sao.transport.kafka import make_consumer, read_all
from sao.transport.topics import ensure_topics


@pytest.mark.parametrize("in_order", [True, False])
def test_a_finished_episode_is_replaced_at_once_and_every_task_is_committed(
        kafka_bootstrap, unique_topic_prefix, tiny_config, tmp_path, in_order):
    from support import turns_env

    config = tiny_config.model_copy(deep=True)
    config.sampler.publish_in_order = in_order
    p = unique_topic_prefix
    config.topics.tasks, config.topics.trajectories = f"{p}.tasks", f"{p}.traj"
    config.topics.policy, config.topics.dlq, config.topics.sampler_group = f"{p}.policy", f"{p}.dlq", f"{p}-s"
    config.env.name, config.env.max_turns = "support.turns_env:TurnsEnv", 5
    config.policy.max_new_tokens, config.metrics.sampler_port, config.sampler.rollout_batch = 3, 0, 2
    ensure_topics(kafka_bootstrap, {config.topics.tasks: 1, config.topics.trajectories: 1, config.topics.policy: 1,
                                    config.topics.dlq: 1})
    feed_tasks(config, kafka_bootstrap, 4)  # task turns: 1, 3, 1, 1
    turns_env.EVENTS.clear()
    counters = Sampler(config, kafka_bootstrap, "s-cb", tmp_path / "status.json").run(max_tasks=4)

    assert counters["produced"] == 4
    events = turns_env.EVENTS
    # Task 0 ends after its first turn; task 2 takes its slot while task 1 is still running.
    assert events.index(("reset", 2)) < len(events) - 1 - events[::-1].index(("step", 1))
    assert events.index(("reset", 3)) < len(events) - 1 - events[::-1].index(("step", 1))
    # (Lockstep batches would reset task 2 only after task 1's third step.)
    steps_per_task = {i: events.count(("step", i)) for i in range(4)}
    assert steps_per_task == {0: 1, 1: 3, 2: 1, 3: 1}
    trajectories = [decode(m.value(), Trajectory) for m in read_all(kafka_bootstrap, config.topics.trajectories)]
    published = [t.task_id for t in trajectories]
    assert sorted(published) == [f"train/turns/{i}" for i in range(4)]
    if in_order:  # task 2 ended before task 1 but waited for it: the trainer sees them as they started
        assert published == [f"train/turns/{i}" for i in range(4)]
    else:  # handed on as they ended: the long episode comes last
        assert published.index("train/turns/2") < published.index("train/turns/1")
    checker = make_consumer(kafka_bootstrap, config.topics.sampler_group)
    try:
        committed = checker.committed([TopicPartition(config.topics.tasks, 0)], timeout=10)
    finally:
        checker.close()
    assert committed[0].offset == 4  # every task handed on, none past unfinished work


class _Announcements:
    """Stands in for the policy follower: offers the newest announcement set by the test, unless refused."""

    def __init__(self):
        self.latest = None
        self.refused_versions = set()
        self.newest_read = None  # the sampler compares its version with it (how far behind it is)
        self.announced = {}  # a delta's chain links (none here: every version is whole)

    def poll(self):
        if self.latest is None or self.latest.policy_version in self.refused_versions:
            return None
        return self.latest

    def loaded(self, version):
        pass

    def refused(self, version, missing=False):
        self.refused_versions.add(version)

    def close(self):
        pass


def test_a_version_is_loaded_only_when_no_episode_is_live_and_a_bad_file_is_not_read_twice(
        kafka_bootstrap, unique_topic_prefix, tiny_config, tmp_path, monkeypatch):
    import shutil

    import torch

    from sao.policy.weights import unique_state_dict, write_weights
    from sao.run_dir import RunDir
    from sao.sampler import weight_sync as weight_sync_module
    from sao.schema import PolicyAnnouncement

    config = tiny_config.model_copy(deep=True)
    config.topics.tasks, config.topics.sampler_group = f"{unique_topic_prefix}.tasks", f"{unique_topic_prefix}-s"
    config.metrics.sampler_port = 0
    run_dir = RunDir(tmp_path)
    config.sampler.policy_dir = str(run_dir.policy_dir)
    sampler = Sampler(config, kafka_bootstrap, "s-reload")
    sampler.policy_follower = follower = _Announcements()
    reads = []
    real_read = weight_sync_module.read_weights_into
    monkeypatch.setattr(weight_sync_module, "read_weights_into",
                        lambda *a, **k: (reads.append(a[1].name), real_read(*a, **k)))
    with torch.no_grad():
        sampler.policy.projector.bias.fill_(0.5)  # v1 differs from v0 in a way we can see
    path = run_dir.weights(1)
    sha = write_weights(unique_state_dict(sampler.policy.state_dict()), path)
    with torch.no_grad():
        sampler.policy.projector.bias.zero_()

    follower.latest = PolicyAnnouncement(1, str(path), sha, path.stat().st_size, 1)
    sampler._follow_policy(reload_now=False)  # episodes are live: note it, do not load
    assert sampler.policy_version == 0 and sampler.pending.policy_version == 1 and reads == []
    sampler._follow_policy(reload_now=True)
    assert sampler.policy_version == 1 and sampler.pending is None
    assert float(sampler.policy.projector.bias.detach()[0]) == 0.5

    shutil.copy(path, run_dir.weights(2))
    follower.latest = PolicyAnnouncement(2, str(run_dir.weights(2)), "0" * 64, path.stat().st_size, 2)  # wrong hash
    sampler._follow_policy(reload_now=True)
    sampler._follow_policy(reload_now=True)  # the same refused announcement again
    assert sampler.policy_version == 1 and reads == [path.name, run_dir.weights(2).name]  # v1 once, v2 once
    sampler.close()
