"""The trainer's step against a bare PyTorch loop on the same batch, same model, same loss.

    python benchmarks/trainer_step.py [--model smollm2-135m-instruct] [--steps 5] [--threads N]
                                      [--set trainer.KNOB=VALUE ...] [--json PATH]

One process, one rank. The batch looks like a default run's: 8 arithmetic trajectories, most of
them two turns (a wrong first answer gets feedback and a retry), so ~15 rows of 50-100 tokens.
Three arms take turns, round after round (the order rotates, so none always runs first):
- sao: the real step (`sao.trainer.training_step.train_step`: the DeepSpeed engine a run builds, which
  on one CPU rank runs without ZeRO; its loss, its length buckets, clipping and AdamW);
- bare_by_hand: what one writes by hand: one row per turn, right-padded into one batch, the same
  loss (`rank_loss`), `loss.backward()`, `clip_grad_norm_`, `torch.optim.AdamW` with its defaults;
- bare_matched: the same bare loop with sao's rows (a first try scored inside its retry's row,
  `sao.trainer.batch.sequences`), length buckets and AdamW kernel (`trainer.length_buckets`,
  `trainer.fused_adamw`), so the headline compares engines, not rows, padding or optimizer
  kernels; the by-hand ratio is reported beside it.
The first round is a warm-up and is not timed; each arm's median step seconds is reported, with
its CPU seconds (robust when other work shares the cores) split into forward+backward and
optimizer. The bare arms share one module and optimizer: its weights are sao's at the start,
which is all the first-step loss check (sao vs bare, same maths) needs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MEMORY_WIDTH = 384  # the default encoder's width; these rows carry no memory


def realistic_batch(seed: int = 0, trajectories: int = 8):
    """Trajectories shaped like the default run's (token ids random, lengths as measured there).

    Prompt (system prompt + chat template + question) ~40-50 tokens; first answer 6-24 tokens;
    seven in eight answers are wrong and get a ~12-token feedback turn and a 6-20-token retry.
    """
    import numpy as np

    from sao.schema import Memory, Step, Trajectory

    rng = np.random.default_rng(seed)

    def tokens(low: int, high: int) -> np.ndarray:
        return rng.integers(3, 49152, int(rng.integers(low, high + 1))).astype(np.int32)

    def step(observation: np.ndarray, action: np.ndarray, reward: float, done: bool) -> Step:
        return Step(observation, action, rng.normal(-1.5, 0.8, len(action)).clip(max=-0.01).astype(np.float32),
                    reward, done, 0)

    batch = []
    for index in range(trajectories):
        steps = [step(tokens(3, 6), tokens(6, 24), 0.0, False)]
        if index % 8 != 0:  # a wrong first answer: feedback and a second try
            steps.append(step(tokens(10, 14), tokens(6, 20), float(rng.random() < 0.3), True))
        else:
            steps[0] = step(steps[0].observation_ids, steps[0].action_ids, 1.0, True)
        batch.append(Trajectory(f"bench-{index}#0", f"bench-{index}", "arithmetic", "bench", 0, tokens(40, 50), steps,
                                Memory.empty(MEMORY_WIDTH), 1.0, "bench", 1))
    return batch


class BareEngine:
    """What a hand-written loop does: the module, loss.backward(), clip_grad_norm_, AdamW, zero_grad."""

    def __init__(self, module, trainer_config):
        import torch

        self.module, self.cfg, self.device = module, trainer_config, torch.device("cpu")
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=trainer_config.learning_rate,
                                           weight_decay=trainer_config.weight_decay)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self, plan, cfg, fused: bool) -> tuple[float, float, float]:
        """(loss, forward+backward seconds, optimizer seconds) of one step on the whole plan.

        `fused` picks AdamW's kernel for this step (AdamW reads it from the group at every step):
        one optimizer state serves both bare arms, which keeps the benchmark within memory.
        """
        import torch

        from sao.trainer.batch import all_rows, rank_loss

        self.optimizer.param_groups[0]["fused"] = fused or None
        self.optimizer.param_groups[0]["foreach"] = None
        started = time.perf_counter()
        count = len(plan.trajectories)
        loss, _ = rank_loss(self, plan, all_rows(plan, list(range(count))), count, cfg, MEMORY_WIDTH)
        loss.backward()
        middle = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), middle - started, time.perf_counter() - middle


def padding_share(plan, max_buckets: int) -> dict[str, float]:
    """Rows and real positions, a row per turn and as sao scores them; the share of sao's computed positions
    that are padding, padded vs bucketed."""
    from sao.trainer.batch import all_rows, length_buckets, plan_rows

    def lengths_of(plan) -> list[int]:
        return [plan_rows(plan, index)[turns[-1]].positions for index, turns in all_rows(plan, range(len(plan.trajectories)))]

    per_turn, lengths = lengths_of(replace(plan, merge_turns=False)), lengths_of(plan)
    real = sum(lengths)
    padded = len(lengths) * max(lengths)
    bucketed = sum(len(b) * max(lengths[r] for r in b) for b in length_buckets(lengths, max_buckets))
    return {"rows_per_turn": len(per_turn), "positions_per_turn": sum(per_turn), "rows": len(lengths), "positions": real,
            "buckets": len(length_buckets(lengths, max_buckets)),
            "padding_share_padded": 1 - real / padded, "padding_share_bucketed": 1 - real / bucketed}


def measure(model: str, steps: int, threads: int | None, overrides: list[str], trajectories: int = 8) -> dict:
    import torch

    from sao.config import load_config
    from sao.policy.weights import build_policy
    from sao.trainer.baselines import RewardBaseline
    from sao.trainer.batch import plan_batch
    from sao.trainer.engine import (
        batch_layout,
        build_engine,
        cpu_autocast,
        deepspeed_config,
        resolved_precision,
        shutdown,
    )
    from sao.trainer.training_step import train_step

    config = load_config(overrides=[f'policy.model="{model}"', *overrides], environ={})
    cfg = config.trainer
    torch.set_num_threads(threads if threads is not None else cfg.threads())
    padded_cfg = cfg.model_copy(update={"length_buckets": 1})
    # Both arms compute in the precision a run's trainer would (trainer.precision): engines are compared, not dtypes.
    policies = [build_policy(config.policy, MEMORY_WIDTH) for _ in range(2)]
    for policy in policies:
        policy.cpu_autocast_bf16 = cpu_autocast(cfg)
    engine = build_engine(policies[0], cfg)
    bare = BareEngine(policies[1], cfg)
    accumulation = batch_layout(cfg, 1)[1]
    plan = plan_batch(realistic_batch(trajectories=trajectories), RewardBaseline(), cfg, 0)

    def sao_step() -> tuple[float, float, float]:
        outcome = train_step(engine, plan, lambda kept: plan_batch(kept, RewardBaseline(), cfg, 0), cfg, MEMORY_WIDTH,
                             accumulation)
        if not outcome.applied:
            raise RuntimeError(f"sao's step was not applied ({outcome.skipped_reason}): nothing to time")
        return outcome.stats.loss, outcome.forward_backward_s, outcome.optimizer_s

    # By hand: a row per turn in one padded batch, AdamW's default kernel. Matched: sao's rows, buckets and kernel.
    arms = {"sao": sao_step, "bare_by_hand": lambda: bare.step(replace(plan, merge_turns=False), padded_cfg, fused=False),
            "bare_matched": lambda: bare.step(plan, cfg, fused=cfg.fused_adamw)}
    names = list(arms)
    times: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    first_loss: dict[str, float] = {}
    for round_index in range(steps + 1):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            started, cpu_started = time.perf_counter(), time.process_time()
            loss, forward_backward_s, optimizer_s = arms[name]()
            total, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
            first_loss.setdefault(name, loss)
            if round_index:  # round 0 warms up allocators and DeepSpeed's fetch trace
                times[name].append({"step_s": total, "cpu_s": cpu_s, "forward_backward_s": forward_backward_s,
                                    "optimizer_s": optimizer_s})
    shutdown()
    medians = {name: {key: statistics.median(t[key] for t in runs) for key in runs[0]} for name, runs in times.items()}
    # Same weights, same rows, same loss: the first step's losses must agree (the engines differ, not the maths).
    first_loss["sao_minus_bare_abs"] = abs(first_loss["sao"] - first_loss["bare_by_hand"])
    return {"medians": medians, "runs": times, "first_loss": first_loss,
            "padding": padding_share(plan, cfg.length_buckets), "threads": torch.get_num_threads(),
            "length_buckets": cfg.length_buckets, "fused_adamw": cfg.fused_adamw, "precision": resolved_precision(cfg),
            "deepspeed_config": deepspeed_config(cfg, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (one step per arm each), after a warm-up")
    parser.add_argument("--trajectories", type=int, default=8, help="trajectories in the batch (a default run: 8)")
    parser.add_argument("--threads", type=int, help="torch threads (default: trainer.torch_threads)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, as `sao run --set` (e.g. trainer.length_buckets=1)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    from rich.console import Console
    from rich.table import Table

    from sao.trainer.engine import init_distributed

    init_distributed()
    result = measure(args.model, args.steps, args.threads, args.overrides, args.trajectories)
    medians, padding = result["medians"], result["padding"]
    table = Table(title=f"trainer step, {args.model}, {padding['rows']} rows / {padding['positions']} positions "
                        f"({padding['rows_per_turn']} / {padding['positions_per_turn']} a row per turn), "
                        f"{result['threads']} thread(s), {result['precision']}; median of {args.steps}")
    for column in ("arm", "step s", "CPU s", "forward+backward s", "optimizer s", "sao / arm (wall)",
                   "sao / arm (CPU)"):
        table.add_column(column, justify="right")
    for name, figures in medians.items():
        table.add_row(name, f"{figures['step_s']:.3f}", f"{figures['cpu_s']:.3f}", f"{figures['forward_backward_s']:.3f}",
                      f"{figures['optimizer_s']:.3f}", f"{medians['sao']['step_s'] / figures['step_s']:.3f}",
                      f"{medians['sao']['cpu_s'] / figures['cpu_s']:.3f}")
    Console().print(table)
    print(f"padding: {padding['padding_share_padded']:.1%} of computed positions padded in one batch, "
          f"{padding['padding_share_bucketed']:.1%} in {padding['buckets']} length bucket(s); first-step loss "
          f"sao - bare: {result['first_loss']['sao_minus_bare_abs']:.2e}")
    # The headline compares engines: the bare loop with sao's buckets and AdamW kernel (by hand: beside it).
    headline = {"metric": "trainer step seconds, sao / bare PyTorch (same rows, buckets, loss and AdamW)", "unit": "s",
                "value": medians["sao"]["step_s"], "baseline": medians["bare_matched"]["step_s"],
                "cpu_ratio": medians["sao"]["cpu_s"] / medians["bare_matched"]["cpu_s"],
                "ratio_to_by_hand": medians["sao"]["step_s"] / medians["bare_by_hand"]["step_s"]}
    headline["ratio"] = headline["value"] / headline["baseline"]
    print(f"headline: sao {headline['value']:.3f} s / bare (matched) {headline['baseline']:.3f} s = "
          f"{headline['ratio']:.3f} (CPU seconds: {headline['cpu_ratio']:.3f}; goal <= 1.1)")
    if args.json:
        args.json.write_text(json.dumps({"headline": headline, "model": args.model, "steps": args.steps,
                                         "trajectories": args.trajectories,
                                         "overrides": args.overrides, **result}, indent=2, default=str))


if __name__ == "__main__":
    main()
