"""The wire contract: typed messages that cross process boundaries, their fields and their checks.

Every message is a msgpack map with `schema` (major version) and `kind`. Arrays travel as
`{"dtype", "shape", "data"}` with little-endian raw bytes, so any reader maps them with
`numpy.frombuffer` without element-by-element copies. A trajectory's steps travel as columns:
every token id of every step in one array, every log-prob in one, and per-step lengths and
scalars as lists, so a message holds a handful of arrays however many turns it has. Nothing
here imports torch, and nothing is ever pickled. `sao/codec.py` writes the bytes (large arrays
spliced in place); `docs/wire-format.md` documents the same format for non-sao readers.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from sao import codec
from sao.config import MAX_RECALL_TURNS  # checked before a step's list is read: decoding never walks a long one
from sao.dead_letters import DeadLetterReason

# 2: a trajectory's steps as columns (one token buffer, one log-prob buffer) instead of three arrays per step.
SCHEMA_VERSION = 2

# The only dtypes a reader accepts (anything else is a malformed message, not a surprise): for each numpy type, the
# little-endian dtype string, item size and dtype a reader expects (the dtype itself, so that frombuffer need not
# parse the string for every array).
_LITTLE_ENDIAN = {np.dtype(string).type: (string, np.dtype(string).itemsize, np.dtype(string))
                  for string in ("<i4", "<f4", "|i1")}
# Stands for a missing key, so `_get` looks a field up once.
_MISSING = object()
# Log-probs above this (float32 slack over 0) are not log-probabilities.
_MAX_LOGPROB = 1e-4


class SchemaError(ValueError):
    """A message that cannot be decoded or fails validation.

    `reason` is a short machine code that becomes the DLQ reason header; `field` names the
    offending field so the sender knows what to fix.
    """

    def __init__(self, reason: DeadLetterReason, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.reason = reason
        self.field = field_name


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise SchemaError(DeadLetterReason.INVALID_FIELD, field_name, message)


def _fail(field_name: str, message: str) -> None:
    raise SchemaError(DeadLetterReason.INVALID_FIELD, field_name, message)


def pack_array(array: np.ndarray, dtype: type) -> dict[str, Any]:
    """Encode an array as little-endian raw bytes with its dtype and shape."""
    arr = np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<"))
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.tobytes()}


def unpack_array(obj: Any, field_name: str, dtype: type, ndim: int) -> np.ndarray:
    """Decode and validate one packed array; the result is a read-only view of the bytes."""
    expected, itemsize, np_dtype = _LITTLE_ENDIAN[dtype]
    # A well-formed array passes one test of the exact types msgpack yields. Anything else takes the
    # checks below, which name the fault. Wire arrays are 1-d or 2-d, so the first and last sizes are all of them.
    if type(obj) is dict and 1 <= ndim <= 2:
        shape, data = obj.get("shape"), obj.get("data")
        if (obj.get("dtype") == expected and type(data) is bytes and type(shape) is list and len(shape) == ndim
                and type(shape[0]) is int and type(shape[-1]) is int and shape[0] >= 0 and shape[-1] >= 0
                and len(data) == math.prod(shape) * itemsize):
            array = np.frombuffer(data, np_dtype)
            return array if ndim == 1 else array.reshape(shape)
    _require(isinstance(obj, dict), field_name, "expected an array map {dtype, shape, data}")
    dtype_str, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if dtype_str != expected:
        _fail(field_name, f"dtype {dtype_str!r}, expected {expected!r}")
    if not (isinstance(shape, list) and len(shape) == ndim and all(isinstance(s, int) and s >= 0 for s in shape)):
        _fail(field_name, f"shape {shape!r} is not a list of {ndim} non-negative ints")
    _require(isinstance(data, bytes), field_name, "data must be bytes")
    count = math.prod(shape)
    if len(data) != count * itemsize:
        _fail(field_name, f"{len(data)} bytes for shape {shape}")
    return np.frombuffer(data, dtype=expected, count=count).reshape(shape)


def _get(obj: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    value = obj.get(name, _MISSING)
    # msgpack yields exact builtin types, so an exact match settles it (and excludes bool from int).
    if type(value) is kind or (type(kind) is tuple and type(value) in kind):
        return value
    _require(value is not _MISSING, name, "missing")
    # bool is an int subclass; a boolean where a number belongs is a sender bug (one where a bool belongs matched).
    if not isinstance(value, kind) or isinstance(value, bool):
        _fail(name, f"expected {kind}, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Task:
    """One unit of work for a sampler: which environment, and the env-specific spec."""

    task_id: str
    env: str
    spec: dict[str, Any]
    copy: int = 0  # which of the task's copies this is (grpo: 0 to group_size - 1); wire field `attempt`
    created_at: float = field(default_factory=time.time)
    # run.mode = sync: the sampler loads at least this version before it starts the task; 0 = any.
    policy_version: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "env": self.env, "spec": self.spec, "attempt": self.copy,
                "created_at": self.created_at, "policy_version": self.policy_version}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Task:
        spec = _get(obj, "spec", dict)
        version = _get(obj, "policy_version", int) if "policy_version" in obj else 0  # absent on the wire = 0
        _require(version >= 0, "policy_version", "must be >= 0")
        return cls(task_id=_get(obj, "task_id", str), env=_get(obj, "env", str), spec=spec,
                   copy=_get(obj, "attempt", int), created_at=float(_get(obj, "created_at", (int, float))),
                   policy_version=version)


@dataclass(frozen=True)
class Step:
    """One turn: the observation shown, the action sampled, and how likely the sampler found it.

    The policy saw the first `memory_count` slots of the trajectory's memory table (as soft
    tokens) when it generated this action. Slots become visible in the order they are created,
    so a count says as much as an index list, at 1 integer per step instead of O(steps).
    `recalled` names the earlier steps the memory put back as text before the recent window
    (ascending; each older than the recent window), so the trainer rebuilds the same context.
    """

    observation_ids: np.ndarray  # int32 [n]
    action_ids: np.ndarray  # int32 [m]
    behaviour_logprobs: np.ndarray  # float32 [m], log mu(a_t | context) under the sampling temperature
    reward: float
    done: bool
    memory_count: int
    recalled: tuple[int, ...] = ()


# The memory table's arrays, in wire order: each one's dtype and number of dimensions.
_MEMORY_ARRAYS = {"vectors": (np.int8, 2), "scales": (np.float32, 1), "spans": (np.int32, 2),
                  "reward_sums": (np.float32, 1)}


@dataclass(frozen=True)
class Memory:
    """The compressed context table of one trajectory: one INT8 vector per kept step group."""

    vectors: np.ndarray  # int8 [K, memory_width]
    scales: np.ndarray  # float32 [K]; vector_fp32 = vectors * scale
    spans: np.ndarray  # int32 [K, 2]: first and last original step a slot stands for
    reward_sums: np.ndarray  # float32 [K]: rewards of the merged steps, so the return stays exact

    @classmethod
    def empty(cls, memory_width: int) -> Memory:
        return cls(np.zeros((0, memory_width), np.int8), np.zeros(0, np.float32), np.zeros((0, 2), np.int32),
                   np.zeros(0, np.float32))

    def dequantized(self, count: int) -> np.ndarray:
        """FP32 vectors of the first `count` slots: exactly what the sampler fed the policy."""
        return self.vectors[:count].astype(np.float32) * self.scales[:count, None]

    def to_wire(self) -> dict[str, Any]:
        return {name: pack_array(getattr(self, name), dtype) for name, (dtype, _) in _MEMORY_ARRAYS.items()}

    @classmethod
    def from_wire(cls, obj: Any) -> Memory:
        _require(isinstance(obj, dict), "memory", "expected a map")
        memory = cls(**{name: unpack_array(obj.get(name), f"memory.{name}", dtype, ndim)
                        for name, (dtype, ndim) in _MEMORY_ARRAYS.items()})
        slots = len(memory.vectors)
        _require(len(memory.scales) == slots and len(memory.spans) == slots and len(memory.reward_sums) == slots,
                 "memory", "vectors, scales, spans and reward_sums must have the same length")
        _require(memory.spans.shape[1] == 2 or slots == 0, "memory.spans", "each span is (first, last)")
        return memory


# Per-step list columns on the wire: the Step field each entry belongs to (which a fault in it names) and the exact
# types an entry may have (msgpack yields exact types; a bool is not a number here).
_STEP_LISTS = {"observation_lengths": ("observation_ids", frozenset({int})),
               "action_lengths": ("action_ids", frozenset({int})), "rewards": ("reward", frozenset({int, float})),
               "done": ("done", frozenset({bool})), "memory_counts": ("memory_count", frozenset({int}))}


def _steps_to_wire(steps: list[Step]) -> dict[str, Any]:
    """Steps as columns: per-step scalars as lists, every token id in one array and every log-prob in another."""
    ids = [part for step in steps for part in (step.observation_ids, step.action_ids)]
    return codec.spliced_map({
        "observation_lengths": [len(step.observation_ids) for step in steps],
        "action_lengths": [len(step.action_ids) for step in steps],
        "rewards": [float(step.reward) for step in steps],
        "done": [bool(step.done) for step in steps],
        "memory_counts": [int(step.memory_count) for step in steps],
        "recalled": [[int(turn) for turn in step.recalled] for step in steps],
        "token_ids": codec.joined_array(ids, np.int32),
        "behaviour_logprobs": codec.joined_array([step.behaviour_logprobs for step in steps], np.float32),
    })


def _step_list(columns: dict, name: str, count: int | None) -> list:
    """A per-step list column: one value of the right exact type per step (a fault names its step)."""
    values = columns.get(name, _MISSING)
    step_field, kinds = _STEP_LISTS[name]
    if type(values) is not list:
        _require(values is not _MISSING, f"steps.{name}", "missing")
        _fail(f"steps.{name}", f"expected a list, got {type(values).__name__}")
    if count is not None and len(values) != count:
        _fail(f"steps.{name}", f"{len(values)} values for {count} steps")
    if not kinds.issuperset(map(type, values)):
        index = next(i for i, value in enumerate(values) if type(value) not in kinds)
        _fail(f"steps[{index}].{step_field}",
              f"expected {' or '.join(sorted(k.__name__ for k in kinds))}, got {type(values[index]).__name__}")
    return values


def _recalled_from_wire(columns: dict, count: int, recent_window: int) -> list[tuple[int, ...]]:
    """Each step's recalled turns: ascending integers, each a turn that had left the recent window (absent: none)."""
    values = columns.get("recalled", _MISSING)
    if values is _MISSING:
        return [()] * count
    _require(type(values) is list and len(values) == count, "steps.recalled", f"expected a list of {count} lists")
    recalled = []
    for i, turns in enumerate(values):
        _require(type(turns) is list and len(turns) <= MAX_RECALL_TURNS, f"steps[{i}].recalled",
                 f"expected a list of at most {MAX_RECALL_TURNS} turns")
        _require(all(type(t) is int for t in turns), f"steps[{i}].recalled", "expected a list of integers")
        if turns:
            below = i - max(recent_window, 0)  # older turns only: the recent window is in the context already
            _require(turns[0] >= 0 and turns[-1] < below and all(a < b for a, b in itertools.pairwise(turns)),
                     f"steps[{i}].recalled", f"turns must ascend, each in [0, {below})")
        recalled.append(tuple(turns))
    return recalled


