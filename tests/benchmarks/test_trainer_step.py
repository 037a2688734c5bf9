"""benchmarks/trainer_step.py on the tiny model: sao's real ZeRO-3 step against the bare PyTorch loop,
and a JSON headline whose figures are finite and consistent. No timing is asserted."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_step.py"


@pytest.mark.slow
def test_trainer_step_compares_sao_with_the_bare_loop(tmp_path):
    out = tmp_path / "result.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--steps", "2", "--threads", "1",
                             "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())

    head = report["headline"]
    assert set(head) >= {"metric", "value", "baseline", "ratio", "unit", "cpu_ratio", "ratio_to_by_hand"}
    assert head["unit"] == "s"
    medians = report["medians"]
    assert set(medians) == {"sao", "bare_by_hand", "bare_matched"}
    assert head["value"] == medians["sao"]["step_s"] and head["baseline"] == medians["bare_matched"]["step_s"]
    assert head["ratio"] == pytest.approx(head["value"] / head["baseline"])
    assert head["cpu_ratio"] == pytest.approx(medians["sao"]["cpu_s"] / medians["bare_matched"]["cpu_s"])
    for arm, figures in medians.items():
        assert all(math.isfinite(v) and v > 0 for v in figures.values()), (arm, figures)
        # The phases are parts of the step; CPU seconds of one thread cannot exceed much the wall time.
        assert figures["forward_backward_s"] + figures["optimizer_s"] <= figures["step_s"] * 1.01, arm
    assert all(len(runs) == 2 for runs in report["runs"].values())  # the warm-up round is not timed
    # The batch looks like a default run's; a first try scored inside its retry's row cuts its positions,
    # and the buckets its padding.
    padding = report["padding"]
    assert 12 <= padding["rows_per_turn"] <= 16 and 800 <= padding["positions_per_turn"] <= 1400
    assert padding["rows"] == 8 and padding["positions"] < 0.8 * padding["positions_per_turn"]
    assert report["length_buckets"] == 2 and padding["buckets"] == 2
    assert padding["padding_share_bucketed"] < padding["padding_share_padded"]
    # Same weights, same rows, same loss: sao and the bare loop agree on the first step's loss.
    assert report["first_loss"]["sao_minus_bare_abs"] < 1e-5
    assert report["deepspeed_config"]["zero_optimization"]["stage"] == 0  # one CPU rank: nothing to partition
