"""Weight sync: bytes per version and encode/apply time for fp32 whole, bf16 whole and bf16 sparse deltas.

    python benchmarks/weight_sync.py BASE.safetensors NEXT.safetensors [--json PATH]

Takes two consecutive published versions (RUN_DIR/policy/policy-vN.safetensors, fp32, as a default
run writes them) and publishes them the way `trainer.publish_dtype` and `trainer.publish_deltas`
would (sao/policy/deltas.py): the bf16 snapshot of NEXT, and the bf16 delta from BASE to NEXT. The
delta is then checked and applied as a sampler does (sao/sampler/weight_sync.py's steps, on a held
bf16 state: read_delta, apply_changes, state_sha256), and the result is compared bit for bit with
NEXT's bf16 cast. Reported: file bytes, the share of bf16 values that changed, what zlib (level 1)
would save on the delta, and the times of each step. Nothing is asserted but the bit-exact result.

`--sync-repeats N` also times the whole sync of NEXT, trainer file to sampler model, for fp32
whole (the folder default before bf16 deltas), bf16 whole and bf16 delta, and a LoRA run's
version (rank 16 on every linear layer: two adapter states of that size with random values, as
a LoRA trainer publishes them, merged into the sampler's plain model): the trainer's
`PolicyPublisher.write_version` (cast, write, hash; for the delta also the compare and the
state hash) and the sampler's `WeightSync.apply` into the real policy (read, verify, load or
apply in place, and for the delta the result-state hash). BASE is published and loaded first,
untimed, as the version the sampler holds. Arms alternate, N rounds; the median and range of
each arm and its ratio to fp32 whole are printed. The ZeRO-3 gather before a publish and the
announcement's trip through Kafka are the same for every arm and left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from sao.policy.deltas import apply_changes, cast_state, read_delta, state_sha256, write_delta
from sao.policy.weights import write_weights
from sao.run_dir import RunDir
from sao.sampler.weight_sync import WeightSync
from sao.trainer.publisher import PolicyPublisher

LORA_ARM = "lora_r16"  # trainer.lora.rank = 16 on all linear layers, published as a LoRA run publishes
LORA_RANK = 16
# Each arm's publish dtype and whether it publishes deltas.
ARMS = {"fp32_whole": ("fp32", False), "bf16_whole": ("bf16", False), "bf16_delta": ("bf16", True),
        LORA_ARM: ("bf16", True)}


def _timed(action):
    started = time.perf_counter()
    result = action()
    return result, time.perf_counter() - started


def measure(base_path: Path, next_path: Path) -> dict:
    base, upcoming = load_file(str(base_path)), load_file(str(next_path))
    (base_bf16, next_bf16), cast_s = _timed(lambda: (cast_state(base, torch.bfloat16),
                                                     cast_state(upcoming, torch.bfloat16)))
    changed = sum(int((base_bf16[n].view(torch.int16) != next_bf16[n].view(torch.int16)).sum()) for n in next_bf16)
    total = sum(t.numel() for t in next_bf16.values())
    with tempfile.TemporaryDirectory() as folder:
        snapshot, delta = Path(folder) / "snapshot.safetensors", Path(folder) / "delta.safetensors"
        _, snapshot_s = _timed(lambda: write_weights(next_bf16, snapshot))
        (delta_sha256, _), encode_s = _timed(lambda: (write_delta(base_bf16, next_bf16, delta), None))
        result_sha256, hash_s = _timed(lambda: state_sha256(next_bf16))
        delta_bytes = delta.read_bytes()
        compressed = len(zlib.compress(delta_bytes, 1))
        held = {name: tensor.clone() for name, tensor in base_bf16.items()}
        changes, read_s = _timed(lambda: read_delta(delta, delta_sha256, held, num_bytes=len(delta_bytes)))
        _, apply_s = _timed(lambda: apply_changes(held, changes))
        check, check_s = _timed(lambda: state_sha256(held))
        return {
            "fp32_snapshot_bytes": next_path.stat().st_size,
            "bf16_snapshot_bytes": snapshot.stat().st_size,
            "bf16_delta_bytes": len(delta_bytes),
            "bf16_delta_zlib1_bytes": compressed,
            "bf16_values": total,
            "bf16_changed_share": changed / total,
            "bit_exact": check == result_sha256 and all(
                torch.equal(held[n].view(torch.int16), next_bf16[n].view(torch.int16)) for n in held),
            "seconds": {"cast_both": cast_s, "write_bf16_snapshot": snapshot_s, "encode_and_write_delta": encode_s,
                        "state_sha256": hash_s, "sampler_read_and_check_delta": read_s, "sampler_apply": apply_s,
                        "sampler_state_sha256": check_s},
        }


def sync_once(arm: str, base: dict, upcoming: dict, policy, folder: Path) -> dict:
    """One sync of `upcoming` in `arm`, after `base` was published and loaded: trainer and sampler seconds."""
    dtype, deltas = ARMS[arm]
    publisher = PolicyPublisher(None, "unused", RunDir(folder), keep_versions=3, publish_dtype=dtype, deltas=deltas,
                                snapshot_every=10, lora=arm == LORA_ARM)
    sampler = WeightSync(policy)
    first = publisher.write_version(base, 1, trainer_step=1)
    sampler.apply(first, Path(first.weights_path))
    announcement, publish_s = _timed(lambda: publisher.write_version(upcoming, 2, trainer_step=2))
    _, apply_s = _timed(lambda: sampler.apply(announcement, Path(announcement.weights_path)))
    return {"kind": announcement.kind, "bytes": announcement.num_bytes, "publish_s": publish_s, "apply_s": apply_s,
            "sync_s": publish_s + apply_s}


def measure_sync(base: dict, upcoming: dict, repeats: int) -> dict:
    """Every arm `repeats` times, alternated, into the default config's policy on the CPU, as a sampler holds it."""
    from sao.config import load_config
    from sao.policy.recipe import PolicyRecipe
    from sao.policy.weights import build_policy, place_for_sampling

    config = load_config(overrides=[], environ={})
    width = PolicyRecipe.from_config(config).memory_width
    policy = place_for_sampling(build_policy(config.policy, width), "cpu")
    # Every arm syncs BASE -> NEXT into the plain policy but the LoRA arm, which syncs adapter states.
    versions = {arm: (base, upcoming, policy) for arm in ARMS}
    versions[LORA_ARM] = _lora_versions(config, width)
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for _ in range(repeats):
        for arm in ARMS:
            arm_base, arm_next, arm_policy = versions[arm]
            with tempfile.TemporaryDirectory() as folder:
                rounds[arm].append(sync_once(arm, arm_base, arm_next, arm_policy, Path(folder)))
    summary = {}
    for arm, runs in rounds.items():
        summary[arm] = {key: statistics.median(run[key] for run in runs) for key in ("publish_s", "apply_s", "sync_s")}
        summary[arm].update(bytes=runs[0]["bytes"], sync_s_min=min(r["sync_s"] for r in runs),
                            sync_s_max=max(r["sync_s"] for r in runs), n=len(runs))
    for arm in ARMS:
        summary[arm]["sync_vs_fp32_whole"] = summary[arm]["sync_s"] / summary["fp32_whole"]["sync_s"]
    return summary


