"""The LSTM redundancy filter: causality, keep rules, and online == batch."""

import numpy as np
import pytest
import torch

from sao.compression.temporal import (
    calibrate_threshold,
    measure_keep_ratio,
    prediction_errors,
)


def test_predictions_are_causal_and_unit_norm(make_filter, dialogue_embeddings):
    model = make_filter(0.0).model
    seq = torch.from_numpy(dialogue_embeddings)[None]
    changed = seq.clone()
    changed[0, 6:] = torch.flip(changed[0, 6:], dims=[-1])
    with torch.no_grad():
        original, perturbed = model(seq), model(changed)
    torch.testing.assert_close(original[0, :6], perturbed[0, :6])
    assert not torch.allclose(original[0, 6:], perturbed[0, 6:])
    torch.testing.assert_close(original.norm(dim=-1), torch.ones(1, len(dialogue_embeddings)))


def test_step_by_step_matches_forward(make_filter, dialogue_embeddings):
    model = make_filter(0.0).model
    state, stepped = None, []
    with torch.no_grad():
        whole = model(torch.from_numpy(dialogue_embeddings)[None])[0]
        for embedding in torch.from_numpy(dialogue_embeddings):
            prediction, state = model.step(embedding, state)
            stepped.append(prediction)
    torch.testing.assert_close(torch.stack(stepped), whole, atol=1e-5, rtol=0)


def test_online_decisions_equal_batch_decisions(median_filter, dialogue, dialogue_embeddings):
    _, rewards = dialogue
    batch = median_filter.filter_batch(dialogue_embeddings, rewards)
    median_filter.start()
    online = [median_filter.observe(e, r) for e, r in zip(dialogue_embeddings, rewards)]
    assert [(d.keep, d.reason) for d in online] == [(d.keep, d.reason) for d in batch]
    np.testing.assert_allclose([d.error for d in online], [d.error for d in batch], atol=1e-5)
    # The case is only meaningful if every rule fired at least once.
    assert {d.reason for d in batch} == {"boundary", "reward", "surprise", "redundant"}


def test_first_step_is_a_boundary_and_start_resets(make_filter, dialogue_embeddings):
    temporal_filter = make_filter(threshold=10.0)  # errors are <= 2, so nothing is surprising
    first = temporal_filter.observe(dialogue_embeddings[0], 0.0)
    second = temporal_filter.observe(dialogue_embeddings[1], 0.0)
    assert (first.keep, first.reason, first.error) == (True, "boundary", 0.0)
    assert (second.keep, second.reason) == (False, "redundant") and second.error > 0
    temporal_filter.start()
    assert temporal_filter.observe(dialogue_embeddings[1], 0.0).reason == "boundary"


def test_nonzero_reward_is_always_kept(make_filter, dialogue_embeddings):
    decisions = make_filter(threshold=10.0).filter_batch(
        dialogue_embeddings[:5], [0.0, 1.0, 0.0, -0.5, 0.0])
    assert [d.reason for d in decisions] == ["boundary", "reward", "redundant", "reward", "redundant"]
    assert [d.keep for d in decisions] == [True, True, False, True, False]


def test_negative_threshold_keeps_every_step_as_surprise(make_filter, dialogue_embeddings):
    decisions = make_filter(threshold=-1.0).filter_batch(
        dialogue_embeddings, [0.0] * len(dialogue_embeddings))
    assert [d.reason for d in decisions[1:]] == ["surprise"] * (len(decisions) - 1)


def test_errors_are_one_minus_cosine():
    a = np.array([[1.0, 0.0], [1.0, 0.0], [3.0, 4.0]])
    b = np.array([[1.0, 0.0], [0.0, 2.0], [-3.0, -4.0]])
    np.testing.assert_allclose(prediction_errors(a, b), [0.0, 1.0, 2.0])


def test_calibrated_threshold_reaches_the_target_keep_ratio(make_filter):
    rng = np.random.default_rng(0)
    sequences = [rng.standard_normal((rng.integers(5, 15), 16)).astype(np.float32)
                 for _ in range(30)]
    temporal_filter = make_filter(0.0, dim=16)
    for target in (0.4, 0.7):
        temporal_filter.threshold = calibrate_threshold(temporal_filter, sequences, target)
        assert measure_keep_ratio(temporal_filter, sequences) == pytest.approx(target, abs=0.02)


def test_target_below_the_boundary_share_keeps_only_boundaries(make_filter):
    sequences = [np.random.default_rng(i).standard_normal((2, 16)).astype(np.float32)
                 for i in range(10)]
    temporal_filter = make_filter(0.0, dim=16)
    temporal_filter.threshold = calibrate_threshold(temporal_filter, sequences, 0.3)
    assert measure_keep_ratio(temporal_filter, sequences) == 0.5  # the 10 first steps of 20
