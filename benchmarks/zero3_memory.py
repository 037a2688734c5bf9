"""Per-rank parameter and optimizer memory of the ZeRO-3 trainer at 1 and N ranks, and with CPU optimizer offload.

    python benchmarks/zero3_memory.py [--model smollm2-135m-instruct] [--ranks 2] [--steps 3] [--no-offload] [--json PATH]

Each arm runs the real trainer engine (`sao.trainer.engine.build_engine`) and --steps optimizer
steps on synthetic trajectories, under torchrun (gloo on CPU, NCCL on GPU). Arms: 1 rank (the
baseline), N ranks, and N ranks with `trainer.offload_optimizer` (DeepSpeed `offload_optimizer:
{device: cpu}`: fp32 master weights and AdamW state live in CPU memory and the optimizer step runs
there). For each arm it prints the bytes each rank holds for its parameter partitions, its AdamW
state and its fp32 master partitions, where they live (cpu or the accelerator), peak RSS, and the
step time (mean of the steps after the first, which allocates the optimizer state).

Headline: param+optimizer bytes per rank at N ranks against 1 rank (ZeRO-3 should approach 1/N).
On a CPU-only machine offload cannot free accelerator memory (there is none): its arm shows what
DeepSpeed's offload path costs in step time; on a GPU it shows the accelerator bytes it frees.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MEMORY_KEYS = ("param_bytes", "optimizer_state_bytes", "master_weight_bytes")


def _devices(engine) -> dict[str, str]:
    """Where this rank's parameter partitions, optimizer state and fp32 masters live ("cpu", "cuda", "-" if none)."""
    import torch

    zero_optimizer = engine.optimizer
    inner = getattr(zero_optimizer, "optimizer", zero_optimizer)
    groups = {
        "param_bytes": [getattr(p, "ds_tensor", p) for p in engine.module.parameters()],
        "optimizer_state_bytes": [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)],
        "master_weight_bytes": list(getattr(zero_optimizer, "fp32_partitioned_groups_flat", [])),
    }
    return {key: ",".join(sorted({t.device.type for t in tensors})) or "-" for key, tensors in groups.items()}


