"""`sao eval`: score one published policy version on held-out tasks.

The trainer keeps the last `trainer.keep_versions` versions on disk (shadow models) with a JSON
sidecar holding their sha256; any of them, or version 0 (the base model), can be scored here.
Actions are greedy by default so that two versions are compared without sampling noise.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from sao.compression.semantic import load_encoder
from sao.compression.temporal import load_temporal_filter
from sao.config import SaoConfig
from sao.envs.registry import make_tasks
from sao.policy.weights import build_policy, place_for_sampling, read_weights_into
from sao.run_dir import RunDir
from sao.sampler.rollout import Roller


def weights_of(run_dir: Path, version: int) -> tuple[Path, str]:
    """Weights file and sha256 of a published version, from its sidecar."""
    run_dir = RunDir(run_dir)
    sidecar = run_dir.weights_sidecar(version)
    if not sidecar.is_file():
        raise FileNotFoundError(f"policy v{version} is not in {run_dir.policy_dir} (kept: "
                                f"{run_dir.kept_versions() or 'none'}; raise trainer.keep_versions to keep more)")
    return run_dir.weights(version), json.loads(sidecar.read_text())["sha256"]


def evaluate(config: SaoConfig, run_dir: Path, version: int, num_tasks: int, greedy: bool = True) -> dict:
    torch.set_num_threads(config.sampler.torch_threads)
    encoder = load_encoder(config.compression.encoder)
    policy = place_for_sampling(build_policy(config.policy, encoder.dim), config.sampler.device)
    if version > 0:
        read_weights_into(policy, *weights_of(run_dir, version))
    temporal_filter = load_temporal_filter(config.compression.temporal_weights, config.compression.keep_threshold)
    roller = Roller(config, policy, encoder, temporal_filter, sampler_id=f"eval-v{version}", seed=0)
    started = time.perf_counter()
    rewards, first_try = [], []
    for task in make_tasks(config.env, num_tasks, split="eval"):
        trajectory = roller.rollout(task, version, greedy=greedy)
        rewards.append(trajectory.total_reward)
        first_try.append(float(trajectory.steps[0].reward >= 1.0))
    result = {"version": version, "tasks": num_tasks, "greedy": greedy, "split": "eval",
              "reward_mean": sum(rewards) / len(rewards), "first_try_success": sum(first_try) / len(first_try),
              "seconds": time.perf_counter() - started}
    out = RunDir(run_dir).eval_result(version)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result
