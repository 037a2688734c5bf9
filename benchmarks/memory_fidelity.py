"""Does the policy act as well with sao memory as with the full history? Measured on the LM itself.

    python benchmarks/memory_fidelity.py [--model smollm2-135m-instruct] [--json PATH]

Held-out recorded episodes (labyrinth episodes of >= 100 steps by the scripted noisy expert, and
multi-turn arithmetic episodes of a stuck learner; seeds no alignment run uses) are replayed
through the sampler's compressor. Each scored step's recorded action is teacher-forced under
six contexts:
  full   - prompt + every earlier step as text (the upper bound, and the KL reference)
  sao    - prompt + memory soft tokens (aligned projector) + the turns memory recalls as text
           (`--recall-turns`, compression.recall_turns) + recent window + observation
  zero   - the same with the zero projector (what a run without alignment reads)
  other  - the aligned projector reading another episode's memory (as many slots, wrong content;
           the turns recalled stay this episode's):
           what sao gains over it is what the memory says about this episode; what it shares with
           it is a learned prompt (e.g. "the replies are short commands")
  recent - prompt + recent window + observation (truncation: no slots, nothing recalled)
  none   - prompt + observation
(`--recall-only` scores only the labyrinth actions whose object only the past names - putting a
gem on the altar, dropping an item - where memory's content, not its form, has to help)
and the benchmark reports per-action NLL (summed over the action's tokens) and KL(full || context)
with standard errors; for each scored gem delivery, whether the context makes the LM rank the gem
it holds first among the world's gems (against chance, 1 / gems); what each env's memory costs on
the wire (INT8 slot bytes against the int32 token ids of the steps the slots stand for;
`--keep-threshold` trades slots for bytes; slots travel as compression.bottleneck says: the shipped
64-d basis by default, `--bottleneck none` for the full width, `--memory-width k` for a basis fitted
here); plus the context length (tokens + soft tokens) at steps 10, 100 and 1000 of a 1000-step
labyrinth episode.
Headline: gap recovered = (NLL_recent - NLL_sao) / (NLL_recent - NLL_full) on the labyrinth;
`baseline` is the zero projector's, `ratio` is the gap recovered itself, and
`other_episode_memory` the gap recovered by the aligned projector reading another episode's
memory (the part of `value` that is not about this episode); `context_ratio` = sao context /
full context at step 1000.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONTEXTS = ("full", "sao", "zero", "other", "recent", "none")
HELDOUT_SEED = 1_000_003  # alignment corpora use small seeds; these worlds and questions are never trained on
LENGTH_STEPS = (10, 100, 1000)


def long_labyrinth(seed: int, count: int, min_steps: int, max_steps: int):
    """`count` noisy-expert labyrinth episodes of at least `min_steps` steps (others are skipped)."""
    from sao.offline.align import labyrinth_corpus

    found, offset = [], 0
    while len(found) < count and offset < 50:
        found += [e for e in labyrinth_corpus(seed + offset, 1, max_steps, random_every=0) if len(e) >= min_steps]
        offset += 1
    return found


# Labyrinth actions whose object only the past names: the gem put on the altar or the item dropped was
# picked up many steps earlier, and the inventory is not shown unless asked for.
RECALL_ACTIONS = ("put ", "drop ")


def scored_steps(prepared, per_episode: int, rng: random.Random, recall_only: bool = False) -> list[int]:
    """Evenly spread steps that see at least one memory slot (where the contexts differ); with `recall_only`,
    only those whose recorded action is one of RECALL_ACTIONS."""
    candidates = [s for s, x in enumerate(prepared.student) if len(x.memory) and (
        not recall_only or prepared.episode.steps[s].action.startswith(RECALL_ACTIONS))]
    if len(candidates) <= per_episode:
        return candidates
    stride = len(candidates) / per_episode
    return [candidates[int(i * stride + rng.random() * stride)] for i in range(per_episode)]


def donor_memory(donor, count: int) -> np.ndarray:
    """`count` memory rows of another episode, cycled if it has fewer: memory of the right form, wrong content.
    Its last step sees every slot the episode sent (a slot no step saw is never sent)."""
    rows = donor.student[-1].memory
    return rows[np.arange(count) % len(rows)] if len(rows) else rows[:0]


def gem_choice(item, step: int, chat):
    """For a recorded "put <gem> on altar": (position, the recorded gem's token, every gem's token) at the first
    action token where this world's gems differ; None for any other action. Lets a context be judged by whether
    the LM names the gem it holds (which only the past says) rather than by the action's total NLL."""
    from sao.envs.textworld import build_world

    action = item.episode.steps[step].action
    if not action.startswith("put ") or "spec" not in item.episode.meta:
        return None
    gems = build_world(item.episode.meta["spec"]).gems
    held = action.split()[1]
    if held not in gems or len(gems) < 2:
        return None
    ids = {gem: list(chat.action_ids(f"put {gem} on altar")) for gem in gems}
    position = next(i for i in range(min(map(len, ids.values())))
                    if len({row[i] for row in ids.values()}) > 1)
    return position, ids[held][position], [row[position] for row in ids.values()]