def worker(model: str, offload: bool, steps: int, out: Path) -> None:
    """One rank: build the engine, take `steps` steps, report this rank's memory, where it lives, and step times."""
    import numpy as np
    import torch

    from sao.config import load_config
    from sao.policy.weights import build_policy
    from sao.schema import Memory, Step, Trajectory
    from sao.trainer.baselines import RewardBaseline
    from sao.trainer.batch import all_rows, plan_batch, rank_loss
    from sao.trainer.distributed import rank, world_size
    from sao.trainer.engine import build_engine, memory_per_rank, shutdown

    torch.set_num_threads(1)
    # ZeRO-3 on every arm, one rank too (sao's one CPU rank otherwise runs without ZeRO): the baseline of the split.
    overrides = [f'policy.model="{model}"', "trainer.batch_size=4", f"trainer.offload_optimizer={str(offload).lower()}",
                 "trainer.deepspeed={ zero_optimization = { stage = 3 } }"]
    config = load_config(overrides=overrides, environ={})
    engine = build_engine(build_policy(config.policy, 384), config.trainer)
    rng = np.random.default_rng(0)
    batch = [Trajectory(f"t{i}#0", f"t{i}", "arithmetic", "bench", 0, rng.integers(3, 49152, 40).astype(np.int32),
                        [Step(rng.integers(3, 49152, 6).astype(np.int32), rng.integers(3, 49152, 16).astype(np.int32),
                              np.full(16, -2.0, np.float32), (i + 1) / 4, True, 0)],
                        Memory.empty(384), 1.0, "bench", 0) for i in range(4)]
    plan = plan_batch(batch, RewardBaseline(), config.trainer, 0)
    step_s, losses = [], []
    for _ in range(steps):
        started = time.perf_counter()
        rows = all_rows(plan, list(range(4))[rank()::world_size()])
        loss, _ = rank_loss(engine, plan, rows, 4 / world_size(), config.trainer, 384)
        engine.backward(loss)
        engine.step()
        step_s.append(time.perf_counter() - started)
        losses.append(float(loss.detach()))
    report = {**memory_per_rank(engine), "devices": _devices(engine), "rank": rank(), "world_size": world_size(),
              "offload_optimizer": offload, "step_s": step_s, "losses": losses,
              # What the ZeRO-3 optimizer does, not what was asked: the config reached DeepSpeed.
              "offload_active": bool(getattr(engine.optimizer, "offload_optimizer", False)),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    (out / f"rank{rank()}.json").write_text(json.dumps(report))
    shutdown()


def run(model: str, ranks: int, offload: bool, steps: int) -> list[dict]:
    out = Path(tempfile.mkdtemp())
    from sao.transport.broker import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", str(free_port()), __file__, "--worker", "--model", model, "--out", str(out),
               "--steps", str(steps)] + (["--offload"] if offload else [])
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"{ranks} rank(s), offload {offload}: torchrun failed ({completed.returncode}):\n"
                         f"{completed.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def summarise(name: str, ranks: list[dict]) -> dict:
    """One arm: the max over ranks of each figure (the rank that bounds the machine), its step time and devices."""
    figures = {key: max(r[key] for r in ranks) for key in (*MEMORY_KEYS, "peak_rss_bytes")}
    # Accelerator bytes: what offload is for; 0 on a CPU-only machine, where everything lives on the CPU.
    figures["accelerator_bytes"] = max(sum(r[key] for key in MEMORY_KEYS if r["devices"][key] not in ("cpu", "-"))
                                       for r in ranks)
    timed = [r["step_s"][1:] or r["step_s"] for r in ranks]  # the first step allocates the optimizer state
    return {"arm": name, "ranks": len(ranks), "offload_optimizer": ranks[0]["offload_optimizer"],
            "offload_active": all(r["offload_active"] for r in ranks), **figures,
            "param_and_optimizer_bytes": figures["param_bytes"] + figures["optimizer_state_bytes"],
            "devices": ranks[0]["devices"], "step_s": max(statistics.fmean(t) for t in timed),
            "losses": ranks[0]["losses"], "per_rank": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="policy.model (tiny for a quick check)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the sharded arms")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per arm; the first is not timed")
    parser.add_argument("--no-offload", dest="offload", action="store_false", help="skip the CPU optimizer offload arm")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--offload", dest="worker_offload", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.worker_offload, args.steps, args.out)
        return
    from rich.console import Console
    from rich.table import Table

    arms = [summarise("1 rank", run(args.model, 1, False, args.steps)),
            summarise(f"{args.ranks} ranks", run(args.model, args.ranks, False, args.steps))]
    if args.offload:
        arms.append(summarise(f"{args.ranks} ranks, optimizer offload", run(args.model, args.ranks, True, args.steps)))
    baseline, sharded = arms[0], arms[1]
    table = Table(title=f"ZeRO-3 per rank (max over ranks), {args.model}, {args.steps} steps")
    table.add_column("figure")
    for arm in arms:
        table.add_column(arm["arm"], justify="right")
    table.add_column(f"{args.ranks} ranks / 1 rank", justify="right")
    for key in (*MEMORY_KEYS, "peak_rss_bytes", "accelerator_bytes"):
        ratio = f"{sharded[key] / baseline[key]:.3f}" if baseline[key] else "-"  # no accelerator: nothing on it
        table.add_row(f"{key} (MiB)", *(f"{arm[key] / 2**20:.1f}" for arm in arms), ratio)
    table.add_row("optimizer state lives on", *(arm["devices"]["optimizer_state_bytes"] for arm in arms), "")
    table.add_row("step s (mean after the first)", *(f"{arm['step_s']:.3f}" for arm in arms),
                  f"{sharded['step_s'] / baseline['step_s']:.3f}")
    Console().print(table)
    headline = {"metric": "param+optimizer bytes per rank", "unit": "bytes",
                "value": sharded["param_and_optimizer_bytes"], "baseline": baseline["param_and_optimizer_bytes"]}
    headline["ratio"] = headline["value"] / headline["baseline"]
    ratios = {key: sharded[key] / baseline[key] for key in ("param_bytes", "optimizer_state_bytes")}
    print(f"param ratio {ratios['param_bytes']:.3f}, optimizer ratio {ratios['optimizer_state_bytes']:.3f} "
          f"(ideal {1 / args.ranks:.3f})")
    result = {"headline": headline, "model": args.model, "ranks": args.ranks, "steps": args.steps, "arms": arms,
              "figures": {key: {"one_rank": baseline[key], "n_ranks_max": sharded[key],
                                "ratio": sharded[key] / baseline[key]}
                          for key in (*MEMORY_KEYS, "peak_rss_bytes")}}
    if args.offload:
        offloaded = arms[2]
        result["offload"] = {"step_s_ratio": offloaded["step_s"] / sharded["step_s"],
                             "accelerator_bytes": offloaded["accelerator_bytes"],
                             "accelerator_bytes_without": sharded["accelerator_bytes"],
                             # Offload changes where the step runs, not what it computes.
                             "loss_max_abs_diff": max(abs(a - b) for a, b in zip(offloaded["losses"],
                                                                                  sharded["losses"]))}
        print(f"optimizer offload at {args.ranks} ranks: step {result['offload']['step_s_ratio']:.2f}x the step "
              f"without, accelerator bytes {offloaded['accelerator_bytes'] / 2**20:.1f} MiB "
              f"(without: {sharded['accelerator_bytes'] / 2**20:.1f} MiB)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
