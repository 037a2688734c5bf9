"""`sao run` with policy.transport = "kafka" end to end (tiny model): the trainer sends every version in chunks on
the weights topic, and its samplers load them from there, snapshot and deltas alike."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_sao_run_with_weights_through_kafka_trains_every_task_and_samplers_load_from_the_topic(tmp_path):
    run_dir = tmp_path / "run"
    tasks = 12
    command = [sys.executable, "-m", "sao.cli", "run", "--model", "tiny", "--num-tasks", str(tasks),
               "--samplers", "1", "--run-dir", str(run_dir),
               "--set", "policy.transport=\"kafka\"", "--set", "policy.transport.chunk_bytes=1048576",
               "--set", "trainer.publish_dtype=\"bf16\"", "--set", "trainer.publish_deltas=true",
               "--set", "trainer.snapshot_every=2",
               # The tiny model's random weights are small: a smaller step keeps v2 a sparse delta, not a
               # whole file (the publisher's fallback when a delta is over half of one).
               "--set", "trainer.learning_rate=2e-6",
               "--set", "trainer.batch_size=4", "--set", "run.max_trajectories_in_flight=4",
               "--set", "policy.max_new_tokens=8", "--set", "run.timeout_s=400", "--set", "run.heldout_eval=false",
               "--set", "metrics.launcher_port=0", "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trajectories_trained"] == tasks and summary["policy_version"] == tasks // 4
    sampler_log = (run_dir / "logs" / "sampler-0.log").read_text()
    assert "refused policy" not in sampler_log, sampler_log[-3000:]
    assert summary["sampler_reloads"] >= 1 and summary["max_behaviour_version"] >= 1
    sidecars = [json.loads((run_dir / "policy" / f"policy-v{v:06d}.json").read_text()) for v in (1, 2)]
    assert [("base_version" in s, s["chunks"][0]) for s in sidecars] == [(False, "sao.weights"), (True, "sao.weights")]
