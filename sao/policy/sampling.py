"""Decoding rules of the sampler: nucleus (top-p) truncation and when an action stops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def nucleus(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probs [B, V] of the top-p distribution: the smallest set of most likely tokens whose
    mass reaches `top_p`, renormalised; every other token gets -inf.

    The sampler draws from this distribution and records its log-probs as the behaviour policy,
    so the trainer's importance ratio pi/mu sees the truncation instead of ignoring it.
    """
    if top_p >= 1.0:
        return logprobs
    ordered, order = logprobs.sort(dim=-1, descending=True)
    probs = ordered.exp()
    # A token stays while the mass strictly before it is below top_p (the top token always stays).
    outside = probs.cumsum(dim=-1) - probs >= top_p
    ordered = ordered.masked_fill(outside, float("-inf"))
    truncated = torch.full_like(logprobs, float("-inf")).scatter(-1, order, ordered)
    return truncated - truncated.logsumexp(dim=-1, keepdim=True)


@dataclass(frozen=True)
class StopRule:
    """An action ends at an end-of-turn token, or with the token that completes a stop string."""

    token_ids: frozenset[int]
    strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None

    def __post_init__(self):
        if self.strings and self.decode is None:
            raise ValueError("stop strings need a decode function")

    def ends(self, tokens: list[int]) -> bool:
        if tokens[-1] in self.token_ids:
            return True
        if not self.strings:
            return False
        # Only the tail can hold a string completed just now; a token spans at least one byte.
        window = max(len(s.encode()) for s in self.strings) + 1
        tail = self.decode(tokens[-window:])
        return any(s in tail for s in self.strings)

    def cut(self, text: str) -> str:
        """The text up to and including the first stop string (what the env is shown)."""
        ends = [text.index(s) + len(s) for s in self.strings if s in text]
        return text[:min(ends)] if ends else text
