"""The trajectory stream on the real broker: dead letters count once, and a resume never meets them again."""

import time
from dataclasses import replace

import numpy as np

from sao.schema import encode
from sao.status import TrainerProgress
from sao.trainer.trajectory_stream import TrajectoryStream
from sao.trainer.validation import TrajectoryValidator
from sao.transport.dlq import DeadLetterQueue
from sao.transport.kafka import make_producer, read_all
from sao.transport.topics import ensure_topics
from support.trainer_runs import synthetic_trajectory

VALIDATOR = TrajectoryValidator(vocab_size=49152, memory_width=384, max_abs_reward=1e4, max_bytes=1 << 20)


def drain(stream: TrajectoryStream, messages: int, timeout: float = 60) -> list:
    """Poll until `messages` were accepted, dead-lettered or dropped as duplicates."""
    accepted, deadline = [], time.monotonic() + timeout
    counters = stream.counters
    while counters.consumed + counters.dead_lettered + counters.duplicates < messages:
        assert time.monotonic() < deadline, counters
        accepted += stream.poll(10, policy_version=0, timeout=0.5)
    return accepted


def test_dead_letters_behind_a_buffered_trajectory_are_not_met_again_after_a_resume(kafka_bootstrap, unique_topic_prefix):
    traj, dlq_topic = f"{unique_topic_prefix}.traj", f"{unique_topic_prefix}.dlq"
    ensure_topics(kafka_bootstrap, {traj: 1, dlq_topic: 1})
    rng = np.random.default_rng(0)
    first_good, last_good = synthetic_trajectory(0, rng), synthetic_trajectory(1, rng)
    wrong_token = replace(synthetic_trajectory(2, rng), prompt_ids=np.array([-5], np.int32))
    producer = make_producer(kafka_bootstrap)
    for key, value in [("task-0", encode(first_good)), ("garbage", b"\x93not a trajectory"),
                       ("task-2", encode(wrong_token)), ("task-1", encode(last_good)), ("big", b"x" * (2 << 20))]:
        producer.produce(traj, value, key=key)
    assert producer.flush(30) == 0
    dlq = DeadLetterQueue(make_producer(kafka_bootstrap), dlq_topic)

    first = TrajectoryStream(kafka_bootstrap, traj, dlq, 1000, VALIDATOR, group_id=f"{unique_topic_prefix}-a")
    accepted = drain(first, 5)
    assert [e.trajectory.trajectory_id for e in accepted] == [first_good.trajectory_id, last_good.trajectory_id]
    assert first.counters.reasons == {"decode-error": 1, "invalid-token": 1, "too-large": 1}
    # The loop dead-letters task-1 later (say it raised while scored): still 5 messages handled, not 6.
    first.dead_letter_entry(accepted[1], "scoring-error", "IndexError")
    assert TrainerProgress(**first.counters.counts()).handled == 5
    # A checkpoint now, with task-0 still buffered, stores its offset and the dead letters above it.
    offsets = first.safe_offsets({0: accepted[0].offset})
    dead_lettered = first.dead_lettered_above(offsets)
    assert offsets == {0: 0} and dead_lettered == {0: [1, 2, 3, 4]}
    seen = first.seen_ids - {first_good.trajectory_id}
    first.close()
    dlq.flush(10)

    second = TrajectoryStream(kafka_bootstrap, traj, dlq, 1000, VALIDATOR, offsets, seen,
                              f"{unique_topic_prefix}-b", dead_lettered)
    assert [e.trajectory.trajectory_id for e in drain(second, 5)] == [first_good.trajectory_id]
    assert second.counters.dead_lettered == 0 and second.counters.duplicates == 4
    second.close()
    dlq.flush(10)
    letters = read_all(kafka_bootstrap, dlq_topic, timeout=20)
    assert sorted(m.key() for m in letters) == [b"big", b"garbage", b"task-1", b"task-2"]
    assert [len(m.value()) for m in letters if m.key() == b"big"] == [2 << 20]
