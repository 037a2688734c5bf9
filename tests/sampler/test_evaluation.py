"""Held-out evaluation: distinct eval tasks, batched greedy scores, the paired comparison and its cache."""

import json

import pytest
import torch

from sao.compression.bottleneck import resolve_bottleneck
from sao.policy.weights import build_policy, unique_state_dict, write_weights
from sao.sampler.evaluation import compare, evaluate, heldout_tasks, validation_tasks, weights_of
from sao.schema import PolicyAnnouncement

# What a default trainer publishes: a projector reading the shipped basis's coordinates.
MEMORY_WIDTH = resolve_bottleneck("auto", "all-MiniLM-L6-v2").width


def _publish(policy, run_dir, version: int) -> None:
    path = run_dir / "policy" / f"policy-v{version:06d}.safetensors"
    sha = write_weights(unique_state_dict(policy.state_dict()), path)
    path.with_suffix(".json").write_text(json.dumps(
        PolicyAnnouncement(version, str(path), sha, path.stat().st_size, version * 2).to_wire()))


def _with_cache(config, cache_dir):
    return config.model_copy(update={"run": config.run.model_copy(update={"heldout_cache_dir": str(cache_dir)})})


def test_heldout_tasks_are_distinct_and_capped(tiny_config):
    tiny_config = tiny_config.model_copy(update={"trainer": tiny_config.trainer.model_copy(update={"shadow_every": 0})})
    everything = heldout_tasks(tiny_config, 400)
    assert len(everything) == len({t.task_id for t in everything}) >= 100  # the default domain holds out 129
    assert [t.task_id for t in heldout_tasks(tiny_config, 10)] == [t.task_id for t in everything[:10]]
    assert all(t.task_id.startswith("eval/") for t in everything)
    # humaneval's eval split cycles through its 33 problems under new ids: each is scored once.
    humaneval = tiny_config.model_copy(update={"env": tiny_config.env.model_copy(update={"name": "humaneval"})})
    assert len(heldout_tasks(humaneval, 50)) == 33


def test_eval_scores_a_published_version(tiny_config, tmp_path):
    policy = build_policy(tiny_config.policy, MEMORY_WIDTH)
    torch.nn.init.normal_(policy.projector.weight, std=0.01)
    _publish(policy, tmp_path, 3)
    result = evaluate(tiny_config, tmp_path, version=3, num_tasks=3)
    penalty = tiny_config.env.repeat_penalty  # a retry with no new answer earns -penalty
    assert (result["version"], result["tasks"], result["n"]) == (3, 3, 3) and -penalty - 1e-9 <= result["reward_mean"] <= 1
    assert (result["second_try_success"], result["second_try_n"]) == (0.0, 3)  # random tokens: wrong twice
    # Penalised second attempts are those the env scored below 0: here the whole episode's reward.
    assert all(task["second_penalised"] == float(task["reward"] < 0) for task in result["per_task"].values())
    assert result["second_try_penalised"] == pytest.approx(
        sum(task["second_penalised"] for task in result["per_task"].values()) / 3)
    assert sorted(result["per_task"]) == sorted(t.task_id for t in heldout_tasks(tiny_config, 3))
    assert json.loads((tmp_path / "eval" / "v000003.json").read_text()) == result
    with pytest.raises(FileNotFoundError, match=r"kept: \[3\]"):
        weights_of(tmp_path, 1)


def test_the_paired_comparison_writes_the_heldout_figures_and_caches_the_base(tiny_config, tmp_path):
    config = _with_cache(tiny_config, tmp_path / "cache")
    _publish(build_policy(config.policy, MEMORY_WIDTH), tmp_path, 1)  # the base weights, republished
    first = compare(config, tmp_path, version=1, cap=4)
    assert first["heldout_n"] == 4 and not first["base_cached"]
    # Same weights, greedy: every task scores the same, so the paired differences are all 0.
    assert first["heldout_final"] == first["heldout_base"] and first["heldout_gain"] == 0
    assert first["heldout_gain_stderr"] == 0
    # A random tiny model is wrong at both attempts: every task had a second try, none right.
    for version in ("base", "final"):
        assert first[f"heldout_second_try_{version}"] == 0.0 and first[f"heldout_second_try_{version}_stderr"] == 0
    assert first["heldout_second_try_base_n"] == first["heldout_second_try_n"] == 4
    assert all(scores["second_try"] == 0.0 for task in first["per_task"].values() for scores in task.values())
    assert json.loads((tmp_path / "eval" / "heldout.json").read_text()) == first
    # Broken down by the env's skills (the sign of the answer), each with its n; the ceiling is the share without it.
    skills = first["heldout_skills"]
    assert sum(row["n"] for row in skills.values()) == 4 and first["heldout_skill"] in skills
    assert sorted(first["skills_by_task"]) == sorted(first["per_task"])
    without = sum(first["heldout_skill"] not in tags for tags in first["skills_by_task"].values())
    assert first["heldout_format_ceiling"] == pytest.approx(without / 4)
    assert first["heldout_skill_n"] == 4 - without and first["heldout_skill_final_gain"] == 0
    [cached] = (tmp_path / "cache").glob("*.json")
    # A later run reads the base model's scores from the cache (here: doctored, to see them used).
    stored = json.loads(cached.read_text())
    stored["scores"] = {task: {"first_try": 0.0, "second_try": 1.0, "second_penalised": 0.0, "reward": 0.5}
                        for task in stored["scores"]}
    stored["scores"][next(iter(stored["scores"]))] = {"first_try": 1.0, "second_try": None, "second_penalised": None,
                                                      "reward": 1.0}
    cached.write_text(json.dumps(stored))
    again = compare(config, tmp_path, version=1, cap=4)
    assert again["base_cached"] and again["heldout_base"] == 0.25
    assert again["heldout_gain"] == pytest.approx(first["heldout_final"] - 0.25)
    assert (again["heldout_second_try_base"], again["heldout_second_try_base_n"]) == (1.0, 3)
    assert again["heldout_second_try_penalised_base"] == 0.0
    # A cache from before second tries were scored is scored again, not read.
    stored["scores"] = {task: {"first_try": 1.0, "reward": 1.0} for task in stored["scores"]}
    cached.write_text(json.dumps(stored))
    assert not compare(config, tmp_path, version=1, cap=4)["base_cached"]
    # Another cap means other tasks: not the cached entry.
    assert not compare(config, tmp_path, version=1, cap=3)["base_cached"]


