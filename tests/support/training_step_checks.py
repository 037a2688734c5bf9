"""Run in its own process (DeepSpeed's process group must not live in pytest's): two engines on the tiny
model (one rank: without ZeRO unless the table asks for it, as offload does), one fed batches with a
faulty trajectory, one fed the same batches without it.

Prints one JSON object of findings for tests/trainer/test_training_step.py to assert on.
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sao.config import load_config
from sao.policy.weights import build_policy
from sao.trainer.baselines import RewardBaseline
from sao.trainer.batch import micro_batches, plan_batch
from sao.trainer.engine import batch_layout, build_engine, gather_full_state, shutdown
from sao.trainer.training_step import train_step
from support.trainer_runs import synthetic_trajectory


def main() -> None:
    # argv[1]: the [trainer] deepspeed table, as TOML (e.g. gradient accumulation, CPU offload).
    deepspeed = sys.argv[1] if len(sys.argv) > 1 else "{}"
    # A small token budget: a batch takes several passes, so a stop can come between two of them.
    cfg = load_config(overrides=['policy.model="tiny"', f"trainer.deepspeed={deepspeed}",
                                 "trainer.micro_batch_tokens=64"], environ={})
    accumulation = batch_layout(cfg.trainer, 1)[1]
    rng = np.random.default_rng(1)
    good = [synthetic_trajectory(i, rng) for i in range(8)]
    unscorable = replace(good[0], trajectory_id="bad#0", prompt_ids=np.array([10**6, 5], np.int32))
    poisoned = replace(good[0], trajectory_id="poison#0", steps=[replace(s, reward=1e39) for s in good[0].steps])

    def step(engine, batch, stop_requested=lambda: False):
        plan = plan_batch(batch, RewardBaseline(), cfg.trainer, 0)
        return train_step(engine, plan, lambda kept: plan_batch(kept, RewardBaseline(), cfg.trainer, 0), cfg.trainer,
                          384, accumulation, stop_requested)

    def snapshot(engine):
        weights = gather_full_state(engine)
        optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer).state  # ZeRO's wraps torch's
        moments = {f"{i}.{name}": tensor.clone() for i, state in enumerate(optimizer.values())
                   for name, tensor in state.items() if torch.is_tensor(tensor)}
        return weights, moments

    def identical(a, b) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    faulty, clean = (build_engine(build_policy(cfg.policy, 384), cfg.trainer) for _ in range(2))
    findings = {}
    # 1. A trajectory that raises: dead-lettered, and the rest trains exactly as if it had never come.
    outcome = step(faulty, [good[0], unscorable, good[1]])
    step(clean, [good[0], good[1]])
    findings["dead_lettered_unscorable"] = [(t.trajectory_id, reason) for t, reason, _ in outcome.dead_letters]
    findings["unscorable_detail"] = outcome.dead_letters[0][2] if outcome.dead_letters else ""
    findings["applied_without_it"] = outcome.applied and [t.trajectory_id for t in outcome.plan.trajectories]
    after_first = snapshot(faulty)
    findings["same_as_clean_after_unscorable"] = identical(after_first[0], snapshot(clean)[0])
    # 2. A batch whose loss is not finite: skipped, nothing moves (weights, Adam moments).
    outcome = step(faulty, [good[2], poisoned, good[3]])
    findings["skipped_reason"] = outcome.skipped_reason
    findings["dead_lettered_poisoned"] = sorted((t.trajectory_id, reason) for t, reason, _ in outcome.dead_letters)
    after_skip = snapshot(faulty)
    findings["weights_unchanged_by_skip"] = identical(after_first[0], after_skip[0])
    findings["moments_unchanged_by_skip"] = identical(after_first[1], after_skip[1])
    # 3. ... and leaves no trace: the next step is the clean engine's next step, bit for bit.
    step(faulty, good[4:8])
    step(clean, good[4:8])
    final = snapshot(faulty)[0]
    findings["same_as_clean_after_skip"] = identical(final, snapshot(clean)[0])
    findings["final_finite"] = all(bool(torch.isfinite(t).all()) for t in final.values())
    findings["moved_since_skip"] = not identical(final, after_skip[0])
    # 4. A stop between two passes abandons the step: nothing moves, and the batch trains later
    #    exactly as if the abandoned step had never begun.
    plan = plan_batch(good[:4], RewardBaseline(), cfg.trainer, 0)
    findings["passes"] = len(micro_batches(plan, list(range(4)), cfg.trainer.micro_batch_tokens, False))
    asked = []
    outcome = step(faulty, good[:4], stop_requested=lambda: asked.append(1) or True)
    findings["interrupted"] = outcome.interrupted and not outcome.applied
    findings["passes_before_stop"] = len(asked)
    findings["weights_unchanged_by_stop"] = identical(final, snapshot(faulty)[0])
    step(faulty, good[:4])
    step(clean, good[:4])
    findings["same_as_clean_after_stop"] = identical(snapshot(faulty)[0], snapshot(clean)[0])
    shutdown()
    print("FINDINGS " + json.dumps(findings))


if __name__ == "__main__":
    main()
