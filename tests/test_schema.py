"""Wire format: round trips, and every kind of bad message is rejected naming its field."""

from dataclasses import replace

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
    task = Task(task_id="a/0/1", env="arithmetic", spec={"index": 1, "options": {"x": [1, 2]}}, copy=2)
    assert decode(encode(task), Task) == task
    ann = PolicyAnnouncement(policy_version=4, weights_path="/w.safetensors", sha256="ab" * 32, num_bytes=10, trainer_step=8)
    assert decode(encode(ann), PolicyAnnouncement) == ann


def test_an_adapter_announcement_says_so_is_signed_so_and_other_contents_are_refused():
    whole = PolicyAnnouncement(policy_version=4, weights_path="/w.safetensors", sha256="ab" * 32, num_bytes=10,
                               trainer_step=8)
    adapters = replace(whole, content="lora")
    assert "content" not in whole.to_wire() and adapters.to_wire()["content"] == "lora"
    assert decode(encode(adapters), PolicyAnnouncement) == adapters
    assert adapters.signed_fields() != whole.signed_fields()  # relabelling the content breaks the signature
    with pytest.raises(SchemaError, match="content"):
        PolicyAnnouncement.from_wire({**adapters.to_wire(), "content": "merged"})


def test_arrays_are_plain_msgpack_readable_without_sao():
    obj = msgpack.unpackb(encode(make_trajectory()), raw=False)
    assert obj["schema"] == SCHEMA_VERSION == 2 and obj["kind"] == "trajectory"
    steps = obj["steps"]
    assert steps["token_ids"]["dtype"] == "<i4" and steps["behaviour_logprobs"]["dtype"] == "<f4"
    # Step 0's observation, step 0's action, step 1's observation, ...; the lengths say where each ends.
    assert steps["observation_lengths"] == [2, 2] and steps["action_lengths"] == [3, 3]
    assert np.frombuffer(steps["token_ids"]["data"], "<i4").tolist() == [1, 2, 3, 4, 5] * 2
    assert np.frombuffer(steps["behaviour_logprobs"]["data"], "<f4").tolist() == pytest.approx([-0.1, -2.0, -0.5] * 2)
    assert steps["rewards"] == [0.0, 1.0] and steps["done"] == [False, True] and steps["memory_counts"] == [0, 1]


def _mutate(mutation) -> bytes:
    obj = msgpack.unpackb(encode(make_trajectory()), raw=False)
    mutation(obj)
    return msgpack.packb(obj, use_bin_type=True)


def _steps(**changes):
    """A mutation of the step columns."""
    return lambda o: o["steps"].update(changes)


def _column(name: str, index: int, value):
    """A mutation of one step's entry in a per-step list column."""
    return lambda o: o["steps"][name].__setitem__(index, value)


def _logprob(step: int, value: float, count: int = 4):
    """Step `step`'s middle log-prob (of 3 per step) set to `value`, in the one buffer of all steps."""
    values = np.tile(np.array([-0.1, -2.0, -0.5], np.float32), count)
    values[3 * step + 1] = value
    return _steps(behaviour_logprobs=pack_array(values, np.float32))


_NO_STEPS = dict(observation_lengths=[], action_lengths=[], rewards=[], done=[], memory_counts=[],
                 token_ids=pack_array(np.zeros(0), np.int32), behaviour_logprobs=pack_array(np.zeros(0), np.float32))


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
    (lambda o: o.pop("steps"), "invalid-field", "steps"),
    (lambda o: o.update(steps=[]), "invalid-field", "steps"),  # schema 1's list of step maps
    (_steps(**_NO_STEPS), "invalid-field", "steps"),
    (lambda o: o["steps"].pop("done"), "invalid-field", "steps.done"),
    (_steps(rewards=1.0), "invalid-field", "steps.rewards"),
    (_steps(memory_counts=[0]), "invalid-field", "steps.memory_counts"),
    (_column("action_lengths", 1, 0), "invalid-field", "steps[1].action_ids"),
    (_column("observation_lengths", 0, -2), "invalid-field", "steps[0].observation_ids"),
    (_column("observation_lengths", 1, 3), "invalid-field", "steps.token_ids"),  # lengths sum past the ids
    (_column("action_lengths", 0, 2.0), "invalid-field", "steps[0].action_ids"),
    (_steps(behaviour_logprobs=pack_array(np.array([-1.0], np.float32), np.float32)),
     "invalid-field", "steps.behaviour_logprobs"),
    (_logprob(1, 0.5, count=2), "invalid-field", "steps[1].behaviour_logprobs"),
    (lambda o: o["steps"]["token_ids"].update(data=b"\x00" * 5), "invalid-field", "steps.token_ids"),
    (lambda o: o["steps"]["token_ids"].update(dtype="<f8"), "invalid-field", "steps.token_ids"),
    (_column("memory_counts", 1, 7), "invalid-field", "steps[1].memory_count"),
    (_column("memory_counts", 1, -1), "invalid-field", "steps[1].memory_count"),
    (_column("rewards", 0, True), "invalid-field", "steps[0].reward"),
    (_column("done", 1, 1), "invalid-field", "steps[1].done"),
])
def test_bad_trajectories_are_rejected_naming_the_field(mutation, reason, field):
    with pytest.raises(SchemaError) as err:
        decode(_mutate(mutation), Trajectory)
    assert err.value.reason == reason
    assert err.value.field == field


