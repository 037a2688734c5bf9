"""The spliced writer changes how a message is written, never what: its bytes are msgpack.packb's."""

from dataclasses import replace

import msgpack
import numpy as np
import pytest

from sao import codec
from sao.schema import SCHEMA_VERSION, PolicyAnnouncement, Step, Task, Trajectory, encode, pack_array
from tests.test_schema import make_trajectory


def _trajectory_of(action_tokens: int, steps: int = 3) -> Trajectory:
    """A trajectory whose steps hold `steps * (action_tokens + 7)` token ids, some given as int64."""
    rng = np.random.default_rng(action_tokens)
    return replace(make_trajectory(steps=steps, slots=2), steps=[
        Step(observation_ids=rng.integers(0, 1000, 7), action_ids=rng.integers(0, 1000, action_tokens).astype(np.int32),
             behaviour_logprobs=-rng.random(action_tokens).astype(np.float32), reward=float(i), done=i == steps - 1,
             memory_count=min(i, 2))
        for i in range(steps)])


_LARGE = _trajectory_of(9000)  # its token ids are past codec.SPLICE_BYTES: spliced
_SMALL = make_trajectory(steps=3, slots=2)
# One int32 short of the threshold, and exactly at it: the two sides of the switch.
_BELOW = _trajectory_of(codec.SPLICE_BYTES // 4 - 8, steps=1)
_AT = _trajectory_of(codec.SPLICE_BYTES // 4 - 7, steps=1)
_MESSAGES = {
    "task": Task(task_id="a/0/1", env="arithmetic", spec={"index": 1, "options": {"x": [1, 2]}}, policy_version=3),
    "unsigned policy": PolicyAnnouncement(4, "/w.safetensors", "ab" * 32, 10, 8),
    "signed policy": PolicyAnnouncement(4, "/w.safetensors", "ab" * 32, 10, 8, signature="cd" * 32),
    "small trajectory": _SMALL, "trajectory below the threshold": _BELOW, "trajectory at the threshold": _AT,
    "large trajectory": _LARGE,
}
_KIND = {Task: "task", PolicyAnnouncement: "policy", Trajectory: "trajectory"}


def _plain_wire(message: Task | Trajectory | PolicyAnnouncement) -> dict:
    """The message's map built without the codec: every array packed whole by `pack_array`."""
    wire = {**message.to_wire(), "schema": SCHEMA_VERSION, "kind": _KIND[type(message)]}
    if isinstance(message, Trajectory):
        wire["steps"] = {**wire["steps"], "token_ids": pack_array(message.step_token_ids(), np.int32),
                         "behaviour_logprobs": pack_array(message.step_logprobs(), np.float32)}
    return wire


@pytest.mark.parametrize("name", _MESSAGES)
def test_encode_writes_what_plain_msgpack_writes(name):
    message = _MESSAGES[name]
    plain = msgpack.packb(_plain_wire(message), use_bin_type=True)
    data = encode(message)
    assert msgpack.unpackb(data, raw=False) == msgpack.unpackb(plain, raw=False)
    assert data == plain  # bin 32 is also what msgpack itself writes for data of SPLICE_BYTES or more


@pytest.mark.parametrize("message, spliced", [(_LARGE, True), (_AT, True), (_BELOW, False), (_SMALL, False)])
def test_only_step_buffers_of_splice_bytes_or_more_take_the_spliced_path(message, spliced):
    """So that the comparison above covers both ways of writing."""
    wire = message.to_wire()
    assert (codec.spliced_map(wire) is not wire) == spliced
    assert (codec.spliced_map(wire["steps"]) is not wire["steps"]) == spliced
