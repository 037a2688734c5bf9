"""Where does a recall fact's value get lost on its way into a memory slot? Linear probes at each stage.

    python benchmarks/recall_probes.py [--train-episodes 500] [--eval-episodes 250] [--json PATH]

Every turn of `recall` episodes (train split to fit the probes, eval split to test them: values
from disjoint halves of the pools) goes through the sampler's own compressor: the sentence
encoder, the shipped LSTM redundancy filter, INT8 coordinates in the shipped basis, and the shipped
projector into the language model's embedding space. For each fact turn the vector at each stage
is kept:

  text_free   - the embedding of the fact's sentence with its value blanked (the probe's floor)
  embedding   - the sentence embedding of the turn (stage 1, semantic)
  slot        - the embedding of the slot that holds the turn after the filter (stage 2, temporal:
                a turn the filter merged into the slot before it is represented by that slot)
  basis_fp32  - that slot in the shipped basis, before quantization
  int8        - its INT8 coordinates, dequantized (stage 3: what travels)
  soft_token  - the projector's output: what the policy reads

A multinomial logistic regression per character position (the 4 digits of a locker code; the 5
letters of a name) is fitted on the train facts and scored on the eval facts. Printed per stage:
character accuracy (± s.e. over eval facts) against the majority-class rate, and whole values
decoded exactly. The stage where accuracy falls to the floor is where the value is lost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STAGES = ("text_free", "embedding", "slot", "basis_fp32", "int8", "soft_token")
KINDS = {"code": 4, "name": 5}  # characters a value of each kind has


def fact_kind(value: str) -> str:
    return "code" if value.isdigit() else "name"


def blank_value(statement: str, value: str) -> str:
    """The statement with its value replaced by a placeholder: same sentence, no value."""
    return re.sub(re.escape(value), "something", statement)


def stage_vectors(roller, spec: dict) -> list[dict]:
    """Per fact turn of one episode: its value, kind, whether the filter merged it, and its vector at every stage."""
    import torch

    from sao.compression.pipeline import OnlineCompressor
    from sao.compression.quantize import dequantize_int8
    from sao.envs.recall import build_episode
    from sao.policy.chat import turn_text

    encoder, bottleneck, projector = roller.encoder, roller.bottleneck, roller.policy.projector
    compressor = OnlineCompressor(encoder, roller.temporal_filter.fork(),
                                  recent_window=roller.config.compression.recent_window, bottleneck=bottleneck)
    episode = build_episode(spec)
    texts = [turn_text(turn.text, turn.reply) for turn in episode.turns]
    for text in texts:  # every turn, as a sampler compresses each finished one
        compressor.finish_turn(text, 0.0)
    table = compressor.memory()
    embeddings = encoder.encode(texts)
    values = {fact.statement: fact.value for fact in episode.facts}
    found = []
    for index, turn in enumerate(episode.turns):
        if turn.fact is not None or turn.text not in values:  # a question's turn, or no fact stated
            continue
        value = values[turn.text]
        slot = int(np.flatnonzero((table.spans[:, 0] <= index) & (index <= table.spans[:, 1]))[0])
        slot_embedding = embeddings[int(table.spans[slot, 0])]  # a merged turn adds nothing to its slot
        int8 = dequantize_int8(table.vectors[slot:slot + 1], table.scales[slot:slot + 1])[0]
        with torch.no_grad():
            soft = projector(torch.from_numpy(int8)[None].to(projector.weight))[0].float().numpy()
        in_basis = bottleneck.encode(slot_embedding[None])[0] if bottleneck is not None else slot_embedding
        found.append({"value": value, "kind": fact_kind(value), "merged": int(table.spans[slot, 0]) != index,
                      "vectors": {"text_free": encoder.encode([blank_value(texts[index], value)])[0],
                                  "embedding": embeddings[index], "slot": slot_embedding, "basis_fp32": in_basis,
                                  "int8": int8, "soft_token": soft}})
    return found


def probe_accuracy(train: list[dict], test: list[dict], stage: str, kind: str) -> dict:
    """Fit one logistic regression per character position on `train`'s facts of `kind` at `stage`, score `test`'s.

    Per test fact: the share of its characters decoded right, and whether all were. The floor is the
    same share when every position is guessed as its most common train character."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from sao.stats import mean, stderr

    fit_rows = [f for f in train if f["kind"] == kind]
    test_rows = [f for f in test if f["kind"] == kind]
    x_fit = np.stack([f["vectors"][stage] for f in fit_rows])
    x_test = np.stack([f["vectors"][stage] for f in test_rows])
    right = np.zeros((len(test_rows), KINDS[kind]), dtype=bool)
    floor = np.zeros_like(right)
    for position in range(KINDS[kind]):
        y_fit = np.array([f["value"][position] for f in fit_rows])
        y_test = np.array([f["value"][position] for f in test_rows])
        probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=0.1))
        right[:, position] = probe.fit(x_fit, y_fit).predict(x_test) == y_test
        characters, counts = np.unique(y_fit, return_counts=True)
        floor[:, position] = y_test == characters[counts.argmax()]
    per_fact = right.mean(axis=1).tolist()
    return {"n_fit": len(fit_rows), "n": len(test_rows), "characters": mean(per_fact), "se": stderr(per_fact),
            "exact": float(right.all(axis=1).mean()), "floor": float(floor.mean())}


