"""INT8 absmax quantization: error bound, fidelity on real embeddings, edge cases."""

import numpy as np
import pytest

from sao.compression.quantize import (
    dequantize_int8,
    dequantize_int8_per_channel,
    quantize_int8,
    quantize_int8_per_channel,
)

# Float32 rounding of x / scale and q * scale may add a few ulps on top of scale / 2.
ROUNDING_SLACK = 1e-6


def test_round_trip_error_is_at_most_half_a_scale_step_on_real_embeddings(dialogue_embeddings):
    codes, scales = quantize_int8(dialogue_embeddings)
    assert codes.dtype == np.int8 and scales.dtype == np.float32
    assert codes.shape == dialogue_embeddings.shape and scales.shape == (len(dialogue_embeddings),)
    assert np.abs(codes).max() == 127  # the absmax element of every row uses the full range
    error = np.abs(dialogue_embeddings - dequantize_int8(codes, scales))
    assert (error <= scales[:, None] / 2 * (1 + ROUNDING_SLACK)).all()


def test_round_trip_keeps_cosine_above_0_999_on_real_embeddings(dialogue_embeddings):
    restored = dequantize_int8(*quantize_int8(dialogue_embeddings))
    cosine = (restored * dialogue_embeddings).sum(1) / (
        np.linalg.norm(restored, axis=1) * np.linalg.norm(dialogue_embeddings, axis=1))
    assert cosine.min() >= 0.999


def test_zero_row_gets_scale_zero_and_no_nan():
    x = np.zeros((3, 8), dtype=np.float32)
    x[1] = np.linspace(-1, 1, 8)
    codes, scales = quantize_int8(x)
    assert scales[0] == 0 and scales[2] == 0 and scales[1] > 0
    assert not codes[0].any() and not codes[2].any()
    restored = dequantize_int8(codes, scales)
    assert np.isfinite(restored).all()
    np.testing.assert_array_equal(restored[0], 0.0)


def test_per_channel_error_bound_and_zero_column():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((50, 6)) * np.array([0.01, 1, 10, 100, 0.5, 0])).astype(np.float32)
    codes, scales = quantize_int8_per_channel(x)
    assert scales.shape == (6,) and scales[5] == 0
    error = np.abs(x - dequantize_int8_per_channel(codes, scales))
    assert (error <= scales[None, :] / 2 * (1 + ROUNDING_SLACK)).all()
    # The tiny first column keeps its precision because it has its own scale.
    assert error[:, 0].max() < 1e-3


def test_non_finite_input_is_rejected():
    with pytest.raises(ValueError, match="NaN"):
        quantize_int8(np.array([[1.0, np.nan]], dtype=np.float32))


def test_one_dimensional_input_is_rejected():
    with pytest.raises(ValueError, match="2-d"):
        quantize_int8(np.ones(4, dtype=np.float32))


def test_per_channel_keeps_cosine_above_0_999_on_real_embeddings(dialogue_embeddings):
    restored = dequantize_int8_per_channel(*quantize_int8_per_channel(dialogue_embeddings))
    cosine = (restored * dialogue_embeddings).sum(1) / (
        np.linalg.norm(restored, axis=1) * np.linalg.norm(dialogue_embeddings, axis=1))
    assert cosine.min() >= 0.999
