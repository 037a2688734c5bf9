"""`benchmarks/vs_trl.py` and its speed sibling `speed_vs_trl.py`: their arithmetic, and one tiny run of each (TRL's
arms only where `trl` imports)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.benchmark_modules import BENCHMARKS, load_benchmark

vs_trl = load_benchmark("vs_trl")
speed = load_benchmark("speed_vs_trl")
SCRIPT = BENCHMARKS / "vs_trl.py"


def test_each_time_takes_the_last_checkpoint_saved_by_then_and_the_budget_the_last_one():
    checkpoints = [{"wall_s": 50, "label": "a"}, {"wall_s": 20, "label": "b"}, {"wall_s": 130, "label": "c"}]
    picked = vs_trl.at_times(checkpoints, [10, 60, 120])
    assert [p and p["label"] for p in picked] == [None, "a", "c"]  # c ends after the budget: still the run's end
    assert vs_trl.at_times([], [10, 20]) == [None, None]


def test_ratios_times_to_reach_and_curves_over_seeds():
    assert vs_trl.ratio(0.6, 0.4) == pytest.approx(1.5) and vs_trl.ratio(0.6, 0.0) is None
    assert vs_trl.ratio(None, 0.4) is None
    curve = [{"wall_s": 10, "overall": 0.3, "skill": 0.0}, {"wall_s": 20, "overall": 0.5, "skill": 0.1}]
    assert vs_trl.time_to_reach(curve, 0.5) == 20 and vs_trl.time_to_reach(curve, 0.6) is None
    assert vs_trl.time_to_reach(curve, 0.05, "skill") == 20
    mean = vs_trl.mean_curve([[{"overall": 0.2, "skill": 0.0, "wall_s": 10, "tokens": 100}],
                              [{"overall": 0.4, "skill": 0.2, "wall_s": 12, "tokens": 300}]])
    assert mean[0]["overall"] == pytest.approx(0.3) and mean[0]["tokens"] == 200
    assert mean[0]["overall_seeds_stderr"] == pytest.approx(0.1)


def test_figures_pair_with_the_base_overall_and_on_the_skill():
    base = {"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0}
    scores = {"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0}
    found = vs_trl.figures(base, scores, ["a", "b"])
    assert (found["overall"], found["n"], found["gain"]) == (0.75, 4, 0.5)
    assert (found["skill"], found["skill_n"], found["skill_gain"]) == (0.5, 2, 0.5)


@pytest.mark.slow
def test_one_tiny_seed_gives_curves_for_every_arm_it_can_run(tmp_path):
    arms = ["sao", "trl-sao-lr"] if importlib.util.find_spec("trl") else ["sao"]
    out = tmp_path / "vs_trl.json"
    tiny = ["--set", 'policy.model="tiny"', "--set", "trainer.batch_size=4", "--set", "policy.max_new_tokens=6",
            "--set", f"run.heldout_cache_dir=\"{tmp_path / 'cache'}\"", "--set", "metrics.launcher_port=0",
            "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    subprocess.run([sys.executable, str(SCRIPT), "--minutes", "1", "--points", "2", "--heldout-cap", "6",
                    "--arms", *arms, "--work-dir", str(tmp_path / "work"), "--json", str(out), "--", *tiny],
                   check=True, timeout=900)
    result = json.loads(out.read_text())
    assert result["arms"] == arms and result["heldout_n"] == 6 and Path(result["plot"]).read_bytes()[:4] == b"\x89PNG"
    assert 0 <= result["format_ceiling"] <= 1 and result["skill_n"] == round((1 - result["format_ceiling"]) * 6)
    assert [run["arm"] for run in result["runs"]] == arms  # one seed, each arm once, in turn
    for run in result["runs"]:
        assert len(run["points"]) == 2 and all(0 <= p["overall"] <= 1 and p["n"] == 6 for p in run["points"])
    sao_run = tmp_path / "work" / "sao-seed0"
    trainer = json.loads((sao_run / "status" / "trainer.json").read_text())
    assert not trainer.get("finished")  # stopped by the budget, not by run.num_tasks
    assert not (sao_run / "policy").exists()  # weights dropped once judged
    headline = result["headline"]
    if len(arms) > 1:
        comparison = result["comparisons"]["sao vs trl-sao-lr"]
        assert headline["ratio"] == vs_trl.ratio(headline["value"], headline["baseline"])
        assert len(comparison["ratio_overall"]) == 2 and len(comparison["paired_at_budget"]["overall"]) <= 1
    else:
        assert result["comparisons"] == {} and headline["baseline"] is None and headline["ratio"] is None


def test_speed_figures_take_the_steady_gap_and_compare_with_the_fastest_sync_loop():
    run = speed.step_figures([30.0, 40.0, 46.0, 52.0], wall_s=60.0, tokens_per_trajectory=20.0)
    assert (run["to_last_step_s"], run["step_s"], run["trajectories_per_s"]) == (52.0, 6.0, 8 / 6.0)
    runs = [{"arm": "sao", "seed": 0, **run},
            {"arm": "sao-sync", "seed": 0, **speed.step_figures([40.0, 52.0, 64.0], 70.0, 20.0)},
            {"arm": "trl", "seed": 0, **speed.step_figures([20.0, 24.0, 28.0], 30.0, 10.0)}]
    summary = speed.summarise(runs, ["sao", "sao-sync", "trl"])
    assert summary["best_sync"] == "trl"
    assert summary["arms"]["sao"]["step_s_vs_best_sync"] == pytest.approx(1.5)
    assert summary["arms"]["sao-sync"]["to_last_step_s_vs_best_sync"] == pytest.approx(64 / 28)


@pytest.mark.slow
def test_a_tiny_speed_run_times_every_arm_it_can_run(tmp_path):
    arms = ["sao", "sao-sync", "trl"] if importlib.util.find_spec("trl") else ["sao", "sao-sync"]
    out = tmp_path / "speed.json"
    tiny = ["--set", 'policy.model="tiny"', "--set", "policy.max_new_tokens=6", "--set", "metrics.launcher_port=0",
            "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    subprocess.run([sys.executable, str(BENCHMARKS / "speed_vs_trl.py"), "--steps", "2", "--seeds", "1", "--arms", *arms,
                    "--work-dir", str(tmp_path / "work"), "--json", str(out), "--", *tiny], check=True, timeout=900)
    result = json.loads(out.read_text())
    assert [run["arm"] for run in result["runs"]] == arms
    for run in result["runs"]:
        assert run["steps"] == 2 and 0 < run["step_s"] < run["to_last_step_s"] <= run["wall_s"]
    assert result["best_sync"] in arms[1:]
    headline = result["headline"]
    assert headline["ratio"] == pytest.approx(headline["value"] / headline["baseline"])
