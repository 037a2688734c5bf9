"""Can the policy answer the recall env's questions from full text, and not from the recent window alone?

    python benchmarks/recall_calibration.py [--episodes 100] [--model smollm2-135m-instruct] [--json PATH]

Held-out recall episodes (`env.name = "recall"`, eval split) are played with the policy's replies
before a question teacher-forced to what the rules ask for (each message repeated back, `Turn.reply`;
the env accepts any reply there), so every context is the same text the sampler would build, in the chat template and
with the system prompt sao applies (`ChatFormat`, the env's generation defaults). At each question
the policy answers greedily (the env's `max_new_tokens` and stop strings) under two contexts, with
no memory slots:
  full   - the prompt + every earlier turn as text (the upper bound)
  recent - the prompt + the last `compression.recent_window` turns + the question (truncation: what
           the policy reads when memory carries nothing)
and the env's own rule (`answer_matches`) scores each answer. Reports success with n and standard
error for each context, overall and by distance in turns between the fact's turn and its question.
Headline: full-text success (`ratio`: recent / full).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONTEXTS = ("full", "recent")
DISTANCE_BINS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 256))  # turns from the fact to its question


def questions_of(chat, spec: dict, recent_window: int, memory_width: int, compressor=None) -> list[dict]:
    """Each question of one episode: its fact's value, the distance in turns from the fact, and the
    TurnInput of each context. Replies before it are teacher-forced: what the rules ask for (`Turn.reply`).
    With a sampler's `compressor` (an OnlineCompressor) every finished turn is also fed to it as an episode
    feeds it, and each question gets `memory`: the slots it holds visible when the question is asked, with
    what recall ranks them by (`spans`, the question's `query`, the first turn still in the recent window
    `before`) and the turns as ids (`finished`, `observation_ids`)."""
    from sao.envs.recall import build_episode
    from sao.policy.chat import turn_text
    from sao.policy.context import TurnInput, turn_tokens

    episode = build_episode(spec)
    turns = episode.turns
    stated_at = {turn.text: index for index, turn in enumerate(turns)}
    no_memory = np.zeros((0, memory_width), np.float32)
    prompt_ids = chat.prompt(turns[0].text)
    observation_ids = chat.first_observation(turns[0].text)
    finished: list[tuple[np.ndarray, np.ndarray]] = []
    found = []
    for index, turn in enumerate(turns):
        if turn.fact is not None:
            windows = {"full": len(finished), "recent": recent_window}
            found.append({"value": turn.fact.value, "stated": episode.values, "turn": index,
                          "distance": index - stated_at[turn.fact.statement],
                          "inputs": {c: TurnInput(prompt_ids, no_memory, turn_tokens(finished, observation_ids, w),
                                                  np.zeros(0, np.int32)) for c, w in windows.items()}})
            if compressor is not None:  # what recall needs to rank this memory for any question, own or not
                visible = compressor.visible_slots()
                found[-1].update(memory=compressor.dequantized(visible), spans=compressor.memory().spans[visible],
                                 query=compressor.query(turn.text), before=len(finished) - recent_window,
                                 finished=list(finished), observation_ids=observation_ids)
        action_ids = chat.action_ids(turn.reply)
        finished.append((observation_ids, action_ids))
        if index + 1 < len(turns):
            if compressor is not None:
                compressor.finish_turn(turn_text(turn.text, turn.reply), 0.0)
            observation_ids = chat.feedback_observation(turns[index + 1].text, action_ids)
    return found


def answer_all(policy, chat, inputs: list, max_new_tokens: int, batch: int) -> list[str]:
    """Greedy answers to every input, batched shortest first (less padding), in input order."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].prompt_ids) + len(inputs[i].context_ids))
    answers: list[str] = [""] * len(inputs)
    for start in range(0, len(order), batch):
        chunk = order[start:start + batch]
        samples = policy.sample_batch([inputs[i] for i in chunk], max_new_tokens, 1.0, chat.stop, greedy=True)
        for i, (action_ids, _) in zip(chunk, samples):
            answers[i] = chat.action_text(action_ids)
    return answers


