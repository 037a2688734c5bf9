"""What the policy sees at step t: one definition shared by the sampler and the trainer.

Layout of a step's input, left to right:
    prompt_ids | one soft token per visible memory slot | recent steps in full | observation_t | action_t
The recent steps are the last `recent_window` finished steps (observation + action tokens);
older steps reach the policy only through memory. Because the sampler and the trainer both
build contexts with `step_tokens`, the trainer recomputes exactly what the sampler sampled from.

With `recent_window >= 1` the text after the memory is a well-formed chat: an observation opens
with the end of the previous assistant turn (`ChatFormat.feedback_observation`), so it must follow
that turn's action. At 0 it follows the memory instead, and the text shows two user turns in a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sao.schema import Trajectory


@dataclass(frozen=True)
class StepInput:
    """Token ids before and after the memory soft tokens, plus the memory vectors themselves."""

    prompt_ids: np.ndarray  # int32, before memory
    memory: np.ndarray  # float32 [k, D], dequantized INT8 memory
    context_ids: np.ndarray  # int32, recent steps + current observation, after memory
    action_ids: np.ndarray  # int32, empty while generating

    @property
    def positions(self) -> int:
        """Positions the step takes in a forward pass: prompt, memory slots, context and action."""
        return len(self.prompt_ids) + len(self.memory) + len(self.context_ids) + len(self.action_ids)


def step_tokens(finished: list[tuple[np.ndarray, np.ndarray]], observation_ids: np.ndarray,
                recent_window: int) -> np.ndarray:
    """Token ids after the memory: the last `recent_window` finished (obs, action) pairs + obs_t."""
    recent = finished[len(finished) - recent_window:] if recent_window > 0 else []
    pieces = [ids for pair in recent for ids in pair] + [observation_ids]
    return np.concatenate([np.asarray(p, dtype=np.int32) for p in pieces])


def training_inputs(trajectory: Trajectory) -> list[StepInput]:
    """Rebuild every step's input of a recorded trajectory (what the trainer scores)."""
    inputs = []
    finished: list[tuple[np.ndarray, np.ndarray]] = []
    for step in trajectory.steps:
        inputs.append(StepInput(
            prompt_ids=trajectory.prompt_ids,
            memory=trajectory.memory.dequantized(step.memory_count),
            context_ids=step_tokens(finished, step.observation_ids, trajectory.recent_window),
            action_ids=step.action_ids,
        ))
        finished.append((step.observation_ids, step.action_ids))
    return inputs

