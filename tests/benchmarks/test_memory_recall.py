"""benchmarks/memory_recall.py: the memory at a question is the sampler's own, the controls keep its slot count,
and content is only claimed when own memory beats another episode's; a tiny run's JSON (no timing asserts)."""

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
SCRIPT = ROOT / "benchmarks" / "memory_recall.py"


@pytest.fixture(scope="module")
def roller(tiny_config):
    env = tiny_config.env.model_copy(update={"name": "recall", "max_turns": 16})  # the env's default turns
    config = tiny_config.model_copy(update={"env": env})
    return Roller.from_config(config, "memory-recall-test")


def test_the_memory_at_a_question_is_what_a_sampler_episode_holds_there(roller):
    bench = load_benchmark("memory_recall")
    for task in make_tasks(roller.config.env, 3, split="eval"):
        (question,) = bench.questions_with_memory(roller, task.spec)
        episode = roller.start(task, 0)  # the sampler's own episode, replying what the rules ask
        for turn in build_episode(task.spec).turns[:-1]:
            episode.advance(roller.chat.action_ids(turn.reply), np.zeros(0, np.float32))
        seen = episode.next_input()
        assert len(question["memory"]) > 0
        np.testing.assert_array_equal(question["memory"], seen.memory)
        recent = question["inputs"]["recent"].context_ids  # after the turns memory recalls (compression.recall_turns)
        np.testing.assert_array_equal(recent, seen.context_ids[len(seen.context_ids) - len(recent):])
        np.testing.assert_array_equal(question["inputs"]["recent"].prompt_ids, seen.prompt_ids)


def test_controls_keep_the_slot_count_and_another_episode_is_another(roller):
    bench = load_benchmark("memory_recall")
    questions = [q for task in make_tasks(roller.config.env, 4, split="eval")
                 for q in bench.questions_with_memory(roller, task.spec)]
    inputs, _ = bench.contexts_of(questions, roller.policy.memory_width, recall=0)
    for i, question in enumerate(questions):
        count = len(question["memory"])
        assert all(len(inputs[c][i].memory) == count for c in bench.WITH_SLOTS)
        assert len(inputs["full"][i].memory) == len(inputs["recent"][i].memory) == 0
        assert not np.array_equal(inputs["other"][i].memory, question["memory"])
        assert not inputs["zero"][i].memory.any()
        assert len(inputs["full"][i].context_ids) > len(inputs["recent"][i].context_ids)
    mean_rows = np.concatenate([inputs["mean"][i].memory for i in range(len(questions))])
    assert np.allclose(mean_rows, mean_rows[0])


def test_with_recall_own_memory_brings_back_this_episodes_turns_and_the_controls_others(roller):
    """sao's context is what a sampler with compression.recall_turns shows; another episode's memory brings back
    that episode's turns; the random control recalls as many of this episode's turns, chosen blind."""
    bench = load_benchmark("memory_recall")
    tasks = make_tasks(roller.config.env, 4, split="eval")
    questions = [q for task in tasks for q in bench.questions_with_memory(roller, task.spec)]
    inputs, chosen = bench.contexts_of(questions, roller.policy.memory_width, recall=1)
    found = bench.found_fact(questions, chosen)
    assert found["sao"]["n"] == found["random"]["n"] > 0
    config = roller.config.model_copy(deep=True)
    config.compression.recall_turns = 1
    sampler = Roller(config, roller.policy, roller.encoder, roller.temporal_filter, "recall-on",
                     bottleneck=roller.bottleneck)
    assert len(questions) == len(tasks)  # one question an episode
    for i, task in enumerate(tasks):
        episode = sampler.start(task, 0)
        for turn in build_episode(task.spec).turns[:-1]:
            episode.next_input()
            episode.advance(sampler.chat.action_ids(turn.reply), np.zeros(0, np.float32))
        np.testing.assert_array_equal(inputs["sao"][i].context_ids, episode.next_input().context_ids)
        recent = len(inputs["recent"][i].context_ids)
        assert len(inputs["sao"][i].context_ids) > recent and len(inputs["random"][i].context_ids) > recent
        assert not np.array_equal(inputs["other"][i].context_ids, inputs["sao"][i].context_ids)
        np.testing.assert_array_equal(inputs["other"][i].context_ids[-recent:], inputs["recent"][i].context_ids)


def test_content_is_claimed_only_above_three_standard_errors():
    bench = load_benchmark("memory_recall")
    same = [1.0, 0.0, 1.0, 0.0] * 25
    assert not bench.content_shown(bench.paired(same, same))  # a swapped control equal to own memory
    better = [1.0] * 60 + [0.0] * 40
    worse = [1.0] * 20 + [0.0] * 80
    assert bench.content_shown(bench.paired(better, worse))
    assert not bench.content_shown(bench.paired(worse, better))
    kept = bench.retention({"sao": better, "recent": worse, "full": [1.0] * 100})
    assert kept["value"] == pytest.approx(0.5) and 0 < kept["se"] < 0.2


@pytest.mark.slow
def test_memory_recall_tiny(tmp_path):
    """The tiny model's projector is zero: without recall its slots carry nothing, and the benchmark must say so."""
    out = tmp_path / "memory_recall.json"
    subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--episodes", "3", "--json", str(out),
                    "--set", "compression.recall_turns=0"], check=True, cwd=ROOT, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert set(result["headline"]) == {"metric", "value", "baseline", "ratio", "unit"}
    assert set(result["contexts"]) == {"full", "recent", "sao", "other", "zero", "mean"}
    assert all(result["contexts"][c]["n"] == 3 for c in result["contexts"])
    assert result["content"]["nll"]["difference"] == 0.0 and result["content_shown"] is False
    assert result["costs"]["recent"]["positions_vs_full"] < 1 and result["costs"]["full"]["bytes_vs_full"] == 1
