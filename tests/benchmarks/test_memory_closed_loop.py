"""benchmarks/memory_closed_loop.py: command scoring is the policy's own likelihood; a tiny run's JSON (no timing asserts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sao.offline.align import context_logprobs
from sao.policy.context import TurnInput
from sao.policy.weights import build_policy
from support.benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "memory_closed_loop.py"


def test_command_logprobs_equal_scoring_each_command_after_the_whole_context(tiny_config):
    """The shared-context shortcut (one forward, its cache repeated per command, commands padded) gives
    what the trainer's scorer gives each command appended to the full context, memory included."""
    bench = load_benchmark("memory_closed_loop")
    torch.manual_seed(0)
    policy = build_policy(tiny_config.policy, 384).eval()
    torch.nn.init.normal_(policy.projector.weight, std=0.02)  # memory that changes the answer
    rng = np.random.default_rng(0)
    prompt, context = rng.integers(3, 1000, 9).astype(np.int32), rng.integers(3, 1000, 7).astype(np.int32)
    memory = rng.normal(size=(3, 384)).astype(np.float32)
    commands = [rng.integers(3, 1000, n).astype(np.int32) for n in (1, 4, 2)]
    with torch.no_grad():
        fast = bench.command_logprobs(policy, prompt, memory, context, commands)
        slow = [float(lp.gather(-1, torch.as_tensor(c, dtype=torch.long)[:, None]).sum())
                for c, lp in zip(commands, context_logprobs(policy, [TurnInput(prompt, memory, context, c)
                                                                     for c in commands]))]
        without_memory = bench.command_logprobs(policy, prompt, memory[:0], context, commands)
    assert fast == pytest.approx(slow, abs=1e-4)
    assert not np.allclose(fast, without_memory, atol=1e-3)  # the memory slots are read


@pytest.mark.slow
def test_memory_closed_loop_tiny(tmp_path):
    out = tmp_path / "closed_loop.json"
    command = [sys.executable, str(SCRIPT), "--model", "tiny", "--minutes", "0.05", "--max-steps", "5",
               "--threads", "1", "--json", str(out)]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert set(result["headline"]) == {"metric", "value", "baseline", "ratio", "unit"}
    assert result["episodes_per_arm"] >= 1
    episodes = result["episodes"]
    assert set(episodes) == {"full", "sao", "zero", "recent"}
    assert {len(v) for v in episodes.values()} == {result["episodes_per_arm"]}  # every arm, the same worlds
    for arm, runs in episodes.items():
        for run in runs:
            assert 1 <= run["steps"] <= 5 and 0 <= run["return"] <= 1 and run["rooms_visited"] >= 1
            assert run["first_moves"]
        assert result["arms"][arm]["return"]["mean"] == pytest.approx(np.mean([r["return"] for r in runs]))
    assert math.isnan(result["headline"]["ratio"]) or result["headline"]["ratio"] >= 0
