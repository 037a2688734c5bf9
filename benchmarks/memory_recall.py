"""Does sao's memory carry the episode? Recall questions answered from memory slots, against controls.

    python benchmarks/memory_recall.py [--episodes 200] [--model smollm2-135m-instruct] [--threads 1]
        [--set compression.recall_turns=1] [--json PATH]

Held-out `recall` episodes (`env.name = "recall"`, eval split: facts no model can know) are played
as `recall_calibration.py` plays them: the replies before a question teacher-forced to what the
rules ask, in sao's chat template. Each finished turn also goes through the sampler's own online
compressor (the sentence encoder, the shipped temporal filter, INT8 in the shipped basis), so at a
question the memory slots are exactly what a sampler would show the policy; the policy is version 0
with the shipped projector (`policy.projector`). With `--set compression.recall_turns=K` the memory also
puts back as text the K earlier turns its slots nearest the question stand for, as a sampler does
(`OnlineCompressor.recall`). Each question is asked under six contexts (seven with recall):

  full    - every earlier turn as text (the upper bound)
  recent  - the recent window as text, no slots (truncation: what memory must beat)
  sao     - the recent window + this episode's memory slots (+ the turns they recall)
  other   - the recent window + another episode's slots, as many (+ the turns of that episode they
            recall for this question): the content control
  zero    - the recent window + as many zero slots (+ the turns sao's memory recalls)
  mean    - the recent window + as many copies of the mean slot, over every question's memory (+ the same)
  random  - with recall only: sao's slots + as many earlier turns of this episode as it recalls,
            drawn at random from those it could have recalled (does choosing by memory matter?)

Per context: greedy success by the env's rule (`answer_matches`) and the answer's NLL per token
(the value and the end of turn, teacher-forced), each ± its standard error over questions, and
the context's positions and bytes against full text (ids as int32; a slot as its INT8
coordinates and scale). Headline: retention = (sao - recent) / (full - recent) of success, its
error by bootstrap over questions; content = sao - other (success and NLL), paired by question.
Content is shown when sao beats another episode's memory by more than 3 standard errors. With recall,
also the share of questions whose recalled turns include the fact's own (sao's and random's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, also when loaded as a module by the tests
import recall_calibration  # the recall episodes as text: one walk for both benchmarks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONTEXTS = ("full", "recent", "sao", "other", "zero", "mean")
WITH_SLOTS = ("sao", "other", "zero", "mean")
CONTENT_STDERRS = 3.0  # how far above another episode's memory sao must be to say the slots carry content


def questions_with_memory(roller, spec: dict) -> list[dict]:
    """Each question of one episode as `recall_calibration.questions_of` builds it (value, distance, the full and
    recent text contexts), with the memory slots the sampler's compressor holds when it is asked."""
    from sao.compression.pipeline import OnlineCompressor

    window = roller.config.compression.recent_window
    compressor = OnlineCompressor(roller.encoder, roller.temporal_filter.fork(), recent_window=window,
                                  bottleneck=roller.bottleneck)
    questions = recall_calibration.questions_of(roller.chat, spec, window, roller.policy.memory_width, compressor)
    return [{**question, "episode": spec["index"]} for question in questions]


def another_episodes_question(questions: list[dict], index: int) -> int | None:
    """The nearest question (cyclically after `index`) from another episode with at least as many slots, or None."""
    own = questions[index]
    for step in range(1, len(questions)):
        other = (index + step) % len(questions)
        if questions[other]["episode"] != own["episode"] and len(questions[other]["memory"]) >= len(own["memory"]):
            return other
    return None


def pairs_text(question: dict, turns: list[int]) -> np.ndarray:
    """The question's episode's finished turns `turns` as ids (observation + action each), in the given order."""
    pieces = [ids for turn in turns for ids in question["finished"][turn]]
    return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)


