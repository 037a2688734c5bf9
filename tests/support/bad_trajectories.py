"""Trajectories that decode fine yet must never reach the trainer's model (issue 12's findings).

Each corruption takes a valid trajectory (see `support.trainer_runs.synthetic_trajectory`) and
changes one thing; with it comes the DLQ reason the trainer must give and the field it must name.
"""

import math
from dataclasses import replace

import numpy as np

from sao.schema import Memory, Trajectory
from support.trainer_runs import SHIPPED_BASIS

WIDTH = SHIPPED_BASIS.width

EMPTY = np.zeros(0, np.int32)


def _with_memory(trajectory: Trajectory, width: int, scale: float) -> Trajectory:
    """One memory slot, visible from the first step on."""
    memory = Memory(vectors=np.ones((1, width), np.int8), scales=np.array([scale], np.float32),
                    spans=np.zeros((1, 2), np.int32), reward_sums=np.zeros(1, np.float32))
    return replace(trajectory, memory=memory, steps=[replace(s, memory_count=1) for s in trajectory.steps])


def _with_span(trajectory: Trajectory, first: int, last: int) -> Trajectory:
    """One memory slot standing for steps first..last (issue 27: such spans were trained on)."""
    with_slot = _with_memory(trajectory, WIDTH, 0.01)
    return replace(with_slot, memory=replace(with_slot.memory, spans=np.array([[first, last]], np.int32)))


def _first_step(trajectory: Trajectory, **changes) -> Trajectory:
    return replace(trajectory, steps=[replace(trajectory.steps[0], **changes), *trajectory.steps[1:]])


def _with_token(ids: np.ndarray, token: int) -> np.ndarray:
    ids = ids.copy()
    ids[-1] = token
    return ids


def _first_logprob(trajectory: Trajectory, value: float) -> Trajectory:
    logprobs = trajectory.steps[0].behaviour_logprobs.copy()
    logprobs[0] = value
    return _first_step(trajectory, behaviour_logprobs=logprobs)


# finding: (corrupt, DLQ reason, field the detail names)
CORRUPTIONS = {
    "token id 10**6": (lambda t: _first_step(t, action_ids=_with_token(t.steps[0].action_ids, 10**6)),
                       "invalid-token", "steps[0].action_ids"),
    "token id -5": (lambda t: replace(t, prompt_ids=_with_token(t.prompt_ids, -5)), "invalid-token", "prompt_ids"),
    "memory 7 wide": (lambda t: _with_memory(t, 7, 0.01), "invalid-memory", "memory.vectors"),
    "empty prompt and observation": (
        lambda t: replace(t, prompt_ids=EMPTY, steps=[replace(s, observation_ids=EMPTY) for s in t.steps]),
        "empty-context", "steps[0].observation_ids"),
    "reward 1e39": (lambda t: _first_step(t, reward=1e39), "out-of-range", "steps[0].reward"),
    "reward 1e300": (lambda t: _first_step(t, reward=1e300), "out-of-range", "steps[0].reward"),
    "memory in another basis": (lambda t: replace(_with_memory(t, WIDTH, 0.01), memory_basis="all-MiniLM-L6-v2/pca64/0"),
                                "invalid-memory", "memory_basis"),
    "memory at full width": (lambda t: replace(_with_memory(t, 384, 0.01), memory_basis=""),
                             "invalid-memory", "memory_basis"),
    "memory scale NaN": (lambda t: _with_memory(t, WIDTH, math.nan), "non-finite", "memory.scales"),
    "memory scale inf": (lambda t: _with_memory(t, WIDTH, math.inf), "non-finite", "memory.scales"),
    "temperature inf": (lambda t: replace(t, temperature=math.inf), "non-finite", "temperature"),
    "temperature 1e-30": (lambda t: replace(t, temperature=1e-30), "out-of-range", "temperature"),
    "log-prob -1e30": (lambda t: _first_logprob(t, -1e30), "out-of-range", "steps[0].behaviour_logprobs"),
    "behaviour version in the future": (lambda t: replace(t, behaviour_version=10**6), "future-version",
                                        "behaviour_version"),
    "created_at NaN": (lambda t: replace(t, created_at=math.nan), "non-finite", "created_at"),
    "recent_window -5": (lambda t: replace(t, recent_window=-5), "out-of-range", "recent_window"),
    # Each env name and turn index would get a running baseline the trainer keeps for the whole run.
    "another run's env": (lambda t: replace(t, env="textworld"), "wrong-env", "env"),
    "more steps than env.max_turns": (lambda t: replace(t, steps=list(t.steps) * 5), "out-of-range", "steps"),
    # Issue 27: within the byte bound, yet a row no model position can hold (scoring it took minutes).
    "a million tokens": (lambda t: _first_step(t, observation_ids=np.resize(t.steps[0].observation_ids, 1 << 20)),
                         "too-large", "steps[0]"),
    "memory span 0..7 on a short trajectory": (lambda t: _with_span(t, 0, 7), "invalid-memory", "memory.spans[0]"),
    "memory span -4..-2": (lambda t: _with_span(t, -4, -2), "invalid-memory", "memory.spans[0]"),
}


def big_valid_trajectory(base: Trajectory, num_bytes: int) -> Trajectory:
    """A well-formed trajectory of about `num_bytes` (one long observation of valid token ids)."""
    observation = np.resize(base.steps[0].observation_ids, num_bytes // 4)
    return _first_step(base, observation_ids=observation.astype(np.int32))
