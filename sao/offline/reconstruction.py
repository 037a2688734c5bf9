"""Teach the projector to carry a slot's *content*: the frozen LM rewrites a step from its slot alone.

Distillation alone (`sao.offline.align`) lets the projector settle on one vector that helps
whatever the memory holds - a learned prompt ("replies are short commands"): another episode's
memory then helps as much as the episode's own. Here each example is one memory slot and the
text of the step it was encoded from:

    "Earlier step:" | slot soft token | newline  ->  the step's text (its last `MAX_TEXT_TOKENS` tokens)

and the loss is the LM's next-token NLL of that text, so the soft token must say what happened
(which room, which gem was taken), in a form the frozen LM reads (autoencoding pre-training, as
in-context autoencoders do for their memory tokens). `content_nll` measures it on held-out slots:
the text's NLL under its own slot against under another step's slot.

Every `sao compression align` run reports that check; the reconstruction loss itself is opt-in
(`--reconstruct-updates`, `--reconstruct-weight`): it makes slots readable but, measured on
SmolLM2-135M, not used by the policy's actions, and it costs distillation (docs/design.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sao.offline.align import PreparedEpisode, reconstruction_nll, summarise
from sao.offline.episodes import turn_text
from sao.policy.chat import token_ids
from sao.policy.context import TurnInput
from sao.policy.model import MemoryPolicy

PREFIX = "Earlier step:"
MAX_TEXT_TOKENS = 48  # a step's text ends with what the slot must name: the room, the item, the command


def slot_examples(prepared: Sequence[PreparedEpisode], tokenizer) -> list[TurnInput]:
    """One reconstruction example per memory slot of each prepared episode, in order."""
    prefix, newline = token_ids(tokenizer, PREFIX), token_ids(tokenizer, "\n")
    examples = []
    for item in prepared:
        memory = item.trajectory.memory
        vectors = memory.dequantized(len(memory.vectors))
        for vector, (first, _) in zip(vectors, memory.spans):
            step = item.episode.steps[int(first)]
            text = token_ids(tokenizer, turn_text(step.observation, step.action))[-MAX_TEXT_TOKENS:]
            examples.append(TurnInput(prefix, vector[None, :], newline, text))
    return examples


@torch.no_grad()
def content_nll(policy: MemoryPolicy, examples: Sequence[TurnInput], batch_size: int = 16) -> dict[str, float]:
    """Held-out per-token NLL of each step's text under its own slot vs another step's slot.

    `other - own` > 0 is what the soft token says about *this* step; ~0 means it carries no content.
    Returns the means, the paired difference and its standard error (n = the examples).
    """
    shift = max(1, len(examples) // 2)  # each example with the slot of the one `shift` on: same text, wrong content
    others = [TurnInput(x.prompt_ids, examples[(i + shift) % len(examples)].memory, x.context_ids, x.action_ids)
              for i, x in enumerate(examples)]
    own, other = [], []
    for start in range(0, len(examples), batch_size):
        own += reconstruction_nll(policy, examples[start:start + batch_size]).tolist()
        other += reconstruction_nll(policy, others[start:start + batch_size]).tolist()
    gain, gain_error = summarise([b - a for a, b in zip(own, other)])
    return {"own": float(np.mean(own)), "other": float(np.mean(other)), "other_minus_own": gain,
            "other_minus_own_stderr": gain_error, "n": len(examples)}
