"""`sao run` with run.mode = sync, end to end (embedded broker, 2 samplers, ZeRO-3 trainer, tiny model):
one batch at a time, each released only after the previous one was trained on and published,
and every trajectory trained by the very version that sampled it."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_sync_mode_trains_every_batch_on_the_version_that_sampled_it(tmp_path):
    run_dir = tmp_path / "sync"
    cpus = sorted(os.sched_getaffinity(0))
    pinned = ["--set", f"sampler.cpu_affinity={cpus[:1]}", "--set", f"trainer.cpu_affinity={cpus[1:]}"]
    command = [sys.executable, "-m", "sao.cli", "run", "--model", "tiny", "--num-tasks", "12", "--samplers", "2",
               "--run-dir", str(run_dir), "--set", 'run.mode="sync"', "--set", "trainer.batch_size=4",
               "--set", "policy.max_new_tokens=6", "--set", "run.timeout_s=400", "--set", "run.heldout_eval=false",
               *(pinned if len(cpus) > 1 else []),
               "--set", "metrics.launcher_port=0", "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trajectories_trained"] == 12 and summary["trainer_steps"] == 3 and summary["policy_version"] == 3
    assert summary["staleness_mean"] == 0

    steps = json.loads((run_dir / "status" / "trainer.json").read_text())["steps"]
    releases = json.loads((run_dir / "status" / "feeder.json").read_text())["releases"]
    assert [(r["trajectories"], r["policy_version"]) for r in releases] == [(4, 0), (4, 1), (4, 2)]
    for step, release in zip(steps, releases):
        # Trained by the version that sampled it: staleness 0, not merely small.
        assert step["behaviour_versions"] == [step["policy_version"]] * 4 == [release["policy_version"]] * 4
        assert step["staleness"] == [0] * 4
        # Every trajectory of the batch was created after the batch's release.
        assert all(step["trained_at"] - delay >= release["released_at"] for delay in step["sampling_to_training_s"])
    # No overlap: a batch is released only once the previous one's step (and its publish) is over.
    for earlier, release in zip(steps, releases[1:]):
        assert release["released_at"] >= earlier["trained_at"]