def _steps_from_wire(columns: Any, recent_window: int) -> tuple[list[Step], np.ndarray, np.ndarray]:
    """Decode the step columns and check their structure and numbers; the steps view two buffers, also returned.

    Structure is checked column by column (the lists, then the two arrays), numbers step by step:
    of several faults, the first in that order is the one named.
    """
    _require(columns is not _MISSING, "steps", "missing")
    _require(type(columns) is dict, "steps", "expected a map of step columns")
    observation_lengths = _step_list(columns, "observation_lengths", None)
    count = len(observation_lengths)
    _require(count > 0, "steps", "a trajectory needs at least one step")
    action_lengths = _step_list(columns, "action_lengths", count)
    rewards = list(map(float, _step_list(columns, "rewards", count)))
    done = _step_list(columns, "done", count)
    memory_counts = _step_list(columns, "memory_counts", count)
    if min(observation_lengths) < 0:
        _fail(f"steps[{next(i for i, n in enumerate(observation_lengths) if n < 0)}].observation_ids",
              "negative length")
    if min(action_lengths) < 1:
        _fail(f"steps[{next(i for i, n in enumerate(action_lengths) if n < 1)}].action_ids",
              "an action needs at least one token")
    token_ids = unpack_array(columns.get("token_ids"), "steps.token_ids", np.int32, 1)
    logprobs = unpack_array(columns.get("behaviour_logprobs"), "steps.behaviour_logprobs", np.float32, 1)
    # Where each step's observation and action start and end in token_ids, and its log-probs in logprobs.
    token_bounds = [0, *itertools.accumulate(itertools.chain.from_iterable(zip(observation_lengths, action_lengths)))]
    logprob_bounds = [0, *itertools.accumulate(action_lengths)]
    if len(token_ids) != token_bounds[-1]:
        _fail("steps.token_ids", f"{len(token_ids)} ids for observations and actions of {token_bounds[-1]} tokens")
    if len(logprobs) != logprob_bounds[-1]:
        _fail("steps.behaviour_logprobs", f"{len(logprobs)} log-probs for {logprob_bounds[-1]} action tokens")
    recalled = _recalled_from_wire(columns, count, recent_window)
    steps = [Step(token_ids[token_bounds[2 * i]:token_bounds[2 * i + 1]],
                  token_ids[token_bounds[2 * i + 1]:token_bounds[2 * i + 2]],
                  logprobs[logprob_bounds[i]:logprob_bounds[i + 1]], rewards[i], done[i], memory_counts[i],
                  recalled[i])
             for i in range(count)]
    # One test over all log-probs and rewards (NaN fails both comparisons; +inf the max, -inf the min);
    # only when it fails do the steps go one by one, to name the first bad one.
    if not (logprobs.min() > -math.inf and logprobs.max() <= _MAX_LOGPROB and all(map(math.isfinite, rewards))):
        for i, step in enumerate(steps):
            own = step.behaviour_logprobs
            _require(bool(np.isfinite(own).all() and (own <= _MAX_LOGPROB).all()),
                     f"steps[{i}].behaviour_logprobs", "log-probs must be finite and <= 0")
            _require(math.isfinite(step.reward), f"steps[{i}].reward", "must be finite")
    return steps, token_ids, logprobs


