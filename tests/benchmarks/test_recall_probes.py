"""benchmarks/recall_probes.py: each stage's vector is the sampler's own, and the probe reads what a vector holds
and nothing more (a vector that encodes the value decodes it; the blanked sentence does not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sao.envs.recall import build_episode
from sao.envs.registry import make_tasks
from sao.sampler.rollout import Roller
from support.benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "recall_probes.py"


@pytest.fixture(scope="module")
def roller(tiny_config):
    config = tiny_config.model_copy(update={"env": tiny_config.env.model_copy(update={"name": "recall"})})
    return Roller.from_config(config, "recall-probes-test")


def test_every_fact_gets_its_vectors_and_a_kept_turn_is_its_own_slot(roller):
    bench = load_benchmark("recall_probes")
    task = make_tasks(roller.config.env, 1, split="eval")[0]
    facts = bench.stage_vectors(roller, task.spec)
    assert sorted(f["value"] for f in facts) == sorted(f.value for f in build_episode(task.spec).facts)
    for fact in facts:
        vectors = fact["vectors"]
        assert set(vectors) == set(bench.STAGES)
        if not fact["merged"]:
            np.testing.assert_array_equal(vectors["slot"], vectors["embedding"])
        np.testing.assert_allclose(vectors["int8"], vectors["basis_fp32"], atol=np.abs(vectors["basis_fp32"]).max() / 100)
        assert vectors["soft_token"].shape == (roller.policy.lm.config.hidden_size,)
        assert not np.allclose(vectors["text_free"], vectors["embedding"])


def test_blanking_removes_every_copy_of_the_value():
    bench = load_benchmark("recall_probes")
    text = "The code of locker 7 is 8315.\nThe code of locker 7 is 8315."
    assert "8315" not in bench.blank_value(text, "8315") and "locker 7" in bench.blank_value(text, "8315")


def test_the_probe_decodes_a_vector_that_holds_the_value_and_not_one_that_does_not():
    bench = load_benchmark("recall_probes")
    rng = np.random.default_rng(0)

    def facts(count):
        rows = []
        for _ in range(count):
            value = str(rng.integers(1000, 10_000))
            one_hot = np.zeros(40, np.float32)
            one_hot[[10 * p + int(d) for p, d in enumerate(value)]] = 1.0
            rows.append({"value": value, "kind": "code",
                         "vectors": {"holds": one_hot + rng.normal(0, 0.1, 40).astype(np.float32),
                                     "noise": rng.normal(0, 1, 40).astype(np.float32)}})
        return rows

    train, test = facts(400), facts(200)
    holds, noise = (bench.probe_accuracy(train, test, stage, "code") for stage in ("holds", "noise"))
    assert holds["characters"] > 0.95 and holds["exact"] > 0.8
    assert noise["characters"] < noise["floor"] + 0.1 and noise["exact"] < 0.01


@pytest.mark.slow
def test_recall_probes_tiny(tmp_path):
    out = tmp_path / "probes.json"
    subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--train-episodes", "12", "--eval-episodes", "6",
                    "--json", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert set(result["headline"]) == {"metric", "value", "baseline", "ratio", "unit"}
    assert set(result["stages"]) == {"code", "name"}
    for kind in result["stages"].values():
        assert set(kind) == {"text_free", "embedding", "slot", "basis_fp32", "int8", "soft_token"}
        assert all(stage["n"] > 0 and 0 <= stage["characters"] <= 1 for stage in kind.values())
    assert result["test_facts"] == 6 * 4  # the env's default: 4 facts an episode
