"""Context compression on long text-labyrinth trajectories: bytes per stage, fidelity, throughput.

One run, on the same recorded trajectories (the noisy scripted expert of sao.envs.textworld,
run to 100 and to 1,000 steps on the same worlds; --short-steps and --steps change both):
  1. bytes: each step's full context as token ids (naive), the conversation stored once, and
     sao's trajectory message; each step's context after each compression stage (INT8 slots as
     they travel: in the shipped bottleneck's 64 coordinates unless --bottleneck none);
  2. fidelity: the return kept exactly in memory; a policy probe (predict the expert's next
     command) trained on sao's compressed memory and on the uncompressed history, same probe,
     same data, same budget; relative loss of test accuracy;
  3. throughput: the compressor's steps/s against the bare encoder's sentences/s, same texts.

    python benchmarks/compression.py --json runs/bench/compression.json
    python benchmarks/compression.py --episodes 3 --probe-train 2 --steps 60 --short-steps 20 ...   # a quick check

See benchmarks/README.md (Compression) for what each figure means and the last measured run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from sao.compression.accounting import STAGES, trajectory_bytes, trajectory_context_costs
from sao.compression.bottleneck import resolve_bottleneck
from sao.compression.pipeline import OnlineCompressor, compress_batch
from sao.compression.semantic import load_encoder
from sao.compression.temporal import load_temporal_filter
from sao.config import EnvConfig
from sao.envs.textworld import TextWorldEnv
from sao.envs.textworld_agents import ExpertAgent
from sao.offline.episodes import (
    Episode,
    record_episode,
    replay_episode,
)

console = Console(width=None if os.isatty(1) else 120)
SYSTEM_PROMPT = "You explore a text labyrinth. Reply with exactly one command."
LABELS = ["go north", "go south", "go east", "go west", "take", "put", "unlock", "other"]
_EXITS = re.compile(r"Exits: ([a-z, ]+)\.")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--episodes", type=int, default=6, help="long (--steps) episodes recorded")
    parser.add_argument("--steps", type=int, default=1000, help="steps of the long episodes (the headline's)")
    parser.add_argument("--short-steps", type=int, default=100, help="the same episodes stopped at this step")
    parser.add_argument("--online-steps", type=int, default=200, help="steps the online throughput arm times")
    parser.add_argument("--probe-train", type=int, default=4, help="episodes each probe fold trains on (the rest test)")
    parser.add_argument("--probe-epochs", type=int, default=400, help="full-batch optimizer steps of each probe")
    parser.add_argument("--probe-seeds", type=int, default=2, help="probe initialisations per fold, averaged")
    parser.add_argument("--size", type=int, default=14, help="labyrinth side (rooms)")
    parser.add_argument("--gems", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.3, help="random-command rate of the recording expert")
    parser.add_argument("--recent-window", type=int, default=1)
    parser.add_argument("--encoder", default="default")
    parser.add_argument("--temporal-weights", default=None, help="default: the weights shipped with sao")
    parser.add_argument("--bottleneck", default="auto",
                        help="compression.bottleneck: auto (the basis shipped for the encoder), none, or a basis file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not 0 < args.short_steps < args.steps:
        parser.error(f"--short-steps {args.short_steps} must be between 1 and --steps {args.steps} (exclusive)")
    return args


# -- recording ----------------------------------------------------------------------------------
def record(args: argparse.Namespace) -> tuple[list[Episode], list[Episode]]:
    """Noisy-expert episodes that last the full --steps (1,000), and the same runs stopped at --short-steps (100).

    Worlds 0, 1, 2, ... of env seed 7 are tried in order; one the agent solves in fewer than
    1,000 steps is skipped. The world and the agent do not depend on the step budget, so a
    100-step run is its 1,000-step run's first 100 steps.
    """
    def config(max_steps: int) -> EnvConfig:
        options = {"size": args.size, "gems": args.gems, "locked_doors": 2, "max_steps": max_steps}
        return EnvConfig(name="textworld", seed=7 + args.seed, options=options)

    env, long, short, index = TextWorldEnv(), [], [], 0
    while len(long) < args.episodes:
        if index >= 20 * args.episodes:
            raise SystemExit(f"too few {args.steps}-step episodes; use a larger --size or --noise")
        task = TextWorldEnv.make_tasks(config(args.steps), 1, index)[0]
        episode = record_episode(env, task.task_id, task.spec, ExpertAgent(args.noise, seed=index))
        if len(episode) == args.steps:
            long.append(episode)
            task = TextWorldEnv.make_tasks(config(args.short_steps), 1, index)[0]
            short.append(record_episode(env, task.task_id, task.spec, ExpertAgent(args.noise, seed=index)))
        index += 1
    return long, short


# -- 1. bytes -----------------------------------------------------------------------------------
def size_figures(trajectories: list, encoder_dim: int) -> dict:
    wire = [trajectory_bytes(t) for t in trajectories]
    costs = [trajectory_context_costs(t, encoder_dim) for t in trajectories]
    mean = lambda values: float(np.mean(values))  # noqa: E731
    figures = {key: mean([w[key] for w in wire]) for key in wire[0]}
    figures["steps"] = mean([len(t.steps) for t in trajectories])
    figures["memory_slots"] = mean([len(t.memory.vectors) for t in trajectories])
    figures["ratio_sao"] = figures["naive"] / figures["sao"]
    figures["ratio_stored_once"] = figures["naive"] / figures["stored_once"]
    figures["ratio_message"] = figures["naive"] / figures["message"]
    figures["stages"] = {stage: {"positions": mean([c[stage].positions for c in costs]),
                                 "bytes": mean([c[stage].bytes for c in costs])} for stage in STAGES}
    for stage in STAGES:
        entry = figures["stages"][stage]
        entry["bytes_ratio"] = figures["stages"]["naive"]["bytes"] / entry["bytes"]
        entry["positions_ratio"] = figures["stages"]["naive"]["positions"] / entry["positions"]
    return figures


def print_sizes(sizes: dict) -> None:
    table = Table(title="Context bytes per trajectory (mean) - what the trainer receives")
    for column in ("steps", "naive", "stored once", "sao", "of which memory", "of which slot refs", "naive / sao",
                   "naive / stored once", "sao message, all fields"):
        table.add_column(column, justify="right")
    for steps, f in sizes.items():
        table.add_row(steps, f"{f['naive']:,.0f}", f"{f['stored_once']:,.0f}", f"{f['sao']:,.0f}",
                      f"{f['memory']:,.0f}", f"{f['slot_refs']:,.0f}", f"{f['ratio_sao']:.1f}x",
                      f"{f['ratio_stored_once']:.1f}x", f"{f['message']:,.0f}")
    console.print(table)
    table = Table(title="Each step's policy context, summed over steps, after each stage (mean per trajectory)")
    table.add_column("steps", justify="right")
    table.add_column("stage")
    for column in ("positions", "x fewer than naive", "bytes", "x smaller than naive"):
        table.add_column(column, justify="right")
    for steps, f in sizes.items():
        for stage in STAGES:
            entry = f["stages"][stage]
            table.add_row(steps, stage, f"{entry['positions']:,.0f}", f"{entry['positions_ratio']:.2f}",
                          f"{entry['bytes']:,.0f}", f"{entry['bytes_ratio']:.2f}")
    console.print(table)


# -- 2. fidelity --------------------------------------------------------------------------------
ARMS = {
    "full": "full history: fp32 embedding of every older step",
    "sao": "sao memory: int8 kept slots",
    "none": "no memory (recent window + observation only)",
}
HEADS = {"command": len(LABELS), "carrying": 2}


def label_index(command: str) -> int:
    for index, label in enumerate(LABELS[:-1]):
        if command == label or (index >= 4 and command.startswith(label + " ")):
            return index
    return len(LABELS) - 1


def carrying_gem(episode: Episode) -> np.ndarray:
    """Whether the agent holds a gem before each step: ground truth, by replaying the episode."""
    env = TextWorldEnv()
    env.reset(episode.meta["spec"])
    carrying = []
    for step in episode.steps:
        carrying.append(any(item in env.world.gems for item in env.state.inventory))
        env.step(step.action)
    return np.array(carrying, np.int64)


class MemoryProbe(torch.nn.Module):
    """Reads the memory in order with a small LSTM; heads see [its state, observation, recent step].

    The state for step t is the one after the memory items visible at t, so one pass over an
    episode's memory serves every step. Same architecture, data and optimizer steps for every arm.
    """

    def __init__(self, dim: int, hidden: int = 32, context: int = 128):
        super().__init__()
        self.project = torch.nn.Linear(dim, hidden)
        self.reader = torch.nn.LSTM(hidden, hidden, batch_first=True)  # an LSTM: ~10x faster than a GRU on CPU
        self.context = torch.nn.Linear(2 * dim, context)
        self.heads = torch.nn.ModuleDict({name: torch.nn.Linear(context + hidden, n) for name, n in HEADS.items()})

    def forward(self, memory, counts, context):  # [B, K, dim], [B, T] visible items, [B, T, 2 dim]
        states, _ = self.reader(torch.tanh(self.project(memory)))
        states = torch.cat([torch.zeros_like(states[:, :1]), states], 1)  # index 0: nothing visible yet
        state = torch.gather(states, 1, counts[..., None].expand(-1, -1, states.shape[2]))
        features = torch.cat([torch.relu(self.context(context)), state], -1)
        return {name: head(features) for name, head in self.heads.items()}


def probe_batch(samples: list[dict], arm: str, basis: tuple[np.ndarray, np.ndarray]) -> tuple[torch.Tensor, ...]:
    """Padded tensors of one arm; every vector is first reduced with the training PCA `basis`."""
    mean, components = basis
    reduce = lambda x: ((x - mean) @ components.T).astype(np.float32)  # noqa: E731
    dim = components.shape[0]
    memories = [reduce(s["steps"]) if arm == "full" else reduce(s["slots"]) if arm == "sao"
                else np.zeros((0, dim), np.float32) for s in samples]
    counts = [s["older"] if arm == "full" else s["visible"] if arm == "sao" else np.zeros_like(s["older"])
              for s in samples]
    memory = torch.zeros(len(samples), max(1, max(len(m) for m in memories)), dim)
    for row, vectors in enumerate(memories):
        memory[row, : len(vectors)] = torch.from_numpy(vectors)
    context = np.stack([np.concatenate([reduce(s["observations"]), reduce(s["recent"])], 1) for s in samples])
    targets = {h: torch.from_numpy(np.stack([s[h] for s in samples])) for h in HEADS}
    return memory, torch.from_numpy(np.stack(counts)), torch.from_numpy(context), targets


def run_probe(train: list[dict], test: list[dict], arm: str, seed: int, epochs: int, dims: int = 64) -> dict:
    # PCA of the training episodes' step embeddings keeps the probe small and fast on one thread.
    vectors = np.concatenate([s["steps"] for s in train])
    mean = vectors.mean(0)
    components = np.linalg.svd(vectors - mean, full_matrices=False)[2][:dims]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        probe = MemoryProbe(dims)
    optimizer = torch.optim.Adam(probe.parameters(), lr=3e-3)
    memory, counts, context, targets = probe_batch(train, arm, (mean, components))
    for _ in range(epochs):  # full batch: a few long episodes
        outputs = probe(memory, counts, context)
        loss = sum(torch.nn.functional.cross_entropy(outputs[h].flatten(0, 1), targets[h].flatten()) for h in HEADS)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    memory, counts, context, targets = probe_batch(test, arm, (mean, components))
    with torch.no_grad():
        outputs = probe(memory, counts, context)
    return {h: float((outputs[h].argmax(-1) == targets[h]).float().mean()) for h in HEADS}


def fidelity_figures(episodes, step_embeddings, observation_embeddings, trajectories, window, train_count, seed,
                     epochs, seeds, bottleneck=None):
    returns_exact = []
    for episode, trajectory in zip(episodes, trajectories):
        # The sent memory's reward sums equal the rewards of the steps its spans cover, and the
        # steps carry every reward: the return is kept exactly.
        spans, sums = trajectory.memory.spans, trajectory.memory.reward_sums
        covered = [sum(episode.rewards()[first:last + 1]) for first, last in spans]
        returns_exact.append(trajectory.total_reward == sum(episode.rewards())
                             and all(np.float32(c) == s for c, s in zip(covered, sums)))
    samples = []
    for episode, steps, observations, trajectory in zip(episodes, step_embeddings, observation_embeddings, trajectories):
        recent = np.zeros_like(steps)
        for t in range(1, len(steps)):
            recent[t] = steps[max(0, t - window):t].mean(0) if window else 0.0
        memory = trajectory.memory
        samples.append({
            "steps": steps, "older": np.array([max(0, t - window) for t in range(len(steps))]),
            # Slots in the encoder's space, as the probe reads the history: a bottleneck's coordinates decoded.
            "slots": (bottleneck.decode if bottleneck is not None else np.asarray)(
                memory.dequantized(len(memory.vectors))),
            "visible": np.array([s.memory_count for s in trajectory.steps]),
            "observations": observations, "recent": recent,
            "command": np.array([label_index(s.label) for s in episode.steps], np.int64),
            "carrying": carrying_gem(episode),
        })
    # Cross-validation over worlds: each fold tests on `test_count` episodes and trains on the rest.
    test_count = len(samples) - train_count
    folds = [list(range(start, start + test_count)) for start in range(0, len(samples) - test_count + 1, test_count)]
    per_fold = {arm: [] for arm in ARMS}  # one entry per (fold, probe seed)
    for test_ids in folds:
        train = [s for i, s in enumerate(samples) if i not in test_ids]
        test = [samples[i] for i in test_ids]
        for probe_seed in range(seed, seed + seeds):
            for arm in ARMS:
                per_fold[arm].append(run_probe(train, test, arm, probe_seed, epochs))
    arms = {arm: {h: float(np.mean([fold[h] for fold in per_fold[arm]])) for h in HEADS} for arm in ARMS}
    # Spread of the sao-vs-full difference over folds and seeds: the resolution of this measurement.
    spread = {h: float(np.std([(f[h] - s[h]) / f[h] for f, s in zip(per_fold["full"], per_fold["sao"])]))
              for h in HEADS}
    losses = {h: (arms["full"][h] - arms["sao"][h]) / arms["full"][h] for h in HEADS}
    retained = {h: (arms["sao"][h] - arms["none"][h]) / (arms["full"][h] - arms["none"][h])
                if arms["full"][h] != arms["none"][h] else None for h in HEADS}  # None: memory made no difference
    return {
        "returns_exact": all(returns_exact),
        "probe": {"episodes": len(samples), "folds": len(folds), "train_episodes": len(samples) - test_count,
                  "test_episodes": test_count, "steps": int(sum(len(s["command"]) for s in samples)),
                  "carrying_rate": float(np.mean(np.concatenate([s["carrying"] for s in samples]))),
                  "epochs": epochs, "seeds": seeds, "arms": arms, "per_fold": per_fold},
        "relative_loss": losses,
        "relative_loss_std": spread,
        "memory_benefit_retained": retained,
        "worst_relative_loss": max(losses.values()),
    }


def print_fidelity(fidelity: dict) -> None:
    probe = fidelity["probe"]
    table = Table(title=f"Probe accuracy on held-out worlds ({probe['folds']}-fold over {probe['episodes']} "
                        f"episodes, {probe['train_episodes']} train / {probe['test_episodes']} test per fold, "
                        f"{probe['seeds']} seeds)")
    table.add_column("context the probe reads")
    table.add_column("policy: expert's next command", justify="right")
    table.add_column("state: carrying a gem?", justify="right")
    for arm, label in ARMS.items():
        table.add_row(label, f"{probe['arms'][arm]['command']:.3f}", f"{probe['arms'][arm]['carrying']:.3f}")
    table.add_row("relative loss, sao vs full history (± std over runs)",
                  *(f"{fidelity['relative_loss'][h]:+.2%} ± {fidelity['relative_loss_std'][h]:.2%}" for h in HEADS))
    retained = fidelity["memory_benefit_retained"]
    table.add_row("share of memory's benefit sao keeps", *("n/a" if retained[h] is None else f"{retained[h]:.2f}"
                                                          for h in HEADS))
    console.print(table)
    console.print(f"returns exact in every trajectory: {fidelity['returns_exact']}")


# -- 3. throughput ------------------------------------------------------------------------------
def throughput_figures(encoder, temporal_filter, episode: Episode, online_steps: int, bottleneck=None) -> dict:
    """Steps/s of the compressor and sentences/s of the bare encoder on one trajectory's texts.

    The compressor runs with its embedding cache cleared (it only gains from repeats inside this
    trajectory) and once more with the cache off, which isolates the rest of sao's code.
    """
    texts, rewards = episode.texts(), episode.rewards()
    few = texts[:online_steps]

    def rate(count: int, run) -> float:
        encoder.clear_cache()
        started = time.perf_counter()
        run()
        return count / (time.perf_counter() - started)

    def bare_single():
        for text in few:
            encoder.model.encode([text], convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False)

    def online():
        compressor = OnlineCompressor(encoder, temporal_filter, bottleneck=bottleneck)
        for text, reward in zip(few, rewards):
            compressor.finish_turn(text, reward)
        shares.update(compressor.stats().__dict__)

    shares: dict = {}
    figures = {
        "batch": {"steps": len(texts), "unique_texts": len(set(texts)), "encoder_sentences_per_s": rate(
            len(texts), lambda: encoder.model.encode(texts, batch_size=64, convert_to_numpy=True,
                                                     normalize_embeddings=True, show_progress_bar=False)),
            "compressor_steps_per_s": rate(len(texts), lambda: compress_batch(texts, rewards, encoder, temporal_filter,
                                                                               bottleneck=bottleneck))},
        "online": {"steps": len(few), "unique_texts": len(set(few)), "encoder_sentences_per_s": rate(len(few), bare_single),
                   "compressor_steps_per_s": rate(len(few), online)},
    }
    cache_size, encoder.cache_size = encoder.cache_size, 0
    try:
        figures["online"]["compressor_steps_per_s_no_cache"] = rate(len(few), online)
    finally:
        encoder.cache_size = cache_size
    spent = shares["encode_seconds"] + shares["filter_seconds"] + shares["quantize_seconds"]
    online_figures = figures["online"]
    online_figures["share_of_time_no_cache"] = {stage: shares[f"{stage}_seconds"] / spent
                                                for stage in ("encode", "filter", "quantize")}
    online_figures["ratio_no_cache"] = online_figures["compressor_steps_per_s_no_cache"] / online_figures[
        "encoder_sentences_per_s"]
    # One encode call embeds each distinct text once, cache or not: compare the model work alone.
    batch = figures["batch"]
    batch["compressor_distinct_texts_per_s"] = batch["compressor_steps_per_s"] * batch["unique_texts"] / batch["steps"]
    batch["ratio_per_distinct_text"] = batch["compressor_distinct_texts_per_s"] / batch["encoder_sentences_per_s"]
    for f in figures.values():
        f["ratio"] = f["compressor_steps_per_s"] / f["encoder_sentences_per_s"]
    return figures


def print_throughput(throughput: dict) -> None:
    table = Table(title="Compressor throughput vs the bare encoder on the same texts (1 CPU thread)")
    for column in ("path", "texts (distinct)", "bare encoder, sentences/s", "compressor, steps/s",
                   "compressor / encoder", "without repeats"):
        table.add_column(column, justify="right" if column != "path" else "left")
    batch, online = throughput["batch"], throughput["online"]
    table.add_row("batch", f"{batch['steps']} ({batch['unique_texts']})", f"{batch['encoder_sentences_per_s']:.1f}",
                  f"{batch['compressor_steps_per_s']:.1f}", f"{batch['ratio']:.2f}",
                  f"{batch['ratio_per_distinct_text']:.2f} (per distinct text)")
    table.add_row("online", f"{online['steps']} ({online['unique_texts']})", f"{online['encoder_sentences_per_s']:.1f}",
                  f"{online['compressor_steps_per_s']:.1f}", f"{online['ratio']:.2f}",
                  f"{online['ratio_no_cache']:.2f} (cache off)")
    console.print(table)
    share = throughput["online"]["share_of_time_no_cache"]
    console.print("online compressor time, cache off: " + ", ".join(f"{k} {v:.1%}" for k, v in share.items()))


# -- main ---------------------------------------------------------------------------------------
def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    from sao.policy.chat import ChatFormat
    from sao.policy.loading import load_tokenizer

    chat = ChatFormat(load_tokenizer("smollm2-135m-instruct", "~/.cache/sao/models"), SYSTEM_PROMPT)
    encoder = load_encoder(args.encoder)
    temporal_filter = load_temporal_filter(args.temporal_weights)
    bottleneck = resolve_bottleneck(args.bottleneck, encoder.name)
    long_episodes, short_episodes = record(args)
    console.print(f"recorded {len(long_episodes)} x {args.steps:,} and {len(short_episodes)} x {args.short_steps:,}"
                  "-step episodes "
                  f"({time.perf_counter() - started:.0f} s)")

    step_embeddings = [encoder.encode(e.texts()) for e in long_episodes]
    observation_embeddings = [encoder.encode([s.observation for s in e.steps]) for e in long_episodes]
    console.print(f"encoded ({time.perf_counter() - started:.0f} s)")
    long_trajectories = [replay_episode(e, chat, encoder, temporal_filter, args.recent_window, embeddings=se,
                                        bottleneck=bottleneck)[0] for e, se in zip(long_episodes, step_embeddings)]
    # The 100-step runs repeat the 1,000-step ones' first 100 steps (same worlds, same agent seeds).
    short_trajectories = [replay_episode(e, chat, encoder, temporal_filter, args.recent_window, bottleneck=bottleneck)[0]
                          for e in short_episodes]
    sizes = {str(args.short_steps): size_figures(short_trajectories, encoder.dim),
             str(args.steps): size_figures(long_trajectories, encoder.dim)}
    print_sizes(sizes)

    fidelity = fidelity_figures(long_episodes, step_embeddings, observation_embeddings, long_trajectories,
                                args.recent_window, args.probe_train, args.seed, args.probe_epochs, args.probe_seeds,
                                bottleneck)
    print_fidelity(fidelity)
    throughput = throughput_figures(encoder, temporal_filter, long_episodes[0], online_steps=args.online_steps,
                                    bottleneck=bottleneck)
    print_throughput(throughput)

    long = sizes[str(args.steps)]
    keep_ratio = float(np.mean([len(t.memory.vectors) / max(1, len(t.steps) - 1) for t in long_trajectories]))
    result = {
        "benchmark": "compression",
        "headline": {"metric": f"context bytes of a {args.steps:,}-step trajectory, naive per-step contexts / sao "
                               "trajectory",
                     "value": long["sao"], "baseline": long["naive"], "ratio": long["ratio_sao"], "unit": "bytes"},
        "fidelity_loss": fidelity["worst_relative_loss"],
        "stored_once_ratio": long["ratio_stored_once"],
        "policy_context_positions_ratio": long["stages"]["int8"]["positions_ratio"],
        "policy_context_bytes_ratio": long["stages"]["int8"]["bytes_ratio"],
        "keep_ratio": keep_ratio,
        "sizes": sizes,
        "fidelity": fidelity,
        "throughput": throughput,
        "setup": {"env": f"textworld size={args.size} gems={args.gems} locked_doors=2, noisy expert noise={args.noise}",
                  "episodes": args.episodes, "steps": args.steps, "short_steps": args.short_steps,
                  "encoder": encoder.name,
                  "temporal_filter": temporal_filter.meta.get("command", args.temporal_weights),
                  "threshold": temporal_filter.threshold, "recent_window": args.recent_window,
                  "bottleneck": bottleneck.identity if bottleneck is not None else "none",
                  "tokenizer": "SmolLM2-135M-Instruct", "threads": args.threads, "seed": args.seed,
                  "machine": platform.platform(), "cpu_count": os.cpu_count(),
                  "wall_s": time.perf_counter() - started},
    }
    console.print(f"headline: {result['headline']['ratio']:.1f}x smaller than naive at {args.steps:,} steps "
                  f"(stored once alone: {result['stored_once_ratio']:.1f}x); fidelity loss (worse probe) "
                  f"{result['fidelity_loss']:+.2%}; wall {result['setup']['wall_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
