"""A run forced to collapse keeps a version at least as good as its base: shadow validation scores
the versions, fires the alert on a drop, rolls the trainer back to the best version, and the run's
summary and report say so. The real policy (SmolLM2-135M) at a learning rate far too high for it:
its first steps wreck it, and a random tiny model could not show a drop (it solves nothing). Its
trajectory log then rebuilds every version the run published, the rollback included, bit for bit."""

import json
import subprocess
import sys

import pytest

from sao.run_dir import RunDir
from support.shadow_env import shadow_on


@pytest.mark.slow
def test_a_collapsing_run_rolls_back_and_keeps_a_version_as_good_as_its_base(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "sao.cli", "run", "--num-tasks", "64", "--run-dir", str(run_dir),
               "--set", "trainer.learning_rate=1e-3", "--set", "trainer.batch_size=4", "--set", "policy.max_new_tokens=12",
               "--set", "trainer.shadow_every=1", "--set", "trainer.shadow_tasks=24", "--set", "run.heldout_cap=24",
               "--set", f"run.heldout_cache_dir=\"{tmp_path / 'heldout-cache'}\"", "--set", "run.timeout_s=1200",
               "--set", "metrics.launcher_port=0", "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500, env=shadow_on())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()

    # The drop was seen and alerted on, and the trainer went back to the best version.
    assert summary["shadow_drops"] >= 1
    assert "ALERT shadow validation" in trainer_log
    assert summary["rollbacks"], trainer_log[-3000:]
    assert "rolled back from" in trainer_log
    rollback = summary["rollbacks"][0]
    ledger = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert {"rollback": rollback} in ledger
    # The kept version is the best scored one, and on the held-out tasks (disjoint from the
    # validation slice) it is no worse than the base model beyond noise.
    board = json.loads((run_dir / "shadow" / "board.json").read_text())
    assert summary["kept_version"] == board["best"]["version"]
    assert summary["heldout_kept"] >= summary["heldout_base"] - 2 * (summary["heldout_kept_gain_stderr"] or 0)
    # The final version, unlike the kept one, may be wrecked: the report names both.
    report = (run_dir / "report.md").read_text()
    assert f"Shadow validation kept v{summary['kept_version']}" in report
    assert "rolled back from" in report
    if summary["kept_version"]:  # its whole file, or its whole export when it was published as a delta
        kept = RunDir(run_dir)
        assert (run_dir / "policy" / "best").resolve() in (kept.weights(summary["kept_version"]).resolve(),
                                                           kept.best_export(summary["kept_version"]).resolve())

    # The real model's run, its rollback included, replays from its log to the same hashes.
    replayed = subprocess.run([sys.executable, "-m", "sao.cli", "replay", str(run_dir)], capture_output=True,
                              text=True, timeout=900)
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    published = summary["policy_version"]  # each step's and each rollback's
    assert f"{published} of {published} versions match" in replayed.stderr, replayed.stderr[-3000:]
