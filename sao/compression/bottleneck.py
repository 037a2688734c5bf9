"""A narrower memory, measured before it is shipped: each slot as INT8 coordinates in a few principal directions.

A slot then costs `width` + 4 bytes (codes + a float32 scale) instead of the encoder's width + 4. The
benchmarks squeeze memory through the bottleneck and map it back to the encoder's space, so the aligned
projector reads it unchanged: a projector W reading the coordinates c directly would compute
W (mean + U c) + b, the same thing. Figures: benchmarks/README.md, "Bytes that earn their keep".
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from sao.compression.quantize import dequantize_int8, quantize_int8


def pca_bottleneck(vectors: np.ndarray, width: int) -> Callable[[np.ndarray], np.ndarray]:
    """Fit on training slots `vectors` [n, d]; returns squeeze(memory [k, d]) -> [k, d] float32, the slots as they
    would arrive through `width` INT8 coordinates in the top principal directions of `vectors`."""
    vectors = np.asarray(vectors, np.float64)
    if not 1 <= width <= min(vectors.shape):
        raise ValueError(f"a bottleneck width must be between 1 and min(slots, dims) = {min(vectors.shape)} "
                         f"(got {width})")
    centre = vectors.mean(0)
    basis = np.linalg.svd(vectors - centre, full_matrices=False)[2][:width].T  # [d, width]

    def squeeze(memory: np.ndarray) -> np.ndarray:
        if not len(memory):
            return np.asarray(memory, np.float32)
        codes, scales = quantize_int8(((np.asarray(memory, np.float64) - centre) @ basis).astype(np.float32))
        return (centre + dequantize_int8(codes, scales) @ basis.T).astype(np.float32)

    return squeeze
