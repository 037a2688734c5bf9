"""`sao compression …`: record scripted episodes, train the temporal filter, fit the memory basis, align the projector, inspect.

Episodes come from a file (JSONL episodes, or length-prefixed trajectory messages: see
sao/offline/episodes.py), from the trajectories topic (`--bootstrap-servers`), or are
played on the spot by an env's scripted agents (`--from-env textworld`).
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Column, Table

from sao.cli_options import ConfigOpt, SetOpt, config_or_exit, console, fail, setup_logging
from sao.config import SaoConfig

if TYPE_CHECKING:  # imported where used: `sao` loads this module for every command, and episodes pulls torch
    from sao.offline.episodes import Episode

compression_app = typer.Typer(help="The context compressor: record episodes, train the temporal filter, fit the memory "
                              "basis, align the projector, inspect.",
                              no_args_is_help=True)
logger = logging.getLogger(__name__)


@compression_app.callback()
def _setup_logging() -> None:
    """Log like every `sao` command (each subcommand runs after this)."""
    setup_logging()


InputOpt = Annotated[Path | None, typer.Option(
    "--input", help="Recorded episodes: JSONL, or length-prefixed trajectory messages.")]
BootstrapOpt = Annotated[str | None, typer.Option(help="Read trajectories from this Kafka instead of a file.")]
FromEnvOpt = Annotated[str | None, typer.Option(help="Play episodes with this env's scripted agents (textworld).")]
AgentOpt = Annotated[str, typer.Option(help="Scripted agent: expert, noisy, random, or mix (4 noisy : 1 random).")]
SeedOpt = Annotated[int, typer.Option(help="Seed of the agents, the worlds (env.seed) and the LSTM training.")]
EncoderOpt = Annotated[str | None, typer.Option(help="Sentence encoder path or name (default: compression.encoder).")]
NoiseOpt = Annotated[float, typer.Option(min=0, max=1, help="Random-command rate of the noisy expert.")]
MaxMessagesOpt = Annotated[int | None, typer.Option(min=1, help="With --bootstrap-servers: read at most this many.")]
KeepRatioOpt = Annotated[float, typer.Option(min=0.01, max=1.0, help="Calibrate the threshold to keep this share of steps.")]
WeightsOpt = Annotated[Path | None, typer.Option(help="Filter weights (default: compression.temporal_weights).")]
ThresholdOpt = Annotated[float | None, typer.Option(
    help="Keep threshold (default: compression.keep_threshold, else the weights').")]
OutOpt = Annotated[Path, typer.Option(help="Weights file to write (.safetensors; a .json sidecar goes beside it).")]


def scripted_episodes(cfg: SaoConfig, env_name: str, count: int, agent: str, noise: float, seed: int,
                      start_index: int = 0) -> list[Episode]:
    """Play `count` tasks of `env_name` (shaped by env.options) with a scripted agent (recall: the replies its
    rules ask for, whatever `agent`)."""
    if env_name == "recall":
        from sao.offline.episodes import recall_episodes

        return recall_episodes(cfg.env.model_copy(update={"name": env_name, "seed": seed}), count, start_index)
    if env_name != "textworld":
        raise typer.BadParameter(f"scripted agents exist for textworld and recall only, not {env_name!r}; record "
                                 "other envs with `sao sampler` and train from the trajectories topic",
                                 param_hint="--from-env")
    from sao.envs.textworld import TextWorldEnv
    from sao.envs.textworld_agents import make_agent
    from sao.offline.episodes import record_episode

    env_config = cfg.env.model_copy(update={"name": env_name, "seed": seed})
    try:
        tasks = TextWorldEnv.make_tasks(env_config, count, start_index)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--set env.options.…") from err
    env, episodes = TextWorldEnv(), []
    for offset, task in enumerate(tasks):
        kind = agent if agent != "mix" else ("random" if offset % 5 == 4 else "noisy")
        episodes.append(record_episode(env, task.task_id, task.spec, make_agent(kind, seed + offset, noise)))
    return episodes


def _tokenizer(cfg: SaoConfig):
    from sao.policy.loading import load_tokenizer

    return load_tokenizer(cfg.policy.model, cfg.policy.cache_dir)


def _recorded_episodes(cfg: SaoConfig, input_path: Path | None, bootstrap_servers: str | None,
                       max_messages: int | None, from_env: str | None = None) -> tuple[list[Episode], str, list[str]]:
    """The episodes of the one source given, --input or --bootstrap-servers (refused beside --from-env, where a
    command takes it), the source in words, and the flags that name it in the recorded command."""
    from sao.offline.episodes import holds_trajectory_records, read_episodes, read_episodes_from_topic

    if len([s for s in (input_path, bootstrap_servers, from_env) if s]) != 1:
        raise typer.BadParameter("give exactly one of --input, --bootstrap-servers, --from-env")
    if input_path is not None:
        if not input_path.is_file():
            raise typer.BadParameter(f"{input_path} does not exist", param_hint="--input")
        tokenizer = _tokenizer(cfg) if holds_trajectory_records(input_path) else None
        return read_episodes(input_path, tokenizer=tokenizer), f"file {input_path}", ["--input", str(input_path)]
    return (read_episodes_from_topic(bootstrap_servers, cfg.topics.trajectories, _tokenizer(cfg), max_messages),
            f"topic {cfg.topics.trajectories}", ["--bootstrap-servers", bootstrap_servers])


@compression_app.command()
def record(out: Annotated[Path, typer.Option(help="Where to write the episodes (JSONL).")],
           env: Annotated[str, typer.Option(help="Env whose scripted agents play.")] = "textworld",
           episodes: Annotated[int, typer.Option(min=1, help="Episodes to record.")] = 10,
           agent: AgentOpt = "noisy", noise: NoiseOpt = 0.2, seed: SeedOpt = 0,
           start_index: Annotated[int, typer.Option(min=0, help="First task index.")] = 0,
           config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Record episodes of the scripted agents to a JSONL file (world shape: --set env.options.size=12 …)."""
    from sao.offline.episodes import write_episodes

    cfg = config_or_exit(config, set_)
    recorded = scripted_episodes(cfg, env, episodes, agent, noise, seed, start_index)
    write_episodes(out, recorded)
    steps = [len(e) for e in recorded]
    solved = sum(bool(e.meta.get("solved")) for e in recorded)
    console.print(f"wrote {len(recorded)} episodes ({sum(steps)} steps, {min(steps)}-{max(steps)} per episode, "
                  f"{solved} solved) to {out}")


