"""Held-out scoring speed: sao's scorer against a plain batched transformers generate of the same questions.

    python benchmarks/heldout_speed.py [--tasks 80] [--threads 2] [--repeats 2] [--json PATH]

Both arms answer the first `--tasks` held-out questions once (first try), greedily, with the same
model, chat prompts, token budget and stop tokens, in one batch. The baseline is
`model.generate` on the left-padded prompts; sao's arm is the scorer `sao run` ends with
(`Scorer.score`: env reset and scoring, online compression, `MemoryPolicy.sample_batch`). The
arms alternate `--repeats` times in one process; the ratio is sao's seconds over the baseline's,
each taken at its fastest repeat. Also printed: how many questions each arm got right (greedy
decoding with the same weights should agree up to ties).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def plain_generate(scorer, tasks, max_new_tokens: int) -> tuple[float, int]:
    """Seconds and right answers of one batched greedy `generate` over the tasks' first prompts."""
    import numpy as np
    import torch

    from sao.envs.registry import make_env

    roller = scorer.roller
    env = make_env(scorer.config.env)
    prompts, specs = [], []
    for task in tasks:
        text = env.reset(task.spec)
        prompts.append(list(roller.chat.prompt(text)) + list(roller.chat.first_observation(text)))
        specs.append(task.spec)
    started = time.perf_counter()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    lm = scorer.policy.lm
    with torch.no_grad():
        out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=sorted(roller.chat.stop.token_ids), pad_token_id=pad)
    seconds = time.perf_counter() - started
    right, stops = 0, roller.chat.stop.token_ids
    for spec, row in zip(specs, out[:, width:].tolist()):
        end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))  # padding after the stop
        env.reset(spec)
        right += env.step(roller.chat.action_text(np.asarray(row[:end]))).reward >= 1.0
    return seconds, right


def sao_scorer(scorer, tasks) -> tuple[float, int]:
    started = time.perf_counter()
    scores, _ = scorer.score(0, tasks)
    return time.perf_counter() - started, int(sum(s["first_try"] for s in scores.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=80)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from sao.config import load_config
    from sao.envs.registry import generation_settings
    from sao.sampler.evaluation import Scorer, heldout_tasks

    config = load_config(overrides=[f'policy.model="{args.model}"', "env.max_turns=1"], environ={})
    tasks = heldout_tasks(config, args.tasks)
    scorer = Scorer(config, Path("runs/heldout-speed"), threads=args.threads, slots=len(tasks))
    max_new_tokens = generation_settings(config).max_new_tokens
    runs: dict[str, list[tuple[float, int]]] = {"plain": [], "sao": []}
    for _ in range(args.repeats):
        runs["plain"].append(plain_generate(scorer, tasks, max_new_tokens))
        runs["sao"].append(sao_scorer(scorer, tasks))
    best = {arm: min(seconds for seconds, _ in results) for arm, results in runs.items()}
    ratio = best["sao"] / best["plain"]
    table = Table(title=f"greedy first try on {len(tasks)} held-out questions, one batch, {args.threads} threads")
    for column in ("arm", "seconds per repeat", "fastest", "right"):
        table.add_column(column, justify="right")
    for arm, results in runs.items():
        table.add_row(arm, ", ".join(f"{s:.1f}" for s, _ in results), f"{best[arm]:.1f}", str(results[-1][1]))
    console = Console()
    console.print(table)
    console.print(f"sao / plain generate: {ratio:.2f}x the time")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "headline": {"metric": "held-out scoring time, sao scorer / plain batched generate", "unit": "seconds",
                         "value": best["sao"], "baseline": best["plain"], "ratio": ratio},
            "tasks": len(tasks), "threads": args.threads, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