def named_first(choice, logprobs) -> float:
    """1.0 if the held gem's token has the highest log-prob among the world's gems, 0.0 if not; NaN: no choice."""
    if choice is None:
        return math.nan
    position, held, candidates = choice
    scores = logprobs[position, candidates]
    return float(int(scores.argmax()) == candidates.index(held))


def score_episode(policy, item, donor, steps: list[int], batch: int, zero_state, aligned_state, chat) -> list[dict]:
    """Per scored action: NLL and KL to full text under each context (`donor`: the episode lending `other` memory),
    and, for gem deliveries, whether the context's LM names the held gem first (`gem_choice`)."""
    from dataclasses import replace

    import torch

    from sao.offline.align import (
        action_nll_kl,
        context_logprobs,
        episode_full_text_logprobs,
        no_history_input,
        without_memory,
    )

    teacher = episode_full_text_logprobs(policy, item.trajectory)
    builders = {"sao": lambda s: item.student[s], "zero": lambda s: item.student[s],
                "other": lambda s: replace(item.student[s], memory=donor_memory(donor, len(item.student[s].memory))),
                "recent": lambda s: without_memory(item.trajectory, s),
                "none": lambda s: no_history_input(item.trajectory, s)}
    rows = [{"step": s, "env": item.episode.env} for s in steps]
    choices = {s: gem_choice(item, s, chat) if item.episode.env == "textworld" else None for s in steps}
    for row, s in zip(rows, steps):
        if choices[s] is not None:
            row["gem_chance"] = 1 / len(choices[s][2])
        row["full"] = (*action_nll_kl(teacher[s], teacher[s], item.trajectory.steps[s].action_ids),
                       named_first(choices[s], teacher[s]))
    for name, build in builders.items():
        policy.projector.load_state_dict(zero_state if name == "zero" else aligned_state)
        with torch.no_grad():
            for start in range(0, len(steps), batch):
                chunk = steps[start:start + batch]
                for s, logprobs, row in zip(chunk, context_logprobs(policy, [build(s) for s in chunk]),
                                            rows[start:start + batch]):
                    row[name] = (*action_nll_kl(teacher[s], logprobs, item.trajectory.steps[s].action_ids),
                                 named_first(choices[s], logprobs))
    policy.projector.load_state_dict(aligned_state)
    return rows


def gap_recovered(rows: list[dict], context: str) -> float:
    recent = np.mean([r["recent"][0] for r in rows])
    full = np.mean([r["full"][0] for r in rows])
    return float((recent - np.mean([r[context][0] for r in rows])) / (recent - full))


