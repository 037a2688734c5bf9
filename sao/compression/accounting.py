"""How big a trajectory's context is: without compression, stored once, and in sao's form, stage by stage.

Two views, both summed over a trajectory's steps:

- `context_costs`: each step's policy context materialised on its own, the way a trainer
  without compression receives one sample per step. `positions` counts what the policy
  attends over (token ids plus one soft token per memory vector); `bytes` what holding it
  takes (int32 token ids, float32 or int8 vectors). It is reported after each stage, so the
  effect of each stage is visible, including where one makes a context bigger.
- `trajectory_bytes`: what crosses the wire for one trajectory: naive per-step contexts,
  the conversation's tokens stored once, and sao's message (tokens once + INT8 memory +
  per-step slot references).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sao.schema import Memory, Step, Trajectory, encode

TOKEN_BYTES = 4  # token ids travel as int32
STAGES = ("naive", "semantic", "temporal", "int8")


@dataclass(frozen=True)
class ContextCost:
    positions: int  # sequence positions the policy reads, summed over steps
    bytes: int  # bytes holding those contexts, summed over steps


def context_costs(prompt_tokens: int, turn_tokens: Sequence[int], visible_slots: Sequence[int], dim: int,
                  recent_window: int, memory_width: int | None = None,
                  recalled_tokens: Sequence[int] | None = None) -> dict[str, ContextCost]:
    """Per-step contexts summed over the trajectory, after each compression stage.

    `turn_tokens[t]` is step t's observation + action token count and `visible_slots[t]` the
    memory slots its policy saw. At step t the context is the prompt, the steps older than the
    recent window (the part compression acts on), the last `recent_window` steps in full and
    step t itself. The older steps are:
      naive     their tokens;
      semantic  one float32 sentence embedding each;
      temporal  one float32 embedding per kept slot;
      int8      one int8 vector (`memory_width` codes: the bottleneck's, default the encoder's `dim`) + float32
                scale per kept slot: what sao's policy reads.
    `recalled_tokens[t]`, if given, counts the older turns step t was shown again as text (memory's recall):
    text in every stage but the naive one, where those turns are already among the older steps.
    """
    memory_width = dim if memory_width is None else memory_width
    if len(turn_tokens) != len(visible_slots):
        raise ValueError(f"{len(turn_tokens)} step token counts but {len(visible_slots)} slot counts")
    totals = {stage: [0, 0] for stage in STAGES}
    older_tokens = 0
    for t, (current, slots) in enumerate(zip(turn_tokens, visible_slots)):
        older_steps = max(0, t - recent_window)
        if older_steps:
            older_tokens += turn_tokens[older_steps - 1]
        recent = sum(turn_tokens[older_steps:t])
        text = prompt_tokens + recent + current  # always in full
        recalled = recalled_tokens[t] if recalled_tokens is not None else 0
        for stage, vectors, vector_bytes in (("semantic", older_steps, 4 * dim), ("temporal", slots, 4 * dim),
                                             ("int8", slots, memory_width + 4)):
            totals[stage][0] += text + recalled + vectors
            totals[stage][1] += (text + recalled) * TOKEN_BYTES + vectors * vector_bytes
        totals["naive"][0] += text + older_tokens
        totals["naive"][1] += (text + older_tokens) * TOKEN_BYTES
    return {stage: ContextCost(*totals[stage]) for stage in STAGES}


def trajectory_context_costs(trajectory: Trajectory, encoder_dim: int | None = None) -> dict[str, ContextCost]:
    """`context_costs` of a trajectory as the sampler sent it. Its memory's width is the int8 stage's; the
    embeddings before it are `encoder_dim` wide (default: the same, right when no bottleneck narrowed them)."""
    memory_width = trajectory.memory.vectors.shape[1]
    turn_tokens = [len(s.observation_ids) + len(s.action_ids) for s in trajectory.steps]
    return context_costs(len(trajectory.prompt_ids), turn_tokens, [s.memory_count for s in trajectory.steps],
                         encoder_dim or memory_width, trajectory.recent_window, memory_width=memory_width,
                         recalled_tokens=[sum(turn_tokens[turn] for turn in s.recalled) for s in trajectory.steps])


def conversation_tokens(prompt_tokens: int, steps: Sequence[Step]) -> int:
    """Tokens of the conversation stored once: the prompt and each step's observation and action."""
    return prompt_tokens + sum(len(s.observation_ids) + len(s.action_ids) for s in steps)


def naive_context_tokens(prompt_tokens: int, steps: Sequence[Step]) -> int:
    """Tokens a trainer without compression would be sent: every step's full history, again."""
    total, history = 0, prompt_tokens
    for step in steps:
        history += len(step.observation_ids) + len(step.action_ids)
        total += history
    return total


def trajectory_bytes(trajectory: Trajectory) -> dict[str, int]:
    """Bytes of one trajectory's context in each representation.

    naive        every step's full context as int32 token ids, one sample per step;
    stored_once  the conversation's token ids once (prompt + each step's observation and
                 action), from which every naive context can be rebuilt;
    memory       sao's INT8 memory table (vectors, scales, spans, reward sums);
    slot_refs    each step's `memory_count` (one int32 per step: the visible slots are a prefix) and the
                 turns it recalled (one int32 each);
    sao          stored_once + memory + slot_refs: every array the trainer needs to rebuild
                 each step's context exactly as the policy saw it;
    message      the whole msgpack message (also behaviour log-probs, ids, timings, framing).
    """
    history = conversation_tokens(len(trajectory.prompt_ids), trajectory.steps)
    naive = naive_context_tokens(len(trajectory.prompt_ids), trajectory.steps)
    memory = trajectory.memory
    memory_bytes = memory.vectors.nbytes + memory.scales.nbytes + memory.spans.nbytes + memory.reward_sums.nbytes
    slot_refs = 4 * (len(trajectory.steps) + sum(len(s.recalled) for s in trajectory.steps))
    stored_once = history * TOKEN_BYTES
    return {"naive": naive * TOKEN_BYTES, "stored_once": stored_once, "memory": memory_bytes, "slot_refs": slot_refs,
            "sao": stored_once + memory_bytes + slot_refs, "message": len(encode(trajectory))}


def compression_stats(prompt_tokens: int, steps: Sequence[Step], memory: Memory) -> dict[str, float]:
    """What a sampler reports per trajectory: context bytes without compression vs in sao's form
    (tokens once + INT8 vectors and scales)."""
    naive = naive_context_tokens(prompt_tokens, steps) * TOKEN_BYTES
    compressed = conversation_tokens(prompt_tokens, steps) * TOKEN_BYTES + memory.vectors.nbytes + memory.scales.nbytes
    return {"naive_context_bytes": float(naive), "compressed_context_bytes": float(compressed),
            "ratio": naive / compressed, "memory_slots": float(len(memory.vectors)), "steps": float(len(steps))}
