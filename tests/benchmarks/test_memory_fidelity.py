"""benchmarks/memory_fidelity.py in a tiny configuration: the JSON's shape and consistency (no timing asserts)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_memory_fidelity_tiny(tmp_path):
    out = tmp_path / "fidelity.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "memory_fidelity.py"), "--model", "tiny",
               "--labyrinth-episodes", "1", "--tutoring-episodes", "1", "--min-steps", "12", "--max-steps", "16",
               "--steps-per-episode", "4", "--align-updates", "2", "--align-episodes", "1", "--longest-step", "100",
               "--json", str(out)]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, timeout=1200)
    result = json.loads(out.read_text())
    headline = result["headline"]
    assert set(headline) == {"metric", "value", "baseline", "ratio", "unit", "other_episode_memory"}
    assert headline["other_episode_memory"] == pytest.approx(result["envs"]["textworld"]["gap_recovered_other"],
                                                            nan_ok=True)
    assert headline["ratio"] == headline["value"]
    assert set(result["envs"]) == {"textworld", "arithmetic"}
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
    lengths = result["context_lengths"]
    assert set(lengths) == {"10", "100"}
    assert lengths["100"]["full"] > lengths["10"]["full"]
    assert lengths["100"]["sao"] < lengths["100"]["full"]
    assert result["context_ratio"] == pytest.approx(lengths["100"]["sao"] / lengths["100"]["full"])


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
    loaded = importlib.util.spec_from_file_location("bench_memory_fidelity", ROOT / "benchmarks" / "memory_fidelity.py")
    bench = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(bench)

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
