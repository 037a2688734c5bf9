"""The long-horizon text labyrinth and its scripted agents."""

import pytest

from sao.config import EnvConfig
from sao.envs.registry import make_env, make_tasks
from sao.envs.textworld import DEFAULT_OPTIONS, TextWorldEnv, build_world
from sao.envs.textworld_agents import ExpertAgent, RandomAgent, expert_action, make_agent
from sao.offline.episodes import record_episode

CONFIG = EnvConfig(name="textworld")


def _task(index=0, **options):
    return make_tasks(CONFIG.model_copy(update={"options": options}), 1, index)[0]


def test_registered_and_tasks_carry_their_world_options():
    env = make_env(CONFIG)
    assert isinstance(env, TextWorldEnv)
    tasks = make_tasks(CONFIG.model_copy(update={"options": {"size": 7}}), 3, start_index=5)
    assert [t.task_id for t in tasks] == ["textworld/0/5", "textworld/0/6", "textworld/0/7"]
    assert tasks[0].spec == {**DEFAULT_OPTIONS, "size": 7, "seed": 0, "index": 5} and tasks[0].env == "textworld"


def test_unknown_or_bad_option_fails_naming_it():
    with pytest.raises(ValueError, match="colour"):
        make_env(CONFIG.model_copy(update={"options": {"colour": 3}}))
    with pytest.raises(ValueError, match="size >= 3"):
        make_tasks(CONFIG.model_copy(update={"options": {"size": 2}}), 1)


@pytest.mark.parametrize("option", [{"size": 100_000}, {"loops": 10**9}, {"max_steps": 10**9}, {"size": "12"}])
def test_a_task_asking_for_a_huge_world_is_refused_before_it_is_built(option):
    """Issue 27: a task is untrusted input, and the maze is built whole at reset."""
    from sao.envs.base import InvalidTask
    from sao.envs.guard import EnvFailure, call_env

    with pytest.raises(EnvFailure) as refused:
        call_env("env.reset", TextWorldEnv().reset, {**_task(0).spec, **option}, timeout_s=5)
    assert refused.value.reason == "invalid-task" and isinstance(refused.value.__cause__, InvalidTask)


def test_worlds_are_deterministic_and_differ_by_index():
    spec = _task(0).spec
    assert TextWorldEnv().reset(spec) == TextWorldEnv().reset(dict(spec))
    assert build_world(spec).exits == build_world(spec).exits
    assert build_world(spec).exits != build_world(_task(1).spec).exits
    # The step budget does not change the maze.
    assert build_world(spec).exits == build_world({**spec, "max_steps": 100}).exits


def test_expert_solves_long_episodes_with_exact_return():
    env = TextWorldEnv()
    for index in range(4):
        task = _task(index)
        episode = record_episode(env, task.task_id, task.spec, ExpertAgent())
        assert 200 <= len(episode) <= 1000 and episode.meta["solved"]
        rewards = [s.reward for s in episode.steps if s.reward]
        assert rewards == [0.25] * 4 and sum(s.reward for s in episode.steps) == 1.0
        assert all(s.action.startswith("put ") for s in episode.steps if s.reward)
        assert episode.steps[-1].done and not any(s.done for s in episode.steps[:-1])
        assert all(s.label == s.action for s in episode.steps)  # the expert's own label


def test_agents_are_deterministic_given_their_seed():
    env, task = TextWorldEnv(), _task(2)
    first = record_episode(env, task.task_id, task.spec, make_agent("noisy", seed=3, noise=0.3))
    again = record_episode(env, task.task_id, task.spec, make_agent("noisy", seed=3, noise=0.3))
    assert first.steps == again.steps
    assert any(s.action != s.label for s in first.steps)  # the noise shows
    assert first.meta["solved"]


def test_random_policy_runs_out_of_moves():
    env, task = TextWorldEnv(), _task(0, max_steps=300)
    episode = record_episode(env, task.task_id, task.spec, RandomAgent(seed=0))
    assert len(episode) == 300 and episode.steps[-1].done
    assert not episode.meta["solved"]
    env.reset(task.spec)
    for step in episode.steps[:-1]:
        feedback = env.step(step.action)
        assert not feedback.done
    assert "out of moves" in env.step(episode.steps[-1].action).observation


def test_commands_doors_keys_and_the_altar():
    env = TextWorldEnv()
    prompt = env.reset(_task(0).spec)
    world, state = env.world, env.state
    assert "Atrium" in prompt and "Commands:" in prompt
    assert env.step("dance wildly").observation.startswith("I don't understand")
    assert env.step("put ruby on altar").observation.startswith("You are not carrying")
    assert env.step("inventory").observation == "You are carrying nothing."
    passage, material = next(iter(world.locks.items()))
    outside, vault = sorted(passage, key=lambda cell: len(world.exits[cell]), reverse=True)
    direction = next(d for d, cell in world.exits[outside].items() if cell == vault)
    state.position = outside
    assert f"A locked {material} door bars the way {direction}" in env.describe()
    assert env.step(f"go {direction}").observation == f"The {material} door is locked."
    assert env.step(f"unlock {material} door").observation == f"You have no {material} key."
    state.inventory.append(f"{material} key")
    assert env.step(f"unlock {material} door").observation.startswith("You unlock")
    assert env.step(direction[0]).observation.startswith(f"You go {direction}.\nA dead end")
    gem = next(item for item in state.items[vault] if item in world.gems)
    assert expert_action(env) == f"take {gem}"
    assert env.step(f"take the {gem}").observation == f"You take the {gem}."
    assert env.step(f"put {gem} on altar").observation == "There is no altar here."
    state.position = world.altar
    feedback = env.step(f"put {gem} on altar")
    assert feedback.reward == 0.25 and "1 of 4 gems" in feedback.observation
    assert f"On it lie a {gem}" in env.describe() or f"On it lie an {gem}" in env.describe()


def test_admissible_actions_are_all_understood():
    env = TextWorldEnv()
    env.reset(_task(3).spec)
    agent = RandomAgent(seed=1)
    for _ in range(200):
        for action in env.admissible_actions():
            assert not action.startswith("I don't")
        feedback = env.step(agent.act(env))
        assert not feedback.observation.startswith("I don't understand")


def test_a_sampler_turn_limit_below_max_steps_is_warned_about(caplog):
    make_env(CONFIG.model_copy(update={"max_turns": 1000}))
    assert not caplog.records
    make_env(CONFIG.model_copy(update={"max_turns": 5}))
    assert "env.max_turns=5" in caplog.text
