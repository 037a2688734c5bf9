"""`sao run` end to end: embedded broker over TCP, feeder, 2 samplers, ZeRO-3 trainer (tiny model)."""

import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from sao.config import load_config
from sao.policy.chain import read_version_into, read_version_state
from sao.policy.lora import add_lora, attach_adapter_merge
from sao.policy.weights import build_policy
from sao.run_dir import RunDir
from support.shadow_env import shadow_on


@pytest.mark.slow
def test_sao_run_trains_through_kafka(tmp_path):
    run_dir = tmp_path / "run"
    tasks = 12
    command = [sys.executable, "-m", "sao.cli", "run", "--model", "tiny", "--num-tasks", str(tasks),
               "--samplers", "2", "--run-dir", str(run_dir),
               "--set", "trainer.batch_size=4", "--set", "run.max_trajectories_in_flight=4",
               "--set", "policy.max_new_tokens=8", "--set", "run.timeout_s=400",
               # The end-of-run held-out comparison on a few tasks, its base-model cache in the test's folder.
               "--set", "run.heldout_cap=3", "--set", f"run.heldout_cache_dir=\"{tmp_path / 'heldout-cache'}\"",
               # Shadow validation on (the suite turns it off by default), on a slice after those 3 tasks.
               "--set", "trainer.shadow_every=1", "--set", "trainer.shadow_tasks=3",
               "--set", "trainer.measure_kl_to_base=true",
               "--set", "metrics.launcher_port=0", "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=500, env=shadow_on())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())

    # Nothing lost, nothing trained twice: every produced trajectory was trained on or dropped as
    # a duplicate of a redelivered task.
    assert summary["trajectories_trained"] == tasks
    assert summary["trajectories_produced"] == (summary["trajectories_trained"] + summary["duplicates_dropped"]
                                                + summary["dead_lettered"])
    # The trainer's ledger, written step by step, agrees: each fed task trained exactly once.
    steps = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    trained_ids = [tid for step in steps for tid in step["trajectory_ids"]]
    assert len(trained_ids) == len(set(trained_ids)) == summary["trajectories_trained"]
    assert sorted(tid.split("#")[0] for tid in trained_ids) == sorted(
        f"train/basic_arithmetic/0/{i}" for i in range(tasks))
    assert [step["step"] for step in steps] == list(range(1, summary["trainer_steps"] + 1))
    assert steps[-1]["policy_version"] + 1 == summary["policy_version"]  # each step published one version
    # Every step scored its rows with the frozen base too; the first step trains the base's own weights.
    kl = [step["kl_to_base"] for step in json.loads((run_dir / "status" / "trainer.json").read_text())["steps"]]
    assert len(kl) == summary["trainer_steps"] and kl[0] == pytest.approx(0.0, abs=1e-6)
    assert all(value is not None and 0 <= value < 1 for value in kl), kl
    # The policy moved, and samplers reloaded it: later trajectories come from newer versions.
    assert summary["trainer_steps"] == tasks // 4
    assert summary["policy_version"] == tasks // 4
    assert summary["max_behaviour_version"] >= 1
    assert summary["sampler_reloads"] >= 1
    # Importance ratios are finite and near 1 (same weights, recomputed in another process).
    assert math.isfinite(summary["importance_ratio_mean"])
    assert abs(summary["importance_ratio_mean"] - 1) < 0.05
    # Bytes of every step's full context vs sao's trajectory. Two-turn episodes are too short for
    # memory to pay for itself (one INT8 slot is 388 bytes), so no bound above 1 is claimed here.
    assert 0 < summary["compression_ratio"] < 100
    # What the run learned leads the summary: base model vs final version on the same held-out tasks.
    assert list(summary)[:5] == ["heldout_base", "heldout_final", "heldout_gain", "heldout_gain_stderr", "heldout_n"]
    assert summary["heldout_n"] == 3 and 0 <= summary["heldout_base"] <= 1 and 0 <= summary["heldout_final"] <= 1
    assert summary["heldout_gain"] == pytest.approx(summary["heldout_final"] - summary["heldout_base"])
    heldout = json.loads((run_dir / "eval" / "heldout.json").read_text())
    assert heldout["final_version"] == summary["policy_version"] and len(heldout["per_task"]) == 3
    assert all(task.startswith("eval/basic_arithmetic/") for task in heldout["per_task"])
    assert list((tmp_path / "heldout-cache").glob("*.json"))  # the next run skips the base model
    # Sampled rewards by behaviour version, against another source: the samplers add up the reward
    # of what they produce; with nothing dropped, the versions' groups hold exactly those trajectories.
    # Shadow validation scored the base model and the final version (at least) on its own 3 tasks, and
    # kept the best one; a random tiny policy never drops, so nothing was rolled back.
    board = json.loads((run_dir / "shadow" / "board.json").read_text())
    assert {"0", str(summary["policy_version"])} <= set(board["scores"])
    assert all(score["n"] == 3 for score in board["scores"].values())
    assert summary["shadow_best"]["version"] == board["best"]["version"] == heldout["kept_version"]
    assert summary["rollbacks"] == []
    # The trainer's trajectory log rebuilds every version it published, bit for bit, without the broker.
    replayed = subprocess.run([sys.executable, "-m", "sao.cli", "replay", str(run_dir)], capture_output=True, text=True,
                              timeout=300)
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    assert f"{summary['policy_version']} of {summary['policy_version']} versions match" in replayed.stderr
    groups = summary["reward_by_version"]
    assert sum(g["n"] for g in groups) == tasks and [g["version"] for g in groups] == sorted({g["version"] for g in groups})
    assert (summary["reward_first_version"], summary["reward_last_version"]) == (groups[0]["mean"], groups[-1]["mean"])
    # Success per attempt, from the same trajectories: one first attempt each, a second only after a wrong first.
    attempts = summary["attempts_by_version"]
    assert [(a["version"], a["first_n"]) for a in attempts] == [(g["version"], g["n"]) for g in groups]
    assert all(a["second_n"] == round(a["first_n"] * (1 - a["first_success"])) for a in attempts)
    assert 0 <= summary["heldout_second_try_base_n"] <= 3 and 0 <= summary["heldout_second_try_n"] <= 3
    if summary["duplicates_dropped"] == summary["dead_lettered"] == 0:
        samplers = [json.loads(path.read_text()) for path in (run_dir / "status").glob("sampler-*.json")]
        assert len(samplers) == 2
        produced_reward = sum(s["reward_sum"] for s in samplers)
        assert sum(g["n"] * g["mean"] for g in groups) == pytest.approx(produced_reward)
    # A clean stop leaves a resumable checkpoint and the published weights.
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert list((run_dir / "policy").glob("policy-v*.safetensors"))
    _check_accounting(summary)


def _check_accounting(summary: dict) -> None:
    """Where the CPU went: every role used some, and no more than the cores there are, over the run's wall time."""
    busy, cores = summary["cpu_cores_busy"], summary["cores"]
    assert set(busy) == {"trainer", "samplers", "broker", "launcher", "total"}
    assert all(0 < busy[role] < cores + 0.05 for role in busy), busy  # broker and launcher are small but not 0
    assert busy["total"] == pytest.approx(busy["trainer"] + busy["samplers"] + busy["broker"] + busy["launcher"])
    # Loading a model takes seconds of CPU even when the machine is busy with other work.
    assert busy["trainer"] * summary["duration_s"] > 1 and busy["samplers"] * summary["duration_s"] > 1
    assert summary["cpu_utilisation"] == pytest.approx(busy["total"] / cores) and 0 < summary["cpu_utilisation"] <= 1.05
    assert 0 <= summary["trainer_idle_ratio"] < 1 and 0 <= summary["sampler_idle_ratio"] < 1
    assert summary["trajectories_per_s"] == pytest.approx(summary["trajectories_trained"] / summary["duration_s"])
    assert 0 < summary["sampling_to_training_s_p50"] <= summary["sampling_to_training_s_p95"] < summary["duration_s"]
    assert 0 <= summary["sampling_to_training_steps_p50"] <= summary["sampling_to_training_steps_p95"]


@pytest.mark.slow
def test_grpo_baseline_runs_synchronously_on_whole_groups(tmp_path):
    run_dir = tmp_path / "grpo"
    command = [sys.executable, "-m", "sao.cli", "run", "--model", "tiny", "--num-tasks", "6", "--samplers", "1",
               "--run-dir", str(run_dir), "--set", "trainer.algorithm=\"grpo\"", "--set", "trainer.algorithm.group_size=2",
               # Another reasoning-gym dataset than the default: it starts from its own options, not basic_arithmetic's.
               "--set", "env.dataset=\"chain_sum\"",
               "--set", "trainer.batch_size=4", "--set", "policy.max_new_tokens=6", "--set", "run.timeout_s=300",
               "--set", "run.heldout_eval=false",
               "--set", "metrics.launcher_port=0", "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trajectories_trained"] == 12 and summary["trainer_steps"] == 3
    assert summary["staleness_mean"] == 0  # synchronous: every batch sampled by the current policy
    assert summary["heldout_n"] is None and not (run_dir / "eval").exists()  # run.heldout_eval = false
    for line in (run_dir / "trained.jsonl").read_text().splitlines():
        ids = json.loads(line)["trajectory_ids"]
        tasks = [tid.split("#")[0] for tid in ids]
        assert all(tasks.count(task) == 2 for task in tasks), ids  # whole groups only
        assert all(task.startswith("train/chain_sum/") for task in tasks), ids


@pytest.mark.slow
def test_sao_run_trains_lora_adapters_and_every_reader_merges_them(tmp_path):
    """trainer.lora.rank > 0 end to end: samplers, the held-out scorer and shadow validation all read adapters."""
    run_dir = tmp_path / "run"
    tasks = 8
    command = [sys.executable, "-m", "sao.cli", "run", "--model", "tiny", "--num-tasks", str(tasks),
               "--samplers", "1", "--run-dir", str(run_dir), "--set", "trainer.lora.rank=8",
               "--set", "trainer.batch_size=4", "--set", "run.max_trajectories_in_flight=4",
               "--set", "policy.max_new_tokens=8", "--set", "run.timeout_s=400",
               "--set", "run.heldout_cap=3", "--set", f"run.heldout_cache_dir=\"{tmp_path / 'heldout-cache'}\"",
               "--set", "trainer.shadow_every=1", "--set", "trainer.shadow_tasks=3",
               "--set", "metrics.launcher_port=0", "--set", "metrics.trainer_port=0", "--set", "metrics.sampler_port=0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=500, env=shadow_on())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trajectories_trained"] == tasks and summary["policy_version"] == tasks // 4
    assert summary["sampler_reloads"] >= 1 and summary["max_behaviour_version"] >= 1
    assert abs(summary["importance_ratio_mean"] - 1) < 0.05
    sidecars = [json.loads(path.read_text()) for path in (run_dir / "policy").glob("policy-v*.json")]
    assert sidecars and all(sidecar["content"] == "lora" for sidecar in sidecars)
    heldout = json.loads((run_dir / "eval" / "heldout.json").read_text())
    assert heldout["final_version"] == summary["policy_version"] and len(heldout["per_task"]) == 3
    board = json.loads((run_dir / "shadow" / "board.json").read_text())
    assert str(summary["policy_version"]) in board["scores"]
    sampler_side = _check_final_adapters(run_dir, summary["policy_version"])
    # `sao export` writes that merged model as a plain HF folder, in the publish dtype (bf16).
    out = tmp_path / "export"
    result = subprocess.run([sys.executable, "-m", "sao.cli", "export", "--run-dir", str(run_dir), "--out", str(out),
                             "--version", "final"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(out, torch_dtype="auto").state_dict()
    merged = sampler_side.lm.state_dict()
    assert exported.keys() == merged.keys()
    assert all(torch.equal(exported[name], merged[name].to(torch.bfloat16)) for name in merged)
    assert json.loads((out / "sao-export.json").read_text())["lora_merged"]


def _check_final_adapters(run_dir, version: int):
    """The final version as the readers merge it into a plain model computes what the trainer's peft model with
    the published adapters computes, and differs from the base model (the adapters learned); returns that model."""
    config = load_config(run_dir / "config.toml", environ={})
    published = read_version_state(RunDir(run_dir), version)
    width = published["projector.weight"].shape[1]
    base = build_policy(config.policy, width).eval()
    trainer_side = build_policy(config.policy, width).eval()
    add_lora(trainer_side, config.trainer.lora)
    trainer_side.load_state_dict(published, strict=False)
    sampler_side = attach_adapter_merge(build_policy(config.policy, width).eval(), config.trainer.lora)
    read_version_into(sampler_side, RunDir(run_dir), version)
    tokens = torch.randint(0, base.lm.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged, peft, before = (policy.lm(input_ids=tokens).logits for policy in (sampler_side, trainer_side, base))
    torch.testing.assert_close(merged, peft, rtol=1e-5, atol=1e-5)
    assert float((merged - before).abs().max()) > 1e-3
    return sampler_side
