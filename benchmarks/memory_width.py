"""How much can a narrower memory slot still say to the LM? The content check at several memory widths.

    python benchmarks/memory_width.py [--widths 384 64 16] [--updates 100] [--json PATH]

Memory slots of scripted episodes (training: seed 0; held out: seed 1) are squeezed to each width:
INT8 coordinates in the top principal directions of the training slots (`sao.compression.bottleneck`,
as `memory_fidelity.py --memory-width`, mapped back to the encoder's space). From the shipped aligned
projector, `--updates` reconstruction updates teach the soft token to say its step (the frozen LM
rewrites the step's text from
`"Earlier step:" | slot` alone), then the content check scores each held-out step's text under its
own slot vs another step's (`sao.offline.reconstruction.content_nll`): other - own, nats per token,
with n and its standard error. A slot costs width + 4 bytes on the wire. The encoder's full width is
the baseline; `ratio` = content at the narrowest width / content at the full width.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="policy.model (tiny for a quick check)")
    parser.add_argument("--widths", type=int, nargs="+", default=[384, 64, 16],
                        help="memory widths to measure, each with a basis fitted here on the training slots")
    parser.add_argument("--shipped", action="store_true",
                        help="also measure the basis shipped for the encoder (compression.bottleneck = auto)")
    parser.add_argument("--updates", type=int, default=100, help="reconstruction updates per width")
    parser.add_argument("--batch", type=int, default=12, help="slots per reconstruction update")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate of the projector")
    parser.add_argument("--labyrinth-episodes", type=int, default=10, help="training labyrinth episodes")
    parser.add_argument("--tutoring-episodes", type=int, default=2, help="training multi-turn arithmetic episodes")
    parser.add_argument("--max-steps", type=int, default=100, help="labyrinth step limit")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from sao.compression.bottleneck import fit_bottleneck, resolve_bottleneck, variance_kept
    from sao.compression.semantic import load_encoder
    from sao.compression.temporal import load_temporal_filter
    from sao.config import load_config
    from sao.offline.align import align_projector, labyrinth_corpus, prepare, tutoring_corpus
    from sao.offline.reconstruction import content_nll, slot_examples
    from sao.policy.loading import load_tokenizer
    from sao.policy.projector import apply_projector_setting
    from sao.policy.weights import build_policy

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    config = load_config(overrides=[f'policy.model="{args.model}"'], environ={})
    encoder = load_encoder(config.compression.encoder)
    bad = [w for w in args.widths if not 1 <= w <= encoder.dim]
    if bad:
        raise SystemExit(f"--widths: each must be between 1 and the encoder's width {encoder.dim} (got {bad})")
    temporal_filter = load_temporal_filter(config.compression.temporal_weights, config.compression.keep_threshold)
    window = config.compression.recent_window
    training = prepare(labyrinth_corpus(0, args.labyrinth_episodes, args.max_steps)
                       + tutoring_corpus(0, args.tutoring_episodes), config, encoder, temporal_filter, window)
    held_out = prepare(labyrinth_corpus(1, 2, args.max_steps) + tutoring_corpus(1, 1),
                       config, encoder, temporal_filter, window)
    tokenizer = load_tokenizer(config.policy.model, config.policy.cache_dir)
    train_slots, held_slots = slot_examples(training, tokenizer), slot_examples(held_out, tokenizer)
    fit = np.concatenate([x.memory for x in train_slots])
    policy = build_policy(config.policy, encoder.dim)
    projector_line = apply_projector_setting(policy.projector, "auto", config.policy.model, config.compression.encoder)
    start_state = {k: v.clone() for k, v in policy.projector.state_dict().items()}
    console = Console()
    console.print(f"{projector_line}\n{len(train_slots)} training slots, {len(held_slots)} held-out slots")
    rows = []
    bases = [(None if width == encoder.dim else fit_bottleneck(fit, width, encoder.name), "fitted here")
             for width in args.widths]
    if args.shipped:
        shipped = resolve_bottleneck("auto", encoder.name)
        if shipped is None:
            raise SystemExit(f"--shipped: no basis ships for encoder {encoder.name!r}")
        bases.append((shipped, f"shipped {shipped.identity}"))
    for bottleneck, basis in bases:
        width = bottleneck.width if bottleneck is not None else encoder.dim
        squeeze = bottleneck.squeeze if bottleneck is not None else (lambda m: m)
        train = [replace(x, memory=squeeze(x.memory)) for x in train_slots]
        held = [replace(x, memory=squeeze(x.memory)) for x in held_slots]
        original = np.concatenate([x.memory for x in held_slots])
        kept = variance_kept(bottleneck, original) if bottleneck is not None else 1.0
        policy.projector.load_state_dict(start_state)
        align_projector(policy, [], steps=0, lr=args.lr, seed=0, reconstruction=train,
                        reconstruct_updates=args.updates, reconstruct_batch=args.batch)
        content = content_nll(policy, held)
        rows.append({"width": width, "basis": basis if bottleneck is not None else "none (full width)",
                     "slot_bytes": width + 4, "held_out_variance_kept": float(kept), **content})
        console.print(f"width {width} ({rows[-1]['basis']}): other - own {content['other_minus_own']:+.3f} ± "
                      f"{content['other_minus_own_stderr']:.3f} ({time.perf_counter() - started:.0f} s)")
    table = Table(title=f"content check after {args.updates} reconstruction updates per width "
                        f"(held-out slots, n {len(held_slots)}; nats per token)")
    for column in ("width", "basis", "bytes / slot", "held-out variance kept", "own slot", "another step's slot",
                   "other - own"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["width"]), r["basis"], str(r["slot_bytes"]), f"{r['held_out_variance_kept']:.3f}", f"{r['own']:.3f}",
                      f"{r['other']:.3f}", f"{r['other_minus_own']:+.3f} ± {r['other_minus_own_stderr']:.3f}")
    console.print(table)
    full = next((r for r in rows if r["width"] == encoder.dim), None)
    narrowest = min(rows, key=lambda r: r["width"])
    baseline = full["other_minus_own"] if full else None
    result = {"headline": {"metric": f"content check at width {narrowest['width']} (other - own)",
                           "value": narrowest["other_minus_own"], "baseline": baseline,
                           "ratio": narrowest["other_minus_own"] / baseline if baseline else None,
                           "unit": "nats/token"},
              "widths": rows, "projector": projector_line, "model": args.model,
              "seconds": time.perf_counter() - started, "args": {k: str(v) for k, v in vars(args).items()}}
    console.print(f"{result['seconds']:.0f} s, {args.threads} thread(s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
