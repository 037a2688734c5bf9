"""A trajectory is checked against the trainer's model before it is buffered (issue 12, item 1).

Unit tests of `TrajectoryValidator`, a fuzz test (whatever passes validation scores to a finite
loss and gradient on the tiny model), and the findings end to end: a real trainer on the real
broker stays alive, dead-letters each bad trajectory with its reason, trains the good ones, and a
`--resume` never meets the bad ones again.
"""

import copy
import json
import math
import subprocess
from dataclasses import replace

import msgpack
import numpy as np
import pytest
import torch

from sao.config import TrainerConfig
from sao.schema import SchemaError, Trajectory, decode, encode, pack_array
from sao.trainer.baselines import RewardBaseline
from sao.trainer.batch import all_rows, plan_batch, rank_loss
from sao.trainer.validation import TrajectoryValidator
from sao.transport.topics import ensure_topics
from support.bad_trajectories import CORRUPTIONS, big_valid_trajectory
from support.trainer_runs import (
    SHIPPED_BASIS,
    dead_letters,
    latest_weights_are_finite,
    produce,
    synthetic_trajectory,
    trained_ids,
    trainer_command,
    write_config,
)

VOCAB = 49152  # the tiny model's (SmolLM2's tokenizer)


@pytest.fixture(scope="module")
def validator() -> TrajectoryValidator:
    return TrajectoryValidator(vocab_size=VOCAB, memory_width=SHIPPED_BASIS.width, max_abs_reward=1e4,
                               max_bytes=16 << 20, max_turns=4, env="arithmetic", memory_basis=SHIPPED_BASIS.identity,
                               max_tokens=65536, max_positions=1024)  # the tiny model's positions


def valid(index: int = 0) -> Trajectory:
    return synthetic_trajectory(index, np.random.default_rng(index))


def over_the_wire(trajectory: Trajectory) -> Trajectory:
    return decode(encode(trajectory), Trajectory)


@pytest.mark.parametrize("finding", list(CORRUPTIONS))
def test_each_finding_decodes_but_is_refused_naming_its_field(validator, finding):
    corrupt, reason, field = CORRUPTIONS[finding]
    trajectory = over_the_wire(corrupt(valid()))  # the schema alone lets every one of them through
    with pytest.raises(SchemaError) as refused:
        validator.validate(trajectory, policy_version=3)
    assert (refused.value.reason, refused.value.field) == (reason, field)


def test_valid_trajectories_pass_at_the_edges(validator):
    base = valid()
    validator.validate(over_the_wire(base), policy_version=0)  # behaviour version = trainer version
    edge = replace(base, prompt_ids=np.array([0, VOCAB - 1], np.int32), temperature=1e-3)
    validator.validate(over_the_wire(edge), policy_version=0)
    # Without prompt or observation, a later step still conditions on the earlier turn it sees in full.
    two_turns = synthetic_trajectory(1, np.random.default_rng(5))
    while len(two_turns.steps) < 2:
        two_turns = replace(two_turns, steps=two_turns.steps * 2)
    later = replace(two_turns, prompt_ids=np.zeros(0, np.int32), recent_window=1,
                    steps=[two_turns.steps[0], replace(two_turns.steps[1], observation_ids=np.zeros(0, np.int32))])
    validator.validate(over_the_wire(later), policy_version=0)
    with pytest.raises(SchemaError, match="steps\\[1\\]"):
        validator.validate(over_the_wire(replace(later, recent_window=0)), policy_version=0)


def _four_steps() -> Trajectory:
    base = valid()
    return replace(base, steps=[replace(base.steps[0], reward=0.0) for _ in range(4)])


def _in_step(index: int, **changes):
    """A corruption: step `index` gets `changes`, each a function of that step's old value."""
    def corrupt(trajectory: Trajectory) -> Trajectory:
        steps = list(trajectory.steps)
        steps[index] = replace(steps[index], **{name: change(getattr(steps[index], name))
                                                for name, change in changes.items()})
        return replace(trajectory, steps=steps)
    return corrupt


def _last(value):
    """Replace the last element of an array (a token id or a log-prob)."""
    def change(array: np.ndarray) -> np.ndarray:
        array = array.copy()
        array[-1] = value
        return array
    return change


