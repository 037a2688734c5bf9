"""The memory bottleneck (sao.compression.bottleneck): narrower slots on the wire, the same soft tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sao.compression.bottleneck import (
    BottleneckMismatch,
    fit_bottleneck,
    load_bottleneck,
    resolve_bottleneck,
    save_bottleneck,
    shipped_bottleneck_path,
    variance_kept,
)


def _plane(seed: int = 0, dim: int = 32, rank: int = 3):
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(rank, dim))
    return rng, directions, (rng.normal(size=(200, rank)) @ directions + 5.0)  # on a plane, off the origin


def test_the_round_trip_keeps_what_the_basis_spans_and_drops_the_rest():
    rng, directions, training = _plane()
    bottleneck = fit_bottleneck(training, 3, "enc")
    assert bottleneck.width == 3 and bottleneck.dim == 32
    np.testing.assert_allclose(bottleneck.basis.T @ bottleneck.basis, np.eye(3), atol=1e-5)
    on_plane = (rng.normal(size=(4, 3)) @ directions + 5.0).astype(np.float32)
    assert bottleneck.encode(on_plane).shape == (4, 3)
    assert np.allclose(bottleneck.squeeze(on_plane), on_plane, atol=0.05)  # INT8 rounding of 3 coordinates only
    off_plane = on_plane + rng.normal(size=(4, 32)).astype(np.float32)
    closer = np.linalg.norm(bottleneck.squeeze(off_plane) - on_plane, axis=1)
    assert (closer < np.linalg.norm(off_plane - on_plane, axis=1)).all()
    assert bottleneck.squeeze(np.zeros((0, 32), np.float32)).shape == (0, 32)
    assert variance_kept(bottleneck, on_plane) > 0.999
    assert variance_kept(fit_bottleneck(training, 1, "enc"), on_plane) < 0.9


def test_the_fit_is_deterministic_and_its_identity_names_the_bytes():
    _, _, training = _plane()
    first, again = fit_bottleneck(training, 2, "enc"), fit_bottleneck(training.copy(), 2, "enc")
    assert first.basis.tobytes() == again.basis.tobytes() and first.identity == again.identity
    assert first.identity.startswith("enc/pca2/")
    flipped = fit_bottleneck(-training, 2, "enc")  # same directions up to sign: the sign rule picks one
    np.testing.assert_allclose(np.abs(flipped.basis), np.abs(first.basis), atol=1e-5)
    assert fit_bottleneck(training[:100], 2, "enc").identity != first.identity


def test_a_width_beyond_the_training_vectors_is_refused():
    with pytest.raises(ValueError, match="width"):
        fit_bottleneck(np.ones((5, 8)), 6, "enc")


def test_save_load_round_trip_and_refusals(tmp_path):
    _, _, training = _plane()
    bottleneck = fit_bottleneck(training, 3, "enc")
    path = tmp_path / "basis.safetensors"
    save_bottleneck(bottleneck, path, {"seed": 0})
    loaded, meta = load_bottleneck(path, "enc")
    assert loaded.identity == bottleneck.identity == meta["identity"] and meta["width"] == 3
    with pytest.raises(BottleneckMismatch, match="fitted on 'enc' embeddings, but this run's encoder is 'other'"):
        load_bottleneck(path, "other")
    sidecar = path.with_suffix(".json")
    record = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**record, "identity": "enc/pca3/000000000000"}))
    with pytest.raises(BottleneckMismatch, match="not the basis its sidecar names"):
        load_bottleneck(path, "enc")
    sidecar.write_text(json.dumps(record))
    path.write_bytes(b"not safetensors")
    with pytest.raises(BottleneckMismatch, match="not a readable safetensors file"):
        load_bottleneck(path, "enc")
    sidecar.unlink()
    with pytest.raises(BottleneckMismatch, match="sidecar"):
        load_bottleneck(path, "enc")


def test_settings_resolve_to_the_shipped_basis_none_or_a_file(tmp_path):
    shipped = resolve_bottleneck("auto", "all-MiniLM-L6-v2")
    assert shipped is not None and shipped.width == 64 and shipped.dim == 384
    assert resolve_bottleneck("none", "all-MiniLM-L6-v2") is None
    assert resolve_bottleneck("auto", "some/encoder-without-a-basis") is None  # full width where none ships
    assert resolve_bottleneck(str(shipped_bottleneck_path("all-MiniLM-L6-v2")), "all-MiniLM-L6-v2").identity == \
        shipped.identity
    with pytest.raises(BottleneckMismatch, match="no such file"):
        resolve_bottleneck(str(tmp_path / "missing.safetensors"), "all-MiniLM-L6-v2")
    with pytest.raises(BottleneckMismatch, match="fitted on"):
        resolve_bottleneck(str(shipped_bottleneck_path("all-MiniLM-L6-v2")), "another-encoder")
