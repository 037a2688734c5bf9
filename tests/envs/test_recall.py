"""The recall env: facts stated once, small talk, then a question on one of them."""

import pytest

from sao.config import EnvConfig
from sao.envs.base import InvalidTask
from sao.envs.guard import EnvFailure, call_env
from sao.envs.recall import DEFAULT_OPTIONS, RecallEnv, answer_matches, build_episode, is_held_out
from sao.envs.registry import make_env, make_tasks

CONFIG = EnvConfig(name="recall", max_turns=DEFAULT_OPTIONS["turns"])


def _tasks(count=20, split="train", **options):
    return make_tasks(CONFIG.model_copy(update={"options": options}), count, split=split)


def _values(tasks):
    return {value for task in tasks for value in build_episode(task.spec).values}


def _play(spec, answer):
    """Play an episode replying what the rules ask for, and `answer(fact)` to each question: the rewards."""
    env = make_env(CONFIG)
    env.reset(spec)
    episode, rewards = build_episode(spec), []
    for turn in episode.turns:
        feedback = env.step(answer(turn.fact) if turn.fact is not None else turn.reply)
        rewards.append(feedback.reward)
        if feedback.done:
            break
    return rewards


def test_registered_and_tasks_carry_their_options():
    assert isinstance(make_env(CONFIG), RecallEnv)
    tasks = make_tasks(CONFIG, 3, start_index=5)
    assert [t.task_id for t in tasks] == ["train/recall/0/5", "train/recall/0/6", "train/recall/0/7"]
    assert tasks[0].spec == {**DEFAULT_OPTIONS, "seed": 0, "index": 5, "split": "train"}


def test_episodes_are_deterministic_from_the_spec_and_differ_by_index():
    first, second = _tasks(2)
    assert build_episode(first.spec) == build_episode(dict(first.spec))
    assert build_episode(first.spec) != build_episode(second.spec)
    env = make_env(CONFIG)
    observations = []
    for _ in range(2):
        observations.append([env.reset(first.spec)] + [env.step("x").observation for _ in range(15)])
    assert observations[0] == observations[1]


def test_held_out_facts_are_disjoint_from_training_facts():
    train, held_out = _values(_tasks(200)), _values(_tasks(200, split="eval"))
    assert train and held_out and train.isdisjoint(held_out)
    assert all(is_held_out(value) for value in held_out) and not any(is_held_out(value) for value in train)
    # Another env.seed reads another training stream, never the held-out one.
    other_seed = make_tasks(CONFIG.model_copy(update={"seed": 7}), 200)
    assert _values(other_seed).isdisjoint(held_out)
    # The held-out episodes are the same whatever env.seed.
    assert [t.spec for t in make_tasks(CONFIG.model_copy(update={"seed": 7}), 3, split="eval")] == [
        t.spec for t in _tasks(3, split="eval")]


@pytest.mark.parametrize("split", ["train", "eval"])
def test_each_answer_is_stated_earlier_in_its_episode_and_in_no_other(split):
    tasks = _tasks(100, split=split)
    episodes = [build_episode(task.spec) for task in tasks]
    for index, episode in enumerate(episodes):
        questions = [(t, turn) for t, turn in enumerate(episode.turns) if turn.fact is not None]
        assert questions
        for t, turn in questions:
            earlier = [i for i, other in enumerate(episode.turns[:t]) if turn.fact.value in other.text]
            assert earlier == [i for i, other in enumerate(episode.turns) if other.text == turn.fact.statement]
            assert 0 < earlier[0] < t  # never in the rules (the prompt, which truncation keeps)
            # The fact (key and value) is this episode's alone; a value may recur elsewhere under another key.
            assert not any(turn.fact.statement == fact.statement for j, other in enumerate(episodes) if j != index
                           for fact in other.facts)


@pytest.mark.parametrize("turns, facts, questions", [(16, 4, 1), (5, 2, 2), (40, 10, 3), (3, 1, 1)])
def test_turns_and_facts_follow_the_options(turns, facts, questions):
    for task in _tasks(5, turns=turns, facts=facts, questions=questions):
        episode = build_episode(task.spec)
        assert len(episode.turns) == turns and len(episode.facts) == facts
        statements = [turn for turn in episode.turns if turn.text in {f.statement for f in episode.facts}]
        assert len(statements) == facts
        asked = [turn.fact for turn in episode.turns if turn.fact is not None]
        assert len(asked) == questions == len(set(asked)) and all(t.fact for t in episode.turns[-questions:])
        assert len(_play(task.spec, lambda fact: fact.value)) == turns


