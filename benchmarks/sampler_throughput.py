"""Sampler rollout throughput: side-by-side episodes vs one at a time, and 1 vs 2 sampler processes.

    python benchmarks/sampler_throughput.py [--tasks 16] [--batch 4] [--model smollm2-135m-instruct] [--json PATH]
                                            [--set section.knob=value ...]

Part 1, in this process: the same tasks rolled out one at a time (rollout_batch 1), in lockstep
batches of --batch (each batch runs to its end), and with continuous batching (--batch slots,
a slot refilled as soon as its episode ends: what `sao sampler` does).
Part 2: one, then two sampler processes, each rolling out --tasks
tasks of its own at --batch; they load their models first and start together at a barrier, so
start-up is not timed. Every process uses one torch thread (what a sampler gets on a 2-core
machine) and `Roller.start`/`Roller.step` (through `rollout_batch`), the code path `sao sampler` runs; Kafka is left out
(producing a trajectory takes ~1 ms). Prints trajectories/s and generated tokens/s per process
and in total, with the ratios against the baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _roller(model: str, seed: int, overrides: list[str]):
    import torch

    from sao.config import load_config
    from sao.sampler.rollout import Roller

    torch.set_num_threads(1)
    config = load_config(overrides=[f'policy.model="{model}"', *overrides], environ={})
    return Roller.from_config(config, f"bench-{seed}", seed=seed), config


def continuous(roller, tasks, batch: int) -> list:
    """What `sao sampler` does: keep `batch` episodes live, refilling a slot when one ends."""
    return roller.rollout_batch(tasks, behaviour_version=0, slots=batch)


def lockstep(roller, tasks, batch: int) -> list:
    """Fixed batches of `batch` tasks, each run to its end before the next starts."""
    return [t for first in range(0, len(tasks), batch)
            for t in roller.rollout_batch(tasks[first:first + batch], behaviour_version=0)]


def measure(roller, tasks, batch: int, mode=continuous) -> dict:
    roller.generator.manual_seed(0)  # every mode starts from the same sampling stream
    started = time.perf_counter()
    trajectories = mode(roller, tasks, batch)
    seconds = time.perf_counter() - started
    tokens = sum(len(step.action_ids) for t in trajectories for step in t.steps)
    return {"batch": batch, "mode": mode.__name__, "trajectories": len(trajectories), "seconds": seconds,
            "tokens": tokens,
            "trajectories_per_s": len(trajectories) / seconds, "tokens_per_s": tokens / seconds,
            "mean_reward": sum(t.total_reward for t in trajectories) / len(trajectories)}


def _sampler_process(index: int, model: str, num_tasks: int, batch: int, overrides: list[str], barrier,
                     results) -> None:
    from sao.envs.registry import make_tasks

    roller, config = _roller(model, seed=index, overrides=overrides)
    tasks = make_tasks(config.env, num_tasks, start_index=index * num_tasks)  # each process its own tasks
    barrier.wait()
    results.put({"process": index, **measure(roller, tasks, batch)})


def processes(count: int, model: str, num_tasks: int, batch: int, overrides: list[str]) -> dict:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(count), context.Queue()
    workers = [context.Process(target=_sampler_process, args=(i, model, num_tasks, batch, overrides, barrier, results))
               for i in range(count)]
    for worker in workers:
        worker.start()
    per_process = sorted((results.get() for _ in workers), key=lambda r: r["process"])
    for worker in workers:
        worker.join()
    # Together: all trajectories over the wall time of the slowest process.
    wall = max(r["seconds"] for r in per_process)
    return {"processes": count, "per_process": per_process,
            "total_trajectories_per_s": sum(r["trajectories"] for r in per_process) / wall,
            "total_tokens_per_s": sum(r["tokens"] for r in per_process) / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KNOB=VALUE",
                        help="config override for every sampler, e.g. policy.max_new_tokens=8 (repeatable)")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from sao.envs.registry import make_tasks

    console = Console()
    roller, config = _roller(args.model, seed=0, overrides=args.overrides)
    tasks = make_tasks(config.env, args.tasks)
    in_process = [measure(roller, tasks, 1), measure(roller, tasks, args.batch, lockstep),
                  measure(roller, tasks, args.batch)]
    scaling = [processes(count, args.model, args.tasks, args.batch, args.overrides) for count in (1, 2)]

    table = Table(title=f"one sampler, {args.model}, {args.tasks} tasks, 1 torch thread")
    for column in ("rollout_batch", "batching", "trajectories/s", "tokens/s", "seconds", "mean reward"):
        table.add_column(column, justify="right")
    for r in in_process:
        table.add_row(str(r["batch"]), r["mode"] if r["batch"] > 1 else "-", f"{r['trajectories_per_s']:.3f}",
                      f"{r['tokens_per_s']:.1f}",
                      f"{r['seconds']:.1f}", f"{r['mean_reward']:.3f}")
    console.print(table)
    table = Table(title=f"sampler processes, rollout_batch {args.batch}, {args.tasks} tasks each, 1 torch thread each")
    for column in ("processes", "process", "trajectories/s", "tokens/s", "seconds"):
        table.add_column(column, justify="right")
    for run in scaling:
        for r in run["per_process"]:
            table.add_row(str(run["processes"]), str(r["process"]), f"{r['trajectories_per_s']:.3f}",
                          f"{r['tokens_per_s']:.1f}", f"{r['seconds']:.1f}")
        table.add_row(str(run["processes"]), "total", f"{run['total_trajectories_per_s']:.3f}",
                      f"{run['total_tokens_per_s']:.1f}", "", end_section=True)
    console.print(table)

    baseline, batched_lockstep, batched = in_process
    batching = batched["trajectories_per_s"] / baseline["trajectories_per_s"]
    refill = batched["trajectories_per_s"] / batched_lockstep["trajectories_per_s"]
    one, two = scaling
    scale = two["total_trajectories_per_s"] / one["total_trajectories_per_s"]
    per_process = (sum(r["trajectories_per_s"] for r in two["per_process"]) / 2
                   / one["per_process"][0]["trajectories_per_s"])
    console.print(f"continuous batching / one at a time: {batching:.2f}x trajectories/s, "
                  f"{batched['tokens_per_s'] / baseline['tokens_per_s']:.2f}x tokens/s")
    console.print(f"continuous / lockstep batches: {refill:.2f}x trajectories/s")
    console.print(f"2 samplers / 1 sampler: {scale:.2f}x trajectories/s in total, "
                  f"{per_process:.2f}x per process ({os.cpu_count()} cores)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "headline": {"metric": "sampler trajectories per second", "unit": "trajectories/s",
                         "value": batched["trajectories_per_s"], "baseline": baseline["trajectories_per_s"],
                         "ratio": batching},
            "continuous_vs_lockstep": refill,
            "scaling": {"metric": "trajectories per second, 2 sampler processes vs 1", "ratio": scale,
                        "per_process_ratio": per_process, "runs": scaling},
            "results": in_process, "model": args.model, "overrides": args.overrides, "cores": os.cpu_count()},
            indent=2))


if __name__ == "__main__":
    main()
