"""Projector alignment by distillation, on the tiny random model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sao.compression.temporal import load_temporal_filter
from sao.offline.align import (
    align_projector,
    full_text_input,
    labyrinth_corpus,
    mean_kl,
    memory_steps,
    prepare,
    tutoring_corpus,
    without_memory,
)
from sao.policy.weights import build_policy


@pytest.fixture(scope="module")
def prepared(tiny_config, encoder):
    torch.set_num_threads(1)
    episodes = tutoring_corpus(0, 1) + labyrinth_corpus(0, 1, max_steps=8)
    return prepare(episodes, tiny_config, encoder, load_temporal_filter(), recent_window=1)


def test_student_reads_memory_and_recent_window_teacher_reads_everything(prepared):
    item = prepared[0]
    step = len(item.student) - 1
    student, teacher = item.student[step], full_text_input(item.trajectory, step)
    assert len(student.memory) > 0 and len(teacher.memory) == 0
    assert len(teacher.context_ids) > len(student.context_ids)  # older steps are text only for the teacher
    truncated = without_memory(item.trajectory, step)
    assert len(truncated.memory) == 0
    assert item.trajectory.steps[step].recalled  # compression.recall_turns: an older turn is text again
    recalled = len(student.context_ids) - len(truncated.context_ids)
    assert recalled > 0 and np.array_equal(truncated.context_ids, student.context_ids[recalled:])


def test_alignment_reduces_kl_in_a_few_steps(tiny_config, prepared):
    policy = build_policy(tiny_config.policy, 384)
    pairs = memory_steps(prepared)
    before = mean_kl(policy, prepared, pairs)
    lm_before = {k: v.clone() for k, v in policy.lm.state_dict().items()}
    # Full-vocabulary teacher and full batch: each update descends the KL on these very steps.
    losses = align_projector(policy, prepared, steps=5, lr=3e-3, batch_size=len(pairs), seed=0,
                             top_k=policy.lm.config.vocab_size)
    after = mean_kl(policy, prepared, pairs)
    assert after < 0.9 * before, (before, after, losses)
    assert losses[-1] < losses[0]
    assert all(torch.equal(v, lm_before[k]) for k, v in policy.lm.state_dict().items())  # the LM stays frozen
    assert all(p.requires_grad for p in policy.lm.parameters())  # and trainable again afterwards


@pytest.mark.parametrize("reconstruct", [False, True])
def test_alignment_is_reproducible_bit_for_bit(tiny_config, prepared, reconstruct):
    from sao.offline.reconstruction import slot_examples
    from sao.policy.loading import load_tokenizer

    slots = slot_examples(prepared, load_tokenizer(tiny_config.policy.model, tiny_config.policy.cache_dir))
    weights = []
    for _ in range(2):
        policy = build_policy(tiny_config.policy, 384)
        align_projector(policy, prepared, steps=2, lr=1e-3, batch_size=3, seed=7, top_k=16,
                        reconstruction=slots if reconstruct else (), reconstruct_updates=2, reconstruct_batch=4,
                        reconstruct_weight=1.0)
        weights.append(policy.projector.weight.detach().clone())
    assert torch.equal(weights[0], weights[1]) and weights[0].any()


def test_each_slot_learns_to_name_its_step(tiny_config, prepared):
    """Reconstruction examples pair a slot with its own step's text; training them makes the slot say it."""
    from sao.offline.align import reconstruction_nll
    from sao.offline.episodes import turn_text
    from sao.offline.reconstruction import MAX_TEXT_TOKENS, content_nll, slot_examples
    from sao.policy.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_config.policy.model, tiny_config.policy.cache_dir)
    examples = slot_examples(prepared, tokenizer)
    item = prepared[0]
    assert len(examples) == sum(len(p.trajectory.memory.vectors) for p in prepared)
    first_slot = item.trajectory.memory
    step = item.episode.steps[int(first_slot.spans[1][0])]
    expected = tokenizer(turn_text(step.observation, step.action), add_special_tokens=False)["input_ids"]
    assert list(examples[1].action_ids) == expected[-MAX_TEXT_TOKENS:]
    assert (examples[1].memory[0] == first_slot.dequantized(2)[1]).all()

    policy = build_policy(tiny_config.policy, 384)
    before = content_nll(policy, examples)
    assert abs(before["other_minus_own"]) < 1e-6  # zero projector: every slot reads alike
    losses = align_projector(policy, prepared, steps=0, lr=1e-2, seed=0, top_k=16, reconstruction=examples,
                             reconstruct_updates=20, reconstruct_batch=len(examples))
    after = content_nll(policy, examples)
    assert len(losses) == 20 and losses[-1] < losses[0]
    assert after["other_minus_own"] > 3 * after["other_minus_own_stderr"] > 0, after
    with torch.no_grad():
        assert float(reconstruction_nll(policy, examples).mean()) == pytest.approx(after["own"], rel=1e-5)


def test_informative_steps_are_those_the_recent_window_answers_least_like_full_text(tiny_config, prepared):
    from sao.offline.align import context_logprobs, episode_full_text_logprobs, informative_steps

    policy = build_policy(tiny_config.policy, 384)
    pairs = memory_steps(prepared)
    assert informative_steps(policy, prepared, 1.0) == pairs
    kl = {}
    for e, s in pairs:
        teacher = episode_full_text_logprobs(policy, prepared[e].trajectory)[s]
        student = context_logprobs(policy, [without_memory(prepared[e].trajectory, s)])[0]
        kl[(e, s)] = float((teacher.exp() * (teacher - student)).sum(-1).mean())
    chosen = informative_steps(policy, prepared, 0.25)
    assert len(chosen) == round(0.25 * len(pairs)) and set(chosen) <= set(pairs)
    assert min(kl[p] for p in chosen) >= max(kl[p] for p in pairs if p not in chosen)


def test_distillation_draws_only_the_given_steps(tiny_config, prepared, monkeypatch):
    import sao.offline.align as alignment

    drawn = []
    real = alignment.distillation_loss
    monkeypatch.setattr(alignment, "distillation_loss",
                        lambda policy, items, pairs: drawn.extend(pairs) or real(policy, items, pairs))
    given = memory_steps(prepared)[:2]
    align_projector(build_policy(tiny_config.policy, 384), prepared, steps=3, batch_size=4, top_k=8, pairs=given)
    assert drawn and set(drawn) <= set(given)
