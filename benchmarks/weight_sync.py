"""Weight sync: bytes per version and encode/apply time for fp32 whole, bf16 whole and bf16 sparse deltas.

    python benchmarks/weight_sync.py BASE.safetensors NEXT.safetensors [--json PATH]

Takes two consecutive published versions (RUN_DIR/policy/policy-vN.safetensors, fp32, as a default
run writes them) and publishes them the way `trainer.publish_dtype` and `trainer.publish_deltas`
would (sao/policy/deltas.py): the bf16 snapshot of NEXT, and the bf16 delta from BASE to NEXT. The
delta is then checked and applied as a sampler does (sao/sampler/weight_sync.py's steps, on a held
bf16 state: read_delta, apply_changes, state_sha256), and the result is compared bit for bit with
NEXT's bf16 cast. Reported: file bytes, the share of bf16 values that changed, what zlib (level 1)
would save on the delta, and the times of each step. No model is loaded; nothing is asserted but
the bit-exact result.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from sao.policy.deltas import apply_changes, cast_state, read_delta, state_sha256, write_delta
from sao.policy.weights import write_weights


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("next", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.base, args.next)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