def test_the_right_value_earns_one_and_anything_else_nothing():
    spec = _tasks(1)[0].spec
    rewards = _play(spec, lambda fact: fact.value)
    assert rewards[-1] == 1.0 and sum(rewards) == 1.0
    assert _play(spec, lambda fact: fact.statement)[-1] == 1.0  # the natural answer: the fact restated
    assert _play(spec, lambda fact: "I do not remember.")[-1] == 0.0
    assert sum(_play(spec, lambda fact: "ok")) == 0.0


@pytest.mark.parametrize("reply, right", [
    ("8315", True), ("  8315.\n", True), ('"8315"', True), ("The code of locker 7 is 8315.", True),
    ("**8315**", True), ("veska", False), ("8316", False), ("83-15", False), ("8315a", False), ("", False),
    ("8315 is the code", False),  # the value must be the last word
    ("It is 4242 or 8315.", False),  # another stated value alongside: listing candidates earns nothing
    ("It is 1111 or 8315.", True),  # a number the episode never stated is not another candidate
])
def test_exact_match_rule(reply, right):
    assert answer_matches(reply, "8315", ("4242", "8315", "Veska")) is right


@pytest.mark.parametrize("reply, right", [("Veska", True), ("veska!", True), ("The courier's name is VESKA", True),
                                          ("Vesk", False), ("Veskaa", False)])
def test_names_match_regardless_of_case(reply, right):
    assert answer_matches(reply, "Veska", ("Veska", "4242")) is right


@pytest.mark.parametrize("option, name", [
    ({"turns": 10_000}, "turns"), ({"turns": 2}, "turns"), ({"facts": 0}, "facts"), ({"facts": 65}, "facts"),
    ({"questions": 0}, "questions"), ({"questions": 3, "facts": 2}, "questions"), ({"turns": 5, "facts": 4}, "facts"),
    ({"turns": "16"}, "turns"), ({"colour": 3}, "colour"), ({"seed": 2**70}, "seed"), ({"split": "test"}, "split"),
])
def test_options_beyond_their_limits_are_refused_naming_them(option, name):
    """Issue 27: a task is untrusted input; its options are checked before anything is built."""
    spec = {**_tasks(1)[0].spec, **option}
    with pytest.raises(InvalidTask, match=name):
        build_episode(spec)
    with pytest.raises(EnvFailure) as refused:
        call_env("env.reset", RecallEnv().reset, spec, timeout_s=5)
    assert refused.value.reason == "invalid-task" and isinstance(refused.value.__cause__, InvalidTask)
    if name not in ("seed", "split"):
        with pytest.raises(InvalidTask, match=name):
            make_tasks(CONFIG.model_copy(update={"options": option}), 1)


def test_a_max_turns_below_the_episode_is_warned_about(caplog):
    with caplog.at_level("WARNING", logger="sao.envs.base"):
        make_env(CONFIG)
        assert not caplog.records
        make_env(CONFIG.model_copy(update={"max_turns": 2}))
    assert "env.max_turns=2 is below recall's turns=16" in caplog.text


def test_held_out_success_is_the_share_of_questions_answered_and_needs_the_whole_episode():
    """Held-out scoring and the shadow scorer use the env's own success: the first turn (the rules) decides nothing."""
    from sao.envs.registry import episode_success, scores_first_turn_only

    success = episode_success("recall")
    spec = _tasks(1, questions=2, facts=4)[0].spec
    assert success(spec, _play(spec, lambda fact: fact.value)) == 1.0
    assert success(spec, _play(spec, lambda fact: "ok")) == 0.0
    first_only = iter([True, False])
    assert success(spec, _play(spec, lambda fact: fact.value if next(first_only) else "ok")) == 0.5
    assert not scores_first_turn_only("recall") and scores_first_turn_only("arithmetic")
    assert episode_success("arithmetic")({}, [1.0]) == 1.0 and episode_success("arithmetic")({}, [0.0, 1.0]) == 0.0
