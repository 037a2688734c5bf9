"""Align the memory projector by distillation: the LM reading full text teaches the LM reading memory.

Teacher: the frozen LM reading the task prompt and every earlier step as text. Student: the same
LM reading what the sampler shows it - prompt, one soft token per visible memory slot, the recent
window in full, the current observation. The loss is the KL from the teacher's next-token
distribution to the student's at every recorded action token; only the projector learns, the LM
stays frozen. Steps whose context holds no memory slot are skipped: the projector cannot change
them. Everything is seeded and runs in a fixed order, so one thread reproduces a run bit for bit.

The teacher is cheap: its context for step t is a prefix of the whole episode's text, so one
forward pass over the episode scores every action. Training keeps the teacher's top-k tokens
per action token (renormalised) to bound memory; evaluation uses the full vocabulary.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from sao.config import EnvConfig, SaoConfig
from sao.envs.registry import generation_settings
from sao.envs.textworld import TextWorldEnv
from sao.envs.textworld_agents import make_agent
from sao.offline.default_weights import arithmetic_questions, long_episode
from sao.offline.episodes import Episode, EpisodeStep, record_episode, replay_episode
from sao.policy.chat import ChatFormat
from sao.policy.context import TurnInput, training_inputs, turn_tokens
from sao.policy.loading import load_tokenizer
from sao.policy.model import MemoryPolicy, collate_turns
from sao.schema import Trajectory
from sao.stats import stderr

logger = logging.getLogger(__name__)


@dataclass
class PreparedEpisode:
    """A recorded episode replayed as the sampler would have built it, plus its teacher targets."""

    episode: Episode
    trajectory: Trajectory
    student: list[TurnInput]  # prompt + memory + recent window + observation + action, per step
    teacher_top: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per step: (token ids [n, k], probs [n, k])


def chat_formats(config: SaoConfig, envs: Sequence[str]) -> dict[str, ChatFormat]:
    """The sampler's chat format for each env (system prompt and stop strings differ per env)."""
    tokenizer = load_tokenizer(config.policy.model, config.policy.cache_dir)
    formats = {}
    for env in sorted(set(envs)):
        settings = generation_settings(config.model_copy(update={"env": config.env.model_copy(update={"name": env})}))
        formats[env] = ChatFormat(tokenizer, settings.system_prompt, settings.stop)
    return formats


def prepare(episodes: Sequence[Episode], config: SaoConfig, encoder, temporal_filter,
            recent_window: int, bottleneck=None) -> list[PreparedEpisode]:
    """Replay each episode through the compressor (exactly the sampler's memory and recall) into student inputs.

    Alignment leaves `bottleneck` unset: projectors are aligned in the encoder's space (the policy composes them
    with a bottleneck at load); benchmarks pass one to read memory as it travels."""
    chats = chat_formats(config, [e.env for e in episodes])
    prepared = []
    for episode in episodes:
        trajectory, _ = replay_episode(episode, chats[episode.env], encoder, temporal_filter.fork(),
                                       recent_window=recent_window, bottleneck=bottleneck,
                                       recall_turns=config.compression.recall_turns)
        prepared.append(PreparedEpisode(episode, trajectory, training_inputs(trajectory)))
    return prepared


def _text_input(trajectory: Trajectory, step: int, window: int) -> TurnInput:
    """Step `step` with no memory: its observation after the last `window` earlier steps as text."""
    finished = [(s.observation_ids, s.action_ids) for s in trajectory.steps[:step]]
    current = trajectory.steps[step]
    return TurnInput(trajectory.prompt_ids, np.zeros((0, trajectory.memory.vectors.shape[1]), np.float32),
                     turn_tokens(finished, current.observation_ids, window), current.action_ids)


def full_text_input(trajectory: Trajectory, step: int) -> TurnInput:
    """Step `step` with every earlier step as text and no memory: the teacher's context."""
    return _text_input(trajectory, step, step)


def without_memory(trajectory: Trajectory, step: int) -> TurnInput:
    """Step `step` without what memory gives it, slots and recalled turns: the recent window alone (truncation)."""
    return _text_input(trajectory, step, trajectory.recent_window)


def no_history_input(trajectory: Trajectory, step: int) -> TurnInput:
    return _text_input(trajectory, step, 0)