def contexts_of(questions: list[dict], width: int, recall: int, seed: int = 0) -> tuple[dict[str, list], dict]:
    """The TurnInput of every question under each context (`recall`: compression.recall_turns), and the turns
    recalled for each question by its own memory (`sao`) and at random (`random`)."""
    from sao.compression.pipeline import recall_turns
    from sao.policy.context import TurnInput

    slots = [q["memory"] for q in questions if len(q["memory"])]
    mean_slot = np.concatenate(slots).mean(axis=0) if slots else np.zeros(width, np.float32)
    rng = np.random.default_rng(seed)
    own_turns = [recall_turns(q["memory"], q["spans"], q["query"], recall, q["before"]) for q in questions]
    memories, recalled = {}, {}
    memories["sao"] = [q["memory"] for q in questions]
    recalled["sao"] = [pairs_text(q, turns) for q, turns in zip(questions, own_turns)]
    memories["other"], recalled["other"] = [], []
    for i, q in enumerate(questions):
        other = another_episodes_question(questions, i)
        if other is None:  # no episode has as many slots: zero rows, nothing recalled
            memories["other"].append(np.zeros_like(q["memory"]))
            recalled["other"].append(np.zeros(0, np.int32))
            continue
        o, count = questions[other], len(q["memory"])
        # Another episode's memory, ranked by this question, brings back that episode's turns.
        turns = recall_turns(o["memory"][:count], o["spans"][:count], q["query"], recall, o["before"])
        memories["other"].append(o["memory"][:count])
        recalled["other"].append(pairs_text(o, turns))
    for context, memory in (("zero", [np.zeros_like(q["memory"]) for q in questions]),
                            ("mean", [np.tile(mean_slot, (len(q["memory"]), 1)).astype(np.float32) for q in questions])):
        memories[context], recalled[context] = memory, recalled["sao"]
    chosen = {"sao": own_turns}
    if recall:  # as many earlier turns as sao recalls, drawn at random from those it could have recalled
        chosen["random"] = [sorted(rng.choice(q["before"], len(turns), replace=False).tolist()) if turns else []
                            for q, turns in zip(questions, own_turns)]
        memories["random"] = memories["sao"]
        recalled["random"] = [pairs_text(q, turns) for q, turns in zip(questions, chosen["random"])]
    inputs = {c: [q["inputs"][c] for q in questions] for c in ("full", "recent")}
    for context, memory in memories.items():
        inputs[context] = [TurnInput(r.prompt_ids, m, np.concatenate([text, r.context_ids]), r.action_ids)
                           for r, m, text in zip(inputs["recent"], memory, recalled[context])]
    return inputs, chosen


def found_fact(questions: list[dict], chosen: dict[str, list]) -> dict[str, dict]:
    """Of the questions whose fact has left the recent window, the share whose recalled turns include the fact's."""
    from sao.stats import mean, stderr

    out = {}
    for context, turns_of in chosen.items():
        hits = [float(q["turn"] - q["distance"] in turns) for q, turns in zip(questions, turns_of)
                if q["turn"] - q["distance"] < q["before"]]
        out[context] = {"n": len(hits), "share": mean(hits) if hits else None, "se": stderr(hits) if hits else None}
    return out


def answer_nll(policy, inputs: list, answers: list[np.ndarray], batch: int) -> list[float]:
    """Mean negative log-prob per token of each answer after its context, teacher-forced, in input order."""
    import torch

    from sao.policy.context import TurnInput
    from sao.policy.model import collate_turns

    full = [TurnInput(i.prompt_ids, i.memory, i.context_ids, a) for i, a in zip(inputs, answers)]
    order = sorted(range(len(full)), key=lambda i: full[i].positions)
    nll = [0.0] * len(full)
    for start in range(0, len(order), batch):
        chunk = order[start:start + batch]
        scored_batch = collate_turns([full[i] for i in chunk], policy.memory_width)
        with torch.no_grad():
            scored = policy(scored_batch)
        for row, i in enumerate(chunk):
            nll[i] = -float(scored[row][scored_batch.action_mask[row]].mean())
    return nll


def paired(a: list[float], b: list[float]) -> dict:
    from sao.stats import mean, stderr

    differences = [x - y for x, y in zip(a, b)]
    return {"difference": mean(differences), "se": stderr(differences)}


def retention(success: dict[str, list[float]], resamples: int = 2000, seed: int = 0) -> dict:
    """(sao - recent) / (full - recent) of mean success, and its bootstrap standard error over questions."""
    rows = np.asarray([success["sao"], success["recent"], success["full"]])

    def ratio(columns) -> float:
        sao, recent, full = rows[:, columns].mean(axis=1)
        return (sao - recent) / (full - recent) if full != recent else float("nan")

    rng = np.random.default_rng(seed)
    draws = [ratio(rng.integers(0, rows.shape[1], rows.shape[1])) for _ in range(resamples)]
    finite = [d for d in draws if np.isfinite(d)]
    return {"value": ratio(slice(None)), "se": float(np.std(finite, ddof=1)) if len(finite) > 1 else None}


def content_shown(content: dict) -> bool:
    """Whether sao's own memory beats another episode's by more than CONTENT_STDERRS standard errors."""
    return bool(content["se"] and content["difference"] > CONTENT_STDERRS * content["se"])


