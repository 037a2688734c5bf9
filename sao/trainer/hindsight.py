"""What a hindsight row answers the first try's question with (`trainer.hindsight_reply`).

A right retry after a wrong first try teaches the first turn an answer (sao/trainer/batch.py). The
retry's own reply is worded for the feedback it answered ("10 is incorrect. The answer is 0."),
and taught to the first turn that wording spreads to first tries. `corrected` teaches instead the
first reply itself with its answer put right by the retry's, as the env says where a reply's answer
stands (`corrected_reply` on the env class): the first try's own words and working, one answer
changed. A first reply cut off before its end has no answer of its own to change: the env writes the
reply whole from the retry's answer, closed like a finished reply. Envs without `corrected_reply`,
and replies that state no answer, keep the retry's reply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from sao.config import EnvConfig, SaoConfig
from sao.envs.registry import UnknownEnv, env_class
from sao.policy.chat import ChatFormat, user_turn_text
from sao.policy.loading import load_tokenizer
from sao.schema import Trajectory

log = logging.getLogger(__name__)


class HindsightAnswer(NamedTuple):
    action_ids: np.ndarray  # the first turn's reply with the retry's answer
    first_try_return: float  # what the first try would have earned with it (its row's advantage starts there)


class CorrectedReplies:
    """The first turn's reply with the answer of turn `retry` in place of its own, or None."""

    def __init__(self, config: SaoConfig, correct: Callable[[EnvConfig, str, str | None, str], str | None],
                 first_try_reward: Callable[[EnvConfig, float, int], float]):
        self.tokenizer = load_tokenizer(config.policy.model, config.policy.cache_dir)
        self.special = set(self.tokenizer.all_special_ids)
        self.end_of_turn = ChatFormat(self.tokenizer, system_prompt="").end_of_turn_ids.tolist()
        self.env_config = config.env
        self.correct = correct  # the env class's `corrected_reply`
        self.first_try_reward = first_try_reward  # the env class's `first_try_reward`

    def __call__(self, trajectory: Trajectory, retry: int) -> HindsightAnswer | None:
        first = [int(token) for token in trajectory.steps[0].action_ids]
        end = len(first)
        while end and first[end - 1] in self.special:  # the stop token stays as sampled
            end -= 1
        finished = end < len(first)
        text = self.correct(self.env_config, user_turn_text(self.tokenizer, trajectory.prompt_ids),
                            self.tokenizer.decode(first[:end]) if finished else None,
                            self.tokenizer.decode(trajectory.steps[retry].action_ids, skip_special_tokens=True))
        if text is None:
            return None
        ids = self.tokenizer.encode(text, add_special_tokens=False) + (first[end:] if finished else self.end_of_turn)
        reward = self.first_try_reward(self.env_config, float(trajectory.steps[retry].reward), retry)
        return HindsightAnswer(np.asarray(ids, dtype=np.int32), reward)


def hindsight_replies(config: SaoConfig) -> CorrectedReplies | None:
    """The corrector `trainer.hindsight_reply` asks for; None: the retry's own reply is taught (or no hindsight row
    is made: with `trainer.turn_credit` resolved, rows exist only for own_reward credit)."""
    cfg = config.trainer
    if not cfg.retry_hindsight or cfg.hindsight_reply != "corrected" or cfg.turn_credit != "own_reward":
        return None
    try:
        env = env_class(config.env.name)
    except UnknownEnv as err:  # the trainer never runs the env: a plugin may be installed only where samplers run
        log.warning("trainer.hindsight_reply corrected: %s; hindsight rows take the retry's own reply", err)
        return None
    if not hasattr(env, "corrected_reply"):
        return None
    return CorrectedReplies(config, env.corrected_reply,
                            getattr(env, "first_try_reward", lambda config, reward, attempt: reward))