def _head(policy: MemoryPolicy, hidden: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(policy.lm.get_output_embeddings()(hidden).float(), dim=-1)


def episode_full_text_logprobs(policy: MemoryPolicy, trajectory: Trajectory) -> list[torch.Tensor]:
    """Teacher log-probs [n_t, V] of every step's action tokens, from one pass over the whole episode."""
    pieces, targets, position = [np.asarray(trajectory.prompt_ids, np.int64)], [], len(trajectory.prompt_ids)
    for step in trajectory.steps:
        position += len(step.observation_ids)
        targets.append(torch.arange(position - 1, position - 1 + len(step.action_ids)))
        position += len(step.action_ids)
        pieces += [np.asarray(step.observation_ids, np.int64), np.asarray(step.action_ids, np.int64)]
    ids = torch.from_numpy(np.concatenate(pieces)).unsqueeze(0).to(policy.projector.weight.device)
    with torch.no_grad():
        hidden = policy.lm.base_model(input_ids=ids).last_hidden_state[0]
        return [_head(policy, hidden[positions]) for positions in targets]


def context_logprobs(policy: MemoryPolicy, inputs: Sequence[TurnInput]) -> list[torch.Tensor]:
    """Log-probs [n_i, V] at each input's action tokens, one batched forward (grad flows to the projector)."""
    batch = collate_turns(list(inputs), policy.memory_width).to(policy.projector.weight.device)
    embeds = policy._embed(batch.token_ids, batch.memory_vectors, batch.memory_mask)
    hidden = policy.lm.base_model(inputs_embeds=embeds, attention_mask=batch.attention_mask).last_hidden_state
    out = []
    for row, x in enumerate(inputs):
        end = x.positions
        out.append(_head(policy, hidden[row, end - len(x.action_ids) - 1:end - 1]))
    return out


def reconstruction_nll(policy: MemoryPolicy, examples: Sequence[TurnInput]) -> torch.Tensor:
    """Per-example mean NLL per text token of `sao.offline.reconstruction` examples (grad flows to the projector)."""
    out = []
    for example, logprobs in zip(examples, context_logprobs(policy, examples)):
        ids = torch.as_tensor(np.asarray(example.action_ids, np.int64), device=logprobs.device)
        out.append(-logprobs.gather(-1, ids[:, None]).mean())
    return torch.stack(out)


def action_nll_kl(teacher: torch.Tensor, student: torch.Tensor, action_ids) -> tuple[float, float]:
    """One action's NLL (summed over its tokens) under `student`, and its KL(teacher || student) summed."""
    ids = torch.as_tensor(np.asarray(action_ids, np.int64), device=student.device)
    nll = -student.gather(-1, ids[:, None]).sum()
    kl = (teacher.exp() * (teacher - student)).sum()
    return float(nll), float(kl)


def attach_teacher(policy: MemoryPolicy, prepared: Sequence[PreparedEpisode], top_k: int) -> None:
    """Keep each action token's top-k teacher tokens and their renormalised probabilities."""
    for item in prepared:
        tops = []
        for logprobs in episode_full_text_logprobs(policy, item.trajectory):
            values, indices = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
            tops.append((indices, torch.softmax(values, dim=-1)))
        item.teacher_top = tops


def memory_steps(prepared: Sequence[PreparedEpisode]) -> list[tuple[int, int]]:
    """(episode, step) pairs whose student context holds at least one memory slot."""
    return [(e, s) for e, item in enumerate(prepared) for s, x in enumerate(item.student) if len(x.memory)]


def distillation_loss(policy: MemoryPolicy, prepared: Sequence[PreparedEpisode],
                      pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Mean over action tokens of the cross-entropy from the top-k teacher to the student."""
    inputs = [prepared[e].student[s] for e, s in pairs]
    total, tokens = 0.0, 0
    for (e, s), logprobs in zip(pairs, context_logprobs(policy, inputs)):
        indices, probs = prepared[e].teacher_top[s]
        total = total - (probs * logprobs.gather(-1, indices)).sum()
        tokens += len(indices)
    return total / max(tokens, 1)


@torch.no_grad()
def step_kls(policy: MemoryPolicy, prepared: Sequence[PreparedEpisode], pairs: Sequence[tuple[int, int]],
             batch_size: int = 8, memory: bool = True) -> list[tuple[float, int]]:
    """Per step, in order: full-vocabulary KL(full-text teacher || the step's context) summed over its action
    tokens, and their count; `memory` False scores the context without its slots.

    A teacher pass covers a whole episode and is held only while its steps are in the batch (pairs sorted by
    episode reuse it): full-vocabulary log-probs of many episodes would not fit in memory at once."""
    out, teachers = [], {}
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        teachers = {e: teachers[e] if e in teachers else episode_full_text_logprobs(policy, prepared[e].trajectory)
                    for e in sorted({e for e, _ in chunk})}
        inputs = [prepared[e].student[s] if memory else without_memory(prepared[e].trajectory, s) for e, s in chunk]
        for (e, s), student in zip(chunk, context_logprobs(policy, inputs)):
            teacher = teachers[e][s]
            out.append((float((teacher.exp() * (teacher - student)).sum()), len(teacher)))
    return out


def informative_steps(policy: MemoryPolicy, prepared: Sequence[PreparedEpisode], share: float,
                      batch_size: int = 8) -> list[tuple[int, int]]:
    """The `share` of memory steps where the recent window alone is furthest from full text.

    Ranked by KL(full-text teacher || the step without its slots) per action token: the steps whose
    actions depend on what only memory can carry (a question about an early fact), not the many a
    recent window already answers (a message repeated back), which otherwise dominate a uniform draw."""
    pairs = memory_steps(prepared)
    if share >= 1.0:
        return pairs
    kls = step_kls(policy, prepared, pairs, batch_size, memory=False)
    ranked = sorted(zip(pairs, kls), key=lambda item: -item[1][0] / max(item[1][1], 1))
    return sorted(pair for pair, _ in ranked[:max(1, round(share * len(pairs)))])


def mean_kl(policy: MemoryPolicy, prepared: Sequence[PreparedEpisode], pairs: Sequence[tuple[int, int]],
            batch_size: int = 8) -> float:
    """Full-vocabulary KL(teacher || student) per action token, averaged over the given steps."""
    kls = step_kls(policy, prepared, pairs, batch_size)
    return sum(kl for kl, _ in kls) / max(sum(tokens for _, tokens in kls), 1)


def align_projector(policy: MemoryPolicy, prepared: Sequence[PreparedEpisode], steps: int, lr: float = 1e-3,
                    batch_size: int = 8, seed: int = 0, top_k: int = 64,
                    progress: Callable[[str, int, float], None] | None = None, reconstruction: Sequence[TurnInput] = (),
                    reconstruct_updates: int = 0, reconstruct_batch: int = 16, reconstruct_weight: float = 0.0,
                    pairs: Sequence[tuple[int, int]] | None = None) -> list[float]:
    """Train `policy.projector` (only); returns the loss of every update.

    With `reconstruction` examples (`sao.offline.reconstruction.slot_examples`), first
    `reconstruct_updates` updates teach the soft token its slot's content (the LM rewrites the
    step from it), then every distillation update adds `reconstruct_weight` x that loss on
    `reconstruct_batch` examples (0, the default: none), so distillation cannot trade the content
    away for a prompt.
    The LM's parameters are frozen for the duration and restored to their previous
    `requires_grad` afterwards. With `steps` 0 only the reconstruction runs (no teacher is computed).
    Distillation draws its steps from `pairs` (default: every step with memory; see `informative_steps`).
    """
    if steps and any(item.teacher_top is None for item in prepared):
        attach_teacher(policy, prepared, top_k)
    pairs = memory_steps(prepared) if pairs is None else list(pairs)
    if steps and not pairs:
        raise ValueError("no step of these episodes sees a memory slot: use longer episodes or a smaller "
                         "recent window")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    frozen = {name: p.requires_grad for name, p in policy.lm.named_parameters()}
    for p in policy.lm.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.projector.parameters(), lr=lr, weight_decay=0.0)
    losses = []

    def update(phase: str, index: int, loss: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(phase, index, losses[-1])

    def reconstruct(count: int) -> torch.Tensor:
        return reconstruction_nll(policy, rng.sample(reconstruction, min(count, len(reconstruction)))).mean()

    try:
        for index in range(reconstruct_updates if reconstruction else 0):
            update("reconstruct", index, reconstruct(reconstruct_batch))
        for index in range(steps):
            loss = distillation_loss(policy, prepared, rng.sample(pairs, min(batch_size, len(pairs))))
            if reconstruction and reconstruct_weight:
                loss = loss + reconstruct_weight * reconstruct(reconstruct_batch)
            update("distil", index, loss)
    finally:
        for name, p in policy.lm.named_parameters():
            p.requires_grad_(frozen[name])
    return losses


# ---- corpora: scripted episodes of the two built-in multi-step envs --------------------------------

def labyrinth_corpus(seed: int, count: int, max_steps: int = 400, random_every: int = 5) -> list[Episode]:
    """Labyrinth episodes of varied size by the noisy expert (every `random_every`-th by the random agent)."""
    rng = random.Random(seed)
    env, episodes = TextWorldEnv(), []
    for index in range(count):
        options = {"size": rng.choice([6, 8, 10]), "gems": rng.randint(2, 4), "locked_doors": rng.randint(0, 2),
                   "max_steps": max_steps}
        task = TextWorldEnv.make_tasks(EnvConfig(name="textworld", seed=seed, options=options), 1, index)[0]
        kind = "random" if random_every and index % random_every == random_every - 1 else "noisy"
        agent = make_agent(kind, seed=seed * 1000 + index, noise=rng.choice([0.1, 0.2, 0.3]))
        episodes.append(record_episode(env, task.task_id, task.spec, agent))
    return episodes


def tutoring_corpus(seed: int, count: int) -> list[Episode]:
    """Multi-turn arithmetic episodes of a stuck learner (10-40 tries under 'incorrect' feedback)."""
    rng = random.Random(seed)
    episodes = []
    for index, (question, answer) in enumerate(arithmetic_questions(seed, count)):
        texts = long_episode(rng, question, answer)
        steps = []
        for turn, text in enumerate(texts):
            observation, action = text.rsplit("\n", 1)  # actions are one line; a question may not be
            numbers = re.findall(r"-?\d+", action)
            right = bool(numbers) and int(numbers[-1]) == answer
            steps.append(EpisodeStep(observation, action, 1.0 if right else 0.0, turn == len(texts) - 1))
        episodes.append(Episode("arithmetic", f"tutoring-{seed}-{index}", steps, "stuck-learner"))
    return episodes


def summarise(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (sao/stats.py's); NaN where there are too few values."""
    values = list(values)
    error = stderr(values)
    return (sum(values) / len(values) if values else math.nan), (math.nan if error is None else error)
