"""benchmarks/async_vs_sync.py in a tiny configuration: three real `sao run`s (pinned), and a JSON
headline whose figures are finite and agree with each other. No timing is asserted."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "async_vs_sync.py"


@pytest.mark.slow
def test_async_vs_sync_reports_rates_and_the_bound(tmp_path):
    out = tmp_path / "result.json"
    command = [sys.executable, str(SCRIPT), "--tasks", "8", "--group-size", "2", "--pinned",
               "--runs-dir", str(tmp_path / "runs"), "--json", str(out), "--",
               "--model", "tiny", "--samplers", "1", "--set", "trainer.batch_size=4", "--set", "policy.max_new_tokens=6",
               "--set", "run.heldout_eval=false", "--set", "run.timeout_s=1500", "--set", "metrics.launcher_port=0",
               "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=5000)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())

    head = report["headline"]
    assert head["metric"] == "async / sync single-trajectory trajectories per second, pinned"
    assert head["unit"] == "trajectories/s"
    for key in ("value", "baseline", "ratio", "bound", "ratio_of_bound"):
        assert math.isfinite(head[key]) and head[key] > 0, key
    assert head["ratio"] == pytest.approx(head["value"] / head["baseline"])
    assert 1 <= head["bound"] <= 2  # (S + T) / max(S, T)
    assert head["ratio_of_bound"] == pytest.approx(head["ratio"] / head["bound"])
    assert report["heldout_gains_within_2se"] is None  # run.heldout_eval = false: nothing to compare

    pinned = report["results"]["pinned"]
    assert list(report["results"]) == ["pinned"]
    assert set(pinned["arms"]) == {"grpo", "sync", "async"}
    for arm, figures in pinned["arms"].items():
        assert figures["trajectories_trained"] == 8, arm  # the same number of trajectories in every arm
        assert figures["steady_trajectories_per_s"] > 0 and figures["wall_s"] > 0, arm
    assert pinned["arms"]["sync"]["staleness_mean"] == 0 and pinned["arms"]["grpo"]["trainer_steps"] == 2
    assert pinned["batches"] == 1 and pinned["S_s"] > 0  # the second batch: the first waits for start-up and pinned["T_s"] > 0
    assert head["value"] == pinned["arms"]["async"]["steady_trajectories_per_s"]
    assert head["baseline"] == pinned["arms"]["sync"]["steady_trajectories_per_s"]