@pytest.mark.parametrize("corruptions, reason, field", [
    ([_in_step(3, action_ids=_last(10**6))], "invalid-token", "steps[3].action_ids"),
    ([_in_step(2, observation_ids=_last(-1))], "invalid-token", "steps[2].observation_ids"),
    ([_in_step(1, action_ids=_last(-(2**31)))], "invalid-token", "steps[1].action_ids"),
    ([_in_step(2, observation_ids=_last(VOCAB))], "invalid-token", "steps[2].observation_ids"),
    # With several faults, the one named is the first a step-by-step reading meets:
    ([_in_step(3, action_ids=_last(VOCAB)), _in_step(1, observation_ids=_last(-5))], "invalid-token",
     "steps[1].observation_ids"),
    ([_in_step(2, observation_ids=_last(VOCAB)), lambda t: replace(t, prompt_ids=_last(-1)(t.prompt_ids))],
     "invalid-token", "prompt_ids"),
    ([_in_step(2, behaviour_logprobs=_last(-1e30))], "out-of-range", "steps[2].behaviour_logprobs"),
    ([_in_step(3, behaviour_logprobs=_last(-81.0)), _in_step(1, reward=lambda _: 1e5)], "out-of-range",
     "steps[1].reward"),
    ([_in_step(1, behaviour_logprobs=_last(-1e30)), _in_step(3, reward=lambda _: 1e5)], "out-of-range",
     "steps[1].behaviour_logprobs"),
])
def test_faults_in_later_steps_are_named_by_step(validator, corruptions, reason, field):
    trajectory = _four_steps()
    for corrupt in corruptions:
        trajectory = corrupt(trajectory)
    with pytest.raises(SchemaError) as refused:
        validator.validate(over_the_wire(trajectory), policy_version=3)
    assert (refused.value.reason, refused.value.field) == (reason, field)


def test_ids_and_log_probs_at_the_edges_pass_in_every_step(validator):
    trajectory = _four_steps()
    for index in range(4):
        trajectory = _in_step(index, observation_ids=_last(0), action_ids=_last(VOCAB - 1),
                              behaviour_logprobs=_last(-80.0))(trajectory)
    validator.validate(over_the_wire(trajectory), policy_version=0)


def test_an_empty_memory_passes_whatever_its_width_or_basis(validator):
    """No slot holds anything coded in a basis, and the policy saw no memory: a 2-turn episode of a sampler with
    another compression.bottleneck is still valid data (its memory-bearing episodes are what gets refused)."""
    from sao.schema import Memory

    for width, basis in ((384, ""), (7, "another/pca7/0")):
        validator.validate(over_the_wire(replace(valid(), memory=Memory.empty(width), memory_basis=basis)), 0)


def test_tokens_are_bounded_per_row_and_in_all(validator):
    """Issue 27: a byte bound is not a token bound. Rows count the prompt, the memory slots a step sees and the
    recent steps it sees in full, as scoring builds them."""
    four = replace(_four_steps(), recent_window=2)
    row = len(four.prompt_ids) + len(four.steps[0].observation_ids) + len(four.steps[0].action_ids)
    pair = row - len(four.prompt_ids)
    rows = [row + pair * min(i, 2) for i in range(4)]  # each sees up to two earlier steps in full
    exact = replace(validator, max_tokens=sum(rows), max_positions=max(rows))
    exact.validate(over_the_wire(four), policy_version=0)
    with pytest.raises(SchemaError, match="steps\\[2\\]") as refused:  # the first of the longest rows
        replace(exact, max_positions=max(rows) - 1).validate(over_the_wire(four), policy_version=0)
    assert refused.value.reason == "too-large"
    with pytest.raises(SchemaError, match=r"trainer\.max_trajectory_tokens") as refused:
        replace(exact, max_tokens=sum(rows) - 1).validate(over_the_wire(four), policy_version=0)
    assert (refused.value.reason, refused.value.field) == ("too-large", "steps")


def test_rows_must_fit_one_training_pass(validator):
    """trainer.micro_batch_tokens bounds what one pass computes: a longer row (or, with sequence-level
    importance, a trajectory whose rows must share a pass) is refused before any tensor is built."""
    four = replace(_four_steps(), recent_window=2)
    row = len(four.prompt_ids) + len(four.steps[0].observation_ids) + len(four.steps[0].action_ids)
    pair = row - len(four.prompt_ids)
    rows = [row + pair * min(i, 2) for i in range(4)]
    replace(validator, max_pass_tokens=max(rows)).validate(over_the_wire(four), policy_version=0)
    with pytest.raises(SchemaError, match=r"trainer\.micro_batch_tokens") as refused:
        replace(validator, max_pass_tokens=max(rows) - 1).validate(over_the_wire(four), policy_version=0)
    assert (refused.value.reason, refused.value.field) == ("too-large", "steps[2]")
    whole = replace(validator, max_pass_tokens=4 * max(rows), whole_trajectory_pass=True)
    whole.validate(over_the_wire(four), policy_version=0)
    with pytest.raises(SchemaError, match="importance_level") as refused:
        replace(whole, max_pass_tokens=4 * max(rows) - 1).validate(over_the_wire(four), policy_version=0)
    assert (refused.value.reason, refused.value.field) == ("too-large", "steps")