@pytest.mark.slow
def test_eval_runs_on_the_labyrinth(tiny_config, tmp_path):
    # The labyrinth's eval split once raised TypeError (its make_tasks had no `split`).
    env = tiny_config.env.model_copy(update={"name": "textworld", "max_turns": 3,
                                             "options": {"size": 3, "gems": 1, "locked_doors": 0, "max_steps": 3}})
    config = tiny_config.model_copy(update={"env": env})
    result = evaluate(config, tmp_path, version=0, num_tasks=2)
    assert (result["tasks"], result["split"]) == (2, "eval") and 0 <= result["reward_mean"] <= 1
    assert result["second_try_n"] == 0  # a labyrinth's second turn is its next move, not a retry
    assert json.loads((tmp_path / "eval" / "v000000.json").read_text()) == result


def test_a_recall_episode_is_scored_whole_by_its_own_success_and_has_no_second_try(tiny_config, tmp_path, monkeypatch):
    """The recall env's first turn is its rules: held-out success is its questions answered, and its second turn
    is not a retry, so no second-try figure is made from it."""
    from sao.envs import recall

    env = tiny_config.env.model_copy(update={"name": "recall", "max_turns": 4, "options": {"turns": 4, "facts": 2}})
    config = tiny_config.model_copy(update={"env": env})
    monkeypatch.setattr(recall, "answer_matches", lambda *args: True)  # every question answered right
    result = evaluate(config, tmp_path, version=0, num_tasks=2)
    assert result["first_try_success"] == 1.0 and result["second_try_n"] == 0
    assert all(task["second_try"] is None for task in result["per_task"].values())


def test_sao_eval_reports_the_paired_comparison_against_a_baseline(tmp_path):
    from typer.testing import CliRunner

    from sao.cli import app
    from sao.config import load_config

    config = load_config(overrides=['policy.model="tiny"'], environ={})
    _publish(build_policy(config.policy, MEMORY_WIDTH), tmp_path, 2)
    common = ["eval", "--run-dir", str(tmp_path), "--num-tasks", "2", "--set", 'policy.model="tiny"',
              "--set", f'run.heldout_cache_dir="{tmp_path / "cache"}"']
    result = CliRunner().invoke(app, [*common, "--version", "2", "--baseline", "0"])
    assert result.exit_code == 0, result.output
    assert "heldout_gain" in result.output and "v2 vs v0" in result.output
    assert json.loads((tmp_path / "eval" / "heldout.json").read_text())["heldout_n"] == 2
    missing = CliRunner().invoke(app, [*common, "--version", "5", "--baseline", "0"])
    assert missing.exit_code == 2 and "policy v5 is not in" in missing.output


def test_a_small_eval_split_is_shared_between_validation_and_the_final_comparison(tiny_config):
    """humaneval holds out 33 problems: with shadow validation on, both get some, and never the same."""
    trainer = tiny_config.trainer.model_copy(update={"shadow_every": 2, "shadow_tasks": 48})
    humaneval = tiny_config.model_copy(update={"env": tiny_config.env.model_copy(update={"name": "humaneval"}),
                                               "trainer": trainer})
    final, validation = heldout_tasks(humaneval, 80), validation_tasks(humaneval)
    assert (len(final), len(validation)) == (17, 16)
    assert not {t.task_id for t in final} & {t.task_id for t in validation}
    arithmetic = tiny_config.model_copy(update={"trainer": trainer})  # 129 distinct: 80 and 48, as configured
    final, validation = heldout_tasks(arithmetic, 80), validation_tasks(arithmetic)
    assert (len(final), len(validation)) == (80, 48)
    assert not {t.task_id for t in final} & {t.task_id for t in validation}


def test_a_long_scoring_logs_how_far_it_got_and_the_time_left(caplog, monkeypatch):
    from sao.sampler import evaluation

    clock = iter([100.0, 110.0, 130.0, 131.0, 160.0])  # start, then one reading per task done
    monkeypatch.setattr(evaluation.time, "perf_counter", lambda: next(clock))
    on_done = evaluation._progress_log("v3", 4, every_s=15.0)
    with caplog.at_level("INFO", logger=evaluation.__name__):
        for done in (1, 2, 3, 4):
            on_done(done)
    # 10 s: too soon; 30 s: due; 31 s: too soon after it; the last task: the result says it.
    assert [record.getMessage() for record in caplog.records] == ["v3: 2 of 4 tasks scored in 30 s, about 30 s left"]
    # Three side by side: two done are the quickest of a batch, so no time left is guessed from them.
    clock = iter([100.0, 110.0, 130.0])
    caplog.clear()
    on_done = evaluation._progress_log("v4", 4, side_by_side=3, every_s=15.0)
    with caplog.at_level("INFO", logger=evaluation.__name__):
        for done in (1, 2):
            on_done(done)
    assert [record.getMessage() for record in caplog.records] == ["v4: 2 of 4 tasks scored in 30 s"]
