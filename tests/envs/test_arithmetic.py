"""The multi-turn reasoning-gym arithmetic env."""

import re

import pytest

from sao.config import ConfigError, EnvConfig, load_config
from sao.envs import arithmetic
from sao.envs.arithmetic import is_held_out, last_number, question_digest
from sao.envs.registry import UnknownEnv, check_env_config, env_class, make_env, make_tasks


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
    config = EnvConfig(max_turns=3, retry_discount=0.5, reveal_answer=False)
    task = make_tasks(config, 1)[0]
    env, _, answer = _answer(task, config)
    wrong = str(int(answer) + 1)
    first = env.step(wrong)
    assert not first.done and first.reward == 0 and wrong in first.observation
    assert f"answer is {answer}" not in first.observation  # reward only: the right answer is not told
    revealing, _, _ = _answer(task, config.model_copy(update={"reveal_answer": True}))  # the default
    assert f"The answer is {answer}." in revealing.step(wrong).observation
    second = env.step(answer)
    assert second.done and second.reward == pytest.approx(0.5)  # right on the second attempt
    env.reset(task.spec)
    results = [env.step("nothing") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert [r.reward for r in results] == [0, -config.repeat_penalty, -config.repeat_penalty]  # retries with no answer


@pytest.mark.parametrize("retry, reward", [
    ("{old}", -0.2),  # the answer already called wrong
    ("{old}\n\nThe answer is {new}.", -0.2),  # listing it before a new one does not dodge the penalty
    ("The answer is {new}.", 0.0),  # a new wrong answer
    ("no idea", -0.2),  # no answer at all
    ("{right}", 0.5),  # right at the second attempt: the discount, no penalty
])
def test_a_retry_that_offers_no_new_answer_is_penalised(retry, reward):
    config = EnvConfig(max_turns=2, retry_discount=0.5, repeat_penalty=0.2)
    env, _, answer = _answer(make_tasks(config, 1)[0], config)
    old, new = int(answer) + 1, int(answer) + 2
    assert env.step(f"{old}.0").reward == 0  # the first attempt is never penalised; "8.0" is the answer 8
    feedback = env.step(retry.format(old=old, new=new, right=answer))
    assert feedback.done and feedback.reward == pytest.approx(reward)


def test_no_penalty_when_off_or_on_a_first_attempt():
    config = EnvConfig(max_turns=2, repeat_penalty=0.0)
    env, _, answer = _answer(make_tasks(config, 1)[0], config)
    wrong = str(int(answer) + 1)
    assert [env.step(wrong).reward, env.step(wrong).reward] == [0, 0]
    env, _, _ = _answer(make_tasks(EnvConfig(), 1)[0])
    assert env.step("no idea").reward == 0  # a first attempt with no answer is only wrong


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


@pytest.mark.parametrize("dataset, options", [("chain_sum", {"max_terms": 3}), ("products", {}), ("gcd", {})])
def test_other_numeric_datasets_start_from_their_own_defaults_and_score(dataset, options):
    # basic_arithmetic's default options are not passed on: each dataset starts from reasoning-gym's own.
    config = load_config(overrides=[f'env.dataset="{dataset}"']
                         + [f"env.dataset_options.{key}={value}" for key, value in options.items()], environ={}).env
    assert config.dataset_options == options
    check_env_config(config)
    tasks = make_tasks(config, 3) + make_tasks(config, 1, split="eval")
    assert len({task.task_id for task in tasks}) == 4 and all(dataset in task.task_id for task in tasks)
    env = make_env(config)
    env.reset(tasks[0].spec)
    answer = env._entry["answer"]
    first = env.step(f"{answer}1")
    assert not first.done and first.reward == 0
    feedback = env.step(f"It is {answer}")
    assert feedback.done and feedback.reward == pytest.approx(config.retry_discount)


def test_one_dataset_option_set_keeps_the_others():
    default = load_config(environ={}).env.dataset_options
    changed = load_config(overrides=["env.dataset_options.max_terms=3"], environ={}).env.dataset_options
    assert changed == {**default, "max_terms": 3} and default["max_terms"] != 3
    table = load_config(overrides=["env.dataset_options={ max_digits = 2 }"], environ={}).env.dataset_options
    assert table == {**default, "max_digits": 2}


@pytest.mark.parametrize("overrides, message", [
    (['env.dataset="chain_sums"'], r"env\.dataset 'chain_sums' is not a reasoning-gym dataset \(did you mean chain_sum"),
    (['env.dataset="chain_sum"', "env.dataset_options.allow_parentheses=true"],
     r"env\.dataset_options\.allow_parentheses: chain_sum has no such option"),
    (["env.dataset_options.max_term=3"], r"env\.dataset_options\.max_term: basic_arithmetic .*did you mean max_terms"),
    (["env.dataset_options.min_terms=0"], r"env\.dataset_options of basic_arithmetic .*min_terms must be positive"),
])
def test_a_dataset_or_option_reasoning_gym_refuses_is_named_at_start(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_env_config(load_config(overrides=overrides, environ={}).env)


# --- the held-out partition --------------------------------------------------------------------

def _questions(tasks, config: EnvConfig | None = None) -> list[str]:
    env = make_env(config or EnvConfig())
    return [env.reset(task.spec) for task in tasks]


@pytest.mark.parametrize("seed", [0, 1, 1_000_003])
def test_no_held_out_question_is_ever_a_training_task(seed):
    # 1_000_003 is the eval split's own scan seed: the split still holds, it is by question.
    config = EnvConfig(seed=seed)
    train = _questions(make_tasks(config, 2000), config)
    held_out = _questions(make_tasks(config, 400, split="eval"), config)
    assert not set(train) & set(held_out)
    assert all(not is_held_out(question_digest(q)) for q in train)
    assert all(is_held_out(question_digest(q)) for q in held_out)


def test_the_default_domain_holds_out_more_than_a_hundred_distinct_questions():
    held_out = make_tasks(EnvConfig(), 400, split="eval")
    distinct = {task.task_id for task in held_out}
    assert len(distinct) == len(set(_questions(held_out))) >= 100
    # 242 questions in all: what is not held out is what training draws from.
    assert len(distinct) + len(set(_questions(make_tasks(EnvConfig(), 2000)))) == 242
    # Ids name the question, so a small domain's eval split repeats from its start.
    ids = [task.task_id for task in held_out]
    assert ids[len(distinct):2 * len(distinct)] == ids[:len(distinct)]
    assert ids[0] == f"eval/basic_arithmetic/{question_digest(_questions(held_out[:1])[0])[:16]}"


def test_the_eval_split_does_not_depend_on_the_seed():
    a, b = make_tasks(EnvConfig(seed=0), 50, split="eval"), make_tasks(EnvConfig(seed=7), 50, split="eval")
    assert [t.task_id for t in a] == [t.task_id for t in b]
    assert [t.spec for t in a] == [t.spec for t in b]


@pytest.mark.parametrize("split", ["train", "eval"])
def test_a_later_wave_continues_the_same_stream(split):
    # A resumed run (a fresh process: nothing cached) sees the tasks the first one saw.
    config = EnvConfig(seed=3)
    whole = [(t.task_id, t.spec) for t in make_tasks(config, 30, split=split)]
    arithmetic._stream.cache_clear()
    arithmetic._dataset.cache_clear()
    assert [(t.task_id, t.spec) for t in make_tasks(config, 12, start_index=18, split=split)] == whole[18:]


def test_a_sampler_refuses_a_held_out_question_sent_for_training():
    held_out = make_tasks(EnvConfig(), 1, split="eval")[0]
    env = make_env(EnvConfig())
    assert env.reset(held_out.spec)  # as an eval task it runs
    with pytest.raises(ValueError, match="held-out question was sent as a training task"):
        env.reset({**held_out.spec, "split": "train"})
    train = make_tasks(EnvConfig(), 1)[0]
    with pytest.raises(ValueError, match="not the question the task names"):
        env.reset({**train.spec, "index": train.spec["index"] + 1, "size": train.spec["size"]})


def test_seeds_draw_their_own_training_questions():
    """reasoning-gym's Random(seed + index) made seeds 0, 1, 2 one stream shifted by an entry;
    a comparison over seeds must compare different task orders, not the same one."""
    def questions(seed: int) -> list[str]:
        return [t.spec["question_sha256"] for t in make_tasks(EnvConfig(seed=seed), 32)]

    zero, one, two = questions(0), questions(1), questions(2)
    assert len(set(zero[1:]) & set(one[:-1])) < 24  # shifted by one, 31 of 31 used to match
    assert zero != one != two
    assert sum(a == b for a, b in zip(zero[1:], one)) < 8


@pytest.mark.parametrize("change", [{"options": {"min_terms": 100_000, "max_terms": 100_000}},
                                    {"options": {"max_digits": 10**6}}, {"options": {"operators": ["+"] * 1000}},
                                    {"index": 2**40}, {"size": 2**40}, {"index": -1}, {"options": None},
                                    {"seed": "0"}])
def test_a_task_asking_for_more_than_any_sensible_question_is_refused_before_it_is_built(change):
    """Issue 27: 100,000 terms built a 409,100-character question in 0.15 s, under any env time limit, and the
    sampler then spun for minutes on it."""
    from sao.envs.arithmetic import ArithmeticEnv
    from sao.envs.guard import EnvFailure, call_env

    spec = make_tasks(EnvConfig(), 1)[0].spec
    options = {**spec["options"], **change["options"]} if change.get("options") else change.get("options", 0)
    hostile = {**spec, **change, **({"options": options} if "options" in change else {})}
    with pytest.raises(EnvFailure) as refused:
        call_env("env.reset", ArithmeticEnv().reset, hostile, timeout_s=5)
    assert refused.value.reason == "invalid-task", refused.value
