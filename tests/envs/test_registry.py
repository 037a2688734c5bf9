"""The env contract, held by every built-in: both splits, disjoint; unknown splits refused; an eval task runs."""

import pytest

from sao.config import EnvConfig, SandboxConfig
from sao.envs import registry
from sao.envs.base import Feedback
from sao.envs.textworld import TextWorldEnv, build_world

FAST = SandboxConfig(cpu_time_s=1, wall_time_s=2, memory_mb=256, max_processes=8, max_file_mb=2)
# A cheap config per built-in, and one action that is valid but earns nothing.
CASES = {
    "arithmetic": (EnvConfig(), "I do not know."),
    "humaneval": (EnvConfig(name="humaneval", max_turns=2, sandbox=FAST), "```python\nreturn None\n```"),
    "textworld": (EnvConfig(name="textworld", max_turns=5, options={"size": 5, "max_steps": 5}), "look"),
    "recall": (EnvConfig(name="recall", max_turns=16), "ok"),
}


def test_every_builtin_has_a_case():
    assert set(CASES) == set(registry.BUILTIN_ENVS)


@pytest.mark.parametrize("name", sorted(registry.BUILTIN_ENVS))
def test_train_and_eval_splits_are_disjoint(name):
    config, _ = CASES[name]
    train = registry.make_tasks(config, 20)
    held_out = registry.make_tasks(config, 20, split="eval")
    assert len(held_out) == 20 and all(task.env == name for task in train + held_out)
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in held_out})
    train_specs = [t.spec for t in train]
    assert all(t.spec not in train_specs for t in held_out)
    # start_index continues the same split: ids name the split and never repeat within it.
    later = registry.make_tasks(config, 5, start_index=20, split="eval")
    assert len({t.task_id for t in held_out + later}) == 25


def test_held_out_labyrinths_are_not_training_labyrinths():
    config, _ = CASES["textworld"]
    train = [build_world(t.spec).exits for t in registry.make_tasks(config, 10)]
    held_out = [build_world(t.spec).exits for t in registry.make_tasks(config, 10, split="eval")]
    assert all(world not in train for world in held_out)


@pytest.mark.parametrize("name", sorted(registry.BUILTIN_ENVS))
def test_unknown_split_is_refused_naming_it(name):
    with pytest.raises(ValueError, match="'test'"):
        registry.make_tasks(CASES[name][0], 1, split="test")


def test_textworld_itself_refuses_an_unknown_split():
    with pytest.raises(ValueError, match="'validation'"):
        TextWorldEnv.make_tasks(CASES["textworld"][0], 1, split="validation")


@pytest.mark.parametrize("name", sorted(registry.BUILTIN_ENVS))
def test_an_eval_task_runs(name):
    config, action = CASES[name]
    env = registry.make_env(config)
    prompt = env.reset(registry.make_tasks(config, 1, split="eval")[0].spec)
    assert isinstance(prompt, str) and prompt
    feedback = env.step(action)
    assert isinstance(feedback, Feedback) and feedback.reward == 0 and not feedback.done