def _lora_versions(config, width: int) -> tuple:
    """Two consecutive adapter states (with the projector) as a LoRA trainer publishes them, and a sampler's plain
    policy set to merge rank-16 adapters. The states hold random values of a trained adapter's size, every value
    moved by the next step (Adam moves them all), so a bf16 delta is no smaller than the whole file and goes whole."""
    from sao.config import LoraConfig
    from sao.policy.lora import add_lora, attach_adapter_merge, trainable_state
    from sao.policy.weights import build_policy, place_for_sampling, unique_state_dict

    lora = LoraConfig(rank=LORA_RANK)
    trainer_side = build_policy(config.policy, width)
    add_lora(trainer_side, lora)
    generator = torch.Generator().manual_seed(0)
    base = {name: 0.02 * torch.randn(t.shape, generator=generator)
            for name, t in unique_state_dict(trainable_state(trainer_side)).items()}
    upcoming = {name: t + 1e-3 * torch.randn(t.shape, generator=generator) for name, t in base.items()}
    del trainer_side
    sampler_policy = attach_adapter_merge(place_for_sampling(build_policy(config.policy, width), "cpu"), lora)
    return base, upcoming, sampler_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("next", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sync-repeats", type=int, default=0, help="rounds of the whole-sync timing (0: skip)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.base, args.next)
    if args.sync_repeats:
        result["sync"] = measure_sync(load_file(str(args.base)), load_file(str(args.next)), args.sync_repeats)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