def bootstrap_se(rows: list[dict], statistic, draws: int = 1000, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    values = [statistic([rows[i] for i in rng.integers(0, len(rows), len(rows))]) for _ in range(draws)]
    finite = [v for v in values if math.isfinite(v)]
    return float(np.std(finite, ddof=1)) if len(finite) > 1 else math.nan


def env_summary(rows: list[dict]) -> dict:
    from sao.offline.align import summarise

    out = {"actions": len(rows)}
    for context in CONTEXTS:
        nll, nll_se = summarise([r[context][0] for r in rows])
        kl, kl_se = summarise([r[context][1] for r in rows])
        out[context] = {"nll": nll, "nll_se": nll_se, "kl": kl, "kl_se": kl_se}
    for context in ("sao", "zero", "other"):
        out[f"gap_recovered_{context}"] = gap_recovered(rows, context)
        out[f"gap_recovered_{context}_se"] = bootstrap_se(rows, lambda sample, c=context: gap_recovered(sample, c))
    diff, diff_se = summarise([r["zero"][0] - r["sao"][0] for r in rows])
    out["nll_zero_minus_sao"], out["nll_zero_minus_sao_se"] = diff, diff_se
    diff, diff_se = summarise([r["other"][0] - r["sao"][0] for r in rows])
    out["nll_other_minus_sao"], out["nll_other_minus_sao_se"] = diff, diff_se
    deliveries = [r for r in rows if "gem_chance" in r]
    if deliveries:  # does the context make the LM name the gem it holds? (chance: 1 / gems in the world)
        out["gem_deliveries"] = len(deliveries)
        out["gem_chance"] = float(np.mean([r["gem_chance"] for r in deliveries]))
        out["gem_named_first"] = {c: summarise([r[c][2] for r in deliveries]) for c in CONTEXTS}
    return out


def wire_cost(prepared) -> dict:
    """What the scored episodes' memory costs on the wire against the text it stands for: INT8 slots (a byte per
    number + a float32 scale each) vs the int32 token ids of the steps their spans cover."""
    slots = steps = tokens = slot_bytes = 0
    for item in prepared:
        memory, trajectory = item.trajectory.memory, item.trajectory
        slots += len(memory.scales)
        slot_bytes += len(memory.scales) * (memory.vectors.shape[1] + 4)
        for first, last in memory.spans:
            steps += int(last - first + 1)
            tokens += sum(len(s.observation_ids) + len(s.action_ids) for s in trajectory.steps[first:last + 1])
    return {"slots": slots, "steps_per_slot": steps / slots if slots else math.nan,
            "tokens_per_slot": tokens / slots if slots else math.nan, "slot_bytes": slot_bytes,
            "replaced_token_bytes": 4 * tokens, "bytes_ratio": slot_bytes / (4 * tokens) if tokens else math.nan}


def context_lengths(config, encoder, temporal_filter, recent_window: int, seed: int, longest: int,
                    bottleneck=None) -> dict:
    """Tokens + soft tokens the policy reads at steps 10, 100, 1000 (up to `longest`) of one labyrinth episode."""
    from sao.offline.align import full_text_input, labyrinth_corpus, prepare, without_memory

    # The random agent almost never finishes, so its episode runs to max_steps.
    episode = labyrinth_corpus(seed, 1, max_steps=longest + 1, random_every=1)[0]
    item = prepare([episode], config, encoder, temporal_filter, recent_window, bottleneck)[0]
    lengths = {}
    for step in LENGTH_STEPS:
        if step > longest or step >= len(item.student):
            continue
        x, full, recent = item.student[step], full_text_input(item.trajectory, step), without_memory(item.trajectory, step)
        full_length = len(full.prompt_ids) + len(full.context_ids)
        recent_length = len(recent.prompt_ids) + len(recent.context_ids)
        replaced = full_length - recent_length  # tokens of the steps memory stands for
        slots, recalled = len(x.memory), len(x.context_ids) - len(recent.context_ids)  # recalled turns' tokens
        lengths[str(step)] = {"full": full_length, "sao": recent_length + recalled + slots, "soft_tokens": slots,
                              "recalled_tokens": recalled,
                              "recent": recent_length, "replaced_tokens": replaced,
                              "tokens_per_slot": replaced / slots if slots else math.nan,
                              # On the wire: an INT8 slot (dim bytes + a float32 scale) vs the int32 token
                              # ids it stands for (what a trajectory would carry without memory).
                              "slot_bytes": slots * (x.memory.shape[1] + 4),
                              "replaced_token_bytes": replaced * 4}
    return lengths


def load_aligned(policy, config, encoder, bottleneck, args, rng_seed: int) -> str:
    """Put the aligned projector in `policy`: a file, the shipped one, or aligned here (--align-updates)."""
    from sao.policy.projector import apply_projector_setting

    if args.align_updates == 0:
        line = apply_projector_setting(policy.projector, args.projector, config.policy.model, config.compression.encoder,
                                       bottleneck)
        if "aligned" not in line:
            raise SystemExit(f"{line}\nno aligned projector: run `sao compression align` or pass --align-updates N")
        return line
    from sao.compression.temporal import load_temporal_filter
    from sao.offline.align import align_projector, labyrinth_corpus, prepare, tutoring_corpus

    temporal_filter = load_temporal_filter(config.compression.temporal_weights, config.compression.keep_threshold)
    corpus = labyrinth_corpus(rng_seed, args.align_episodes, args.max_steps) + tutoring_corpus(rng_seed, args.align_episodes)
    train = prepare(corpus, config, encoder, temporal_filter, args.recent_window, bottleneck)
    align_projector(policy, train, args.align_updates, args.align_lr, batch_size=4, seed=rng_seed)
    return f"memory projector: aligned here ({args.align_updates} updates on {len(corpus)} episodes, seed {rng_seed})"


def fit_here(config, encoder, temporal_filter, args):
    """--memory-width: a basis fitted on the slots of seed-0 episodes (never the scored ones)."""
    from sao.compression.bottleneck import fit_bottleneck
    from sao.offline.align import labyrinth_corpus, prepare, tutoring_corpus

    fit = prepare(labyrinth_corpus(0, args.align_episodes, args.max_steps) + tutoring_corpus(0, args.align_episodes),
                  config, encoder, temporal_filter, args.recent_window)
    training_slots = np.concatenate([item.student[-1].memory for item in fit if len(item.student[-1].memory)])
    return fit_bottleneck(training_slots, args.memory_width, encoder.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="policy.model (tiny for a quick check)")
    parser.add_argument("--projector", default="auto", help="aligned projector: auto (shipped) or a file")
    parser.add_argument("--labyrinth-episodes", type=int, default=2, help="held-out labyrinth episodes (>= --min-steps)")
    parser.add_argument("--tutoring-episodes", type=int, default=4, help="held-out multi-turn arithmetic episodes")
    parser.add_argument("--min-steps", type=int, default=100, help="labyrinth episodes shorter than this are skipped")
    parser.add_argument("--max-steps", type=int, default=160, help="labyrinth step limit of the scored episodes")
    parser.add_argument("--steps-per-episode", type=int, default=24, help="scored actions per episode")
    parser.add_argument("--recent-window", type=int, default=1, help="finished steps in full text")
    parser.add_argument("--recall-turns", type=int, default=None,
                        help="compression.recall_turns: earlier turns memory puts back as text; default: the config's")
    parser.add_argument("--keep-threshold", type=float, default=None,
                        help="compression.keep_threshold: higher keeps fewer, coarser slots (fewer bytes); "
                             "default: the temporal weights' calibrated value")
    parser.add_argument("--bottleneck", default=None,
                        help="compression.bottleneck: auto (the shipped basis: how memory travels by default), none "
                             "(the encoder's full width) or a basis file; default: the config's")
    parser.add_argument("--memory-width", type=int, default=None,
                        help="instead of --bottleneck, a basis fitted here: INT8 coordinates in this many principal "
                             "directions of training slots (--align-episodes per env, seed 0)")
    parser.add_argument("--recall-only", action="store_true",
                        help="labyrinth: score only actions whose object only the past names (put a gem, drop)")
    parser.add_argument("--batch", type=int, default=4, help="contexts per forward pass")
    parser.add_argument("--align-updates", type=int, default=0, help="align a projector here first (tests, tiny)")
    parser.add_argument("--align-episodes", type=int, default=2, help="with --align-updates: episodes per env")
    parser.add_argument("--align-lr", type=float, default=1e-3, help="with --align-updates: learning rate")
    parser.add_argument("--longest-step", type=int, default=1000, help="context lengths are measured up to this step")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from sao.compression.bottleneck import BottleneckMismatch, describe, memory_width, resolve_bottleneck
    from sao.compression.semantic import load_encoder
    from sao.compression.temporal import load_temporal_filter
    from sao.config import ConfigError, load_config
    from sao.offline.align import chat_formats, prepare, tutoring_corpus
    from sao.policy.weights import build_policy

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    overrides = [f'policy.model="{args.model}"']
    if args.keep_threshold is not None:  # validated by the config, which names the field on a bad value
        overrides.append(f"compression.keep_threshold={args.keep_threshold}")
    if args.bottleneck is not None:
        overrides.append(f"compression.bottleneck={json.dumps(args.bottleneck)}")
    if args.recall_turns is not None:
        overrides.append(f"compression.recall_turns={args.recall_turns}")
    try:
        config = load_config(overrides=overrides, environ={})
    except ConfigError as err:
        raise SystemExit(str(err)) from err  # names the config field (compression.keep_threshold, policy.model)
    encoder = load_encoder(config.compression.encoder)
    if args.memory_width is not None and not 1 <= args.memory_width <= encoder.dim:
        raise SystemExit(f"--memory-width must be between 1 and the encoder's width {encoder.dim} (got {args.memory_width})")
    temporal_filter = load_temporal_filter(config.compression.temporal_weights, config.compression.keep_threshold)
    try:
        bottleneck = resolve_bottleneck(config.compression.bottleneck, encoder.name)
    except BottleneckMismatch as err:
        raise SystemExit(str(err)) from err
    if args.memory_width is not None:
        bottleneck = fit_here(config, encoder, temporal_filter, args)
    policy = build_policy(config.policy, memory_width(bottleneck, encoder.dim)).eval()
    zero_state = {k: v.clone() for k, v in policy.projector.state_dict().items()}
    projector_line = load_aligned(policy, config, encoder, bottleneck, args, rng_seed=0)
    projector_line += f"\n{describe(bottleneck, encoder.dim)}"
    aligned_state = {k: v.clone() for k, v in policy.projector.state_dict().items()}
    episodes = (long_labyrinth(HELDOUT_SEED, args.labyrinth_episodes, args.min_steps, args.max_steps)
                + tutoring_corpus(HELDOUT_SEED, args.tutoring_episodes))
    prepared = prepare(episodes, config, encoder, temporal_filter, args.recent_window, bottleneck)
    chats = chat_formats(config, [e.env for e in episodes])
    rng = random.Random(0)
    rows: list[dict] = []
    progress = Console(stderr=True)
    for index, item in enumerate(prepared):
        # The next episode of the same env with memory lends its slots to the `other` context.
        others = [d for d in prepared[index + 1:] + prepared[:index] if len(d.trajectory.memory.vectors)]
        donors = [d for d in others if d.episode.env == item.episode.env] or others or [item]
        steps = scored_steps(item, args.steps_per_episode, rng, args.recall_only and item.episode.env == "textworld")
        rows += score_episode(policy, item, donors[0], steps, args.batch, zero_state, aligned_state,
                              chats.get(item.episode.env))
        progress.print(f"scored episode {index + 1}/{len(prepared)} ({item.episode.env}, {len(item.episode)} steps) "
                       f"at {time.perf_counter() - started:.0f} s")
    if args.recall_only and not any(r["env"] == "textworld" for r in rows):
        raise SystemExit("--recall-only: no labyrinth episode has an action that puts a gem or drops an item after "
                         "memory began; raise --labyrinth-episodes or --max-steps")
    by_env = {env: env_summary([r for r in rows if r["env"] == env]) for env in sorted({r["env"] for r in rows})}
    for env, summary in by_env.items():
        summary["wire"] = wire_cost([item for item in prepared if item.episode.env == env])
    lengths = context_lengths(config, encoder, temporal_filter, args.recent_window, HELDOUT_SEED, args.longest_step,
                              bottleneck)
    longest = lengths[max(lengths, key=int)]
    context_ratio = longest["sao"] / longest["full"]
    lab = by_env.get("textworld") or next(iter(by_env.values()))

    console = Console()
    console.print(projector_line)
    for env, summary in by_env.items():
        table = Table(title=f"{env}: {summary['actions']} held-out actions, teacher-forced (mean ± s.e.)")
        for column in ("context", "NLL / action", "KL(full || context) / action"):
            table.add_column(column, justify="right")
        for context in CONTEXTS:
            s = summary[context]
            table.add_row(context, f"{s['nll']:.3f} ± {s['nll_se']:.3f}", f"{s['kl']:.3f} ± {s['kl_se']:.3f}")
        console.print(table)
        console.print(f"gap recovered: aligned {summary['gap_recovered_sao']:.3f} ± {summary['gap_recovered_sao_se']:.3f}, "
                      f"zero projector {summary['gap_recovered_zero']:.3f} ± {summary['gap_recovered_zero_se']:.3f}, "
                      f"another episode's memory {summary['gap_recovered_other']:.3f} ± "
                      f"{summary['gap_recovered_other_se']:.3f}; NLL zero - aligned {summary['nll_zero_minus_sao']:+.3f} "
                      f"± {summary['nll_zero_minus_sao_se']:.3f}, other - aligned {summary['nll_other_minus_sao']:+.3f} "
                      f"± {summary['nll_other_minus_sao_se']:.3f}")
        wire = summary["wire"]
        console.print(f"memory on the wire: {wire['slots']} slots, {wire['steps_per_slot']:.2f} steps and "
                      f"{wire['tokens_per_slot']:.1f} tokens per slot; slot bytes / their token ids' bytes "
                      f"{wire['bytes_ratio']:.2f} ({wire['slot_bytes']} / {wire['replaced_token_bytes']})")
        if "gem_named_first" in summary:
            named = ", ".join(f"{c} {m:.2f} ± {e:.2f}" for c, (m, e) in summary["gem_named_first"].items())
            console.print(f"gem deliveries ({summary['gem_deliveries']}): the held gem ranked first among the world's "
                          f"gems - {named} (chance {summary['gem_chance']:.2f})")
    lengths_table = Table(title=f"context length (tokens + soft tokens), recent window {args.recent_window}")
    for column in ("step", "full text", "sao", "of which soft tokens", "recent window alone", "sao / full",
                   "tokens per slot", "slot bytes / replaced token bytes"):
        lengths_table.add_column(column, justify="right")
    for step, figures in lengths.items():
        lengths_table.add_row(step, str(figures["full"]), str(figures["sao"]), str(figures["soft_tokens"]),
                              str(figures["recent"]), f"{figures['sao'] / figures['full']:.3f}",
                              f"{figures['tokens_per_slot']:.1f}",
                              f"{figures['slot_bytes'] / max(figures['replaced_token_bytes'], 1):.2f}")
    console.print(lengths_table)
    seconds = time.perf_counter() - started
    console.print(f"{seconds:.0f} s, {args.threads} thread(s)")
    result = {
        "headline": {"metric": "gap recovered (labyrinth, aligned projector)", "value": lab["gap_recovered_sao"],
                     "baseline": lab["gap_recovered_zero"], "ratio": lab["gap_recovered_sao"],
                     "unit": "fraction of the truncation NLL gap",
                     # The same projector reading another episode's memory: what it shares with `value` is a
                     # learned prompt, not what this episode's memory says.
                     "other_episode_memory": lab["gap_recovered_other"]},
        "context_ratio": context_ratio, "gap_recovered_se": lab["gap_recovered_sao_se"],
        "model": args.model, "projector": projector_line, "recent_window": args.recent_window,
        "envs": by_env, "context_lengths": lengths, "seconds": seconds, "threads": args.threads,
        "args": {k: str(v) for k, v in vars(args).items()},
        "actions": [{"env": r["env"], "step": r["step"], **{c: list(r[c]) for c in CONTEXTS}} for r in rows],
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, allow_nan=True))


if __name__ == "__main__":
    main()
