"""Which dtype the policy computes in: bf16 where the hardware multiplies it natively, else fp32.

A GPU, and a CPU with AVX512-BF16 or AMX, run bf16 matmuls faster than fp32 ones (half the bytes to
read, twice the lanes); a CPU without them emulates bf16 and runs it slower than fp32. `auto`
(`sampler.precision`, `trainer.precision`) takes bf16 exactly where it is native.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from sao.config.section import Precision


@cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 multiply instructions (Linux's /proc/cpuinfo flags; elsewhere: no)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None


def uses_bf16(precision: Precision, device_type: str) -> bool:
    """Whether `precision` means bf16 compute on a device of this type ("cpu" or "cuda")."""
    if precision != "auto":
        return precision == "bf16"
    return device_type == "cuda" or cpu_has_native_bf16()
