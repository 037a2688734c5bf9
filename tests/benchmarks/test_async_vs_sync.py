"""benchmarks/async_vs_sync.py in a tiny configuration: three real `sao run`s (pinned), and a JSON
headline whose figures are finite and agree with each other; and its learning comparison over seeds.
No timing is asserted."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from support.benchmark_modules import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "async_vs_sync.py"


def _bench():
    return load_benchmark("async_vs_sync")


def _runs(*gains_and_errors, seeds=None):
    seeds = seeds or range(len(gains_and_errors))
    return [{"seed": seed, "heldout_gain": gain, "heldout_gain_stderr": error}
            for seed, (gain, error) in zip(seeds, gains_and_errors)]


def test_learning_is_compared_across_seeds_when_there_are_several():
    bench = _bench()
    # Two seeds whose per-run errors over questions are small but whose differences disagree: the
    # spread across seeds, not the questions' error, decides.
    asynchronous, sync = _runs((0.10, 0.05), (0.25, 0.05)), _runs((0.30, 0.05), (-0.05, 0.05))
    result = bench.gain_difference(asynchronous, sync)
    assert result["heldout_gain_differences"] == pytest.approx([-0.20, 0.30])
    assert result["heldout_gain_difference"] == pytest.approx(0.05)
    assert result["heldout_gain_difference_stderr"] == pytest.approx(0.25)  # sd 0.354 / sqrt 2
    assert result["difference_error"] == "across 2 seeds" and result["heldout_gains_within_2se"] is True
    # One seed: only the questions' error is known, and the result says so.
    one = bench.gain_difference(asynchronous[:1], sync[:1])
    assert one["heldout_gain_difference_stderr"] == pytest.approx(math.hypot(0.05, 0.05))
    assert one["heldout_gains_within_2se"] is False and one["difference_error"].startswith("over questions")
    # No held-out figures: nothing compared.
    assert bench.gain_difference(_runs((None, None)), _runs((0.1, 0.05)))["heldout_gains_within_2se"] is None
    learned = bench.learning(asynchronous)
    assert learned["gain"] == pytest.approx(0.175) and learned["gain_stderr_seeds"] == pytest.approx(0.075)
    assert learned["worst"] == pytest.approx(0.10) and learned["below_zero"] == 0


def test_repeats_of_a_seed_count_once_in_the_mean_and_their_spread_judges_each_seed():
    bench = _bench()
    # Seed 0: async runs 0.30 and 0.10, sync 0.25 and 0.25; seed 1: async 0.20, 0.20, sync 0.40, 0.20, -0.10.
    asynchronous = _runs((0.30, 0.05), (0.10, 0.05), (0.20, 0.05), (0.20, 0.05), seeds=[0, 0, 1, 1])
    sync = _runs((0.25, 0.05), (0.25, 0.05), (0.40, 0.05), (0.20, 0.05), (-0.10, 0.05), seeds=[0, 0, 1, 1, 1])
    learned = bench.learning(sync)
    assert learned["gain"] == pytest.approx((0.25 + 0.50 / 3) / 2)  # each seed's mean, then over seeds
    assert learned["worst"] == pytest.approx(-0.10) and learned["below_zero"] == 1
    difference = bench.gain_difference(asynchronous, sync)
    assert difference["heldout_gain_differences"] == pytest.approx([0.20 - 0.25, 0.20 - 0.50 / 3])
    judged = bench.seed_learning(asynchronous, sync)
    # Pooled within-seed variance: async (0.02 + 0) / (1 + 1); sync (0 + 0.1267) / (1 + 2).
    var_async, var_sync = 0.02 / 2, (0.4 ** 2 + 0.2 ** 2 + 0.1 ** 2 - 3 * (0.5 / 3) ** 2) / 3
    assert judged["run_sd"]["async"] == pytest.approx(var_async ** 0.5)
    assert judged["run_sd"]["sync"] == pytest.approx(var_sync ** 0.5)
    seed_0, seed_1 = judged["rows"]
    assert seed_0["stderr"] == pytest.approx((var_async / 2 + var_sync / 2) ** 0.5)
    assert seed_1["stderr"] == pytest.approx((var_async / 2 + var_sync / 3) ** 0.5)
    assert seed_0["within_2se"] and seed_1["within_2se"] and judged["outside"] == 0 and judged["behind"] == 0
    # A seed far behind against a small spread is called behind; one run a seed leaves no spread to judge by.
    far = bench.seed_learning(_runs((0.0, 0.05), (0.02, 0.05), seeds=[0, 0]), _runs((0.3, 0.05), (0.32, 0.05), seeds=[0, 0]))
    assert far["behind"] == 1 and far["rows"][0]["behind_2se"] is True
    alone = bench.seed_learning(_runs((0.1, 0.05)), _runs((0.3, 0.05)))
    assert alone["outside"] is None and alone["rows"][0]["stderr"] is None


def test_repeats_draw_other_tokens_and_no_two_arms_share_draws():
    bench = _bench()
    seeds = {(arm, r): bench.sampler_seed(arm, r) for arm in ("sync", "async", "resampled") for r in range(3)}
    assert seeds[("sync", 0)] == seeds[("async", 0)] == 0 and seeds[("resampled", 0)] == bench.RESAMPLED_SEED
    assert len({seeds[("sync", r)] for r in range(3)} | {seeds[("resampled", r)] for r in range(3)}) == 6
    assert bench.arm_arguments("async", 48, 8, repeat=2)[-2:] == ["--set", "sampler.seed=4"]
    assert "sampler.seed" not in " ".join(bench.arm_arguments("sync", 48, 8, repeat=0))


def _finished_run(run_dir: Path, *overrides: str, gain: float = 0.2) -> Path:
    from sao.config import load_config, to_toml

    (run_dir / "status").mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(load_config(overrides=[f"run.run_dir={str(run_dir)!r}", *overrides],
                                                             environ={})))
    (run_dir / "summary.json").write_text(json.dumps({"heldout_gain": gain, "heldout_gain_stderr": 0.05}))
    (run_dir / "status" / "trainer.json").write_text(json.dumps({"steps": []}))
    return run_dir


def test_merge_pools_only_finished_runs_of_the_same_code_and_config(tmp_path):
    bench = _bench()
    own = {"async": [{"seed": 0, "run_dir": str(_finished_run(tmp_path / "now" / "pinned-async" / "seed-0",
                                                                   "env.seed=0"))}]}

    def earlier(name: str, code: str | None) -> Path:
        folder = tmp_path / name
        (folder / "pinned-async").mkdir(parents=True)
        if code is not None:
            (folder / bench.CODE_RECORD).write_text(json.dumps({"sao_source_sha256": code}))
        return folder

    same = earlier("same", bench.code_digest())
    _finished_run(same / "pinned-async" / "seed-0", "env.seed=0", "sampler.seed=2", gain=0.4)  # another repeat
    _finished_run(same / "pinned-async" / "seed-0-r1", "env.seed=0", "trainer.learning_rate=3e-5")  # another config
    _finished_run(same / "pinned-async" / "seed-1", "env.seed=1")  # a seed not run now: skipped, not reported
    (same / "pinned-async" / "seed-0-r2").mkdir()  # died before its summary
    _finished_run(earlier("other-code", "0" * 64) / "pinned-async" / "seed-0", "env.seed=0")
    _finished_run(earlier("unrecorded", None) / "pinned-async" / "seed-0", "env.seed=0")
    garbled = earlier("garbled", None)
    (garbled / bench.CODE_RECORD).write_text("{not json")  # a record cut short: left out, not a traceback
    _finished_run(garbled / "pinned-async" / "seed-0", "env.seed=0")

    pooled, left_out = bench.merged_runs([same, tmp_path / "other-code", tmp_path / "unrecorded", garbled],
                                         "pinned", own)
    (run,) = pooled["async"]
    assert run["seed"] == 0 and run["merged"] and run["heldout_gain"] == 0.4
    assert run["run_dir"].endswith("same/pinned-async/seed-0")
    reasons = "\n".join(left_out)
    assert "seed-0-r1: config differs in trainer.learning_rate" in reasons
    assert "seed-0-r2: unfinished" in reasons
    assert "other-code: made by other code" in reasons
    assert f"unrecorded: no readable {bench.CODE_RECORD}" in reasons and f"garbled: no readable {bench.CODE_RECORD}" in reasons
    assert len(left_out) == 5


@pytest.mark.slow
def test_async_vs_sync_reports_rates_and_the_bound(tmp_path):
    out = tmp_path / "result.json"
    command = [sys.executable, str(SCRIPT), "--tasks", "8", "--group-size", "2", "--pinned", "--seeds", "0",
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
    assert report["seeds"] == [0] and report["repeats"] == 1 and report["arms"] == ["grpo", "sync", "async"]
    assert report["seeds_async_behind_2se"] is None  # one run an arm: no run-to-run spread to judge a seed by
    runs_dir = Path(report["runs_dir"])
    assert json.loads((runs_dir / "code.json").read_text())["sao_source_sha256"] == _bench().code_digest()

    pinned = report["results"]["pinned"]
    assert list(report["results"]) == ["pinned"]
    assert set(pinned["arms"]) == {"grpo", "sync", "async"}
    for arm, (figures,) in pinned["arms"].items():  # one seed: one run per arm
        assert figures["seed"] == 0 and figures["repeat"] == 0, arm
        assert figures["run_dir"].endswith(f"pinned-{arm}/seed-0"), arm
        assert figures["trajectories_trained"] == 8, arm  # the same number of trajectories in every arm
        assert not (Path(figures["run_dir"]) / "checkpoints").exists(), arm  # dropped once the figures are read
        assert figures["steady_trajectories_per_s"] > 0 and figures["wall_s"] > 0, arm
        # Each run's own phases: busy seconds of each side per batch, and the share of a steady batch they fill.
        assert figures["sampler_busy_s"] > 0 and figures["trainer_busy_s"] > 0 and figures["batch_s"] > 0, arm
        ideal = ((max if arm == "async" else sum)((figures["sampler_busy_s"], figures["trainer_busy_s"])))
        assert figures["efficiency"] == pytest.approx(ideal / figures["batch_s"]), arm
    assert pinned["arms"]["sync"][0]["staleness_mean"] == 0 and pinned["arms"]["grpo"][0]["trainer_steps"] == 2
    assert pinned["batches"] == 1 and pinned["S_s"] > 0  # the second batch: the first waits for start-up and pinned["T_s"] > 0
    assert head["value"] == pinned["arms"]["async"][0]["steady_trajectories_per_s"]
    assert head["baseline"] == pinned["arms"]["sync"][0]["steady_trajectories_per_s"]
    (row,) = pinned["per_seed"]
    a, s = pinned["arms"]["async"][0], pinned["arms"]["sync"][0]
    assert row["work_bound"] == pytest.approx((s["sampler_busy_s"] + s["trainer_busy_s"])
                                              / max(a["sampler_busy_s"], a["trainer_busy_s"]))
    assert row["ratio_of_work_bound"] == pytest.approx(row["ratio"] / row["work_bound"])
    (seed_row,) = pinned["seed_rates"]  # one run an arm: the seed's figures are its one pair's
    assert seed_row["ratio"] == pytest.approx(row["ratio"]) and seed_row["bound"] == pytest.approx(row["bound"])


def test_a_seeds_rate_pools_all_its_runs_of_each_arm(monkeypatch):
    """Two run pairs of one seed at 3.0x and 0.67x: the seed's ratio is its mean async rate over its mean sync
    rate (1.6x), against the bound from both sync runs' batches."""
    bench = _bench()
    pooled_from = []
    monkeypatch.setattr(bench, "sync_phases", lambda dirs: pooled_from.append(dirs) or {"bound": 1.6})
    runs = {"async": [{"seed": 0, "steady_trajectories_per_s": rate, "run_dir": f"a{i}"} for i, rate in enumerate((0.6, 0.2))],
            "sync": [{"seed": 0, "steady_trajectories_per_s": rate, "run_dir": f"s{i}"} for i, rate in enumerate((0.2, 0.3))]}
    (row,) = bench.seed_rates(runs)
    assert row["ratio"] == pytest.approx(1.6) and row["ratio_of_bound"] == pytest.approx(1.0)
    assert row["async_runs"] == row["sync_runs"] == 2 and pooled_from == [[Path("s0"), Path("s1")]]


