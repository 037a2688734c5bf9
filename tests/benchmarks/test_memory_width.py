"""benchmarks/memory_width.py in a tiny configuration: the JSON's shape and consistency (no timing asserts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "memory_width.py"


@pytest.mark.slow
def test_memory_width_tiny(tmp_path):
    out = tmp_path / "width.json"
    command = [sys.executable, str(SCRIPT), "--model", "tiny", "--widths", "384", "8", "--updates", "2",
               "--labyrinth-episodes", "1", "--tutoring-episodes", "1", "--max-steps", "16", "--threads", "1",
               "--shipped", "--json", str(out)]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, timeout=900)
    result = json.loads(out.read_text())
    full, narrow, shipped = result["widths"]
    assert (full["width"], full["slot_bytes"], narrow["width"], narrow["slot_bytes"]) == (384, 388, 8, 12)
    assert (shipped["width"], shipped["slot_bytes"]) == (64, 68) and shipped["basis"].startswith("shipped ")
    assert full["basis"] == "none (full width)" and narrow["basis"] == "fitted here"
    assert full["held_out_variance_kept"] == pytest.approx(1.0)  # the full width is not squeezed
    assert 0 < narrow["held_out_variance_kept"] < 1
    for row in (full, narrow, shipped):
        assert row["n"] > 0 and all(math.isfinite(row[k]) for k in ("own", "other", "other_minus_own"))
        assert row["other_minus_own"] == pytest.approx(row["other"] - row["own"])
    headline = result["headline"]
    assert set(headline) == {"metric", "value", "baseline", "ratio", "unit"}
    assert headline["value"] == narrow["other_minus_own"] and headline["baseline"] == full["other_minus_own"]


def test_a_width_beyond_the_encoder_is_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--widths", "64", "400"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "--widths" in done.stderr and "400" in done.stderr
