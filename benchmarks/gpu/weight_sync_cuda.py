"""Weight sync into a GPU sampler: bf16 deltas applied in place to a CUDA bf16 policy, bit-exact, timed.

    python benchmarks/gpu/weight_sync_cuda.py [--versions 8] [--lr 1.5e-5] [--snapshot-every 10] [--json PATH]

A GPU sampler holds the policy in bf16 (`place_for_sampling`), so with `trainer.publish_dtype =
"bf16"` it holds exactly what the trainer publishes. This builds a policy of SmolLM2-135M's
shapes with random weights (no model files needed), plays a trainer that moves its fp32 weights by
about one AdamW step per version (each value by +-lr), and publishes every version twice through
`PolicyPublisher.write_version`: fp32 whole (the folder default before bf16 deltas) and bf16 deltas
(a snapshot first). A `WeightSync` per arm applies each version into its own CUDA bf16 policy.
Checked after every version: the delta arm's model equals the trainer's bf16 cast bit for bit, and
so does the fp32 arm's (the GPU casts what it loads). Printed per arm: median publish and apply
seconds over the versions after the first, file bytes, and the share of bf16 values that changed.
Random weights are not trained ones, so the changed share is the step's, not the default run's.
Needs a CUDA GPU; the embedded broker and DeepSpeed are not used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sao.policy.model import MemoryPolicy
from sao.policy.weights import place_for_sampling, unique_state_dict
from sao.run_dir import RunDir
from sao.sampler.weight_sync import WeightSync
from sao.trainer.publisher import PolicyPublisher

# SmolLM2-135M-Instruct's architecture (its config.json), for realistic tensor shapes and sizes.
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                    tie_word_embeddings=True, rms_norm_eps=1e-5)
MEMORY_WIDTH = 384  # the MiniLM sentence encoder's width


def _synced(action, *args):
    torch.cuda.synchronize()
    started = time.perf_counter()
    result = action(*args)
    torch.cuda.synchronize()
    return result, time.perf_counter() - started


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def measure(versions: int, lr: float, snapshot_every: int, folder: Path) -> dict:
    torch.manual_seed(0)
    trainer = MemoryPolicy(LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)), MEMORY_WIDTH)
    with torch.no_grad():  # a projector that is not all zeros, as after alignment
        trainer.projector.weight.normal_(0, 0.02)
    state = unique_state_dict(trainer.state_dict())  # fp32 CPU master weights
    arms = {"fp32_whole": ("fp32", False), "bf16_delta": ("bf16", True)}
    publishers = {arm: PolicyPublisher(None, "unused", RunDir(folder / arm), keep_versions=3, publish_dtype=dtype,
                                       deltas=deltas, snapshot_every=snapshot_every)
                  for arm, (dtype, deltas) in arms.items()}
    samplers = {arm: WeightSync(place_for_sampling(MemoryPolicy(LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)),
                                                                MEMORY_WIDTH), "cuda")) for arm in arms}
    rows = {arm: [] for arm in arms}
    changed_shares = []
    generator = torch.Generator().manual_seed(1)
    for version in range(1, versions + 1):
        if version > 1:
            before = {name: tensor.bfloat16() for name, tensor in state.items()}
            for tensor in state.values():  # an AdamW-sized step: each value moves by about lr
                tensor.add_(torch.randn(tensor.shape, generator=generator).sign_() * lr)
            changed = sum(int((_bits(before[n]) != _bits(t.bfloat16())).sum()) for n, t in state.items())
            changed_shares.append(changed / sum(t.numel() for t in state.values()))
        expected = {name: tensor.bfloat16() for name, tensor in state.items()}
        for arm in arms:
            publisher, sampler = publishers[arm], samplers[arm]
            announcement, publish_s = _synced(publisher.write_version, state, version, version)
            _, apply_s = _synced(sampler.apply, announcement, Path(announcement.weights_path))
            model = sampler.policy.state_dict()
            exact = all(torch.equal(_bits(model[name].cpu()), _bits(tensor)) for name, tensor in expected.items())
            rows[arm].append({"version": version, "kind": announcement.kind, "bytes": announcement.num_bytes,
                              "publish_s": publish_s, "apply_s": apply_s, "bit_exact": exact})
    summary = {"device": torch.cuda.get_device_name(), "versions": versions, "lr": lr,
               "bf16_changed_share_median": statistics.median(changed_shares) if changed_shares else None}
    for arm, arm_rows in rows.items():
        later = arm_rows[1:]  # the first version is a snapshot in both arms
        summary[arm] = {"publish_s_median": statistics.median(r["publish_s"] for r in later),
                        "apply_s_median": statistics.median(r["apply_s"] for r in later),
                        "bytes_median": statistics.median(r["bytes"] for r in later),
                        "kinds": sorted({r["kind"] for r in later}),
                        "all_bit_exact": all(r["bit_exact"] for r in arm_rows), "per_version": arm_rows}
    fp32, delta = summary["fp32_whole"], summary["bf16_delta"]
    summary["sync_ratio_bf16_delta_vs_fp32_whole"] = (
        (delta["publish_s_median"] + delta["apply_s_median"]) / (fp32["publish_s_median"] + fp32["apply_s_median"]))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1.5e-5)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as folder:
        result = measure(args.versions, args.lr, args.snapshot_every, Path(folder))
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text)
    sys.stdout.write(text + "\n")
    if not (result["fp32_whole"]["all_bit_exact"] and result["bf16_delta"]["all_bit_exact"]):
        raise SystemExit("a sampler's model is not the trainer's bf16 cast")


if __name__ == "__main__":
    main()
