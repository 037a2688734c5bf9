"""`sao run` with a vLLM sampler: real SmolLM2, the embedded broker, the ZeRO-3 trainer, vLLM's CPU engine."""

import json
import subprocess
import sys

import pytest

from support.vllm_required import require_vllm

require_vllm()


@pytest.mark.slow
def test_sao_run_samples_with_vllm_and_follows_every_version(tmp_path):
    run_dir, tasks = tmp_path / "run", 8
    command = [sys.executable, "-m", "sao.cli", "run", "--num-tasks", str(tasks), "--samplers", "1",
               "--run-dir", str(run_dir),
               "--set", 'sampler.engine="vllm"', "--set", "trainer.batch_size=4",
               "--set", "run.max_trajectories_in_flight=4", "--set", "policy.max_new_tokens=16",
               # fp32 whole versions and an fp32 trainer (vLLM on a CPU samples in fp32): the sampler then
               # holds exactly the trainer's weights, so at version lag 0 the importance ratio measures only
               # the two implementations' agreement.
               "--set", 'trainer.publish_dtype="fp32"', "--set", "trainer.publish_deltas=false",
               "--set", 'trainer.precision="fp32"',
               "--set", "run.heldout_cap=4", "--set", f"run.heldout_cache_dir=\"{tmp_path / 'heldout-cache'}\"",
               "--set", "run.timeout_s=900",
               "--set", "metrics.launcher_port=0", "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1000)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trajectories_trained"] == tasks and summary["policy_version"] == tasks // 4
    assert summary["sampler_reloads"] >= 1
    # The first step trains only trajectories of v0 with v0's weights: vLLM's behaviour log-probs against
    # the trainer's recomputation, tokens of every kind the sampler produced.
    first = json.loads((run_dir / "status" / "trainer.json").read_text())["steps"][0]
    assert first["ratio_abs_dev"] < 1e-3, first
    # Every version pushed into the engine passed its probe check (a failed one stops the sampler).
    logs = "".join(path.read_text() for path in (run_dir / "logs").glob("sampler*.log"))
    assert "into its vLLM engine" in logs
