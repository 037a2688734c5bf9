"""benchmarks/recall_calibration.py: the two contexts are the sampler's, full text holds the fact and the
recent window does not; a tiny run's JSON (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sao.envs.recall import build_episode
from sao.envs.registry import generation_settings, make_tasks
from sao.policy.chat import ChatFormat
from sao.policy.loading import load_tokenizer
from support.benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "recall_calibration.py"


def test_full_text_holds_the_fact_and_the_recent_window_only_when_it_is_the_last_turn(tiny_config):
    bench = load_benchmark("recall_calibration")
    config = tiny_config.model_copy(update={"env": tiny_config.env.model_copy(update={"name": "recall"})})
    tokenizer = load_tokenizer(config.policy.model, config.policy.cache_dir)
    settings = generation_settings(config)
    chat = ChatFormat(tokenizer, settings.system_prompt, settings.stop)
    distances = set()
    for task in make_tasks(config.env, 12, split="eval"):
        episode = build_episode(task.spec)
        (question,) = bench.questions_of(chat, task.spec, recent_window=1, memory_width=3)
        asked = episode.turns[-1]
        assert question["value"] == asked.fact.value and question["stated"] == episode.values
        assert question["distance"] == len(episode.turns) - 1 - [t.text for t in episode.turns].index(
            asked.fact.statement)
        full, recent = (tokenizer.decode(question["inputs"][c].context_ids) for c in ("full", "recent"))
        assert asked.fact.statement in full and full.rstrip().endswith("assistant")
        assert (asked.fact.statement in recent) == (question["distance"] == 1)
        assert recent.count("<|im_start|>user") == 2 and full.count("<|im_start|>user") == len(episode.turns) - 1
        for context in ("full", "recent"):
            assert question["inputs"][context].memory.shape == (0, 3)
        distances.add(question["distance"])
    assert len(distances) > 3  # facts sit at various distances


@pytest.mark.slow
def test_recall_calibration_tiny(tmp_path):
    out = tmp_path / "recall.json"
    command = [sys.executable, str(SCRIPT), "--model", "tiny", "--episodes", "3", "--turns", "6", "--facts", "2",
               "--threads", "1", "--json", str(out)]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert set(result["headline"]) == {"metric", "value", "baseline", "ratio", "unit"}
    assert result["options"] == {"turns": 6, "facts": 2}
    assert len(result["questions"]) == 3 and result["contexts"]["full"]["n"] == 3
    assert sum(figures["full"]["n"] for figures in result["by_distance"].values()) == 3
    for question in result["questions"]:
        assert set(question["answers"]) == {"full", "recent"} and 1 <= question["distance"] <= 4
