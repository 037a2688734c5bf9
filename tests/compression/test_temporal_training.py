"""Self-supervised LSTM training: it must beat the previous-embedding baseline, deterministically."""

import numpy as np
import pytest
import torch

from sao.compression.temporal import TemporalFilter
from sao.compression.train import train_from_texts, train_temporal_model


def cyclic_sequences(count: int = 40, length: int = 12, dim: int = 16, seed: int = 0):
    """Episodes cycling through 4 fixed directions from a random phase, plus a little noise.

    Consecutive steps are far apart, so "predict the previous embedding" is bad, while the
    next step is fully predictable from the current one.
    """
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((4, dim))
    sequences = []
    for _ in range(count):
        phase = rng.integers(4)
        steps = directions[(phase + np.arange(length)) % 4] + 0.05 * rng.standard_normal((length, dim))
        sequences.append((steps / np.linalg.norm(steps, axis=1, keepdims=True)).astype(np.float32))
    return sequences


@pytest.fixture(scope="module")
def trained():
    return train_temporal_model(cyclic_sequences(), dim=16, hidden=32, epochs=25, lr=1e-2, seed=0)


def test_training_beats_the_previous_embedding_baseline(trained):
    _, stats = trained
    assert stats["baseline_val_loss"] > 0.5
    assert stats["val_loss"] < 0.5 * stats["baseline_val_loss"]
    assert stats["train_loss"] < 0.5 * stats["baseline_train_loss"]


def test_training_is_deterministic_given_the_seed(trained):
    model, stats = trained
    again, again_stats = train_temporal_model(
        cyclic_sequences(), dim=16, hidden=32, epochs=25, lr=1e-2, seed=0)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, atol=0, rtol=0)
    assert again_stats == stats


def test_training_rejects_too_little_data():
    with pytest.raises(ValueError, match="two episodes"):
        train_temporal_model([np.ones((1, 4), np.float32)] * 5, dim=4)


def test_train_from_texts_returns_a_calibrated_filter(encoder, dialogue):
    texts, _ = dialogue
    episodes = [texts[:11], texts[11:], texts[1:8], texts[4:11]]
    temporal_filter = train_from_texts(episodes, encoder, target_keep_ratio=0.6,
                                       hidden=16, epochs=2, seed=1)
    assert isinstance(temporal_filter, TemporalFilter)
    assert temporal_filter.meta["encoder"] == encoder.name
    assert temporal_filter.meta["seed"] == 1
    assert temporal_filter.meta["keep_ratio"] == pytest.approx(0.6, abs=0.1)


def test_long_episodes_train_in_chunks_that_cover_every_pair():
    sequences = cyclic_sequences(count=3, length=50, dim=16)
    _, stats = train_temporal_model(sequences, dim=16, hidden=8, epochs=1, seed=0, chunk_length=8)
    # 49 (t, t+1) pairs per episode, 7 per chunk of 8 steps: 7 chunks each.
    assert stats["train_sequences"] + stats["val_sequences"] == 3 * 7
    with pytest.raises(ValueError, match="chunk_length"):
        train_temporal_model(sequences, dim=16, chunk_length=1)
