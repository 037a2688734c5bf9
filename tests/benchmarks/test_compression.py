"""`benchmarks/compression.py` on short labyrinth episodes: the house headline, exact returns, consistent figures."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compression.py"


@pytest.mark.slow
def test_short_episodes_give_a_consistent_headline_and_exact_returns(tmp_path):
    out = tmp_path / "compression.json"
    subprocess.run([sys.executable, str(SCRIPT), "--episodes", "3", "--probe-train", "2", "--steps", "40",
                    "--short-steps", "10", "--online-steps", "10", "--probe-epochs", "5", "--probe-seeds", "1",
                    "--size", "6", "--json", str(out)], check=True, timeout=1800)
    result = json.loads(out.read_text())

    headline = result["headline"]
    assert set(headline) == {"metric", "value", "baseline", "ratio", "unit"} and headline["unit"] == "bytes"
    assert "40-step" in headline["metric"]
    assert all(math.isfinite(headline[key]) and headline[key] > 0 for key in ("value", "baseline", "ratio"))
    assert headline["ratio"] == pytest.approx(headline["baseline"] / headline["value"])  # naive / sao: x smaller
    assert set(result["sizes"]) == {"10", "40"}
    long, short = result["sizes"]["40"], result["sizes"]["10"]
    assert (long["steps"], short["steps"]) == (40, 10)
    assert (headline["value"], headline["baseline"]) == (long["sao"], long["naive"])
    # Naive contexts grow as T^2, sao's message as T: the longer episodes compress more.
    assert long["ratio_sao"] > short["ratio_sao"]
    assert long["stored_once"] < long["naive"]
    assert result["fidelity"]["returns_exact"] is True
    assert result["fidelity"]["probe"]["folds"] == 3 and result["fidelity"]["probe"]["steps"] == 3 * 40
    assert math.isfinite(result["fidelity_loss"]) and 0 < result["keep_ratio"] <= 1
    throughput = result["throughput"]
    assert throughput["batch"]["steps"] == 40 and throughput["online"]["steps"] == 10
    for path in ("batch", "online"):
        assert throughput[path]["ratio"] == pytest.approx(throughput[path]["compressor_steps_per_s"]
                                                          / throughput[path]["encoder_sentences_per_s"])