@compression_app.command()
def train(out: OutOpt, input_path: InputOpt = None, bootstrap_servers: BootstrapOpt = None, from_env: FromEnvOpt = None,
          episodes: Annotated[int, typer.Option(min=2, help="With --from-env: episodes to play.")] = 20,
          agent: AgentOpt = "mix", noise: NoiseOpt = 0.2, max_messages: MaxMessagesOpt = None,
          encoder: EncoderOpt = None, seed: SeedOpt = 0, target_keep_ratio: KeepRatioOpt = 0.5,
          hidden: Annotated[int, typer.Option(min=1, help="LSTM hidden size.")] = 128,
          epochs: Annotated[int, typer.Option(min=1, help="Training epochs.")] = 30,
          threads: Annotated[int, typer.Option(min=1, help="torch CPU threads.")] = 1,
          config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Train the LSTM redundancy filter self-supervised on recorded episodes and calibrate its threshold."""
    import torch

    from sao.compression.semantic import load_encoder
    from sao.compression.temporal import save_temporal_weights
    from sao.compression.train import train_from_texts

    cfg = config_or_exit(config, set_)
    torch.set_num_threads(threads)
    if from_env and not (input_path or bootstrap_servers):
        loaded = scripted_episodes(cfg, from_env, episodes, agent, noise, seed)
        source = f"{from_env} scripted agents ({agent}, noise {noise:g})"
        flags = ["--from-env", from_env, "--episodes", str(episodes), "--agent", agent, "--noise", f"{noise:g}"]
    else:
        loaded, source, flags = _recorded_episodes(cfg, input_path, bootstrap_servers, max_messages, from_env)
    if len(loaded) < 2:
        fail(f"[red]only {len(loaded)} episode(s) found[/]: training needs at least two", 1)
    sentence_encoder = load_encoder(encoder or cfg.compression.encoder)
    temporal_filter = train_from_texts([e.texts() for e in loaded], sentence_encoder,
                                       target_keep_ratio=target_keep_ratio, hidden=hidden, epochs=epochs, seed=seed)
    flags += [f"--set={item}" for item in set_ or []]
    flags += ["--seed", str(seed), "--target-keep-ratio", f"{target_keep_ratio:g}", "--hidden", str(hidden),
              "--epochs", str(epochs), "--out", str(out)] + (["--encoder", encoder] if encoder else [])
    meta = {**temporal_filter.meta, "threshold": temporal_filter.threshold,
            "command": shlex.join(["sao", "compression", "train", *flags]),
            "corpus": f"{len(loaded)} episodes from {source}"}
    save_temporal_weights(temporal_filter.model, out, meta)
    training = meta["training"]
    table = Table(title=f"temporal filter written to {out}")
    for column in ("episodes", "steps", "val loss", "previous-step baseline", "threshold", "keep ratio"):
        table.add_column(column, justify="right")
    table.add_row(str(meta["episodes"]), str(meta["steps"]), f"{training['val_loss']:.4f}",
                  f"{training['baseline_val_loss']:.4f}", f"{temporal_filter.threshold:.4f}", f"{meta['keep_ratio']:.3f}")
    Console().print(table)
    console.print(f"use it with --set compression.temporal_weights='\"{out}\"'")


@compression_app.command()
def bottleneck(width: Annotated[int, typer.Option(min=1, help="Directions kept: bytes a slot costs, less 4.")] = 64,
               seed: SeedOpt = 0,
               out: Annotated[Path | None, typer.Option(
                   help="Basis file to write (default: the shipped one for this encoder).")] = None,
               input_path: InputOpt = None, bootstrap_servers: BootstrapOpt = None, max_messages: MaxMessagesOpt = None,
               config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Fit the memory bottleneck: the principal directions memory slots travel in (compression.bottleneck), on the
    built-in scripted corpus or on your workload's episodes (--input, --bootstrap-servers)."""
    import torch

    from sao.compression.bottleneck import save_bottleneck, shipped_bottleneck_path
    from sao.compression.semantic import load_encoder
    from sao.compression.temporal import load_temporal_filter
    from sao.offline.memory_basis import fit_memory_basis

    cfg = config_or_exit(config, set_)
    torch.set_num_threads(1)  # one thread: the embeddings, and so the basis, come out the same bytes every run
    sentence_encoder = load_encoder(cfg.compression.encoder)
    if not 1 <= width <= sentence_encoder.dim:
        fail(f"[red]--width[/] must be between 1 and the encoder's {sentence_encoder.dim} dims (got {width})")
    temporal_filter = load_temporal_filter(cfg.compression.temporal_weights, cfg.compression.keep_threshold)
    episodes, source, named = None, "", []
    if input_path or bootstrap_servers:
        episodes, source, named = _recorded_episodes(cfg, input_path, bootstrap_servers, max_messages)
        if len(episodes) < 2:
            fail(f"[red]only {len(episodes)} episode(s) found[/]: fitting needs one to hold out and one more", 1)
    flags = [f"--set={item}" for item in set_ or []] + (["--out", str(out)] if out else []) + named
    try:
        basis, record = fit_memory_basis(sentence_encoder, temporal_filter, width, seed, episodes, source)
    except ValueError as err:  # fewer kept steps than --width
        fail(f"[red]--width {width}[/]: {err}", 1)
    path = out or shipped_bottleneck_path(sentence_encoder.name)
    record["command"] = shlex.join(["sao", "compression", "bottleneck", "--width", str(width), "--seed", str(seed),
                                    *flags])
    save_bottleneck(basis, path, record)
    kept = ", ".join(f"{name} {value:.3f}" for name, value in record["variance_kept"].items())
    console.print(f"wrote {path}: {width} of {sentence_encoder.dim} dims ({width + 4} B a slot instead of "
                  f"{sentence_encoder.dim + 4}), fitted on {sum(record['vectors'].values())} kept steps' embeddings; "
                  f"variance kept: {kept}; identity {basis.identity}")
    if out:
        console.print(f"use it with --set compression.bottleneck='\"{out}\"' (samplers and trainer alike)")


@compression_app.command()
def inspect(input_path: InputOpt = None, bootstrap_servers: BootstrapOpt = None, from_env: FromEnvOpt = None,
            index: Annotated[int, typer.Option(min=0, help="Which episode of the file, topic or env.")] = 0,
            agent: AgentOpt = "noisy", noise: NoiseOpt = 0.2, seed: SeedOpt = 0, encoder: EncoderOpt = None,
            temporal_weights: WeightsOpt = None, threshold: ThresholdOpt = None,
            limit: Annotated[int | None, typer.Option(min=1, help="Show at most this many rows.")] = None,
            kept_only: Annotated[bool, typer.Option(help="Show only the kept steps.")] = False,
            width: Annotated[int, typer.Option(min=10, help="Characters of step text shown.")] = 70,
            config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Compress one episode and show, step by step, what was kept, what merged, and why."""
    import torch

    from sao.compression.pipeline import compress_batch
    from sao.compression.semantic import load_encoder
    from sao.compression.temporal import load_temporal_filter

    cfg = config_or_exit(config, set_)
    torch.set_num_threads(1)
    if from_env:
        loaded = scripted_episodes(cfg, from_env, 1, agent, noise, seed, start_index=index)
        index = 0
    else:
        loaded, _, _ = _recorded_episodes(cfg, input_path, bootstrap_servers, index + 1)
    if index >= len(loaded):
        fail(f"[red]no episode {index}[/]: the source holds {len(loaded)}", 1)
    episode = loaded[index]
    sentence_encoder = load_encoder(encoder or cfg.compression.encoder)
    temporal_filter = load_temporal_filter(temporal_weights or cfg.compression.temporal_weights,
                                           threshold if threshold is not None else cfg.compression.keep_threshold)
    compressed = episode.compressed_steps()  # the sampler never compresses a final step
    texts, rewards = episode.texts(), episode.rewards()
    memory, _, decisions = compress_batch(texts[:compressed], rewards[:compressed], sentence_encoder,
                                          temporal_filter, recent_window=cfg.compression.recent_window)
    Console().print(decision_table(episode, decisions, memory.spans, temporal_filter.threshold, limit, kept_only, width))
    exact = float(memory.reward_sums.sum()) == sum(rewards[:compressed])
    console.print(f"{len(episode)} steps, {compressed} compressed into {len(memory)} slots "
                  f"(keep ratio {len(memory) / max(compressed, 1):.3f}); return {sum(rewards):g}, "
                  f"memory reward sums {'match' if exact else 'DO NOT match'} the compressed steps' rewards")


def decision_table(episode: Episode, decisions, spans, threshold: float, limit: int | None, kept_only: bool,
                   width: int) -> Table:
    """One row per step: its text, keep/merge, the reason, the prediction error, and its slot."""
    table = Table(Column("step", justify="right"), "text", "decision", "reason",
                  *[Column(column, justify="right") for column in ("error", "reward", "slot")],
                  title=f"{episode.task_id} ({episode.agent}): keep when error > {threshold:.4f}, "
                        "or reward, or first step")
    slot_of = {step: slot for slot, (first, last) in enumerate(spans) for step in range(first, last + 1)}
    for t, step in enumerate(episode.steps):
        decision = decisions[t] if t < len(decisions) else None
        if kept_only and not (decision and decision.keep):
            continue
        if limit is not None and table.row_count >= limit:
            break
        text = " ".join(f"{step.observation} ▸ {step.action}".split())
        text = text if len(text) <= width else text[: width - 1] + "…"
        if decision is None:
            cells = ("—", "final step, not compressed", "", "")
        else:
            cells = ("[green]keep[/]" if decision.keep else "[dim]merge[/]", decision.reason,
                     f"{decision.error:.4f}", str(slot_of[t]))
        table.add_row(str(t), text, cells[0], cells[1], cells[2], f"{step.reward:g}" if step.reward else "", cells[3])
    return table


@compression_app.command()
def align(out: Annotated[Path | None, typer.Option(
              help="Projector file to write (default: the shipped one for this model + encoder).")] = None,
          input_path: InputOpt = None, bootstrap_servers: BootstrapOpt = None,
          max_messages: MaxMessagesOpt = None,
          labyrinth_episodes: Annotated[int, typer.Option(min=0, help="Scripted labyrinth episodes to train on.")] = 8,
          tutoring_episodes: Annotated[int, typer.Option(min=0, help="Scripted multi-turn arithmetic episodes.")] = 8,
          max_steps: Annotated[int, typer.Option(min=2, help="Labyrinth: actions before an episode ends.")] = 120,
          updates: Annotated[int, typer.Option(min=0, help="Optimizer updates of the projector.")] = 40,
          batch_size: Annotated[int, typer.Option(min=1, help="Steps per update.")] = 4,
          lr: Annotated[float, typer.Option(min=0, help="AdamW learning rate of the projector.")] = 1e-3,
          top_k: Annotated[int, typer.Option(min=1, help="Teacher tokens kept per action token.")] = 64,
          reconstruct_updates: Annotated[int, typer.Option(
              min=0, help="Updates before distillation that teach each slot its step's text (0: none).")] = 0,
          reconstruct_batch: Annotated[int, typer.Option(min=1, help="Slots per reconstruction loss.")] = 16,
          reconstruct_weight: Annotated[float, typer.Option(
              min=0, help="Weight of the reconstruction loss added to each distillation update (0: none).")] = 0.0,
          recent_window: Annotated[int | None, typer.Option(
              min=0, help="Steps in full text (default: compression.recent_window).")] = None,
          validation_steps: Annotated[int, typer.Option(min=1, help="Held-out steps the KL is reported on.")] = 24,
          distil_share: Annotated[float, typer.Option(
              min=0.001, max=1.0, help="Distil on this share of the steps with memory: those where the recent window "
                                       "alone is furthest (KL) from full text (1: every step).")] = 1.0,
          seed: SeedOpt = 0,
          threads: Annotated[int, typer.Option(min=1, help="torch CPU threads.")] = 1,
          config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Align the memory projector by distillation (full text teaches memory), optionally after slots learn their step's
    text; reports whether slots carry their step's content. LM frozen."""
    import random
    import time

    import torch

    from sao.compression.semantic import encoder_name, load_encoder
    from sao.compression.temporal import load_temporal_filter
    from sao.offline import align as alignment
    from sao.offline import reconstruction as content
    from sao.policy.projector import save_projector, shipped_projector_path
    from sao.policy.weights import build_policy

    cfg = config_or_exit(config, set_)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    started = time.perf_counter()
    window = cfg.compression.recent_window if recent_window is None else recent_window
    if input_path or bootstrap_servers:
        loaded, source, flags = _recorded_episodes(cfg, input_path, bootstrap_servers, max_messages)
        random.Random(seed).shuffle(loaded)
        held = max(1, len(loaded) // 5)
        training, validation = loaded[held:], loaded[:held]
    else:
        training = (alignment.labyrinth_corpus(seed, labyrinth_episodes, max_steps)
                    + alignment.tutoring_corpus(seed, tutoring_episodes))
        # Held-out worlds and questions from another seed.
        validation = alignment.labyrinth_corpus(seed + 1, 1, max_steps) + alignment.tutoring_corpus(seed + 1, 1)
        source = (f"scripted: {labyrinth_episodes} labyrinth episodes (noisy expert / random, <= {max_steps} steps) + "
                  f"{tutoring_episodes} multi-turn arithmetic episodes (stuck learner), seed {seed}")
        flags = ["--labyrinth-episodes", str(labyrinth_episodes), "--tutoring-episodes", str(tutoring_episodes),
                 "--max-steps", str(max_steps)]
    encoder = load_encoder(cfg.compression.encoder)
    temporal_filter = load_temporal_filter(cfg.compression.temporal_weights, cfg.compression.keep_threshold)
    train_set = alignment.prepare(training, cfg, encoder, temporal_filter, window)
    val_set = alignment.prepare(validation, cfg, encoder, temporal_filter, window)
    policy = build_policy(cfg.policy, encoder.dim).train()
    val_pairs = alignment.memory_steps(val_set)
    val_pairs = sorted(random.Random(seed).sample(val_pairs, min(validation_steps, len(val_pairs))))
    kl_zero = alignment.mean_kl(policy, val_set, val_pairs)
    tokenizer = _tokenizer(cfg)
    train_slots = content.slot_examples(train_set, tokenizer)
    val_slots = content.slot_examples(val_set, tokenizer)  # every held-out slot: a forward each, cheap
    console.print(f"{len(train_set)} training episodes ({len(alignment.memory_steps(train_set))} steps with memory, "
                  f"{len(train_slots)} slots); held-out KL with the zero projector {kl_zero:.4f}")
    totals = {"reconstruct": reconstruct_updates, "distil": updates}
    distilled = alignment.informative_steps(policy, train_set, distil_share) if updates else []
    if distil_share < 1.0:
        console.print(f"distilling on {len(distilled)} of {len(alignment.memory_steps(train_set))} steps with memory "
                      f"(those the recent window alone answers least like full text)")

    def progress(phase: str, update: int, loss: float) -> None:
        if update % 5 == 0 or update == totals[phase] - 1:
            console.print(f"{phase} {update + 1}/{totals[phase]}: loss {loss:.4f} "
                          f"({time.perf_counter() - started:.0f} s)")

    losses = alignment.align_projector(policy, train_set, updates, lr, batch_size, seed, top_k, progress,
                                       reconstruction=train_slots, reconstruct_updates=reconstruct_updates,
                                       reconstruct_batch=reconstruct_batch, reconstruct_weight=reconstruct_weight,
                                       pairs=distilled or None)
    kl_aligned = alignment.mean_kl(policy, val_set, val_pairs)
    readable = content.content_nll(policy, val_slots)
    model, encoder_identity = cfg.policy.model, encoder_name(cfg.compression.encoder)
    target = out or shipped_projector_path(model, encoder_identity)
    flags += ["--updates", str(updates), "--batch-size", str(batch_size), "--lr", f"{lr:g}", "--top-k", str(top_k),
              "--reconstruct-updates", str(reconstruct_updates), "--reconstruct-batch", str(reconstruct_batch),
              "--reconstruct-weight", f"{reconstruct_weight:g}", "--distil-share", f"{distil_share:g}",
              "--recent-window", str(window), "--validation-steps", str(validation_steps), "--seed", str(seed),
              "--threads", str(threads)]  # the thread count can change float sums, so it is part of the recipe
    flags += [f"--set={item}" for item in set_ or []] + (["--out", str(out)] if out else [])
    meta = {"model": model, "encoder": encoder_identity, "corpus": source, "recent_window": window,
            "recall_turns": cfg.compression.recall_turns,
            "temporal_filter": temporal_filter.meta.get("command", "shipped default"),
            "command": shlex.join(["sao", "compression", "align", *flags]), "seed": seed,
            "projector": "linear", "teacher": "same LM reading the full history as text",
            "result": {"kl_zero": kl_zero, "kl_aligned": kl_aligned, "validation_steps": len(val_pairs),
                       "content": readable,
                       "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
                       "seconds": round(time.perf_counter() - started, 1), "threads": threads}}
    save_projector(policy.projector, target, meta)
    table = Table(title=f"projector written to {target}")
    for column in ("updates", "held-out KL, zero projector", "held-out KL, aligned", "change"):
        table.add_column(column, justify="right")
    table.add_row(str(updates), f"{kl_zero:.4f}", f"{kl_aligned:.4f}", f"{(kl_aligned - kl_zero) / kl_zero:+.1%}")
    Console().print(table)
    console.print(f"content: a held-out step's text costs {readable['own']:.3f} nats/token under its own slot, "
                  f"{readable['other']:.3f} under another step's (other - own {readable['other_minus_own']:+.3f} "
                  f"± {readable['other_minus_own_stderr']:.3f}, n {readable['n']}); ~0 means the memory says nothing "
                  "about its step")
