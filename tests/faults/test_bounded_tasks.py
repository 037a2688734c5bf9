"""Tasks are bounded before any work (issue 27): a real `sao sampler` on the real broker dead-letters each
hostile task with its reason, never exits on one, never spins on one, and rolls out the valid tasks behind them.

Before: a task asking for 100,000 terms spun a sampler for minutes (and the next one died allocating 95 GB); a
50 MB task made the sampler exit 1 producing its trajectory; a task of another env was rolled out for nothing.
"""

from __future__ import annotations

import subprocess

import msgpack
import pytest

from sao.envs.registry import make_tasks
from sao.feeder import feed_tasks
from sao.run_dir import RunDir
from sao.schema import Trajectory, decode, encode
from sao.transport.dlq import describe_dlq_message
from sao.transport.kafka import make_producer, read_all
from support.fault_runs import on_own_topics, sampler_command, write_toml

BOUND_S = 240  # the whole run, tiny model: minutes before the bounds, for the first hostile task alone


def _task(base, **changes) -> bytes:
    wire = msgpack.unpackb(encode(base), raw=False)
    for path, value in changes.items():
        *parents, last = path.split(".")
        target = wire
        for key in parents:
            target = target[key]
        target[last] = value
    return msgpack.packb(wire, use_bin_type=True)


def _run_sampler(config, tmp_path, spawn, tasks: int) -> subprocess.Popen:
    run_dir = tmp_path / "run"
    RunDir(run_dir).policy_dir.mkdir(parents=True)
    process = spawn(sampler_command(write_toml(config, tmp_path / "sao.toml"), run_dir, "s-bounds",
                                    "--max-tasks", str(tasks)), tmp_path / "sampler.log")
    try:
        assert process.wait(BOUND_S) == 0, (tmp_path / "sampler.log").read_text()[-3000:]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the sampler did not get through {tasks} tasks within {BOUND_S} s: "
                    + (tmp_path / "sampler.log").read_text()[-2000:])
    return process


def _letters(bootstrap: str, topic: str) -> dict[str, dict]:
    """Dead letters by the task id their detail or key names (the test's own ids are short)."""
    return {(letter["key"] or b"").decode(errors="replace")[:40]: letter
            for letter in map(describe_dlq_message, read_all(bootstrap, topic, timeout=30))}


@pytest.mark.slow
def test_hostile_tasks_are_dead_lettered_before_work_and_valid_ones_behind_them_roll_out(
        kafka_bootstrap, unique_topic_prefix, tiny_config, tmp_path, spawn):
    config = on_own_topics(tiny_config, kafka_bootstrap, unique_topic_prefix)
    config.policy.max_new_tokens, config.sampler.rollout_batch = 3, 2
    config.sampler.max_prompt_tokens = 200  # a default task's first context is about 50 tokens
    base = make_tasks(config.env, 1)[0]
    options = dict(base.spec["options"])
    # Changed options give another question: neither a digest nor a split (which holds out half of them) names it.
    base = type(base)(**{**vars(base), "spec": {k: v for k, v in base.spec.items()
                                                if k not in ("question_sha256", "split")}})
    hostile = {
        "terms": (_task(base, task_id="terms", **{"spec.options": {**options, "min_terms": 100_000,
                                                                    "max_terms": 100_000}}), "invalid-task"),
        "bulk": (_task(base, task_id="bulk" + "x" * (200 << 10)), "too-large"),
        "nosuchenv": (_task(base, task_id="nosuchenv", env="nosuchenv"), "wrong-env"),
        # Within the option limits yet a question longer than sampler.max_prompt_tokens.
        "long": (_task(base, task_id="long", **{"spec.options": {**options, "min_terms": 64, "max_terms": 64,
                                                                   "min_digits": 18, "max_digits": 18}}),
                 "too-large"),
        "index": (_task(base, task_id="index", **{"spec.index": 2**40}), "invalid-task"),
    }
    producer = make_producer(kafka_bootstrap)
    for task_id, (value, _) in hostile.items():
        producer.produce(config.topics.tasks, value, key=task_id)
    assert producer.flush(30) == 0
    valid = feed_tasks(config, kafka_bootstrap, 3)

    _run_sampler(config, tmp_path, spawn, len(hostile) + valid)

    letters = _letters(kafka_bootstrap, config.topics.dlq)
    assert {task_id: letter["reason"] for task_id, letter in letters.items()} == {
        task_id: reason for task_id, (_, reason) in hostile.items()}
    assert all(letter["detail"] for letter in letters.values())
    trajectories = [decode(m.value(), Trajectory) for m in read_all(kafka_bootstrap, config.topics.trajectories)]
    assert sorted(t.task_id for t in trajectories) == sorted(t.task_id for t in make_tasks(config.env, 3))


@pytest.mark.slow
def test_a_trajectory_over_the_broker_limit_dead_letters_its_task_and_the_sampler_goes_on(
        kafka_bootstrap, unique_topic_prefix, tiny_config, tmp_path, spawn):
    """With sampler.max_task_bytes raised, a task of 33 MB passes intake; its trajectory repeats the id (id and
    trajectory id) and would be over the broker's 64 MiB: before, producing it raised and the sampler exited 1."""
    config = on_own_topics(tiny_config, kafka_bootstrap, unique_topic_prefix)
    config.policy.max_new_tokens, config.sampler.max_task_bytes = 3, 60 << 20
    base = make_tasks(config.env, 1)[0]
    producer = make_producer(kafka_bootstrap)
    bulky = _task(base, task_id="b" * (33 << 20))
    producer.produce(config.topics.tasks, bulky, key="bulky")
    assert producer.flush(60) == 0
    valid = feed_tasks(config, kafka_bootstrap, 2)

    _run_sampler(config, tmp_path, spawn, 1 + valid)

    letters = _letters(kafka_bootstrap, config.topics.dlq)
    assert list(letters) == ["bulky"] and letters["bulky"]["reason"] == "too-large"
    assert letters["bulky"]["value_bytes"] == len(bulky)  # the original task travels with its dead letter
    trajectories = [decode(m.value(), Trajectory) for m in read_all(kafka_bootstrap, config.topics.trajectories)]
    assert sorted(t.task_id for t in trajectories) == sorted(t.task_id for t in make_tasks(config.env, 2))
