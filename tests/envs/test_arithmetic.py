"""The multi-turn reasoning-gym arithmetic env."""

import re

import pytest

from sao.config import EnvConfig
from sao.envs.arithmetic import last_number
from sao.envs.registry import UnknownEnv, env_class, make_env, make_tasks


@pytest.mark.parametrize("text, number", [("The answer is 12.", "12"), ("-3", "-3"), ("1 + 2 = 3", "3"),
                                          ("no digits", None), ("2.5 then 7", "7")])
def test_last_number(text, number):
    assert last_number(text) == number


def _answer(task, config: EnvConfig | None = None):
    env = make_env(config or EnvConfig())
    question = env.reset(task.spec)
    return env, question, env._entry["answer"]


def test_right_answer_first_try_gets_full_reward():
    task = make_tasks(EnvConfig(), 3)[2]
    env, question, answer = _answer(task)
    # The default options ask for a sum or difference of two non-negative terms: the question
    # states it, and the entry's answer is its value.
    match = re.fullmatch(r"Calculate (\d+) ([+-]) (\d+)\.", question)
    assert match, question
    left, operator, right = int(match[1]), match[2], int(match[3])
    assert int(answer) == (left + right if operator == "+" else left - right)
    feedback = env.step(f"It is {answer}")
    assert feedback.done and feedback.reward == 1.0


def test_wrong_answers_get_feedback_then_end():
    config = EnvConfig(max_turns=3, retry_discount=0.5)
    task = make_tasks(config, 1)[0]
    env, _, answer = _answer(task, config)
    wrong = str(int(answer) + 1)
    first = env.step(wrong)
    assert not first.done and first.reward == 0 and wrong in first.observation
    second = env.step(answer)
    assert second.done and second.reward == pytest.approx(0.5)  # right on the second attempt
    env.reset(task.spec)
    results = [env.step("nothing") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True] and all(r.reward == 0 for r in results)


def test_tasks_are_deterministic_and_distinct():
    a, b = make_tasks(EnvConfig(seed=1), 5), make_tasks(EnvConfig(seed=1), 5)
    assert [t.task_id for t in a] == [t.task_id for t in b]
    assert len({t.task_id for t in a}) == 5
    questions = [make_env(EnvConfig()).reset(t.spec) for t in a]
    assert questions == [make_env(EnvConfig()).reset(t.spec) for t in b]


def test_registry_loads_builtins_and_import_paths_and_names_bad_ones():
    assert env_class("arithmetic").name == "arithmetic"
    assert env_class("sao.envs.arithmetic:ArithmeticEnv") is env_class("arithmetic")
    for bad in ("nope", "sao.envs.arithmetic:Missing", "no_such_module_xyz:Env"):
        with pytest.raises(UnknownEnv, match=r"env\.name"):
            env_class(bad)


def test_any_reasoning_gym_dataset_with_last_line_answers():
    from sao.envs.arithmetic import last_line

    assert last_line("thinking...\n\n  noremopyh  \n") == "noremopyh" and last_line("  \n") is None
    config = EnvConfig(dataset="spell_backward", dataset_options={}, answer_format="last_line", max_turns=2)
    task = make_tasks(config, 1)[0]
    env = make_env(config)
    question = env.reset(task.spec)
    assert "backward" in question
    word = question.rsplit(":", 1)[1].strip()
    assert not env.step("I am not sure.").done  # wrong: feedback and another try
    feedback = env.step(f"Reversed:\n{word[::-1]}")
    assert feedback.done and feedback.reward == pytest.approx(0.5)  # right at the second attempt
