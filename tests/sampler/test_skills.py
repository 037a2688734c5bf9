"""Held-out success by skill: the env's tags, the breakdown per version, the headline skill and the format ceiling."""

import re

import pytest

from sao.envs.arithmetic import ArithmeticEnv
from sao.envs.registry import task_skills
from sao.sampler.evaluation import heldout_tasks
from sao.sampler.skills import breakdown, format_ceiling, headline_skill, skill_figures, tag_tasks


def test_arithmetic_tags_each_heldout_task_by_the_sign_of_its_answer(tiny_config):
    tasks = heldout_tasks(tiny_config, 400)
    tags = tag_tasks("arithmetic", tasks)
    env = ArithmeticEnv()
    for task in tasks:
        a, op, b = re.fullmatch(r"Calculate (-?\d+) ([+-]) (-?\d+)\.", env.reset(task.spec)).groups()
        answer = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert tags[task.task_id] == (["answer<0"] if answer < 0 else ["answer>=0"])
    assert {tag for found in tags.values() for tag in found} == {"answer<0", "answer>=0"}


def test_an_env_without_skills_tags_nothing():
    assert task_skills("humaneval")({"anything": 1}) == set()


def test_the_breakdown_pairs_each_version_with_the_base_on_each_skill():
    tags = {"a": ["neg"], "b": ["neg"], "c": ["pos"], "d": ["pos"], "e": []}
    versions = {"base": {"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0, "e": 1.0},
                "final": {"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0, "e": 0.0}}
    figures = breakdown(tags, versions)
    assert figures["neg"]["n"] == 2 and figures["neg"]["base"] == 0.0 and figures["neg"]["final"] == 0.5
    assert figures["neg"]["final_gain"] == 0.5 and figures["neg"]["final_gain_stderr"] == pytest.approx(0.5)
    assert figures["pos"]["final_gain"] == 0.5 and "base_gain" not in figures["pos"]
    assert headline_skill(tags, versions["base"]) == "neg"
    # Every task without the skill right, every one with it wrong: 3 of 5 (the untagged task counts as without).
    assert format_ceiling(tags, "neg", list(versions["base"])) == pytest.approx(3 / 5)
    flat = skill_figures(tags, versions)
    assert flat["heldout_skill"] == "neg" and flat["heldout_skill_final_gain"] == 0.5
    assert flat["heldout_format_ceiling"] == pytest.approx(0.6) and flat["heldout_skills"] == figures


def test_no_skill_no_headline_and_no_ceiling():
    versions = {"base": {"a": 1.0}, "final": {"a": 1.0}}
    flat = skill_figures({"a": []}, versions)
    assert flat["heldout_skill"] is None and flat["heldout_format_ceiling"] is None and flat["heldout_skills"] == {}
