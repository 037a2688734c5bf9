"""Projector alignment by distillation, on the tiny random model."""

from __future__ import annotations

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
    assert len(without_memory(student).memory) == 0


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


def test_alignment_is_reproducible_bit_for_bit(tiny_config, prepared):
    weights = []
    for _ in range(2):
        policy = build_policy(tiny_config.policy, 384)
        align_projector(policy, prepared, steps=2, lr=1e-3, batch_size=3, seed=7, top_k=16)
        weights.append(policy.projector.weight.detach().clone())
    assert torch.equal(weights[0], weights[1]) and weights[0].any()