def _heldout(run_dir: Path, per_task: dict) -> Path:
    (run_dir / "eval").mkdir(parents=True)
    (run_dir / "eval" / "heldout.json").write_text(json.dumps({"per_task": per_task}))
    return run_dir


def test_a_seed_compares_the_two_runs_paired_by_task(tmp_path):
    bench = _bench()

    def scores(final, kept=None):
        return {"final": {"first_try": final}, **({"kept": {"first_try": kept}} if kept is not None else {})}

    asynchronous = _heldout(tmp_path / "a", {"t1": scores(1.0, 1.0), "t2": scores(0.0, 1.0), "t3": scores(1.0, 0.0),
                                             "only-async": scores(1.0, 1.0)})
    sync = _heldout(tmp_path / "s", {"t1": scores(0.0), "t2": scores(0.0), "t3": scores(1.0)})
    difference, se, n = bench.paired_by_task(asynchronous, sync, "final")
    assert n == 3 and difference == pytest.approx(1 / 3)  # tasks both runs scored: +1, 0, 0
    assert se == pytest.approx(1 / 3)  # sd of (1, 0, 0) is 0.577, over sqrt 3
    # The sync run kept no version: nothing to pair for "kept".
    assert bench.paired_by_task(asynchronous, sync, "kept") == (None, None, 0)


