"""What the policy reads as text: chat-template pieces as token ids, and one turn's text for the encoder.

The one place that knows the chat template's shape. Both the sampler (building contexts) and
the offline tools (rebuilding text from token ids, replaying recorded episodes) go through it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from sao.policy.sampling import StopRule

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# ChatML, the template of SmolLM2 and many others. Other templates work too: the feedback turn
# is split from the template itself; these two only sharpen end-of-turn and user-turn detection.
CHATML_END_OF_TURN = "<|im_end|>"
_CHATML_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)


class ChatFormat:
    """Chat-template pieces as token ids, split so that turns concatenate into a valid chat.

    prompt = system + user(task); turn 0's observation = the assistant header; a later
    observation = end of the previous turn + user(feedback) + assistant header.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_prompt: str, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        end_of_turn = tokenizer.convert_tokens_to_ids(CHATML_END_OF_TURN)  # unk (or None) where it is no token
        turn_end = {tokenizer.eos_token_id} | ({end_of_turn} - {None, tokenizer.unk_token_id})
        self.stop = StopRule(frozenset(turn_end), stop, self._decode_ids)
        self.end_of_turn_ids, self._before_feedback, self._after_feedback = self._split_feedback_turn()

    def _encode(self, text: str) -> np.ndarray:
        return token_ids(self.tokenizer, text)

    def _decode_ids(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _chat(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _split_feedback_turn(self) -> tuple[np.ndarray, str, str]:
        """The end-of-turn marker, then the template's text before and after a feedback user turn's
        content (up to the next assistant header)."""
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        full = self._chat(base + [{"role": "user", "content": "\x00"}], True)
        end_of_answer = full.index("y", len(self._chat(base[:1], True))) + 1
        after = full[end_of_answer:]
        end_of_turn = ""
        for stop in (CHATML_END_OF_TURN, self.tokenizer.eos_token or ""):
            if stop and after.startswith(stop):
                end_of_turn, after = stop, after[len(stop):]
                break
        before, after = after.split("\x00")
        return self._encode(end_of_turn), before, after

    def _opening(self, task_text: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task_text}]

    def prompt(self, task_text: str) -> np.ndarray:
        return self._encode(self._chat(self._opening(task_text), generation_prompt=False))

    def first_observation(self, task_text: str) -> np.ndarray:
        messages = self._opening(task_text)
        return self._encode(self._chat(messages, True)[len(self._chat(messages, False)):])

    def feedback_observation(self, feedback: str, action_ids: np.ndarray) -> np.ndarray:
        """The next user turn. An action that ended at its end-of-turn token already closed its
        turn; one cut by a stop string or max_new_tokens gets the marker here, so the chat the
        policy sees (and the trainer rescores) stays well formed."""
        observation = self._encode(self._before_feedback + feedback + self._after_feedback)
        closed = len(action_ids) > 0 and int(action_ids[-1]) in self.stop.token_ids
        return observation if closed else np.concatenate([self.end_of_turn_ids, observation])

    def action_ids(self, text: str) -> np.ndarray:
        """A written action as the policy would have produced it: its tokens, then the end-of-turn marker."""
        return np.concatenate([self._encode(text), self.end_of_turn_ids]).astype(np.int32)

    def action_text(self, ids: np.ndarray) -> str:
        """What the env is shown: the decoded action, cut after its stop string if it has one."""
        return self.stop.cut(self._decode_ids(ids.tolist()))


def token_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> np.ndarray:
    """`text` as int32 token ids, with no special tokens added (the chat template writes those)."""
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


def user_turn_text(tokenizer: PreTrainedTokenizerBase, ids) -> str:
    """The content of the last user turn in token ids (a turn's observation, or the prompt)."""
    decoded = tokenizer.decode(list(map(int, ids)), skip_special_tokens=False)
    found = _CHATML_USER.findall(decoded)
    if found:
        return found[-1]
    # Another chat template: the plain text without special tokens is the best guess.
    return tokenizer.decode(list(map(int, ids)), skip_special_tokens=True).strip()


def turn_text(observation: str, action: str) -> str:
    """One finished turn as the sentence encoder reads it (turn 0's observation is the task prompt)."""
    return f"{observation}\n{action}"
