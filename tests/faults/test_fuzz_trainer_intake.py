"""Property-based fuzz of `sao.trajectories` (issue 12, item 5): 10,000 hostile messages through the
trainer's real intake, on the real broker, then the accepted ones through the real training step.

Every message is accepted, dead-lettered with a reason (its bytes, its tokens, its memory spans, ...), or
dropped as a duplicate (nothing raises, nothing vanishes); whatever is accepted trains to a finite loss
and gradient norm, and the weights stay finite.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import msgpack
import numpy as np
import pytest

from sao.schema import Memory, SchemaError, Trajectory, decode, encode, pack_array
from sao.trainer.baselines import RewardBaseline
from sao.trainer.batch import plan_batch, record_rewards
from sao.trainer.training_step import train_step
from sao.trainer.trajectory_stream import TrajectoryStream
from sao.trainer.validation import TrajectoryValidator
from sao.transport.dlq import DeadLetterQueue, describe_dlq_message
from sao.transport.kafka import make_producer, read_all
from support.fault_runs import on_own_topics
from support.hostile_messages import hostile_messages, pack
from support.plain_engine import PlainEngine
from support.trainer_runs import SHIPPED_BASIS, synthetic_trajectory

MESSAGES, PER_ROUND_TRIP = 10_000, 2_000
REDELIVERED_PER_ROUND_TRIP = 10  # copies of messages with an id: a sampler's retry, dropped as duplicates
POLICY_VERSION = 10  # the trainer's; bases are 10, 5 and 0 versions behind it (max_staleness 8)
SCORED, BATCH = 200, 16


def _bases() -> list[dict]:
    """Three valid wire maps: one step or more, a memory table in use, behaviour versions 0, 5 and 10."""
    bases = []
    for index in range(3):
        trajectory = synthetic_trajectory(index, np.random.default_rng(index))
        if index == 1:  # two steps, each slot standing for one of them (spans in order, within the steps)
            memory = Memory(np.ones((2, SHIPPED_BASIS.width), np.int8), np.full(2, 0.01, np.float32),
                            np.array([[0, 0], [1, 1]], np.int32), np.zeros(2, np.float32))
            steps = (trajectory.steps * 2)[:2]
            trajectory = replace(trajectory, memory=memory,
                                 steps=[replace(s, memory_count=min(k + 1, 2)) for k, s in enumerate(steps)])
        trajectory = replace(trajectory, recent_window=1, behaviour_version=POLICY_VERSION - 5 * index,
                             trajectory_id="base#0", task_id="base")
        bases.append(msgpack.unpackb(encode(trajectory), raw=False))
    return bases


def _long_prompts() -> list[dict]:
    """Issue 27: more tokens than trainer.max_trajectory_tokens, yet under the byte bound (random draws rarely
    give that); the shorter ones are valid."""
    return [{**base, "prompt_ids": pack_array(np.full(length, 5), np.int32)}
            for base in _bases() for length in (8, 20, 60, 120, 400, 900)]


def _stamped(messages: list, start: int) -> list[bytes]:
    """Each map gets an id of its own unless its change was to the id itself (so duplicates are deliberate)."""
    packed = []
    for number, message in enumerate(messages, start):
        if isinstance(message, dict) and message.get("trajectory_id") == "base#0":
            message = {**message, "trajectory_id": f"fuzz-{number}#0", "task_id": f"fuzz-{number}"}
        packed.append(pack(message))
    return packed


def _has_an_id(value: bytes, validator: TrajectoryValidator) -> bool:
    """Whether the intake reads this message's trajectory id (so a copy of it is a duplicate)."""
    try:
        validator.check_size(len(value))
        decode(value, Trajectory)
    except SchemaError:
        return False
    return True


@pytest.fixture(scope="module")
def intake(kafka_bootstrap, tiny_config):
    """The trainer's intake as `Trainer.__init__` wires it: its model's validator, its stream and DLQ."""
    from sao.policy.weights import build_policy

    config = on_own_topics(tiny_config, kafka_bootstrap, "fuzz-traj", partitions=2)
    # Small, so that long arrays meet the size check; the arrays drawn stay far below what a model can score.
    config.trainer.max_trajectory_bytes, config.trainer.freshness_decay = 4096, 0.9
    # Small too, so that longer token arrays within the byte bound meet the token bound (issue 27): a valid base's
    # rows hold under 70 tokens in all.
    config.trainer.max_trajectory_tokens = 96
    policy = build_policy(config.policy, SHIPPED_BASIS.width)  # memory as a default trainer reads it
    validator = TrajectoryValidator.for_model(policy, SHIPPED_BASIS.width, config, SHIPPED_BASIS.identity)
    stream = TrajectoryStream(kafka_bootstrap, config.topics.trajectories,
                              DeadLetterQueue(make_producer(kafka_bootstrap), config.topics.dlq),
                              config.trainer.max_staleness, validator, None, set(), config.topics.trainer_group)
    yield config, policy, validator, stream
    stream.close()