@dataclass(frozen=True)
class Trajectory:
    """One episode rolled out by one sampler with one policy version, compressed."""

    trajectory_id: str
    task_id: str
    env: str
    sampler_id: str
    behaviour_version: int
    prompt_ids: np.ndarray  # int32 [p]: chat-formatted system prompt + task, before any memory
    steps: list[Step]
    memory: Memory
    temperature: float  # sampling temperature the behaviour log-probs were computed under
    encoder: str  # sentence encoder that produced the memory vectors
    recent_window: int  # how many latest steps the policy saw in full text instead of memory
    created_at: float = field(default_factory=time.time)
    timings: dict[str, float] = field(default_factory=dict)
    compression: dict[str, float] = field(default_factory=dict)
    top_p: float = 1.0  # nucleus the behaviour log-probs were truncated to (1 = none); absent on the wire = 1
    # The basis memory vectors are coordinates in (sao.compression.bottleneck identity); "" = the encoder's
    # full width. Absent on the wire = "".
    memory_basis: str = ""
    # Set by `decode`: the message's token-id and log-prob buffers that the steps view, so that a check over every
    # id or log-prob needs no concatenation. Not an init field, so `dataclasses.replace` (new steps) drops it.
    _step_buffers: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False, compare=False)

    @staticmethod
    def make_id(task_id: str, copy: int) -> str:
        """Deterministic from the task, so a redelivered task's trajectory dedups at the trainer."""
        return f"{task_id}#{copy}"

    @property
    def total_reward(self) -> float:
        return float(sum(step.reward for step in self.steps))

    def step_token_ids(self) -> np.ndarray:
        """Every step's observation and action ids, end to end, in step order."""
        if self._step_buffers is not None:
            return self._step_buffers[0]
        return np.concatenate([ids for step in self.steps for ids in (step.observation_ids, step.action_ids)]
                              or [np.zeros(0, np.int32)])

    def step_logprobs(self) -> np.ndarray:
        """Every step's behaviour log-probs, end to end, in step order."""
        if self._step_buffers is not None:
            return self._step_buffers[1]
        return np.concatenate([step.behaviour_logprobs for step in self.steps] or [np.zeros(0, np.float32)])

    def to_wire(self) -> dict[str, Any]:
        """The wire map, for `encode` (large step buffers are spliced: only `sao.codec.packb` writes them)."""
        return {
            "trajectory_id": self.trajectory_id, "task_id": self.task_id, "env": self.env,
            "sampler_id": self.sampler_id, "behaviour_version": self.behaviour_version,
            "prompt_ids": pack_array(self.prompt_ids, np.int32),
            "steps": _steps_to_wire(self.steps), "memory": self.memory.to_wire(),
            "temperature": float(self.temperature), "encoder": self.encoder, "recent_window": self.recent_window,
            "created_at": self.created_at, "timings": dict(self.timings), "compression": dict(self.compression),
            "top_p": float(self.top_p), "memory_basis": self.memory_basis,
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Trajectory:
        recent_window = _get(obj, "recent_window", int)
        steps, token_ids, logprobs = _steps_from_wire(obj.get("steps", _MISSING), recent_window)
        memory = Memory.from_wire(obj.get("memory"))
        for i, step in enumerate(steps):
            if not 0 <= step.memory_count <= len(memory.vectors):  # the message is built only on failure
                _fail(f"steps[{i}].memory_count",
                      f"{step.memory_count} is outside the memory table of {len(memory.vectors)} slots")
        temperature = float(_get(obj, "temperature", (int, float)))
        _require(temperature > 0, "temperature", "must be > 0")
        top_p = float(_get(obj, "top_p", (int, float))) if "top_p" in obj else 1.0
        _require(0 < top_p <= 1, "top_p", "must be in (0, 1]")
        memory_basis = _get(obj, "memory_basis", str) if "memory_basis" in obj else ""
        version = _get(obj, "behaviour_version", int)
        _require(version >= 0, "behaviour_version", "must be >= 0")
        trajectory = cls(
            trajectory_id=_get(obj, "trajectory_id", str), task_id=_get(obj, "task_id", str),
            env=_get(obj, "env", str), sampler_id=_get(obj, "sampler_id", str), behaviour_version=version,
            prompt_ids=unpack_array(obj.get("prompt_ids"), "prompt_ids", np.int32, 1), steps=steps,
            memory=memory, temperature=temperature, encoder=_get(obj, "encoder", str),
            recent_window=recent_window, created_at=float(_get(obj, "created_at", (int, float))),
            timings=dict(_get(obj, "timings", dict)), compression=dict(_get(obj, "compression", dict)), top_p=top_p,
            memory_basis=memory_basis,
        )
        object.__setattr__(trajectory, "_step_buffers", (token_ids, logprobs))
        return trajectory


@dataclass(frozen=True)
class ChunkRange:
    """Where a version's file travels with `policy.transport = "kafka"`: `count` WeightsChunk messages at the
    consecutive offsets from `offset` on, in one partition of the weights topic."""

    topic: str
    partition: int
    offset: int
    count: int

    def to_wire(self) -> list:
        return [self.topic, self.partition, self.offset, self.count]

    @classmethod
    def from_wire(cls, obj: Any) -> ChunkRange:
        _require(type(obj) is list and len(obj) == 4, "chunks", "expected [topic, partition, offset, count]")
        topic, partition, offset, count = obj
        _require(type(topic) is str and 0 < len(topic) <= 249, "chunks", "the topic must be a name")
        _require(all(type(n) is int for n in (partition, offset, count)), "chunks", "partition, offset and count "
                 "must be integers")
        _require(partition >= 0 and offset >= 0 and count >= 1, "chunks", "a partition and offset >= 0 and "
                 "at least one chunk")
        return cls(topic, partition, offset, count)


ANNOUNCED_CONTENTS = frozenset({"full", "lora"})


@dataclass(frozen=True)
class PolicyAnnouncement:
    """A new policy version: where its safetensors file is and its sha256; whole, or a delta on an earlier one.

    `policy_version` travels as the wire field `version` (docs/wire-format.md).
    """

    policy_version: int
    weights_path: str
    sha256: str
    num_bytes: int
    trainer_step: int
    created_at: float = field(default_factory=time.time)
    # HMAC-SHA256 (hex) of the fields above under the run's announcement key (sao/transport/announcements.py);
    # "" = unsigned, which samplers ignore. Absent on the wire = "".
    signature: str = ""
    # "snapshot" (the whole state) or "delta" (sao/policy/deltas.py: changes on `base_version`, whose state hashes
    # to `base_sha256`); on the wire a delta is the announcement with a `base_version`. `state_sha256` hashes the
    # state the file leaves (deltas.state_sha256); "" = not hashed, which only snapshots may be, and no delta can
    # follow one. Absent on the wire: a snapshot, "".
    kind: str = "snapshot"
    base_version: int = 0
    base_sha256: str = ""
    state_sha256: str = ""
    # With `policy.transport = "kafka"`: where the file's chunks are on the weights topic (sao/transport/weights.py);
    # `weights_path` then only names the trainer's own copy. None (absent on the wire): the file is in the folder.
    chunks: ChunkRange | None = None
    # What the file's state is: "full" (the policy's tensors) or "lora" (trainer.lora.rank > 0: only the adapters
    # and the projector, sao/policy/lora.py). Absent on the wire: "full".
    content: str = "full"

    def signed_fields(self) -> bytes:
        """The bytes a signature covers: every field but the signature, in a fixed order (the chain fields and the
        chunks only when there are any, so a whole file's announcement in the folder is signed as before they
        existed), then the content where it is not "full". The chunks are one nested list and the content a string,
        so no two layouts of the fields pack alike."""
        fields = [self.policy_version, self.weights_path, self.sha256, self.num_bytes, self.trainer_step,
                  self.created_at]
        if self.kind != "snapshot" or self.state_sha256:
            fields += [self.kind, self.base_version, self.base_sha256, self.state_sha256]
        if self.chunks is not None:
            fields.append(self.chunks.to_wire())
        if self.content != "full":
            fields.append(self.content)
        return msgpack.packb(fields, use_bin_type=True)

    def to_wire(self) -> dict[str, Any]:
        wire = {"version": self.policy_version, "weights_path": self.weights_path, "sha256": self.sha256,
                "num_bytes": self.num_bytes, "trainer_step": self.trainer_step, "created_at": self.created_at}
        if self.signature:
            wire["signature"] = self.signature
        if self.kind == "delta":  # the envelope's `kind` is the message's, so a delta is known by its base
            wire.update(base_version=self.base_version, base_sha256=self.base_sha256)
        if self.state_sha256:
            wire["state_sha256"] = self.state_sha256
        if self.chunks is not None:
            wire["chunks"] = self.chunks.to_wire()
        if self.content != "full":
            wire["content"] = self.content
        return wire

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> PolicyAnnouncement:
        sha = _get(obj, "sha256", str)
        _require(len(sha) == 64, "sha256", "expected 64 hex characters")
        kind = "delta" if "base_version" in obj else "snapshot"
        state_sha = _get(obj, "state_sha256", str) if "state_sha256" in obj else ""
        _require(len(state_sha) in (0, 64), "state_sha256", "expected 64 hex characters")
        content = _get(obj, "content", str) if "content" in obj else "full"
        _require(content in ANNOUNCED_CONTENTS, "content", f"expected one of {sorted(ANNOUNCED_CONTENTS)}")
        base_version, base_sha = 0, ""
        if kind == "delta":
            base_version, base_sha = _get(obj, "base_version", int), _get(obj, "base_sha256", str)
            version = _get(obj, "version", int)
            _require(0 <= base_version < version, "base_version", "must be below the version it is a delta for")
            _require(len(base_sha) == 64 and len(state_sha) == 64, "base_sha256",
                     "a delta needs base_sha256 and state_sha256, 64 hex characters each")
        return cls(policy_version=_get(obj, "version", int), weights_path=_get(obj, "weights_path", str), sha256=sha,
                   num_bytes=_get(obj, "num_bytes", int), trainer_step=_get(obj, "trainer_step", int),
                   created_at=float(_get(obj, "created_at", (int, float))),
                   signature=_get(obj, "signature", str) if "signature" in obj else "",
                   kind=kind, base_version=base_version, base_sha256=base_sha, state_sha256=state_sha,
                   chunks=ChunkRange.from_wire(obj["chunks"]) if "chunks" in obj else None, content=content)


@dataclass(frozen=True)
class WeightsChunk:
    """One piece of a published weights file on the weights topic: `data` is the file's bytes from `position` on.

    Chunk `index` of `count` of the file whose sha256 is `sha256` (policy.transport = "kafka"; docs/wire-format.md).
    """

    policy_version: int
    sha256: str
    index: int
    count: int
    position: int
    data: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.policy_version, "sha256": self.sha256, "index": self.index, "count": self.count,
                "position": self.position, "data": self.data}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> WeightsChunk:
        sha = _get(obj, "sha256", str)
        _require(len(sha) == 64, "sha256", "expected 64 hex characters")
        count, index, position = _get(obj, "count", int), _get(obj, "index", int), _get(obj, "position", int)
        _require(count >= 1 and 0 <= index < count, "index", f"chunk {index} of {count}")
        _require(position >= 0, "position", "must be >= 0")
        return cls(policy_version=_get(obj, "version", int), sha256=sha, index=index, count=count,
                   position=position, data=_get(obj, "data", bytes))


