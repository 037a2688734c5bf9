"""Per-rank parameter and optimizer memory of the ZeRO-3 trainer at 1 and N ranks, in one run.

    python benchmarks/zero3_memory.py [--model smollm2-135m-instruct] [--ranks 2] [--json PATH]

Each configuration runs the real trainer engine (`sao.trainer.engine.build_engine`) and one
optimizer step on synthetic trajectories, under torchrun on CPU (gloo). It prints the bytes
each rank holds for its parameter partitions, its AdamW state and its fp32 master partitions,
plus peak RSS, and the ratio of N ranks to 1 rank (ZeRO-3 should approach 1/N).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def worker(model: str, out: Path) -> None:
    """One rank: build the engine, take one step, report this rank's memory."""
    import numpy as np
    import torch

    from sao.config import load_config
    from sao.policy.weights import build_policy
    from sao.schema import Memory, Step, Trajectory
    from sao.trainer.baselines import RewardBaseline
    from sao.trainer.batch import plan_batch, rank_loss
    from sao.trainer.distributed import rank, world_size
    from sao.trainer.engine import build_engine, memory_per_rank, shutdown

    torch.set_num_threads(1)
    config = load_config(overrides=[f'policy.model="{model}"', "trainer.batch_size=4"], environ={})
    engine = build_engine(build_policy(config.policy, 384), config.trainer)
    rng = np.random.default_rng(0)
    batch = [Trajectory(f"t{i}#0", f"t{i}", "arithmetic", "bench", 0, rng.integers(3, 49152, 40).astype(np.int32),
                        [Step(rng.integers(3, 49152, 6).astype(np.int32), rng.integers(3, 49152, 16).astype(np.int32),
                              np.full(16, -2.0, np.float32), float(i % 2), True, 0)],
                        Memory.empty(384), 1.0, "bench", 0) for i in range(4)]
    plan = plan_batch(batch, RewardBaseline(), config.trainer, 0)
    started = time.perf_counter()
    loss, _ = rank_loss(engine, plan, list(range(4))[rank()::world_size()], 4 / world_size(), config.trainer, 384)
    engine.backward(loss)
    engine.step()
    step_s = time.perf_counter() - started
    report = {**memory_per_rank(engine), "rank": rank(), "world_size": world_size(), "step_s": step_s,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    (out / f"rank{rank()}.json").write_text(json.dumps(report))
    shutdown()


def run(model: str, ranks: int) -> list[dict]:
    out = Path(tempfile.mkdtemp())
    from sao.transport.broker import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", str(free_port()), __file__, "--worker", "--model", model, "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True)
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.out)
        return
    from rich.console import Console
    from rich.table import Table

    baseline, sharded = run(args.model, 1), run(args.model, args.ranks)
    table = Table(title=f"ZeRO-3 memory per rank, {args.model}: 1 rank vs {args.ranks} ranks (CPU, gloo)")
    for column in ("bytes per rank", "1 rank (MiB)", f"{args.ranks} ranks, max over ranks (MiB)", "ratio"):
        table.add_column(column, justify="right")
    figures = {}
    for key in ("param_bytes", "optimizer_state_bytes", "master_weight_bytes", "peak_rss_bytes"):
        one, many = baseline[0][key], max(r[key] for r in sharded)
        figures[key] = {"one_rank": one, "n_ranks_max": many, "ratio": many / one}
        table.add_row(key, f"{one / 2**20:.1f}", f"{many / 2**20:.1f}", f"{many / one:.3f}")
    Console().print(table)
    state = figures["param_bytes"]["ratio"], figures["optimizer_state_bytes"]["ratio"]
    headline = {"metric": "param+optimizer bytes per rank", "unit": "ratio to 1 rank",
                "value": (figures["param_bytes"]["n_ranks_max"] + figures["optimizer_state_bytes"]["n_ranks_max"]),
                "baseline": (figures["param_bytes"]["one_rank"] + figures["optimizer_state_bytes"]["one_rank"])}
    headline["ratio"] = headline["value"] / headline["baseline"]
    print(f"param ratio {state[0]:.3f}, optimizer ratio {state[1]:.3f} (ideal {1 / args.ranks:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"headline": headline, "model": args.model, "ranks": args.ranks,
                                         "figures": figures, "one_rank": baseline, "n_ranks": sharded}, indent=2))


if __name__ == "__main__":
    main()