def test_the_previous_schema_is_refused_as_a_version_saying_so():
    """Schema 1 (three arrays per step) is the layout a not yet upgraded sampler sends: the DLQ says which."""
    one = {**msgpack.unpackb(encode(make_trajectory()), raw=False), "schema": 1,
           "steps": [{"observation_ids": pack_array(np.array([1, 2]), np.int32)}]}
    with pytest.raises(SchemaError, match=r"major version 1 is not supported.*upgrade the sender") as err:
        decode(msgpack.packb(one, use_bin_type=True), Trajectory)
    assert (err.value.reason, err.value.field) == ("schema-version", "schema")


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


def test_the_memory_basis_is_optional_on_the_wire_and_must_be_a_string():
    assert decode(_mutate(lambda o: o.pop("memory_basis")), Trajectory).memory_basis == ""
    assert decode(_mutate(lambda o: o.update(memory_basis="enc/pca64/abc")), Trajectory).memory_basis == "enc/pca64/abc"
    with pytest.raises(SchemaError) as err:
        decode(_mutate(lambda o: o.update(memory_basis=64)), Trajectory)
    assert (err.value.reason, err.value.field) == ("invalid-field", "memory_basis")


def test_top_p_is_optional_on_the_wire():
    assert decode(_mutate(lambda o: o.pop("top_p")), Trajectory).top_p == 1.0
    assert decode(_mutate(lambda o: o.update(top_p=0.9)), Trajectory).top_p == 0.9


@pytest.mark.parametrize("data", [b"", b"\xc1", b"not msgpack at all \xff\xff", msgpack.packb([1, 2]), None])
def test_garbage_is_a_decode_error(data):
    with pytest.raises(SchemaError) as err:
        decode(data, Trajectory)
    assert err.value.reason in {"decode-error", "schema-version"}


# --- the decoder checks all steps' numbers at once: the field named must not change ------------

def _reward(step: int, value):
    return _column("rewards", step, value)


@pytest.mark.parametrize("mutations, field", [
    ([_logprob(2, 0.5)], "steps[2].behaviour_logprobs"),
    ([_logprob(3, float("nan"))], "steps[3].behaviour_logprobs"),
    ([_logprob(1, float("-inf"))], "steps[1].behaviour_logprobs"),
    ([_logprob(3, float("inf"))], "steps[3].behaviour_logprobs"),
    ([_reward(2, float("inf"))], "steps[2].reward"),
    ([_reward(3, float("nan"))], "steps[3].reward"),
    # With several bad numbers, the one named is the first a step-by-step reading meets:
    ([_reward(1, float("nan")), _logprob(1, float("nan"))], "steps[1].behaviour_logprobs"),  # log-probs first
    ([_logprob(2, 0.5), _reward(1, float("inf"))], "steps[1].reward"),
    # Structure comes before numbers, column by column: a broken column is named whatever step it is in.
    ([_logprob(1, 0.5), _column("action_lengths", 3, 0)], "steps[3].action_ids"),
    ([_reward(0, float("nan")), _column("memory_counts", 2, "1")], "steps[2].memory_count"),
])
def test_bad_numbers_are_named_by_step(mutations, field):
    obj = msgpack.unpackb(encode(make_trajectory(steps=4)), raw=False)
    for mutation in mutations:
        mutation(obj)
    with pytest.raises(SchemaError) as err:
        decode(msgpack.packb(obj, use_bin_type=True), Trajectory)
    assert (err.value.reason, err.value.field) == ("invalid-field", field)


def test_a_large_trajectory_round_trips_and_reads_as_plain_msgpack():
    """Step buffers past 64 KiB are written piece by piece into the message; any msgpack reader sees the same map."""
    rng = np.random.default_rng(1)
    original = replace(make_trajectory(steps=3, slots=2), steps=[
        Step(observation_ids=rng.integers(0, 1000, 7000).astype(np.int32),
             action_ids=rng.integers(0, 1000, 9000 + i).astype(np.int32),
             behaviour_logprobs=-rng.random(9000 + i).astype(np.float32), reward=float(i), done=i == 2,
             memory_count=i)
        for i in range(3)])
    data = encode(original)
    restored = decode(data, Trajectory)
    for a, b in zip(original.steps, restored.steps, strict=True):
        for name in ("observation_ids", "action_ids", "behaviour_logprobs"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert (a.reward, a.done, a.memory_count) == (b.reward, b.done, b.memory_count)
    plain = msgpack.unpackb(data, raw=False)
    ids = np.concatenate([x for step in original.steps for x in (step.observation_ids, step.action_ids)])
    assert plain["steps"]["token_ids"] == {"dtype": "<i4", "shape": [len(ids)], "data": ids.tobytes()}
    logprobs = np.concatenate([step.behaviour_logprobs for step in original.steps])
    assert plain["steps"]["behaviour_logprobs"]["data"] == logprobs.tobytes()
    assert len(data) == len(msgpack.packb(plain, use_bin_type=True))  # nothing but the same map


def test_decoded_steps_view_one_buffer_and_a_replaced_trajectory_has_none():
    restored = decode(encode(make_trajectory(steps=3)), Trajectory)
    tokens, logprobs = restored.step_token_ids(), restored.step_logprobs()
    assert all(step.action_ids.base is tokens and step.behaviour_logprobs.base is logprobs for step in restored.steps)
    changed = replace(restored, steps=restored.steps[:1])  # new steps: the buffers of the old ones no longer fit
    assert len(changed.step_token_ids()) == 5 and len(changed.step_logprobs()) == 3


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