def facts_of(roller, config, episodes: int, split: str) -> list[dict]:
    from sao.envs.registry import make_tasks

    return [f for task in make_tasks(config.env, episodes, split=split) for f in stage_vectors(roller, task.spec)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-episodes", type=int, default=500, help="episodes whose facts fit the probes")
    parser.add_argument("--eval-episodes", type=int, default=250, help="held-out episodes whose facts test them")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="policy.model (its shipped projector)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from sao.config import ConfigError, load_config
    from sao.sampler.rollout import Roller

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        config = load_config(overrides=[f'policy.model="{args.model}"', 'env.name="recall"'], environ={})
    except ConfigError as err:
        raise SystemExit(str(err)) from err
    roller = Roller.from_config(config, "recall-probes")  # the sampler's encoder, filter, basis and projector
    train = facts_of(roller, config, args.train_episodes, "train")
    test = facts_of(roller, config, args.eval_episodes, "eval")
    results = {kind: {stage: probe_accuracy(train, test, stage, kind) for stage in STAGES} for kind in KINDS}
    merged = float(np.mean([f["merged"] for f in test])) if test else 0.0
    seconds = time.perf_counter() - started

    console = Console()
    table = Table(title=f"decoding a recall fact's value by stage: {len(train)} train facts, {len(test)} held-out "
                        f"(character accuracy ± s.e.; exact values)")
    table.add_column("stage")
    for kind in KINDS:
        table.add_column(f"{kind}: characters", justify="right")
        table.add_column(f"{kind}: exact", justify="right")
    for stage in STAGES:
        cells = []
        for kind in KINDS:
            r = results[kind][stage]
            cells += [f"{r['characters']:.3f} ± {r['se']:.3f}", f"{r['exact']:.3f}"]
        table.add_row(stage, *cells)
    table.add_row("floor (most common)", *[cell for kind in KINDS
                                           for cell in (f"{results[kind]['embedding']['floor']:.3f}", "")])
    console.print(table)
    console.print(f"fact turns the filter merged into the slot before: {merged:.1%} of the held-out ones; "
                  f"{seconds:.0f} s, {args.threads} thread(s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        code = results["code"]
        args.json.write_text(json.dumps({
            "headline": {"metric": "locker-code digits decoded from the soft token vs the sentence embedding",
                         "value": code["soft_token"]["characters"], "baseline": code["embedding"]["characters"],
                         "ratio": (code["soft_token"]["characters"] / code["embedding"]["characters"]
                                   if code["embedding"]["characters"] else None), "unit": "fraction of characters"},
            "stages": results, "merged_share": merged, "train_facts": len(train), "test_facts": len(test),
            "model": args.model, "seconds": seconds, "threads": args.threads}, indent=1))


if __name__ == "__main__":
    main()
