"""Stage 3 of compression: symmetric absmax INT8 quantization of embedding matrices.

Each element is stored as q = round(x / scale) with scale = absmax / 127, so q lies in
[-127, 127] and the reconstruction x̂ = q * scale satisfies |x - x̂| <= scale / 2 per element
(up to float32 rounding of the division and product). A group whose absmax is 0 gets scale 0
and all-zero codes, which reconstruct exactly.
"""

from __future__ import annotations

import numpy as np

INT8_LEVELS = 127  # symmetric: -128 is never used, so negation stays exact


def _quantize(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-d [n, d] array, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("cannot quantize NaN or infinite values; check the encoder output")
    absmax = np.abs(x).max(axis=axis) if x.shape[axis] else np.zeros(x.shape[1 - axis])
    scales = (absmax / INT8_LEVELS).astype(np.float32)
    # Dividing by 1 where the scale is 0 keeps zero groups at zero instead of producing NaN.
    divisor = np.expand_dims(np.where(scales > 0, scales, np.float32(1.0)), axis)
    codes = np.clip(np.rint(x / divisor), -INT8_LEVELS, INT8_LEVELS).astype(np.int8)
    return codes, scales


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize each row of float32 [n, d] to int8 with its own scale (float32 [n]).

    Error bound: |x[i, j] - dequantize_int8(q, s)[i, j]| <= s[i] / 2.
    """
    return _quantize(x, axis=1)


def dequantize_int8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Rebuild float32 [n, d] from per-row int8 codes and scales [n]."""
    return q.astype(np.float32) * np.asarray(scales, dtype=np.float32)[:, None]


def quantize_int8_per_channel(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float32 [n, d] to int8 with one scale per column (float32 [d]).

    Error bound: |x[i, j] - dequantize_int8_per_channel(q, s)[i, j]| <= s[j] / 2.
    """
    return _quantize(x, axis=0)


def dequantize_int8_per_channel(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Rebuild float32 [n, d] from int8 codes and per-column scales [d]."""
    return q.astype(np.float32) * np.asarray(scales, dtype=np.float32)[None, :]
