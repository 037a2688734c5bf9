"""Saving and loading temporal filter weights, and the default shipped with sao."""

import json

import numpy as np
import pytest
import torch

from sao.compression import temporal
from sao.compression.semantic import DEFAULT_MODEL_NAME
from sao.compression.temporal import load_temporal_filter, save_temporal_weights, sidecar_path


def test_save_load_round_trip(tmp_path, make_filter, dialogue_embeddings):
    original = make_filter(0.05)
    path = tmp_path / "filter.safetensors"
    save_temporal_weights(original.model, path, {"threshold": 0.05, "encoder": "x", "seed": 3})
    loaded = load_temporal_filter(path)
    assert loaded.threshold == 0.05
    assert loaded.meta["seed"] == 3 and loaded.meta["hidden"] == 32 and loaded.meta["dim"] == 384
    with torch.no_grad():
        seq = torch.from_numpy(dialogue_embeddings)[None]
        torch.testing.assert_close(loaded.model(seq), original.model(seq), atol=0, rtol=0)
    assert load_temporal_filter(path, threshold=0.5).threshold == 0.5


def test_weights_are_safetensors_not_pickle(tmp_path, make_filter):
    path = tmp_path / "filter.safetensors"
    save_temporal_weights(make_filter(0.1).model, path, {"threshold": 0.1})
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_length])
    assert "lstm.weight_ih_l0" in header and "head.weight" in header
    assert json.loads(sidecar_path(path).read_text())["threshold"] == 0.1


def test_missing_default_names_the_command_that_creates_it(tmp_path, monkeypatch):
    monkeypatch.setattr(temporal, "DEFAULT_WEIGHTS_PATH", tmp_path / "absent.safetensors")
    with pytest.raises(FileNotFoundError, match=r"python -m sao\.offline\.default_weights"):
        load_temporal_filter()


def test_missing_sidecar_is_reported(tmp_path, make_filter):
    path = tmp_path / "filter.safetensors"
    save_temporal_weights(make_filter(0.1).model, path, {"threshold": 0.1})
    sidecar_path(path).unlink()
    with pytest.raises(FileNotFoundError, match=r"filter\.json"):
        load_temporal_filter(path)


def test_shipped_default_matches_the_encoder_and_beats_the_baseline(encoder):
    default = load_temporal_filter()
    assert default.dim == encoder.dim == 384
    assert default.meta["encoder"] == DEFAULT_MODEL_NAME
    assert "default_weights" in default.meta["command"]
    training = default.meta["training"]
    assert training["val_loss"] < training["baseline_val_loss"]
    assert 0.0 < default.threshold < 2.0
    assert temporal.DEFAULT_WEIGHTS_PATH.stat().st_size < 2 * 1024 * 1024


def test_shipped_default_merges_repeated_feedback(encoder):
    default = load_temporal_filter()
    texts = ["Calculate 3 + 4.\n8"] + ["Incorrect. Try again.\n8"] * 12 + ["Incorrect. Try again.\n7"]
    decisions = default.filter_batch(encoder.encode(texts), [0.0] * len(texts))
    kept = [d.keep for d in decisions]
    assert kept[0] and kept[-1]  # the question and the changed answer are turning points
    assert not any(kept[6:13])  # a long run of identical feedback is redundant
    assert np.mean(kept) < 0.5
