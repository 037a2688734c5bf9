"""Sampler rollout throughput: side-by-side episodes vs one at a time, and 1 vs 2 sampler processes.

    python benchmarks/sampler_throughput.py [--tasks 16] [--batch 4] [--model smollm2-135m-instruct] [--json PATH]
                                            [--set section.knob=value ...]
    python benchmarks/sampler_throughput.py --engines [--tasks 32] [--batch 32] [--rounds 3] [--json PATH]

With --engines: the generation engines compared instead (sampler.engine = hf and vllm), --rounds
rounds alternated, each round of each engine in a fresh process: start-up (the roller's build, the
vLLM engine's included) and the RSS it added; one plain generation of the same prompts (the first
contexts of --tasks tasks, exactly --gen-tokens tokens each with no stop rule, all at once); then rollouts of those tasks
at --batch slots. Prints tokens/s, trajectories/s and CPU seconds per wall second (the threads each
engine really used), and vllm / hf per round and overall.

Part 1, in this process: the same tasks rolled out one at a time (rollout_batch 1), in lockstep
batches of --batch (each batch runs to its end), and with continuous batching (--batch slots,
a slot refilled as soon as its episode ends: what `sao sampler` does).
Part 2: one, then two sampler processes, each rolling out --tasks
tasks of its own at --batch; they load their models first and start together at a barrier, so
start-up is not timed. Every process uses sampler.torch_threads torch threads (auto: 1, what a sampler
of an async run gets; `--set sampler.torch_threads=2` for more) and
`Roller.start`/`Roller.step` (through `rollout_batch`), the code path `sao sampler` runs; Kafka is left out
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

    config = load_config(overrides=[f'policy.model="{model}"', *overrides], environ={})
    torch.set_num_threads(config.sampler.threads(config.run.mode))  # what `sao sampler` does
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


def _rss_gib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _engine_round(engine: str, model: str, num_tasks: int, batch: int, gen_tokens: int, overrides: list[str],
                  results) -> None:
    """One round of one engine in a fresh process (an engine's libraries never share a process with the
    other's): start-up and RSS added, then plain generation of the tasks' first contexts, then rollouts."""
    import torch

    from sao.envs.registry import make_tasks
    from sao.policy.sampling import StopRule
    from sao.status import own_cpu_seconds

    rss, started = _rss_gib(), time.perf_counter()
    roller, config = _roller(model, seed=0, overrides=[*overrides, f'sampler.engine="{engine}"'])
    startup_s, rss_added = time.perf_counter() - started, _rss_gib() - rss
    tasks = make_tasks(config.env, num_tasks)
    contexts = [roller.start(task, 0).next_input() for task in tasks]
    generation = roller.generation
    cpu, started = own_cpu_seconds(), time.perf_counter()
    # No stop rule: every row generates exactly gen_tokens, so both engines do the same work.
    samples = (roller.engine or roller.policy).sample_batch(contexts, gen_tokens, generation.temperature,
                                                            StopRule(frozenset()), torch.Generator().manual_seed(0),
                                                            top_p=generation.top_p)
    seconds = time.perf_counter() - started
    tokens = sum(len(action) for action, _ in samples)
    generate = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "cpu_per_wall": (own_cpu_seconds() - cpu) / seconds}
    cpu = own_cpu_seconds()
    rollout = measure(roller, tasks, batch)
    rollout["cpu_per_wall"] = (own_cpu_seconds() - cpu) / rollout["seconds"]
    results.put({"startup_s": startup_s, "rss_added_gib": rss_added, "generate": generate, "rollout": rollout})


def compare_engines(model: str, num_tasks: int, batch: int, rounds: int, gen_tokens: int,
                    overrides: list[str]) -> dict:
    """hf vs vllm, rounds alternated, each round of each engine in its own process."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    engines = {"hf": [], "vllm": []}
    for _ in range(rounds):
        for engine, arm in engines.items():
            worker = context.Process(target=_engine_round,
                                     args=(engine, model, num_tasks, batch, gen_tokens, overrides, results))
            worker.start()
            arm.append(results.get())
            worker.join()
    summary = {}
    for engine, arm in engines.items():
        summary[engine] = {"rounds": arm, **{
            f"{part}_tokens_per_s": sum(r[part]["tokens"] for r in arm) / sum(r[part]["seconds"] for r in arm)
            for part in ("generate", "rollout")},
            "rollout_trajectories_per_s": (sum(r["rollout"]["trajectories"] for r in arm)
                                           / sum(r["rollout"]["seconds"] for r in arm))}
    return summary


def print_engines(console, engines: dict, model: str, num_tasks: int, batch: int, gen_tokens: int) -> dict:
    from rich.table import Table

    table = Table(title=f"engines, {model}, {num_tasks} tasks: generation of their first contexts "
                        f"({gen_tokens} tokens each), then rollouts at rollout_batch {batch}; rounds alternated")
    for column in ("engine", "round", "start-up s", "RSS added GiB", "generate tok/s", "cpu/wall",
                   "rollout tok/s", "rollout traj/s", "cpu/wall", "mean reward"):
        table.add_column(column, justify="right")
    for engine, arm in engines.items():
        for index, r in enumerate(arm["rounds"]):
            g, o = r["generate"], r["rollout"]
            table.add_row(engine, str(index), f"{r['startup_s']:.1f}", f"{r['rss_added_gib']:.2f}",
                          f"{g['tokens_per_s']:.1f}", f"{g['cpu_per_wall']:.2f}", f"{o['tokens_per_s']:.1f}",
                          f"{o['trajectories_per_s']:.3f}", f"{o['cpu_per_wall']:.2f}", f"{o['mean_reward']:.3f}")
        table.add_row(engine, "all", "", "", f"{arm['generate_tokens_per_s']:.1f}", "",
                      f"{arm['rollout_tokens_per_s']:.1f}", f"{arm['rollout_trajectories_per_s']:.3f}", "", "",
                      end_section=True)
    console.print(table)
    hf, vllm = engines["hf"], engines["vllm"]
    ratios = {part: vllm[f"{part}_tokens_per_s"] / hf[f"{part}_tokens_per_s"] for part in ("generate", "rollout")}
    per_round = [v["generate"]["tokens_per_s"] / h["generate"]["tokens_per_s"]
                 for h, v in zip(hf["rounds"], vllm["rounds"])]
    console.print(f"vllm / hf, generation tokens/s: {ratios['generate']:.2f}x "
                  f"(per round {', '.join(f'{r:.2f}' for r in per_round)}); rollout tokens/s {ratios['rollout']:.2f}x, "
                  f"trajectories/s {vllm['rollout_trajectories_per_s'] / hf['rollout_trajectories_per_s']:.2f}x "
                  "(start-up not included in either)")
    return {"headline": {"metric": "generated tokens per second, vllm vs hf engine, same prompts", "unit": "tokens/s",
                         "value": vllm["generate_tokens_per_s"], "baseline": hf["generate_tokens_per_s"],
                         "ratio": ratios["generate"]},
            "rollout_ratio": ratios["rollout"], "per_round_ratio": per_round, "engines": engines}


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
    parser.add_argument("--engines", action="store_true", help="compare sampler.engine hf and vllm instead")
    parser.add_argument("--rounds", type=int, default=3, help="--engines: alternated rounds per engine")
    parser.add_argument("--gen-tokens", type=int, default=128, help="--engines: tokens per plain generation")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from sao.envs.registry import make_tasks

    console = Console()
    if args.engines:
        engines = compare_engines(args.model, args.tasks, args.batch, args.rounds, args.gen_tokens, args.overrides)
        result = print_engines(console, engines, args.model, args.tasks, args.batch, args.gen_tokens)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({**result, "model": args.model, "tasks": args.tasks, "batch": args.batch,
                                             "overrides": args.overrides, "cores": os.cpu_count()}, indent=2))
        return
    roller, config = _roller(args.model, seed=0, overrides=args.overrides)
    tasks = make_tasks(config.env, args.tasks)
    in_process = [measure(roller, tasks, 1), measure(roller, tasks, args.batch, lockstep),
                  measure(roller, tasks, args.batch)]
    scaling = [processes(count, args.model, args.tasks, args.batch, args.overrides) for count in (1, 2)]

    threads = config.sampler.threads(config.run.mode)
    table = Table(title=f"one sampler, {args.model}, {args.tasks} tasks, {threads} torch thread(s)")
    for column in ("rollout_batch", "batching", "trajectories/s", "tokens/s", "seconds", "mean reward"):
        table.add_column(column, justify="right")
    for r in in_process:
        table.add_row(str(r["batch"]), r["mode"] if r["batch"] > 1 else "-", f"{r['trajectories_per_s']:.3f}",
                      f"{r['tokens_per_s']:.1f}",
                      f"{r['seconds']:.1f}", f"{r['mean_reward']:.3f}")
    console.print(table)
    table = Table(title=f"sampler processes, rollout_batch {args.batch}, {args.tasks} tasks each, "
                        f"{threads} torch thread(s) each")
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
