"""Sampler rollout throughput: side-by-side episodes (sampler.rollout_batch) vs one at a time, in one run.

    python benchmarks/sampler_throughput.py [--tasks 16] [--batch 4] [--model smollm2-135m-instruct] [--json PATH]

Both configurations roll out the same tasks with the same policy, encoder and filter on one
torch thread (what a sampler process gets on a 2-core machine), through `Roller.rollout_batch`,
the code path `sao sampler` runs. Kafka is left out: producing a trajectory takes ~1 ms.
Prints trajectories/s and generated tokens/s for each, and the ratio batched / one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def measure(roller, tasks, batch: int) -> dict:
    started = time.perf_counter()
    trajectories = []
    for first in range(0, len(tasks), batch):
        trajectories += roller.rollout_batch(tasks[first:first + batch], behaviour_version=0)
    seconds = time.perf_counter() - started
    tokens = sum(len(step.action_ids) for t in trajectories for step in t.steps)
    return {"batch": batch, "trajectories": len(trajectories), "seconds": seconds, "tokens": tokens,
            "trajectories_per_s": len(trajectories) / seconds, "tokens_per_s": tokens / seconds,
            "mean_reward": sum(t.total_reward for t in trajectories) / len(trajectories)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from sao.compression.semantic import load_encoder
    from sao.compression.temporal import load_temporal_filter
    from sao.config import load_config
    from sao.envs.registry import make_env, make_tasks
    from sao.policy.loading import load_tokenizer
    from sao.policy.weights import build_policy
    from sao.producers.rollout import ChatFormat, Roller

    torch.set_num_threads(1)
    config = load_config(overrides=[f'policy.model="{args.model}"'], environ={})
    encoder = load_encoder(config.compression.encoder)
    policy = build_policy(config.policy, encoder.dim).eval()
    chat = ChatFormat(load_tokenizer(config.policy.model, config.policy.cache_dir), config.policy.system_prompt)
    tasks = make_tasks(config.env, args.tasks)
    results = []
    for batch in (1, args.batch):
        roller = Roller(config, lambda: make_env(config.env), policy, chat, encoder, load_temporal_filter(),
                        "bench", seed=0)
        results.append(measure(roller, tasks, batch))
    baseline, batched = results
    table = Table(title=f"sampler throughput, {args.model}, {args.tasks} tasks, 1 torch thread")
    for column in ("rollout_batch", "trajectories/s", "tokens/s", "seconds", "mean reward"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r["batch"]), f"{r['trajectories_per_s']:.3f}", f"{r['tokens_per_s']:.1f}",
                      f"{r['seconds']:.1f}", f"{r['mean_reward']:.3f}")
    Console().print(table)
    ratio = batched["trajectories_per_s"] / baseline["trajectories_per_s"]
    print(f"batched / one at a time: {ratio:.2f}x trajectories/s, "
          f"{batched['tokens_per_s'] / baseline['tokens_per_s']:.2f}x tokens/s")
    if args.json:
        args.json.write_text(json.dumps({
            "headline": {"metric": "sampler trajectories per second", "unit": "trajectories/s",
                         "value": batched["trajectories_per_s"], "baseline": baseline["trajectories_per_s"],
                         "ratio": ratio},
            "results": results, "model": args.model}, indent=2))


if __name__ == "__main__":
    main()
