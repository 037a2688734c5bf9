"""`benchmarks/sampler_throughput.py` on the tiny model: the house headline, and every mode rolled out every task."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sampler_throughput.py"


@pytest.mark.slow
def test_every_mode_rolls_out_every_task_and_the_headline_is_consistent(tmp_path):
    out = tmp_path / "sampler.json"
    subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--tasks", "2", "--batch", "2",
                    "--set", "policy.max_new_tokens=6", "--json", str(out)], check=True, timeout=1800)
    result = json.loads(out.read_text())

    headline = result["headline"]
    assert set(headline) == {"metric", "value", "baseline", "ratio", "unit"}
    assert headline["unit"] == "trajectories/s"
    assert all(math.isfinite(headline[key]) and headline[key] > 0 for key in ("value", "baseline", "ratio"))
    assert headline["ratio"] == pytest.approx(headline["value"] / headline["baseline"])
    one_at_a_time, lockstep, continuous = result["results"]
    assert [r["batch"] for r in result["results"]] == [1, 2, 2]
    assert (lockstep["mode"], continuous["mode"]) == ("lockstep", "continuous")
    assert (headline["value"], headline["baseline"]) == (continuous["trajectories_per_s"],
                                                         one_at_a_time["trajectories_per_s"])
    assert result["overrides"] == ["policy.max_new_tokens=6"]
    for row in result["results"]:
        assert row["trajectories"] == 2 and row["tokens"] > 0 and row["seconds"] > 0
        assert row["trajectories_per_s"] == pytest.approx(row["trajectories"] / row["seconds"])
        # The override reached the roller: at most 6 tokens an action, at most a few turns an episode.
        assert row["tokens"] <= 2 * 6 * 4
    scaling = result["scaling"]
    assert [run["processes"] for run in scaling["runs"]] == [1, 2]
    for run in scaling["runs"]:
        assert [r["process"] for r in run["per_process"]] == list(range(run["processes"]))
        assert all(r["trajectories"] == 2 for r in run["per_process"])
    one, two = scaling["runs"]
    assert scaling["ratio"] == pytest.approx(two["total_trajectories_per_s"] / one["total_trajectories_per_s"])


@pytest.mark.slow
def test_engine_comparison_generates_the_same_work_in_both_and_reports_the_ratio(tmp_path):
    from support.vllm_required import require_vllm

    require_vllm()
    out = tmp_path / "engines.json"
    subprocess.run([sys.executable, str(SCRIPT), "--engines", "--tasks", "2", "--batch", "2", "--rounds", "1",
                    "--gen-tokens", "5", "--set", "policy.max_new_tokens=6", "--json", str(out)],
                   check=True, timeout=1800)
    result = json.loads(out.read_text())
    headline, engines = result["headline"], result["engines"]
    assert headline["unit"] == "tokens/s" and set(engines) == {"hf", "vllm"}
    assert headline["ratio"] == pytest.approx(headline["value"] / headline["baseline"])
    assert (headline["value"], headline["baseline"]) == (engines["vllm"]["generate_tokens_per_s"],
                                                         engines["hf"]["generate_tokens_per_s"])
    for arm in engines.values():
        [round_] = arm["rounds"]
        # No stop rule in the plain generation: both engines generate exactly 2 x 5 tokens.
        assert round_["generate"]["tokens"] == 2 * 5
        assert round_["rollout"]["trajectories"] == 2 and 0 < round_["rollout"]["tokens"] <= 2 * 6 * 4
        assert round_["startup_s"] > 0
