"""Wire format: round trips, and every kind of bad message is rejected naming its field."""

import msgpack
import numpy as np
import pytest

from sao.schema import (
    SCHEMA_VERSION,
    Memory,
    PolicyAnnouncement,
    SchemaError,
    Step,
    Task,
    Trajectory,
    decode,
    encode,
    pack_array,
)


def make_trajectory(steps: int = 2, slots: int = 1) -> Trajectory:
    rng = np.random.default_rng(0)
    memory = Memory(vectors=rng.integers(-127, 128, (slots, 8), dtype=np.int8),
                    scales=np.full(slots, 0.01, np.float32),
                    spans=np.array([[i, i] for i in range(slots)], np.int32).reshape(slots, 2),
                    reward_sums=np.zeros(slots, np.float32))
    return Trajectory(
        trajectory_id="t#0", task_id="t", env="arithmetic", sampler_id="s0", behaviour_version=3,
        prompt_ids=np.arange(5, dtype=np.int32),
        steps=[Step(observation_ids=np.array([1, 2], np.int32), action_ids=np.array([3, 4, 5], np.int32),
                    behaviour_logprobs=np.array([-0.1, -2.0, -0.5], np.float32), reward=float(i == steps - 1),
                    done=i == steps - 1, memory_count=min(i, slots))
               for i in range(steps)],
        memory=memory, temperature=1.0, encoder="mini", recent_window=1,
        timings={"rollout_s": 1.5}, compression={"ratio": 2.0})


def test_trajectory_round_trip_is_exact():
    original = make_trajectory(steps=3, slots=2)
    restored = decode(encode(original), Trajectory)
    assert restored.trajectory_id == original.trajectory_id and restored.behaviour_version == 3
    assert restored.total_reward == original.total_reward == 1.0
    for a, b in zip(original.steps, restored.steps):
        np.testing.assert_array_equal(a.action_ids, b.action_ids)
        np.testing.assert_array_equal(a.behaviour_logprobs, b.behaviour_logprobs)
        assert a.memory_count == b.memory_count
    np.testing.assert_array_equal(restored.memory.vectors, original.memory.vectors)
    np.testing.assert_allclose(restored.memory.dequantized(2), original.memory.dequantized(2))
    assert restored.timings == {"rollout_s": 1.5} and restored.compression == {"ratio": 2.0}


def test_task_and_announcement_round_trip():
    task = Task(task_id="a/0/1", env="arithmetic", spec={"index": 1, "options": {"x": [1, 2]}}, attempt=2)
    assert decode(encode(task), Task) == task
    ann = PolicyAnnouncement(policy_version=4, weights_path="/w.safetensors", sha256="ab" * 32, num_bytes=10, trainer_step=8)
    assert decode(encode(ann), PolicyAnnouncement) == ann


def test_arrays_are_plain_msgpack_readable_without_sao():
    obj = msgpack.unpackb(encode(make_trajectory()), raw=False)
    assert obj["schema"] == SCHEMA_VERSION and obj["kind"] == "trajectory"
    step = obj["steps"][0]["action_ids"]
    assert step["dtype"] == "<i4"
    assert np.frombuffer(step["data"], "<i4").tolist() == [3, 4, 5]


def _mutate(mutation) -> bytes:
    obj = msgpack.unpackb(encode(make_trajectory()), raw=False)
    mutation(obj)
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("mutation, reason, field", [
    (lambda o: o.update(schema=99), "schema-version", "schema"),
    (lambda o: o.pop("schema"), "schema-version", "schema"),
    (lambda o: o.update(kind="task"), "wrong-kind", "kind"),
    (lambda o: o.pop("task_id"), "invalid-field", "task_id"),
    (lambda o: o.update(behaviour_version="3"), "invalid-field", "behaviour_version"),
    (lambda o: o.update(behaviour_version=-1), "invalid-field", "behaviour_version"),
    (lambda o: o.update(temperature=0), "invalid-field", "temperature"),
    (lambda o: o.update(top_p=1.5), "invalid-field", "top_p"),
    (lambda o: o.update(top_p="0.9"), "invalid-field", "top_p"),
    (lambda o: o.update(steps=[]), "invalid-field", "steps"),
    (lambda o: o["steps"][0].update(behaviour_logprobs=pack_array(np.array([-1.0], np.float32), np.float32)),
     "invalid-field", "steps[0].behaviour_logprobs"),
    (lambda o: o["steps"][1].update(behaviour_logprobs=pack_array(np.array([0.5, -1, -1], np.float32), np.float32)),
     "invalid-field", "steps[1].behaviour_logprobs"),
    (lambda o: o["steps"][0]["action_ids"].update(data=b"\x00" * 5), "invalid-field", "steps[0].action_ids"),
    (lambda o: o["steps"][0]["action_ids"].update(dtype="<f8"), "invalid-field", "steps[0].action_ids"),
    (lambda o: o["steps"][1].update(memory_count=7), "invalid-field", "steps[1].memory_count"),
    (lambda o: o["steps"][1].update(memory_count=-1), "invalid-field", "steps[1].memory_count"),
    (lambda o: o["steps"][0].update(reward=True), "invalid-field", "steps[0].reward"),
])
def test_bad_trajectories_are_rejected_naming_the_field(mutation, reason, field):
    with pytest.raises(SchemaError) as err:
        decode(_mutate(mutation), Trajectory)
    assert err.value.reason == reason
    assert err.value.field == field