_KIND_OF: dict[type, str] = {Task: "task", Trajectory: "trajectory", PolicyAnnouncement: "policy",
                             WeightsChunk: "weights-chunk"}


def encode(message: Task | Trajectory | PolicyAnnouncement | WeightsChunk) -> bytes:
    """Serialise a message to msgpack bytes with its schema version and kind."""
    body = message.to_wire()
    body["schema"] = SCHEMA_VERSION
    body["kind"] = _KIND_OF[type(message)]
    return codec.packb(body)


def decode(data: bytes | None,
           expected: type[Task] | type[Trajectory] | type[PolicyAnnouncement] | type[WeightsChunk]):
    """Parse and validate msgpack bytes into `expected`; raise SchemaError naming the bad field."""
    if data is None:
        raise SchemaError(DeadLetterReason.DECODE_ERROR, "value", "message has no value")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as err:
        raise SchemaError(DeadLetterReason.DECODE_ERROR, "value", f"not valid msgpack ({err})") from err
    if not isinstance(obj, dict):
        raise SchemaError(DeadLetterReason.DECODE_ERROR, "value", f"expected a msgpack map, got {type(obj).__name__}")
    version = obj.get("schema")
    if not isinstance(version, int) or isinstance(version, bool):
        raise SchemaError(DeadLetterReason.SCHEMA_VERSION, "schema", "missing schema version")
    if version != SCHEMA_VERSION:
        hint = "; its sender predates one buffer per trajectory, so upgrade the sender" if version == 1 else ""
        raise SchemaError(DeadLetterReason.SCHEMA_VERSION, "schema",
                          f"major version {version} is not supported (this reader speaks {SCHEMA_VERSION}){hint}")
    kind = obj.get("kind")
    if kind != _KIND_OF[expected]:
        raise SchemaError(DeadLetterReason.WRONG_KIND, "kind", f"expected {_KIND_OF[expected]!r}, got {kind!r}")
    try:
        return expected.from_wire(obj)
    except SchemaError:
        raise
    except (KeyError, TypeError, ValueError) as err:
        raise SchemaError(DeadLetterReason.INVALID_FIELD, "value", str(err)) from err
