"""Sampling engines on a CUDA machine: vLLM against sao's own loop, throughput and default runs.

    python benchmarks/gpu/engines_cuda.py [--tasks 32] [--rounds 3] [--seeds 0 1 2] [--json PATH]

The GPU half of issue 28's comparison, run where vLLM (`pip install -e '.[vllm]'`, which
`make install` picks when `nvidia-smi` exists) and a CUDA GPU are. Two parts, each the CPU
benchmark run with the sampler on the GPU (`sampler.device = "cuda"`: bf16 policy, vLLM with
`sampler.engine.kv_cache_gib` of KV cache):

1. `benchmarks/sampler_throughput.py --engines`: the same prompts generated and rolled out by
   each engine in alternated rounds, each round in a fresh process; tokens/s, trajectories/s,
   start-up and memory per engine, vllm / hf.
2. `benchmarks/learning.py` once per engine over `--seeds` (`--seeds` with no value skips it):
   the default run with `sampler.engine` the only change; held-out gain per seed (paired by task
   against its base), the kept version, and wall time, engine start-up and weight pushes included.

Prints both parts and writes them with `--json`; the headline is part 1's generation ratio.
Stops with a message where there is no CUDA GPU or no vLLM.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent
ENGINES = ("hf", "vllm")


def require_cuda_and_vllm() -> None:
    import torch

    from sao.policy.vllm_engine import vllm_installed

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: this script measures the engines on one (the CPU comparison is "
                         "`python benchmarks/sampler_throughput.py --engines`)")
    if not vllm_installed():
        raise SystemExit("vLLM is not installed: `pip install -e '.[vllm]'` (or `make install` on this machine)")


def run_json(command: list[str], json_path: Path) -> dict:
    """Run a benchmark with `--json json_path`, its own output shown as it goes; its JSON."""
    subprocess.run([sys.executable, *command, "--json", str(json_path)], check=True)
    return json.loads(json_path.read_text())


def throughput(tasks: int, rounds: int, gen_tokens: int, scratch: Path) -> dict:
    return run_json([str(BENCHMARKS / "sampler_throughput.py"), "--engines", "--tasks", str(tasks), "--batch",
                     str(tasks), "--rounds", str(rounds), "--gen-tokens", str(gen_tokens),
                     "--set", 'sampler.device="cuda"'], scratch / "throughput.json")


def default_runs(seeds: list[int], runs_dir: Path, scratch: Path) -> dict:
    """Per engine: learning.py's figures over `seeds`, one run at a time (each run has the GPU to itself)."""
    results = {}
    for engine in ENGINES:
        results[engine] = run_json([str(BENCHMARKS / "learning.py"), "--seeds", *map(str, seeds),
                                    "--runs-dir", str(runs_dir / engine), "--",
                                    "--set", 'sampler.device="cuda"', "--set", f'sampler.engine="{engine}"'],
                                   scratch / f"learning-{engine}.json")
    return results


def paired_by_seed(runs: dict) -> list[dict]:
    """Per seed both engines ran: gains, kept gains and wall time side by side, vllm - hf."""
    by_engine = {engine: {run["seed"]: run for run in runs[engine]["runs"]} for engine in ENGINES}
    rows = []
    for seed in sorted(set(by_engine["hf"]) & set(by_engine["vllm"])):
        hf, vllm = by_engine["hf"][seed], by_engine["vllm"][seed]
        rows.append({"seed": seed, **{f"{name}_{key}": run.get(key) for name, run in (("hf", hf), ("vllm", vllm))
                                      for key in ("heldout_gain", "heldout_kept_gain", "wall_s")},
                     "vllm_minus_hf": vllm["heldout_gain"] - hf["heldout_gain"]})
    return rows


def _signed(value: float | None) -> str:
    return "—" if value is None else f"{value:+.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=32, help="prompts generated at once (and rollout slots)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="default runs per engine")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/engines-cuda"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    require_cuda_and_vllm()
    from rich.console import Console
    from rich.table import Table

    console = Console()
    with tempfile.TemporaryDirectory(prefix="sao-engines-cuda-") as scratch:
        speed = throughput(args.tasks, args.rounds, args.gen_tokens, Path(scratch))
        runs = default_runs(args.seeds, args.runs_dir, Path(scratch)) if args.seeds else {}
    rows = paired_by_seed(runs) if runs else []
    if rows:
        table = Table(title="default runs on the GPU, sampler.engine the only change")
        for column in ("seed", "hf gain", "hf kept", "hf wall s", "vllm gain", "vllm kept", "vllm wall s", "vllm - hf"):
            table.add_column(column, justify="right")
        for row in rows:
            cells = [_signed(row[f"{engine}_{key}"]) if key != "wall_s" else f"{row[f'{engine}_wall_s']:.0f}"
                     for engine in ENGINES for key in ("heldout_gain", "heldout_kept_gain", "wall_s")]
            table.add_row(str(row["seed"]), *cells, _signed(row["vllm_minus_hf"]))
        console.print(table)
    headline = speed["headline"]
    console.print(f"generation on the GPU, vllm / hf: {headline['ratio']:.2f}x "
                  f"({headline['value']:.0f} vs {headline['baseline']:.0f} tokens/s); "
                  f"rollouts {speed['rollout_ratio']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"headline": headline, "throughput": speed, "default_runs": runs,
                                         "paired_by_seed": rows}, indent=2))


if __name__ == "__main__":
    main()