def test_the_resampled_arm_is_sync_with_other_draws_and_its_gaps_are_counted_like_asyncs(tmp_path):
    bench = _bench()
    assert bench.arm_arguments("resampled", 48, 8) == bench.arm_arguments("sync", 48, 8) + [
        "--set", f"sampler.seed={bench.RESAMPLED_SEED}"]
    assert "sampler.seed" not in " ".join(bench.arm_arguments("async", 48, 8))

    def run(name, firsts):
        per_task = {f"t{i}": {"final": {"first_try": f}, "kept": {"first_try": f}} for i, f in enumerate(firsts)}
        return {"run_dir": str(_heldout(tmp_path / name, per_task))}

    sync = run("sync", [1.0] * 20 + [0.0] * 20)
    close = run("close", [1.0] * 21 + [0.0] * 19)  # one task apart: within 2 s.e.
    far = run("far", [0.0] * 20 + [1.0] * 5 + [0.0] * 15)  # 20 right -> wrong, 5 wrong -> right: outside
    rows = [{**bench.paired_versions(close, sync), "resampled": bench.paired_versions(far, sync)},
            {**bench.paired_versions(far, sync), "resampled": bench.paired_versions(close, sync)},
            {**bench.paired_versions(far, sync)}]  # a seed without the resampled arm
    assert bench.outside_2se(rows) == {"final": {"outside": 2, "pairs": 3}, "kept": {"outside": 2, "pairs": 3}}
    assert bench.outside_2se(rows, "resampled")["final"] == {"outside": 1, "pairs": 2}