@pytest.mark.parametrize("spans", [[[0, 0], [0, 1]], [[1, 0]], [[0, 1], [3, 3]]])
def test_memory_spans_must_be_ordered_and_within_the_steps(validator, spans):
    from sao.schema import Memory

    four = _four_steps()
    slots = len(spans)
    memory = Memory(np.ones((slots, SHIPPED_BASIS.width), np.int8), np.full(slots, 0.01, np.float32),
                    np.array(spans, np.int32), np.zeros(slots, np.float32))
    trajectory = replace(four, memory=memory, steps=[*four.steps[:3], replace(four.steps[3], memory_count=slots)])
    if spans == [[0, 1], [3, 3]]:  # the last step's own index is in range: only spans past it are refused
        validator.validate(over_the_wire(trajectory), policy_version=0)
        trajectory = replace(trajectory, steps=trajectory.steps[:3])
    with pytest.raises(SchemaError) as refused:
        validator.validate(over_the_wire(trajectory), policy_version=0)
    assert refused.value.reason == "invalid-memory" and refused.value.field.startswith("memory.spans[")


def test_size_is_checked_before_decoding(validator):
    validator.check_size(16 << 20)
    with pytest.raises(SchemaError) as refused:
        validator.check_size((16 << 20) + 1)
    assert refused.value.reason == "too-large"


def test_limits_come_from_the_model_the_trainer_built(tiny_config):
    from sao.policy.weights import build_policy

    validator = TrajectoryValidator.for_model(build_policy(tiny_config.policy, 384), 384, tiny_config)
    assert (validator.vocab_size, validator.memory_width) == (VOCAB, 384)
    assert validator.max_abs_reward == tiny_config.trainer.max_abs_reward
    assert validator.max_bytes == tiny_config.trainer.max_trajectory_bytes
    assert (validator.max_tokens, validator.max_positions) == (tiny_config.trainer.max_trajectory_tokens, 1024)
    assert (validator.max_pass_tokens, validator.whole_trajectory_pass) == (tiny_config.trainer.micro_batch_tokens, False)


# --- fuzz: whatever passes validation can be scored --------------------------------------------

_FLOATS = [math.nan, math.inf, -math.inf, 1e39, -1e39, 1e300, 3.4e38, 1e4, -1e4, 0.0, -0.0, 1e-30, -1.0, 1.0, 5.0,
           -80.0, -81.0, 1e-3, 1e3]
_INTS = [-(2**31), -5, -1, 0, 1, 3, VOCAB - 1, VOCAB, 10**6, 2**31 - 1]


def _mutate(wire: dict, rng: np.random.Generator) -> bytes:
    """Change 1-3 random fields of a trajectory's wire map to hostile values; the bytes."""
    obj = copy.deepcopy(wire)
    steps = obj["steps"]
    index = int(rng.integers(len(steps["rewards"])))  # the step whose scalars change
    for _ in range(int(rng.integers(1, 4))):
        target = int(rng.integers(8))
        if target == 0:
            obj[str(rng.choice(["temperature", "top_p", "created_at"]))] = float(rng.choice(_FLOATS))
        elif target == 1:
            obj[str(rng.choice(["behaviour_version", "recent_window"]))] = int(rng.choice(_INTS + [2**40]))
        elif target == 2:
            steps["rewards"][index] = float(rng.choice(_FLOATS))
        elif target == 3:  # token ids: a new prompt, or hostile ids somewhere in the steps' buffer
            if rng.random() < 0.5:
                obj["prompt_ids"] = pack_array(rng.choice(_INTS, int(rng.integers(0, 4))), np.int32)
            else:
                ids = np.frombuffer(steps["token_ids"]["data"], np.int32).copy()
                ids[rng.integers(len(ids), size=int(rng.integers(1, 4)))] = rng.choice(_INTS)
                steps["token_ids"] = pack_array(ids, np.int32)
        elif target == 4:
            count = len(np.frombuffer(steps["behaviour_logprobs"]["data"], np.float32))
            steps["behaviour_logprobs"] = pack_array(rng.choice(_FLOATS, count), np.float32)
        else:  # memory: width, slot count, scales, and which slots the steps see
            slots, width = int(rng.integers(0, 3)), int(rng.choice([0, 7, SHIPPED_BASIS.width, 384]))
            obj["memory"] = {"vectors": pack_array(rng.integers(-127, 128, (slots, width)), np.int8),
                             "scales": pack_array(rng.choice(_FLOATS, slots), np.float32),
                             "spans": pack_array(np.zeros((slots, 2)), np.int32),
                             "reward_sums": pack_array(rng.choice(_FLOATS, slots), np.float32)}
            steps["memory_counts"] = [int(rng.integers(0, slots + 1)) for _ in steps["memory_counts"]]
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e39 as float32, on purpose
def test_whatever_passes_validation_scores_to_a_finite_loss_and_gradient(tiny_config, validator):
    """Issue 12: of 2,000 malformed messages, 243 decoded and then crashed the scoring path."""
    from sao.policy.weights import build_policy

    class Engine:  # rank_loss needs only a callable module and its device
        def __init__(self, module):
            self.module, self.device = module, torch.device("cpu")

        def __call__(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    policy = build_policy(tiny_config.policy, SHIPPED_BASIS.width)
    cfg = TrainerConfig(freshness_decay=0.9)  # freshness ** staleness crashed on a future behaviour version
    rng = np.random.default_rng(12)
    wire = msgpack.unpackb(encode(replace(valid(), recent_window=1)), raw=False)
    partner = over_the_wire(valid(1))
    outcomes = {"refused": 0, "scored": 0}
    for _ in range(300):
        try:
            trajectory = decode(_mutate(wire, rng), Trajectory)
            validator.validate(trajectory, policy_version=2)
        except SchemaError:
            outcomes["refused"] += 1
            continue
        plan = plan_batch([trajectory, partner], RewardBaseline(), cfg, policy_version=2)
        loss, _ = rank_loss(Engine(policy), plan, all_rows(plan, [0, 1]), 2, cfg, SHIPPED_BASIS.width)
        policy.zero_grad()
        loss.backward()
        assert torch.isfinite(loss), trajectory
        assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None), trajectory
        outcomes["scored"] += 1
    assert outcomes["refused"] > 100 and outcomes["scored"] > 30, outcomes  # both sides were exercised