def test_a_task_policy_version_is_optional_and_validated():
    task = Task(task_id="a/0/1", env="arithmetic", spec={}, policy_version=3)
    assert decode(encode(task), Task).policy_version == 3
    wire = msgpack.unpackb(encode(task), raw=False)
    del wire["policy_version"]  # a task from a writer that predates the field
    assert decode(msgpack.packb(wire), Task).policy_version == 0
    for bad in (-1, True, "3", 1.5):
        with pytest.raises(SchemaError) as err:
            decode(msgpack.packb({**wire, "policy_version": bad}), Task)
        assert err.value.field == "policy_version"


def test_top_p_is_optional_on_the_wire():
    assert decode(_mutate(lambda o: o.pop("top_p")), Trajectory).top_p == 1.0
    assert decode(_mutate(lambda o: o.update(top_p=0.9)), Trajectory).top_p == 0.9


@pytest.mark.parametrize("data", [b"", b"\xc1", b"not msgpack at all \xff\xff", msgpack.packb([1, 2]), None])
def test_garbage_is_a_decode_error(data):
    with pytest.raises(SchemaError) as err:
        decode(data, Trajectory)
    assert err.value.reason in {"decode-error", "schema-version"}


# --- the decoder checks all steps' numbers at once: the field named must not change ------------

def _logprob(step: int, value: float):
    return lambda o: o["steps"][step].update(
        behaviour_logprobs=pack_array(np.array([-0.1, value, -0.5], np.float32), np.float32))


def _reward(step: int, value):
    return lambda o: o["steps"][step].update(reward=value)


def _broken_actions(step: int):
    return lambda o: o["steps"][step]["action_ids"].update(dtype="<f8")


@pytest.mark.parametrize("mutations, field", [
    ([_logprob(2, 0.5)], "steps[2].behaviour_logprobs"),
    ([_logprob(3, float("nan"))], "steps[3].behaviour_logprobs"),
    ([_logprob(1, float("-inf"))], "steps[1].behaviour_logprobs"),
    ([_logprob(3, float("inf"))], "steps[3].behaviour_logprobs"),
    ([_reward(2, float("inf"))], "steps[2].reward"),
    ([_reward(3, float("nan"))], "steps[3].reward"),
    # With several faults, the one named is the first a step-by-step reading meets:
    ([_reward(1, float("nan")), _logprob(1, float("nan"))], "steps[1].behaviour_logprobs"),  # log-probs first
    ([_logprob(2, 0.5), _reward(1, float("inf"))], "steps[1].reward"),
    ([_logprob(1, 0.5), _broken_actions(3)], "steps[1].behaviour_logprobs"),  # a bad number before a broken array
    ([_logprob(3, 0.5), _broken_actions(2)], "steps[2].action_ids"),
])
def test_bad_numbers_are_named_by_step(mutations, field):
    obj = msgpack.unpackb(encode(make_trajectory(steps=4)), raw=False)
    for mutation in mutations:
        mutation(obj)
    with pytest.raises(SchemaError) as err:
        decode(msgpack.packb(obj, use_bin_type=True), Trajectory)
    assert (err.value.reason, err.value.field) == ("invalid-field", field)


@pytest.mark.parametrize("array, shape, data, field", [
    ("vectors", [-1, -8], b"\x00" * 8, "memory.vectors"),  # a product of negative sizes still matches the bytes
    ("vectors", [-3, 0], b"", "memory.vectors"),
    ("scales", [-1], b"", "memory.scales"),
    ("scales", [1.0], b"\x00" * 4, "memory.scales"),
])
def test_array_sizes_must_be_non_negative_ints(array, shape, data, field):
    obj = msgpack.unpackb(encode(make_trajectory(slots=0)), raw=False)
    obj["memory"][array].update(shape=shape, data=data)
    with pytest.raises(SchemaError) as err:
        decode(msgpack.packb(obj, use_bin_type=True), Trajectory)
    assert (err.value.reason, err.value.field) == ("invalid-field", field)


def test_decoded_arrays_are_read_only_views_of_the_message():
    restored = decode(encode(make_trajectory(steps=3, slots=2)), Trajectory)
    memory = restored.memory
    arrays = [restored.prompt_ids, memory.vectors, memory.scales, memory.spans, memory.reward_sums]
    arrays += [a for step in restored.steps for a in (step.observation_ids, step.action_ids, step.behaviour_logprobs)]
    for array in arrays:
        assert not array.flags.writeable
        owner = array
        while isinstance(owner, np.ndarray):
            owner = owner.base
        assert isinstance(owner, bytes)  # numpy maps the message's bytes: no copy
    assert memory.vectors.shape == (2, 8) and memory.spans.shape == (2, 2)