def _dead_lettered_or_usable(validator: TrajectoryValidator):
    """The property in process, per drawn message: only SchemaError may come out of decoding and validation."""
    def check(message) -> None:
        value = pack(message)
        try:
            validator.check_size(len(value))
            validator.validate(decode(value, Trajectory), POLICY_VERSION)
        except SchemaError:
            pass
    return check


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e39 as float32, on purpose
def test_every_hostile_trajectory_is_accepted_or_dead_lettered_and_what_is_accepted_trains_finite(
        intake, kafka_bootstrap):
    config, policy, validator, stream = intake
    long_prompts = _long_prompts()
    drawn = hostile_messages(_bases(), "trajectory", MESSAGES - len(long_prompts), _dead_lettered_or_usable(validator))
    drawn = [message for pair in zip(drawn, long_prompts) for message in pair] + drawn[len(long_prompts):]
    producer = make_producer(kafka_bootstrap)
    produced, accepted = [], []
    for start in range(0, len(drawn), PER_ROUND_TRIP):
        batch = _stamped(drawn[start:start + PER_ROUND_TRIP], start)
        batch += [value for value in batch if _has_an_id(value, validator)][:REDELIVERED_PER_ROUND_TRIP]
        for value in batch:
            producer.produce(config.topics.trajectories, value)
        assert producer.flush(60) == 0
        produced += batch
        counters, deadline = stream.counters, time.monotonic() + 60
        while counters.consumed + counters.dead_lettered + counters.duplicates < len(produced):
            assert time.monotonic() < deadline, f"{len(produced)} produced, yet after 60 s only {counters}"
            accepted += stream.poll(PER_ROUND_TRIP, POLICY_VERSION, timeout=0.5)
    assert stream.dlq.flush(30) == 0

    counters = stream.counters
    assert counters.consumed + counters.dead_lettered + counters.duplicates == len(produced) == MESSAGES + 50
    assert len(accepted) == counters.consumed and counters.duplicates >= 5 * REDELIVERED_PER_ROUND_TRIP, counters
    letters = [describe_dlq_message(m) for m in read_all(kafka_bootstrap, config.topics.dlq, timeout=120)]
    assert len(letters) == counters.dead_lettered
    assert all(letter["reason"] and letter["detail"] for letter in letters)
    reasons = {letter["reason"] for letter in letters}
    # The fuzz reached every gate: the envelope, the schema, the size, validation against the model, staleness.
    assert {"decode-error", "schema-version", "wrong-kind", "invalid-field", "too-large", "invalid-token",
            "out-of-range", "non-finite", "future-version", "too-stale", "invalid-memory"} <= reasons, reasons
    assert any("trainer.max_trajectory_tokens" in letter["detail"] for letter in letters)  # tokens, not bytes
    assert any("memory.spans" in letter["detail"] for letter in letters)
    assert counters.consumed > 1000, counters

    _train_on(_extremes_and_a_spread(accepted), policy, config.trainer)


# What makes a trajectory hard to score; the most extreme accepted ones by each are scored for sure.
EXTREMES = {
    "reward": lambda t: max(abs(step.reward) for step in t.steps),
    "log-prob": lambda t: -min(float(step.behaviour_logprobs.min()) for step in t.steps),
    "memory scale": lambda t: float(t.memory.scales.max(initial=0.0)),
    "temperature": lambda t: abs(math.log(t.temperature)),
}
PER_EXTREME = 20


def _extremes_and_a_spread(entries: list) -> list:
    """SCORED entries: the PER_EXTREME most extreme by each of EXTREMES, then an even spread of the others."""
    chosen = {}
    for extremity in EXTREMES.values():
        for entry in sorted(entries, key=lambda entry: extremity(entry.trajectory), reverse=True)[:PER_EXTREME]:
            chosen[id(entry)] = entry
    others = [entry for entry in entries if id(entry) not in chosen]
    spread = others[::len(others) // (SCORED - len(chosen))]
    return (list(chosen.values()) + spread)[:SCORED]


def _train_on(entries: list, policy, cfg) -> None:
    """Batches of accepted trajectories through `train_step`: none dead-lettered, every figure and weight finite."""
    engine, baseline = PlainEngine(policy, cfg), RewardBaseline(cfg.baseline_key, cfg.baseline_momentum)
    for start in range(0, len(entries), BATCH):
        trajectories = [entry.trajectory for entry in entries[start:start + BATCH]]
        plan = plan_batch(trajectories, baseline, cfg, POLICY_VERSION)
        outcome = train_step(engine, plan, lambda kept: plan_batch(kept, baseline, cfg, POLICY_VERSION), cfg,
                             SHIPPED_BASIS.width, 1)
        assert outcome.applied and outcome.dead_letters == [], [t.trajectory_id for t, _, _ in outcome.dead_letters]
        assert math.isfinite(outcome.stats.loss) and math.isfinite(engine.grad_norm), trajectories
        record_rewards(outcome.plan, baseline)
        assert engine.weights_are_finite(), trajectories
