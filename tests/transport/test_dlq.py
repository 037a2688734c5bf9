"""Dead-letter queue: original bytes kept, reason in headers, a counted metric."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from sao.schema import Task, Trajectory, encode
from sao.transport.dlq import DeadLetteredTasks, DeadLetterQueue, describe_dlq_message
from sao.transport.kafka import make_producer, read_all
from sao.transport.topics import ensure_topics


def _dlq_count(reason: str) -> float:
    return REGISTRY.get_sample_value("sao_dlq_messages_total", {"reason": reason}) or 0.0


def test_a_reason_outside_the_vocabulary_is_refused_before_anything_is_sent() -> None:
    class NoProducer:  # reached only if the reason passed
        def produce(self, *args, **kwargs):
            raise AssertionError("produced a dead letter with an unknown reason")

    with pytest.raises(ValueError, match="not-a-reason"):
        DeadLetterQueue(NoProducer(), "t").send(b"x", "not-a-reason")


def test_dead_letters_keep_bytes_and_say_why(kafka_bootstrap: str, unique_topic_prefix: str) -> None:
    topic = f"{unique_topic_prefix}.dlq"
    ensure_topics(kafka_bootstrap, {topic: 1})
    dlq = DeadLetterQueue(make_producer(kafka_bootstrap), topic)
    garbage = b"\x00\xffnot msgpack\x00"
    decode_before, stale_before = _dlq_count("decode-error"), _dlq_count("too-stale")

    dlq.send(
        garbage, "decode-error",
        source_topic="trajectories", partition=2, offset=17, key="traj-9", detail="bad magic byte",
    )
    dlq.send(b"", "too-stale")
    assert dlq.flush(10) == 0

    decoded, stale = read_all(kafka_bootstrap, topic)
    assert decoded.value() == garbage and decoded.key() == b"traj-9"
    assert describe_dlq_message(decoded) | {"dlq_offset": None} == {
        "reason": "decode-error",
        "detail": "bad magic byte",
        "source_topic": "trajectories",
        "source_partition": 2,
        "source_offset": 17,
        "key": b"traj-9",
        "value_bytes": len(garbage),
        "dlq_topic": topic,
        "dlq_partition": 0,
        "dlq_offset": None,
    }
    stale_info = describe_dlq_message(stale)
    assert (stale_info["reason"], stale_info["value_bytes"], stale_info["source_topic"]) == ("too-stale", 0, None)
    assert _dlq_count("decode-error") == decode_before + 1
    assert _dlq_count("too-stale") == stale_before + 1


def _count_when_settled(reader: DeadLetteredTasks, at_least: int, handled_ids=frozenset()) -> int:
    """The reader's count once it reached `at_least`, after a further second of refreshes (so a late
    overcount would show); the reader never blocks, so it is refreshed until then."""
    deadline = time.monotonic() + 30
    while reader.count(handled_ids) < at_least and time.monotonic() < deadline:
        reader.refresh(now=True)
        time.sleep(0.1)
    settle = time.monotonic() + 1.0
    while time.monotonic() < settle:
        reader.refresh(now=True)
        time.sleep(0.1)
    return reader.count(handled_ids)


def test_tasks_dead_lettered_count_once_each_and_again_after_a_restart(kafka_bootstrap, unique_topic_prefix):
    tasks_topic, dlq_topic = f"{unique_topic_prefix}.tasks", f"{unique_topic_prefix}.dlq"
    ensure_topics(kafka_bootstrap, {dlq_topic: 1})
    dlq = DeadLetterQueue(make_producer(kafka_bootstrap), dlq_topic)
    failed, recovered = Task("t-1", "arithmetic", {}, copy=0), Task("t-2", "arithmetic", {}, copy=1)
    # A task a sampler dead-lettered, then (dying before its commit) again once it was delivered anew.
    for _ in range(2):
        dlq.send(encode(failed), "env-error", source_topic=tasks_topic, partition=1, offset=4, key=failed.task_id)
    dlq.send(b"\x93garbage", "decode-error", source_topic=tasks_topic, partition=0, offset=9)  # undecodable task
    dlq.send(encode(recovered), "env-timeout", source_topic=tasks_topic, partition=0, offset=2, key=recovered.task_id)
    # Not tasks: a trajectory the trainer dead-lettered, and a dead letter that says not where it came from.
    dlq.send(b"trajectory", "too-stale", source_topic=f"{unique_topic_prefix}.traj", partition=0, offset=4)
    dlq.send(encode(failed), "env-error", source_topic=tasks_topic)
    assert dlq.flush(10) == 0

    reader = DeadLetteredTasks(kafka_bootstrap, dlq_topic, tasks_topic)
    try:
        assert _count_when_settled(reader, 3) == 3
        assert reader.reasons() == {"env-error": 1, "decode-error": 1, "env-timeout": 1}
        # t-2's trajectory was trained after all (a sampler redid it): it counts there, not here.
        assert reader.count({Trajectory.make_id("t-2", 1)}) == 2
        assert reader.reasons({Trajectory.make_id("t-2", 1)}) == {"env-error": 1, "decode-error": 1}
    finally:
        reader.close()
    restarted = DeadLetteredTasks(kafka_bootstrap, dlq_topic, tasks_topic)  # a new life reads the topic anew
    try:
        assert _count_when_settled(restarted, 3) == 3
    finally:
        restarted.close()


def test_a_missing_dead_letter_topic_counts_nothing_yet(kafka_bootstrap, unique_topic_prefix):
    reader = DeadLetteredTasks(kafka_bootstrap, f"{unique_topic_prefix}.nowhere", f"{unique_topic_prefix}.tasks")
    reader.refresh(now=True)
    assert reader.count() == 0 and reader.consumer is None  # tried again at the next refresh