# --- end to end: a real trainer on the real broker ---------------------------------------------

@pytest.mark.slow
def test_trainer_dead_letters_each_finding_trains_the_rest_and_resumes_past_them(
        kafka_bootstrap, unique_topic_prefix, tmp_path):
    prefix = unique_topic_prefix
    ensure_topics(kafka_bootstrap, {f"{prefix}.traj": 1, f"{prefix}.policy": 1, f"{prefix}.dlq": 1})
    rng = np.random.default_rng(0)
    good = [synthetic_trajectory(i, rng) for i in range(9)]
    bad, expected = [], {}
    for i, (finding, (corrupt, reason, field)) in enumerate(CORRUPTIONS.items()):
        trajectory = replace(corrupt(good[i % 6]), trajectory_id=f"bad-{i}#0", task_id=f"bad-{i}")
        bad.append(trajectory)
        expected[trajectory.task_id] = (reason, field, finding)
    huge = replace(big_valid_trajectory(good[0], 50 << 20), trajectory_id="huge#0", task_id="huge")
    expected["huge"] = ("too-large", "value", "a valid 50 MB message")
    interleaved = [t for pair in zip(bad[:6], good[:6]) for t in pair] + bad[6:] + [huge]
    produce(kafka_bootstrap, f"{prefix}.traj", interleaved)
    config, run_dir = tmp_path / "sao.toml", tmp_path / "run"
    write_config(config, prefix, checkpoint_every=100, freshness_decay=0.5)
    first = subprocess.run(trainer_command(config, kafka_bootstrap, run_dir, expect=len(interleaved)),
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]

    letters = dead_letters(kafka_bootstrap, f"{prefix}.dlq")
    assert set(letters) == set(expected)
    for key, (reason, field, finding) in expected.items():
        assert letters[key]["reason"] == reason, (finding, letters[key])
        assert field in letters[key]["detail"], (finding, letters[key]["detail"])
    assert letters["huge"]["value_bytes"] == len(encode(huge))  # the original bytes travel with the dead letter
    assert sorted(trained_ids(run_dir)) == sorted(t.trajectory_id for t in good[:6])
    status = json.loads((run_dir / "status" / "trainer.json").read_text())
    assert status["dead_lettered"] == len(expected) and status["skipped_steps"] == {}
    assert latest_weights_are_finite(run_dir)

    # A resumed trainer starts past them: it trains the new trajectories and refuses nothing again.
    produce(kafka_bootstrap, f"{prefix}.traj", good[6:])
    second = subprocess.run(trainer_command(config, kafka_bootstrap, run_dir, "--resume", expect=len(interleaved) + 3),
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert set(dead_letters(kafka_bootstrap, f"{prefix}.dlq")) == set(expected)
    assert sorted(trained_ids(run_dir)) == sorted(t.trajectory_id for t in good)
    assert json.loads((run_dir / "status" / "trainer.json").read_text())["dead_lettered"] == 0
    assert latest_weights_are_finite(run_dir)
