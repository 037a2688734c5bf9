"""benchmarks/memory_fidelity.py in a tiny configuration: the JSON's shape and consistency (no timing asserts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from support.benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_memory_fidelity_tiny(tmp_path):
    out = tmp_path / "fidelity.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "memory_fidelity.py"), "--model", "tiny",
               "--labyrinth-episodes", "1", "--tutoring-episodes", "1", "--min-steps", "12", "--max-steps", "16",
               "--steps-per-episode", "4", "--align-updates", "2", "--align-episodes", "1", "--longest-step", "100",
               "--memory-width", "8", "--json", str(out)]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, timeout=1200)
    result = json.loads(out.read_text())
    headline = result["headline"]
    assert set(headline) == {"metric", "value", "baseline", "ratio", "unit", "other_episode_memory"}
    assert headline["other_episode_memory"] == pytest.approx(result["envs"]["textworld"]["gap_recovered_other"],
                                                            nan_ok=True)
    assert headline["ratio"] == headline["value"]
    assert set(result["envs"]) == {"textworld", "arithmetic"}
    assert "memory slots: 8 INT8 coordinates in basis all-MiniLM-L6-v2/pca8/" in result["projector"]
    for summary in result["envs"].values():
        assert summary["actions"] > 0
        full = summary["full"]
        assert full["kl"] == pytest.approx(0.0, abs=1e-5)  # the reference against itself
        for context in ("sao", "zero", "other", "recent", "none"):
            assert math.isfinite(summary[context]["nll"]) and summary[context]["nll"] > 0
            assert summary[context]["kl"] >= -1e-5
        # The zero projector's soft tokens are zero vectors, not absent ones: its NLL differs from truncation's,
        # but the aligned projector must differ from it (it was trained).
        assert summary["sao"]["nll"] != summary["zero"]["nll"]
        assert summary["wire"]["slot_bytes"] == summary["wire"]["slots"] * (8 + 4)  # --memory-width 8: 8 codes + a scale
    lengths = result["context_lengths"]
    assert set(lengths) == {"10", "100"}
    assert lengths["100"]["full"] > lengths["10"]["full"]
    assert lengths["100"]["sao"] < lengths["100"]["full"]
    assert lengths["100"]["slot_bytes"] == lengths["100"]["soft_tokens"] * (8 + 4)
    assert result["context_ratio"] == pytest.approx(lengths["100"]["sao"] / lengths["100"]["full"])


def _bench():
    return load_benchmark("memory_fidelity")


def test_wire_cost_counts_slots_against_the_token_ids_of_the_steps_they_span(tiny_config, encoder):
    """A higher keep threshold keeps fewer, coarser slots: fewer slot bytes for the same steps' text."""
    from sao.compression.temporal import load_temporal_filter
    from sao.offline.align import labyrinth_corpus, prepare

    episodes = labyrinth_corpus(0, 1, max_steps=24, random_every=1)
    costs = {}
    for threshold in (None, 0.4):
        item = prepare(episodes, tiny_config, encoder, load_temporal_filter(threshold=threshold), recent_window=1)[0]
        costs[threshold] = cost = _bench().wire_cost([item])
        memory, steps = item.trajectory.memory, item.trajectory.steps
        assert cost["slots"] == len(memory.scales) > 0
        assert cost["slot_bytes"] == len(memory.scales) * (memory.vectors.shape[1] + 4)
        first, last = memory.spans[0][0], memory.spans[-1][1]  # spans tile the steps memory stands for
        tokens = sum(len(s.observation_ids) + len(s.action_ids) for s in steps[first:last + 1])
        assert cost["replaced_token_bytes"] == 4 * tokens
        assert cost["bytes_ratio"] == pytest.approx(cost["slot_bytes"] / (4 * tokens))
        assert np.array_equal(item.student[-1].memory, memory.dequantized(len(memory.vectors)))  # the donors' rows
    assert costs[0.4]["slots"] < costs[None]["slots"]
    assert costs[0.4]["steps_per_slot"] > costs[None]["steps_per_slot"]
    assert costs[0.4]["bytes_ratio"] < costs[None]["bytes_ratio"]
    # Narrower slots: the same slots at 16 INT8 coordinates each.
    from sao.compression.bottleneck import fit_bottleneck

    bottleneck = fit_bottleneck(encoder.encode(episodes[0].texts()), 16, encoder.name)
    narrow = prepare(episodes, tiny_config, encoder, load_temporal_filter(), recent_window=1, bottleneck=bottleneck)[0]
    assert _bench().wire_cost([narrow])["slot_bytes"] == costs[None]["slots"] * (16 + 4)


@pytest.mark.parametrize(("flag", "value", "message"), [("--keep-threshold", "5", "compression.keep_threshold"),
                                                         ("--memory-width", "0", "--memory-width"),
                                                         ("--bottleneck", "/no/such/basis.safetensors",
                                                          "compression.bottleneck")])
def test_bad_memory_settings_are_refused_naming_them(flag, value, message):
    command = [sys.executable, str(ROOT / "benchmarks" / "memory_fidelity.py"), "--model", "tiny", flag, value]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and message in done.stderr


def test_gem_choice_asks_whether_the_held_gem_is_named_first(chat):
    from types import SimpleNamespace

    from sao.config import EnvConfig
    from sao.envs.textworld import TextWorldEnv, build_world
    from sao.offline.episodes import Episode, EpisodeStep

    spec = TextWorldEnv.make_tasks(EnvConfig(name="textworld", seed=3, options={"gems": 3}), 1, 0)[0].spec
    gems = build_world(spec).gems
    steps = [EpisodeStep("You see the altar.", f"put {gems[1]} on altar", 0.0, False),
             EpisodeStep("Fine.", "go north", 0.0, False)]
    item = SimpleNamespace(episode=Episode("textworld", "t", steps, "test", {"spec": spec}))
    bench = _bench()

    assert bench.gem_choice(item, 1, chat) is None  # not a delivery
    position, held, candidates = bench.gem_choice(item, 0, chat)
    assert len(candidates) == 3 and candidates[1] == held
    assert list(chat.action_ids(f"put {gems[1]} on altar"))[position] == held
    logprobs = torch.full((position + 1, max(candidates) + 1), -5.0)
    logprobs[position, held] = -1.0
    assert bench.named_first((position, held, candidates), logprobs) == 1.0
    logprobs[position, candidates[0]] = -0.5
    assert bench.named_first((position, held, candidates), logprobs) == 0.0
    assert math.isnan(bench.named_first(None, logprobs))
