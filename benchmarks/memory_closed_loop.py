"""Closed loop: does the LM policy act as well with sao memory as with the full history? Task success, not NLL.

    python benchmarks/memory_closed_loop.py [--minutes 10] [--json PATH]

The policy plays small held-out labyrinths (sao.envs.textworld: one gem in a dead-end vault,
30-60 moves) in four contexts, on the same worlds with the same random numbers:
  full     - every earlier step in text (nothing becomes memory)
  sao      - memory soft tokens through the projector `policy.projector` names (the aligned one
             shipped for the model + encoder) + the recent window in text, built online by the
             sampler's compressor (sao.compression.pipeline.OnlineCompressor)
  zero     - the same memory through the zero projector (a run without alignment)
  recent   - the recent window alone: memory slots dropped (truncation)

Acting: a 135M policy left to generate freely writes prose, not commands (every arm then scores
0), so each move is drawn from the policy's own distribution renormalised over the commands the
env admits there (TextWorld's "admissible commands", the usual way LM agents are scored on text
games): p(command | context) is the product of its tokens' probabilities, end of turn included,
and the move is sampled from p^(1/T) with the config's temperature. Contexts are built token for
token as the sampler builds them (sao.sampler.rollout.LiveEpisode), so only the context differs.

Arms take turns world by world until the time budget is spent, so every arm plays the same
worlds. Per arm, mean ± s.e. over episodes of: return (share of gems on the altar), solved, gem
taken (the first half of the task), distinct rooms visited (revisiting is what an agent without
its history does) and steps. The headline is sao's mean return against truncation's (`ratio` =
sao / recent); `paired` holds the per-world differences with their standard errors.
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

ARMS = ("full", "sao", "zero", "recent")
METRICS = ("return", "solved", "gem_taken", "rooms_visited", "steps")
# Small enough that a 135M policy sometimes finishes, large enough that it needs its past: 16 rooms, one gem.
WORLD = {"size": 4, "gems": 1, "locked_doors": 0, "distractors": 2, "loops": 1}


def command_logprobs(policy, prompt_ids, memory, context_ids, commands: list[np.ndarray]) -> np.ndarray:
    """log p(command | context) for each command: the shared context runs once, the commands as one batch."""
    import torch
    import torch.nn.functional as F

    from sao.policy.context import TurnInput
    from sao.policy.model import CACHE_ARGUMENT, collate_turns, kv_cache

    batch = collate_turns([TurnInput(prompt_ids, memory, context_ids, np.zeros(0, np.int32))], policy.memory_width)
    embeds = policy._embed(batch.token_ids, batch.memory_vectors, batch.memory_mask)
    out = policy.lm(inputs_embeds=embeds, use_cache=True, logits_to_keep=1)
    first = F.log_softmax(out.logits[0, -1].float(), dim=-1)
    width, length = max(len(c) for c in commands), embeds.shape[1]
    tokens = torch.zeros(len(commands), width, dtype=torch.long)
    mask = torch.zeros(len(commands), width, dtype=torch.long)
    for row, command in enumerate(commands):
        tokens[row, :len(command)] = torch.as_tensor(command, dtype=torch.long)
        mask[row, :len(command)] = 1
    cache = kv_cache(out)
    cache.batch_repeat_interleave(len(commands))
    attention = torch.cat([torch.ones(len(commands), length, dtype=torch.long), mask], dim=1)
    positions = torch.arange(length, length + width).unsqueeze(0).expand(len(commands), -1)
    logits = policy.lm(input_ids=tokens, attention_mask=attention, position_ids=positions, **{CACHE_ARGUMENT: cache},
                       use_cache=False).logits.float()
    # Token i of a command is predicted at command position i - 1 (the first one by the context's last position).
    later = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return (first[tokens[:, 0]] + (later * mask[:, 1:]).sum(dim=1)).numpy()


def play(spec: dict, policy, chat, encoder, temporal_filter, recent_window: int, use_memory: bool,
         temperature: float, seed: int, bottleneck=None) -> dict:
    """One episode; its return, solved, gem_taken, rooms_visited, steps and first moves."""
    from sao.compression.pipeline import OnlineCompressor
    from sao.envs.textworld import TextWorldEnv
    from sao.policy.chat import turn_text
    from sao.policy.context import turn_tokens

    rng = np.random.default_rng(seed)
    env = TextWorldEnv()
    text = env.reset(spec)
    prompt_ids, observation_ids, observation_text = chat.prompt(text), chat.first_observation(text), text
    compressor = OnlineCompressor(encoder, temporal_filter.fork(), recent_window=recent_window, bottleneck=bottleneck)
    finished: list[tuple[np.ndarray, np.ndarray]] = []
    rooms, gem_taken, total, moves = {env.state.position}, False, 0.0, []
    while True:
        commands = env.admissible_actions()
        command_ids = [chat.action_ids(c) for c in commands]
        visible = len(compressor.visible_slots()) if use_memory else 0
        scores = command_logprobs(policy, prompt_ids, compressor.dequantized(list(range(visible))),
                                  turn_tokens(finished, observation_ids, recent_window), command_ids)
        weights = np.exp((scores - scores.max()) / temperature)
        choice = int(rng.choice(len(commands), p=weights / weights.sum()))
        feedback = env.step(commands[choice])
        moves.append(commands[choice])
        total += feedback.reward
        rooms.add(env.state.position)
        gem_taken |= bool(set(env.world.gems) & (set(env.state.inventory) | set(env.state.delivered)))
        finished.append((observation_ids, command_ids[choice]))
        if feedback.done:
            break
        compressor.finish_turn(turn_text(observation_text, commands[choice]), feedback.reward)
        observation_text = feedback.observation
        observation_ids = chat.feedback_observation(feedback.observation, command_ids[choice])
    return {"return": total, "solved": float(total >= 1 - 1e-6), "gem_taken": float(gem_taken),
            "rooms_visited": float(len(rooms)), "steps": float(len(moves)), "first_moves": moves[:12]}


def mean_se(values: list[float]) -> dict:
    from sao.offline.align import summarise

    return dict(zip(("mean", "se"), summarise(values)))  # se NaN below two episodes


def summary(episodes: list[dict]) -> dict:
    return {m: mean_se([e[m] for e in episodes]) for m in METRICS}


def paired(a: list[dict], b: list[dict], metric: str) -> dict:
    return mean_se([x[metric] - y[metric] for x, y in zip(a, b)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="policy.model (tiny for a quick check)")
    parser.add_argument("--minutes", type=float, default=10.0, help="time budget; arms stop together, world by world")
    parser.add_argument("--max-episodes", type=int, default=64, help="at most this many worlds per arm")
    parser.add_argument("--max-steps", type=int, default=30, help="moves per episode (30-60: a medium horizon)")
    parser.add_argument("--recent-window", type=int, default=1, help="finished steps in full text (sao, zero, recent)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := set(arms) - set(ARMS):
        parser.error(f"--arms: unknown {sorted(unknown)}; choose from {', '.join(ARMS)}")

    import torch
    from rich.console import Console
    from rich.table import Table

    from sao.compression.bottleneck import memory_width, resolve_bottleneck
    from sao.compression.semantic import load_encoder
    from sao.compression.temporal import load_temporal_filter
    from sao.config import load_config
    from sao.envs.registry import make_tasks
    from sao.offline.align import chat_formats
    from sao.policy.projector import apply_projector_setting
    from sao.policy.weights import build_policy

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    options = {**WORLD, "max_steps": args.max_steps}
    config = load_config(overrides=[f'policy.model="{args.model}"', 'env.name="textworld"',
                                    f"env.max_turns={args.max_steps}",
                                    *(f"env.options.{key}={value}" for key, value in options.items())], environ={})
    encoder = load_encoder(config.compression.encoder)
    temporal_filter = load_temporal_filter(config.compression.temporal_weights, config.compression.keep_threshold)
    chat = chat_formats(config, ["textworld"])["textworld"]
    bottleneck = resolve_bottleneck(config.compression.bottleneck, encoder.name)  # memory as it travels
    policy = build_policy(config.policy, memory_width(bottleneck, encoder.dim)).eval()
    zero_state = {k: v.clone() for k, v in policy.projector.state_dict().items()}
    projector_line = apply_projector_setting(policy.projector, config.policy.projector, config.policy.model,
                                             config.compression.encoder, bottleneck)
    aligned_state = {k: v.clone() for k, v in policy.projector.state_dict().items()}
    settings = {"full": (args.max_steps, False, aligned_state), "sao": (args.recent_window, True, aligned_state),
                "zero": (args.recent_window, True, zero_state), "recent": (args.recent_window, False, aligned_state)}
    tasks = make_tasks(config.env, args.max_episodes, split="eval")
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    progress = Console(stderr=True)
    for index, task in enumerate(tasks):
        for arm in arms:
            window, use_memory, state = settings[arm]
            policy.projector.load_state_dict(state)
            with torch.no_grad():
                results[arm].append(play(task.spec, policy, chat, encoder, temporal_filter, window, use_memory,
                                         config.policy.temperature, seed=index, bottleneck=bottleneck))
        elapsed = time.perf_counter() - started
        progress.print(f"{index + 1} worlds per arm at {elapsed:.0f} s: " + ", ".join(
            f"{a} return {results[a][-1]['return']:.1f} rooms {results[a][-1]['rooms_visited']:.0f}" for a in arms))
        if elapsed * (index + 2) / (index + 1) > args.minutes * 60:
            break  # another world would overrun the budget

    n = len(results[arms[0]])
    by_arm = {arm: summary(results[arm]) for arm in arms}
    comparisons = {f"{a}-{b}": {m: paired(results[a], results[b], m) for m in ("return", "gem_taken", "rooms_visited")}
                   for a, b in (("sao", "recent"), ("sao", "zero"), ("full", "recent")) if a in results and b in results}
    console = Console()
    table = Table(title=f"closed loop: {n} held-out labyrinths per arm, {options}; mean ± s.e.")
    table.add_column("context")
    for metric in METRICS:
        table.add_column(metric, justify="right")
    for arm in arms:
        table.add_row(arm, *(f"{by_arm[arm][m]['mean']:.3f} ± {by_arm[arm][m]['se']:.3f}" for m in METRICS))
    console.print(table)
    for name, figures in comparisons.items():
        console.print(f"{name}, paired by world: "
                      + ", ".join(f"{m} {v['mean']:+.3f} ± {v['se']:.3f}" for m, v in figures.items()))
    seconds = time.perf_counter() - started
    console.print(f"{projector_line}\n{seconds:.0f} s, {args.threads} thread(s)")
    value = by_arm["sao"]["return"]["mean"] if "sao" in by_arm else float("nan")
    baseline = by_arm["recent"]["return"]["mean"] if "recent" in by_arm else float("nan")
    result = {
        "headline": {"metric": "return per episode (share of gems delivered), sao memory vs truncation",
                     "value": value, "baseline": baseline, "ratio": value / baseline if baseline else float("nan"),
                     "unit": "return"},
        "episodes_per_arm": n, "world": options, "model": args.model, "recent_window": args.recent_window,
        "temperature": config.policy.temperature, "projector": projector_line, "arms": by_arm,
        "paired": comparisons, "seconds": seconds, "threads": args.threads, "episodes": results,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, allow_nan=True))


if __name__ == "__main__":
    main()
