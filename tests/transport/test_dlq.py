"""Dead-letter queue: original bytes kept, reason in headers, a counted metric."""

from __future__ import annotations

from prometheus_client import REGISTRY

from sao.transport.dlq import DeadLetterQueue, describe_dlq_message
from sao.transport.kafka import make_producer, read_all
from sao.transport.topics import ensure_topics


def _dlq_count(reason: str) -> float:
    return REGISTRY.get_sample_value("sao_dlq_messages_total", {"reason": reason}) or 0.0


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
