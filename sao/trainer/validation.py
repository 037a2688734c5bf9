"""Decide whether a decoded Trajectory is usable by this trainer's model, before it is buffered.

The schema checks that a message is well formed; this checks it against the model and the run:
the run's env and no more turns than it allows (each env and turn has a baseline the trainer keeps),
token ids inside the vocabulary, memory as wide as the encoder, something to condition on,
numbers finite and in ranges the loss can carry, and a behaviour version this trainer has
published. A trajectory that fails raises `SchemaError` with a reason code (the DLQ header) and
the field at fault; one that passes can be scored without raising and gives a finite loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from torch import nn

from sao.config import SaoConfig
from sao.dead_letters import DeadLetterReason
from sao.envs.registry import task_env
from sao.schema import SchemaError, Trajectory

# A sampler draws from logits / temperature: far outside this band the distribution is a one-hot
# or a uniform in all but name, and dividing logits by it overflows or underflows float32.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
# No sampler ever draws a token of probability e^-80 (about 2e-35); and with log mu >= -80 one
# token's importance ratio pi/mu <= e^80 still fits in float32 (whose limit is about e^88.7).
MIN_BEHAVIOUR_LOGPROB = -80.0
# The encoder's vectors have norm 1, so an absmax INT8 scale is at most 1/127; this bound is
# generous and keeps the dequantized memory (int8 x scale) far from float32 overflow.
MAX_MEMORY_SCALE = 1e3


@dataclass(frozen=True)
class TrajectoryValidator:
    """What this trainer's model and config accept; `validate` raises SchemaError on the first misfit."""

    vocab_size: int  # token ids must lie in [0, vocab_size)
    memory_width: int  # width of every memory vector (the encoder's, or the bottleneck's)
    max_abs_reward: float
    max_bytes: int
    max_turns: int | None = None  # env.max_turns: a sampler ends every episode there
    env: str | None = None  # the `env` the run's tasks carry; None when the env class is not importable here
    memory_basis: str = ""  # the bottleneck identity memory must be coded in; "" = the encoder's full width
    max_tokens: int | None = None  # trainer.max_trajectory_tokens: every scored row's tokens together
    max_positions: int | None = None  # the model's positions: the longest row it can score
    max_pass_tokens: int | None = None  # trainer.micro_batch_tokens: the longest row one training pass may hold
    whole_trajectory_pass: bool = False  # sequence-level importance: all of a trajectory's rows share a pass

    @classmethod
    def for_model(cls, model: nn.Module, memory_width: int, config: SaoConfig,
                  memory_basis: str = "") -> TrajectoryValidator:
        """Limits of `model` (a MemoryPolicy: ids index its input embeddings and its output logits) and of the run."""
        lm = model.lm
        vocab_size = lm.get_input_embeddings().num_embeddings
        output = lm.get_output_embeddings()
        if output is not None:
            vocab_size = min(vocab_size, output.out_features)
        return cls(vocab_size, memory_width, config.trainer.max_abs_reward, config.trainer.max_trajectory_bytes,
                   config.env.max_turns, task_env(config.env.name), memory_basis, config.trainer.max_trajectory_tokens,
                   getattr(lm.config, "max_position_embeddings", None), config.trainer.micro_batch_tokens,
                   config.trainer.sequence_level_ratio)

    def check_size(self, num_bytes: int) -> None:
        """Before decoding: a message over `trainer.max_trajectory_bytes` is dead-lettered unread."""
        if num_bytes > self.max_bytes:
            raise SchemaError(DeadLetterReason.TOO_LARGE, "value",
                              f"{num_bytes} bytes is over trainer.max_trajectory_bytes ({self.max_bytes})")

    def validate(self, trajectory: Trajectory, policy_version: int) -> None:
        """Raise SchemaError (reason, field) unless this trainer can train on `trajectory` at `policy_version`."""
        self._check_run(trajectory)  # the step count first: the token count below walks the steps
        self._check_token_counts(trajectory)
        self._check_versions_and_settings(trajectory, policy_version)
        self._check_memory(trajectory)
        self._check_spans(trajectory)
        self._check_tokens(trajectory)
        self._check_steps(trajectory)

    def _check_versions_and_settings(self, trajectory: Trajectory, policy_version: int) -> None:
        if trajectory.behaviour_version > policy_version:
            raise SchemaError(DeadLetterReason.FUTURE_VERSION, "behaviour_version",
                              f"v{trajectory.behaviour_version} is newer than this trainer's v{policy_version}: "
                              "no such policy was published")
        _finite(trajectory.created_at, "created_at")
        _finite(trajectory.temperature, "temperature")
        if not MIN_TEMPERATURE <= trajectory.temperature <= MAX_TEMPERATURE:
            raise SchemaError(DeadLetterReason.OUT_OF_RANGE, "temperature",
                              f"{trajectory.temperature} is outside [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
        for name, table in (("timings", trajectory.timings), ("compression", trajectory.compression)):
            for key, value in table.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise SchemaError(DeadLetterReason.INVALID_FIELD, f"{name}.{key}",
                                      f"expected a number, got {type(value).__name__}")
                _finite(value, f"{name}.{key}")

    def _check_run(self, trajectory: Trajectory) -> None:
        # Every env name and turn index gets its own running baseline, kept for the whole run: a
        # trajectory of another env, or longer than any sampler makes, would add keys without end.
        if self.env is not None and trajectory.env != self.env:
            raise SchemaError(DeadLetterReason.WRONG_ENV, "env",
                              f"{trajectory.env!r} is not this run's env ({self.env!r})")
        if self.max_turns is not None and len(trajectory.steps) > self.max_turns:
            raise SchemaError(DeadLetterReason.OUT_OF_RANGE, "steps",
                              f"{len(trajectory.steps)} steps is over env.max_turns "
                              f"({self.max_turns}): no sampler of this run plays that many")

    def _check_token_counts(self, trajectory: Trajectory) -> None:
        # What scoring builds is one row per step (sao/policy/context.py), so its cost is the rows' lengths, which
        # the message's array shapes give without touching a token: a byte bound is not a token bound.
        if trajectory.recent_window < 0:
            raise SchemaError(DeadLetterReason.OUT_OF_RANGE, "recent_window", f"{trajectory.recent_window} is negative")
        prompt, window = len(trajectory.prompt_ids), trajectory.recent_window
        pair_lengths: list[int] = []
        total = longest = 0
        for i, step in enumerate(trajectory.steps):
            recent = sum(pair_lengths[len(pair_lengths) - window:]) if window else 0
            recent += sum(pair_lengths[turn] for turn in step.recalled)  # earlier turns only: the decoder checked
            pair = len(step.observation_ids) + len(step.action_ids)
            row = prompt + step.memory_count + recent + pair
            if self.max_positions is not None and row > self.max_positions:
                raise SchemaError(DeadLetterReason.TOO_LARGE, f"steps[{i}]",
                                  f"its row of {row} tokens (prompt, memory, recalled and recent steps, "
                                  f"observation, action) is over the model's {self.max_positions} positions")
            if self.max_pass_tokens is not None and row > self.max_pass_tokens:
                raise SchemaError(DeadLetterReason.TOO_LARGE, f"steps[{i}]",
                                  f"its row of {row} tokens is over the {self.max_pass_tokens} one training pass "
                                  f"holds (trainer.micro_batch_tokens)")
            longest = max(longest, row)
            if self.whole_trajectory_pass and self.max_pass_tokens is not None and \
                    longest * (i + 1) > self.max_pass_tokens:
                raise SchemaError(DeadLetterReason.TOO_LARGE, "steps",
                                  f"its {i + 1} rows need {longest * (i + 1)} positions in one pass "
                                  f"(importance_level = 'sequence'), over trainer.micro_batch_tokens "
                                  f"({self.max_pass_tokens})")
            total += row
            if self.max_tokens is not None and total > self.max_tokens:
                raise SchemaError(DeadLetterReason.TOO_LARGE, "steps", f"its rows hold over {self.max_tokens} "
                                  f"tokens (trainer.max_trajectory_tokens) by step {i}")
            pair_lengths.append(pair)

    def _check_spans(self, trajectory: Trajectory) -> None:
        # A slot stands for consecutive earlier steps, slots in step order (sao/compression/pipeline.py); offline
        # tools index steps by these spans, so one pointing nowhere is dead-lettered, not trained on.
        spans = trajectory.memory.spans
        if not len(spans):
            return
        firsts, lasts = spans[:, 0].astype(np.int64), spans[:, 1].astype(np.int64)
        steps = len(trajectory.steps)
        if firsts.min() >= 0 and lasts.max() < steps and (firsts <= lasts).all() and (firsts[1:] > lasts[:-1]).all():
            return
        for k, (first, last) in enumerate(zip(firsts.tolist(), lasts.tolist())):
            if not 0 <= first <= last < steps:
                raise SchemaError(DeadLetterReason.INVALID_MEMORY, f"memory.spans[{k}]",
                                  f"({first}, {last}) is not a span of steps 0..{steps - 1} (first <= last)")
            if k and first <= int(lasts[k - 1]):
                raise SchemaError(DeadLetterReason.INVALID_MEMORY, f"memory.spans[{k}]",
                                  f"({first}, {last}) does not follow the previous slot's span, which ends at step "
                                  f"{int(lasts[k - 1])}: slots stand for consecutive steps in order")

    def _check_memory(self, trajectory: Trajectory) -> None:
        memory = trajectory.memory
        if not len(memory.vectors):
            return  # no slot: nothing coded in any width or basis, and the policy saw no memory
        if trajectory.memory_basis != self.memory_basis:
            raise SchemaError(DeadLetterReason.INVALID_MEMORY, "memory_basis",
                              f"memory is coded in basis {trajectory.memory_basis or 'none (full width)'!r}; this "
                              f"trainer reads {self.memory_basis or 'none (full width)'!r} "
                              "(compression.bottleneck must be the same in samplers and trainer)")
        if memory.vectors.shape[1] != self.memory_width:
            raise SchemaError(DeadLetterReason.INVALID_MEMORY, "memory.vectors",
                              f"vectors are {memory.vectors.shape[1]} wide; this trainer's memory is "
                              f"{self.memory_width} wide")
        scales = memory.scales
        # Scales within [0, MAX_MEMORY_SCALE] are finite (NaN and inf fail the comparisons), so only
        # scales out of range take the finiteness pass that tells the two faults apart.
        in_range = not len(scales) or (scales.min() >= 0 and scales.max() <= MAX_MEMORY_SCALE)
        if not in_range:
            _all_finite(scales, "memory.scales")
        _all_finite(memory.reward_sums, "memory.reward_sums")
        if not in_range:
            raise SchemaError(DeadLetterReason.OUT_OF_RANGE, "memory.scales",
                              f"scales must lie in [0, {MAX_MEMORY_SCALE}]")

    def _check_tokens(self, trajectory: Trajectory) -> None:
        # One test over the prompt and one over every step's ids (a decoded trajectory's own buffer: no copy);
        # only a trajectory that fails goes array by array, to name the first bad one.
        if self._in_vocabulary(trajectory.prompt_ids) and self._in_vocabulary(trajectory.step_token_ids()):
            return
        arrays = [("prompt_ids", trajectory.prompt_ids)]
        for i, step in enumerate(trajectory.steps):
            arrays += [(f"steps[{i}].observation_ids", step.observation_ids),
                       (f"steps[{i}].action_ids", step.action_ids)]
        for name, ids in arrays:
            if len(ids) and not (ids.min() >= 0 and ids.max() < self.vocab_size):
                bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
                raise SchemaError(DeadLetterReason.INVALID_TOKEN, name,
                                  f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _in_vocabulary(self, ids: np.ndarray) -> bool:
        # Viewed as unsigned, a negative int32 id is over 2**31, so a single max checks both ends of
        # [0, vocab_size). Ids off the wire are int32; any other dtype takes the array-by-array checks.
        return not len(ids) or (ids.dtype == np.int32 and ids.view(np.uint32).max() < self.vocab_size)

    def _check_steps(self, trajectory: Trajectory) -> None:
        # One min over the log-probs of all steps (a decoded trajectory's own buffer: no copy); only if it
        # fails (or a step has none, whose own min raises as it always did) does each step take its own, to
        # name the first bad one.
        steps = trajectory.steps
        logprobs_in_range = (len(steps) > 0 and all(len(step.behaviour_logprobs) for step in steps)
                             and trajectory.step_logprobs().min() >= MIN_BEHAVIOUR_LOGPROB)
        # A prompt gives every step a context, so with the rewards in range nothing below can fail: skip the
        # loop (a few µs per step). Otherwise it runs, and names the first fault in step order.
        rewards = [step.reward for step in steps]
        if (logprobs_in_range and len(trajectory.prompt_ids) > 0 and all(abs(r) <= self.max_abs_reward for r in rewards)
                and abs(sum(rewards)) <= self.max_abs_reward):
            return
        for i, step in enumerate(steps):
            # The first action token is scored given what precedes it; with nothing before it
            # the model has no position to predict it from.
            sees_earlier_turn = i > 0 and trajectory.recent_window > 0
            context = len(trajectory.prompt_ids) + step.memory_count + len(step.observation_ids)
            if context == 0 and not sees_earlier_turn:
                raise SchemaError(DeadLetterReason.EMPTY_CONTEXT, f"steps[{i}].observation_ids",
                                  "prompt, memory and observation are all empty: nothing to condition the action on")
            if abs(step.reward) > self.max_abs_reward:
                raise SchemaError(DeadLetterReason.OUT_OF_RANGE, f"steps[{i}].reward",
                                  f"|{step.reward}| is over trainer.max_abs_reward ({self.max_abs_reward})")
            if not logprobs_in_range and step.behaviour_logprobs.min() < MIN_BEHAVIOUR_LOGPROB:
                raise SchemaError(DeadLetterReason.OUT_OF_RANGE, f"steps[{i}].behaviour_logprobs",
                                  f"{float(step.behaviour_logprobs.min())} is below {MIN_BEHAVIOUR_LOGPROB}: no "
                                  "sampler draws a token that unlikely")
        if abs(trajectory.total_reward) > self.max_abs_reward:
            raise SchemaError(DeadLetterReason.OUT_OF_RANGE, "steps", f"total reward {trajectory.total_reward} is over "
                              f"trainer.max_abs_reward ({self.max_abs_reward})")


def _finite(value: float, field_name: str) -> None:
    if not math.isfinite(value):
        raise SchemaError(DeadLetterReason.NON_FINITE, field_name, f"{value} is not a finite number")


def _all_finite(values: np.ndarray, field_name: str) -> None:
    # An empty table (a first turn's memory) is finite without a pass over it.
    if values.size and not np.isfinite(values).all():
        raise SchemaError(DeadLetterReason.NON_FINITE, field_name, "holds NaN or infinity")