def context_costs(inputs: dict[str, list], width: int) -> dict[str, dict]:
    """Mean positions and bytes of each context (ids as int32, a slot as INT8 coordinates and a float32 scale)."""
    costs = {}
    for context, rows in inputs.items():
        positions = [r.positions for r in rows]
        slot_bytes = [len(r.memory) * (width + 4) for r in rows]
        ids = [len(r.prompt_ids) + len(r.context_ids) for r in rows]
        costs[context] = {"positions": float(np.mean(positions)),
                          "bytes": float(np.mean([4 * n + s for n, s in zip(ids, slot_bytes)])),
                          "slots": float(np.mean([len(r.memory) for r in rows]))}
    for cost in costs.values():
        cost["positions_vs_full"] = cost["positions"] / costs["full"]["positions"]
        cost["bytes_vs_full"] = cost["bytes"] / costs["full"]["bytes"]
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=200, help="held-out episodes (one question each by default)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="policy.model (tiny for a quick check)")
    parser.add_argument("--batch", type=int, default=8, help="contexts per batched generation")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KNOB=VALUE",
                        help="config override, e.g. compression.recent_window=2 (repeatable)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from sao.config import ConfigError, load_config
    from sao.envs.recall import answer_matches
    from sao.envs.registry import make_tasks
    from sao.sampler.rollout import Roller

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        config = load_config(overrides=[f'policy.model="{args.model}"', 'env.name="recall"', *args.overrides],
                             environ={})
    except ConfigError as err:
        raise SystemExit(str(err)) from err
    roller = Roller.from_config(config, "memory-recall")  # the sampler's encoder, filter, basis and policy
    policy, chat, width = roller.policy, roller.chat, roller.policy.memory_width
    questions = [q for task in make_tasks(config.env, args.episodes, split="eval")
                 for q in questions_with_memory(roller, task.spec)]
    recall = config.compression.recall_turns
    inputs, chosen = contexts_of(questions, width, recall)
    found = found_fact(questions, chosen) if recall else {}
    contexts = CONTEXTS + (("random",) if recall else ())
    answers_ids = [chat.action_ids(q["value"]) for q in questions]
    success, nll, answers = {}, {}, {}
    for context in contexts:
        answers[context] = recall_calibration.answer_all(policy, chat, inputs[context],
                                                         roller.generation.max_new_tokens, args.batch)
        success[context] = [float(answer_matches(a, q["value"], q["stated"])) for a, q in zip(answers[context], questions)]
        nll[context] = answer_nll(policy, inputs[context], answers_ids, args.batch)
    summary = recall_calibration.summary
    figures = {c: {**summary(success[c]), "nll": float(np.mean(nll[c])), "nll_se": summary(nll[c])["se"]}
               for c in contexts}
    costs = context_costs(inputs, width)
    kept = retention(success)
    content = {"success": paired(success["sao"], success["other"]),
               "nll": paired(nll["other"], nll["sao"])}  # positive: own memory makes the answer likelier
    shown = content_shown(content["success"]) or content_shown(content["nll"])
    seconds = time.perf_counter() - started

    console = Console()
    table = Table(title=f"recall from memory, {len(questions)} held-out questions, {args.model}, greedy "
                        f"(± s.e.; recent window {config.compression.recent_window}, recall_turns {recall})")
    for column in ("context", "success", "answer NLL/token", "slots", "positions vs full", "bytes vs full"):
        table.add_column(column, justify="right")
    for c in contexts:
        f = figures[c]
        table.add_row(c, f"{f['success']:.3f} ± {f['se']:.3f}", f"{f['nll']:.2f} ± {f['nll_se']:.2f}",
                      f"{costs[c]['slots']:.1f}", f"{costs[c]['positions_vs_full']:.2f}",
                      f"{costs[c]['bytes_vs_full']:.2f}")
    console.print(table)
    kept_se = "n/a" if kept["se"] is None else f"{kept['se']:.2f}"
    console.print(f"retention (sao - recent) / (full - recent): {kept['value']:.2f} ± {kept_se}; "
                  f"content, sao - another episode's memory: success {content['success']['difference']:+.3f} ± "
                  f"{content['success']['se']:.3f}, NLL {content['nll']['difference']:+.3f} ± "
                  f"{content['nll']['se']:.3f} nats/token: "
                  f"{'shown' if shown else 'not shown'} (> {CONTENT_STDERRS:g} s.e.)")
    for context, share in found.items():
        if share["n"]:
            console.print(f"recall ({context}) brings back the fact's turn for {share['share']:.3f} ± {share['se']:.3f} "
                          f"of the {share['n']} questions whose fact left the recent window")
    console.print(f"{seconds:.0f} s, {args.threads} thread(s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "headline": {"metric": "recall retention from memory, (sao - recent) / (full - recent)",
                         "value": figures["sao"]["success"], "baseline": figures["recent"]["success"],
                         "ratio": kept["value"] if np.isfinite(kept["value"]) else None, "unit": "fraction of questions"},
            "contexts": figures, "costs": costs, "retention": kept, "content": content, "content_shown": shown,
            "fact_turn_recalled": found,
            "model": args.model, "recent_window": config.compression.recent_window, "recall_turns": recall,
            "seconds": seconds, "threads": args.threads, "episodes": args.episodes,
            "questions": [{"distance": q["distance"], "value": q["value"], "slots": len(q["memory"]),
                           "answers": {c: answers[c][i] for c in contexts}, "success": {c: success[c][i] for c in contexts},
                           "nll": {c: nll[c][i] for c in contexts}} for i, q in enumerate(questions)]}, indent=1))


if __name__ == "__main__":
    main()
