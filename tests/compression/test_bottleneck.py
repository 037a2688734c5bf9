"""The narrower-memory bottleneck the benchmarks measure (sao.compression.bottleneck)."""

from __future__ import annotations

import numpy as np
import pytest

from sao.compression.bottleneck import pca_bottleneck


def test_pca_bottleneck_keeps_what_its_directions_span_and_drops_the_rest():
    rng = np.random.default_rng(0)
    directions = rng.normal(size=(3, 32))
    training = rng.normal(size=(200, 3)) @ directions + 5.0  # slots on a 3-d plane, off the origin
    squeeze = pca_bottleneck(training, 3)
    on_plane = (rng.normal(size=(4, 3)) @ directions + 5.0).astype(np.float32)
    assert np.allclose(squeeze(on_plane), on_plane, atol=0.05)  # INT8 rounding of 3 coordinates only
    off_plane = on_plane + rng.normal(size=(4, 32)).astype(np.float32)
    assert (np.linalg.norm(squeeze(off_plane) - on_plane, axis=1) < np.linalg.norm(off_plane - on_plane, axis=1)).all()
    assert squeeze(np.zeros((0, 32), np.float32)).shape == (0, 32)
    narrowed = pca_bottleneck(training, 1)(on_plane)
    assert np.linalg.matrix_rank(narrowed - narrowed.mean(0), tol=1e-3) == 1


def test_a_width_beyond_the_training_slots_is_refused():
    with pytest.raises(ValueError, match="width"):
        pca_bottleneck(np.ones((5, 8)), 6)