def summary(values: list[float]) -> dict:
    from sao.stats import mean, stderr

    return {"n": len(values), "success": mean(values), "se": stderr(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=100, help="held-out episodes (one question each by default)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="policy.model (tiny for a quick check)")
    parser.add_argument("--turns", type=int, default=None, help="env option turns (default: the env's)")
    parser.add_argument("--facts", type=int, default=None, help="env option facts (default: the env's)")
    parser.add_argument("--questions", type=int, default=None, help="env option questions (default: the env's)")
    parser.add_argument("--recent-window", type=int, default=None,
                        help="turns the truncated context keeps (default: compression.recent_window)")
    parser.add_argument("--batch", type=int, default=8, help="contexts per batched generation")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--show", type=int, default=5, help="wrong full-text answers to print")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from sao.config import ConfigError, load_config
    from sao.envs.recall import answer_matches
    from sao.envs.registry import generation_settings, make_tasks
    from sao.policy.chat import ChatFormat
    from sao.policy.loading import load_tokenizer
    from sao.policy.weights import build_policy

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    options = {k: v for k, v in (("turns", args.turns), ("facts", args.facts), ("questions", args.questions))
               if v is not None}
    inline = ", ".join(f"{key} = {value}" for key, value in options.items())  # a TOML inline table
    overrides = [f'policy.model="{args.model}"', 'env.name="recall"', f"env.options={{{inline}}}"]
    try:
        config = load_config(overrides=overrides, environ={})
    except ConfigError as err:
        raise SystemExit(str(err)) from err
    recent_window = config.compression.recent_window if args.recent_window is None else args.recent_window
    generation = generation_settings(config)
    chat = ChatFormat(load_tokenizer(config.policy.model, config.policy.cache_dir), generation.system_prompt,
                      generation.stop)
    policy = build_policy(config.policy, memory_width=1).eval()  # no memory is read: the projector never runs
    questions = [q for task in make_tasks(config.env, args.episodes, split="eval")
                 for q in questions_of(chat, task.spec, recent_window, policy.memory_width)]
    console = Console()
    for question in questions:
        question["success"] = {}
    for context in CONTEXTS:
        answers = answer_all(policy, chat, [q["inputs"][context] for q in questions], generation.max_new_tokens,
                             args.batch)
        for question, answer in zip(questions, answers):
            question["success"][context] = float(answer_matches(answer, question["value"], question["stated"]))
            question.setdefault("answers", {})[context] = answer
    result = {context: summary([q["success"][context] for q in questions]) for context in CONTEXTS}
    by_distance = {}
    for low, high in DISTANCE_BINS:
        chosen = [q for q in questions if low <= q["distance"] <= high]
        if chosen:
            by_distance[f"{low}-{high}" if high > low else str(low)] = {
                context: summary([q["success"][context] for q in chosen]) for context in CONTEXTS}
    seconds = time.perf_counter() - started

    table = Table(title=f"recall, {len(questions)} held-out questions, {args.model}, greedy "
                        f"(success ± s.e.; recent window {recent_window})")
    for column in ("distance (turns)", "n", "full text", "recent window"):
        table.add_column(column, justify="right")
    rows = [("all", result)] + list(by_distance.items())
    for label, figures in rows:
        table.add_row(label, str(figures["full"]["n"]),
                      *(f"{figures[c]['success']:.2f} ± " + ("n/a" if figures[c]["se"] is None else f"{figures[c]['se']:.2f}")
                        for c in CONTEXTS))
    console.print(table)
    wrong = [q for q in questions if not q["success"]["full"]][:args.show]
    for q in wrong:
        console.print(f"wrong from full text (distance {q['distance']}): {q['answers']['full']!r}, "
                      f"expected {q['value']!r}")
    console.print(f"{seconds:.0f} s, {args.threads} thread(s); options {config.env.options or 'default'}")
    if args.json:
        args.json.write_text(json.dumps({
            "headline": {"metric": "recall success from full text (held-out, greedy)",
                         "value": result["full"]["success"], "baseline": result["recent"]["success"],
                         "ratio": (result["recent"]["success"] / result["full"]["success"]
                                   if result["full"]["success"] else None), "unit": "fraction of questions"},
            "contexts": result, "by_distance": by_distance, "model": args.model, "recent_window": recent_window,
            "options": config.env.options, "seconds": seconds, "threads": args.threads,
            "questions": [{"distance": q["distance"], "value": q["value"], "answers": q["answers"],
                           "success": q["success"]} for q in questions]}, indent=1))


if __name__ == "__main__":
    main()
