"""`benchmarks/learning.py` on one tiny run: the house headline, and figures that agree with the run's own summary."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "learning.py"


@pytest.mark.slow
def test_one_tiny_seed_gives_the_headline_of_its_summary(tmp_path):
    out, runs = tmp_path / "learning.json", tmp_path / "runs"
    tiny_run = ["--model", "tiny", "--num-tasks", "4", "--samplers", "1", "--set", "trainer.batch_size=4",
                "--set", "policy.max_new_tokens=6", "--set", "run.heldout_cap=3",
                "--set", f"run.heldout_cache_dir=\"{tmp_path / 'heldout-cache'}\"",
                "--set", "metrics.launcher_port=0", "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    subprocess.run([sys.executable, str(SCRIPT), "--seeds", "0", "--runs-dir", str(runs), "--json", str(out),
                    "--", *tiny_run], check=True, timeout=1800)
    result = json.loads(out.read_text())

    headline = result["headline"]
    assert set(headline) == {"metric", "value", "baseline", "ratio", "unit"}
    assert 0 <= headline["baseline"] <= 1 and 0 <= headline["value"] <= 1
    # A random tiny model may solve nothing: then there is no ratio (null), never NaN or infinity.
    if headline["baseline"] > 0:
        assert math.isfinite(headline["ratio"]) and headline["ratio"] == pytest.approx(headline["value"]
                                                                                       / headline["baseline"])
    else:
        assert headline["ratio"] is None
    # The figures are the run's own: its summary.json, with the extra arguments applied.
    summary = json.loads((runs / "seed-0" / "summary.json").read_text())
    # Weights and checkpoints are dropped once the figures are read (--keep-weights keeps them).
    assert not (runs / "seed-0" / "checkpoints").exists() and not (runs / "seed-0" / "policy").exists()
    (run,) = result["runs"]
    assert run["seed"] == 0 and run["heldout_n"] == summary["heldout_n"] == 3
    assert run["trajectories_trained"] == summary["trajectories_trained"] == 4
    assert headline["baseline"] == summary["heldout_base"]
    assert headline["value"] == pytest.approx(summary["heldout_final"])
    assert result["gain"] == pytest.approx(summary["heldout_gain"]) and result["seeds"] == 1
    assert result["gain_stderr_seeds"] is None  # one seed has no spread across seeds
    assert result["second_try"] == summary["heldout_second_try_final"]  # None if every first answer was right
    assert result["second_try_base"] == summary["heldout_second_try_base"]
    # The skill figure and the format-only ceiling travel with it, where the held-out tasks hold the skill.
    assert run["heldout_format_ceiling"] == summary["heldout_format_ceiling"]
    if summary.get("heldout_skill_final_gain") is not None:
        assert result["skill"] == summary["heldout_skill"]
        assert result["skill_gain"] == pytest.approx(summary["heldout_skill_final_gain"])
    else:
        assert "skill_gain" not in result
