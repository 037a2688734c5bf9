"""What the policy sees at turn t: one definition shared by the sampler and the trainer.

Layout of a turn's input, left to right:
    prompt_ids | one soft token per visible memory slot | recalled turns | recent turns | observation_t | action_t
The recent turns are the last `recent_window` finished turns (observation + action tokens);
older turns reach the policy through memory, and the few the memory recalls for this turn
(`Step.recalled`, in turn order) also as text. Because the sampler and the trainer both
build contexts with `turn_tokens`, the trainer recomputes exactly what the sampler sampled from.

With `recent_window >= 1` the text after the memory is a well-formed chat: an observation opens
with the end of the previous assistant turn (`ChatFormat.feedback_observation`), so it must follow
that turn's action. At 0 it follows the memory instead, and the text shows two user turns in a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sao.schema import Trajectory


@dataclass(frozen=True)
class TurnInput:
    """Token ids before and after the memory soft tokens, plus the memory vectors themselves."""

    prompt_ids: np.ndarray  # int32, before memory
    memory: np.ndarray  # float32 [k, D], dequantized INT8 memory
    context_ids: np.ndarray  # int32, recent turns + current observation, after memory
    action_ids: np.ndarray  # int32, empty while generating

    @property
    def positions(self) -> int:
        """Positions the turn takes in a forward pass: prompt, memory slots, context and action."""
        return len(self.prompt_ids) + len(self.memory) + len(self.context_ids) + len(self.action_ids)


def turn_tokens(finished: list[tuple[np.ndarray, np.ndarray]], observation_ids: np.ndarray,
                recent_window: int, recalled: Sequence[int] = ()) -> np.ndarray:
    """Token ids after the memory: the recalled finished (obs, action) pairs, the last `recent_window` ones, obs_t."""
    recent = finished[len(finished) - recent_window:] if recent_window > 0 else []
    pairs = [finished[turn] for turn in recalled] + recent
    pieces = [ids for pair in pairs for ids in pair] + [observation_ids]
    return np.concatenate([np.asarray(p, dtype=np.int32) for p in pieces])


def training_inputs(trajectory: Trajectory) -> list[TurnInput]:
    """Rebuild every turn's input of a recorded trajectory (what the trainer scores)."""
    inputs = []
    finished: list[tuple[np.ndarray, np.ndarray]] = []
    for turn in trajectory.steps:  # the wire's steps are turns
        inputs.append(TurnInput(
            prompt_ids=trajectory.prompt_ids,
            memory=trajectory.memory.dequantized(turn.memory_count),
            context_ids=turn_tokens(finished, turn.observation_ids, trajectory.recent_window, turn.recalled),
            action_ids=turn.action_ids,
        ))
        finished.append((turn.observation_ids, turn.action_ids))
    return inputs

