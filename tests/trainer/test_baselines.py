"""Reward baselines: what each key remembers, and what it does to a batch's advantages."""

import numpy as np
import pytest
import torch

from sao.config import TrainerConfig
from sao.schema import Memory, Step, Trajectory
from sao.trainer.baselines import RewardBaseline, prompt_digest
from sao.trainer.batch import plan_batch, record_rewards
from sao.trainer.objectives import whiten
from support.advantages import flat, one_turn

_ids = iter(range(10**9))


def trajectory(question: int, reward: float, env: str = "arithmetic") -> Trajectory:
    """A trajectory for `question`, under a fresh task id each time, as the feeder names train tasks."""
    position = next(_ids)
    step = Step(np.zeros(2, np.int32), np.ones(3, np.int32), np.full(3, -1.0, np.float32), reward, True, 0)
    prompt = np.array([7, 7, question, question + 1], np.int32)  # same question -> same prompt tokens
    return Trajectory(f"train/q/0/{position}#0", f"train/q/0/{position}", env, "s", 0, prompt, [step],
                      Memory.empty(8), 1.0, "enc", 0)


def _train(baseline: RewardBaseline, batch: list[Trajectory]) -> None:
    record_rewards(plan_batch(batch, baseline, TrainerConfig(), policy_version=0), baseline)


def test_prompt_key_gives_a_recurring_question_its_own_history():
    baseline = RewardBaseline(key="prompt", momentum=0.9)
    _train(baseline, [trajectory(1, 1.0), trajectory(2, 0.0), trajectory(1, 1.0), trajectory(3, 0.0)])
    assert baseline.value(trajectory(1, 0.0)) == 1.0  # another task id, the same question
    assert baseline.value(trajectory(2, 1.0)) == 0.0
    assert baseline.value(trajectory(99, 0.0)) == pytest.approx(0.5)  # unseen: the env's running mean
    assert baseline.value(trajectory(1, 0.0, env="other")) == 0.0  # same tokens in another env: its own key
    # task_id keys never see a repeat here (ids are stream positions): every value is the env's.
    by_id = RewardBaseline(key="task_id", momentum=0.9)
    _train(by_id, [trajectory(1, 1.0), trajectory(2, 0.0), trajectory(1, 1.0), trajectory(3, 0.0)])
    assert by_id.value(trajectory(1, 0.0)) == by_id.value(trajectory(2, 0.0)) == pytest.approx(0.5)
    # ...while a plugin env whose ids name the task gets one value per id.
    repeat = trajectory(1, 0.0)
    by_id.update(*one_turn(repeat))
    assert by_id.value(repeat) == 0.0 and by_id.value(trajectory(1, 1.0)) == pytest.approx(0.4)


def _whitened_advantages(key: str, history: list[Trajectory], batch: list[Trajectory]) -> list[float]:
    """Classic whitening (centred), under which some baselines are known to cancel."""
    baseline = RewardBaseline(key=key, momentum=0.9)
    _train(baseline, history)
    cfg = TrainerConfig(scale_advantages=True, center_advantages=True)
    return flat(plan_batch(batch, baseline, cfg, policy_version=0).advantages)


def test_a_question_always_solved_earns_no_advantage_with_the_prompt_key_and_the_most_with_env():
    # Question 1 was solved every time it came up; 2 was always failed. History's mean reward: 0.5.
    history = [trajectory(1, 1.0), trajectory(2, 0.0)] * 3
    batch = [trajectory(1, 1.0), trajectory(2, 0.0), trajectory(10, 1.0), trajectory(11, 0.0),
             trajectory(12, 1.0), trajectory(13, 0.0)]
    by_prompt = _whitened_advantages("prompt", history, batch)
    by_env = _whitened_advantages("env", history, batch)
    # prompt: the known questions did as expected (0); the unseen ones are judged against the env's 0.5.
    assert by_prompt[:2] == pytest.approx([0.0, 0.0], abs=1e-6)
    assert by_prompt[2:] == pytest.approx([1.118, -1.118, 1.118, -1.118], abs=1e-3)
    # env: the always-solved question is pushed up like any success, the always-failed one down.
    assert by_env[0] == pytest.approx(0.913, abs=1e-3) and by_env[1] == pytest.approx(-0.913, abs=1e-3)


def test_a_question_that_stops_being_solved_is_pushed_down_harder_than_an_unseen_failure():
    history = [trajectory(1, 1.0), trajectory(1, 1.0)] + [trajectory(5 + i, 0.0) for i in range(4)]
    batch = [trajectory(1, 0.0), trajectory(20, 0.0), trajectory(21, 1.0), trajectory(22, 0.0)]
    by_prompt = _whitened_advantages("prompt", history, batch)
    by_env = _whitened_advantages("env", history, batch)
    assert by_prompt[0] < by_prompt[1] - 0.5  # regressed on a known question: worse than a fresh failure
    assert by_env[0] == pytest.approx(by_env[1])  # env cannot tell them apart


def test_env_and_leave_one_out_baselines_change_nothing_once_whitened_and_centred():
    history = [trajectory(i, r) for i, r in enumerate([1.0, 1.0, 0.0, 1.0, 0.25])]
    batch = [trajectory(30 + i, r) for i, r in enumerate([1.0, 0.0, 0.5, 0.0, 1.0, 0.25, 0.0, 0.0])]
    none = whiten(torch.tensor([t.total_reward for t in batch])).tolist()
    for key in ("env", "leave_one_out"):
        assert _whitened_advantages(key, history, batch) == pytest.approx(none, abs=1e-5), key
    # ...while unwhitened both do subtract something, so the equality above is not vacuous.
    env = RewardBaseline(key="env", momentum=0.9)
    _train(env, history)
    unwhitened = flat(plan_batch(batch, env, TrainerConfig(scale_advantages=False), policy_version=0).advantages)
    assert unwhitened == pytest.approx([t.total_reward - 0.65 for t in batch])


def test_leave_one_out_subtracts_the_other_trajectories_mean():
    baseline = RewardBaseline(key="leave_one_out")
    batch = [trajectory(1, 1.0), trajectory(2, 0.0), trajectory(3, 0.5)]
    plan = plan_batch(batch, baseline, TrainerConfig(scale_advantages=False), policy_version=0)
    assert flat(plan.advantages) == pytest.approx([1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5])
    record_rewards(plan, baseline)
    # A batch of one has no others: it falls back to the env's running mean.
    alone = plan_batch([trajectory(4, 1.0)], baseline, TrainerConfig(scale_advantages=False), policy_version=0)
    assert flat(alone.advantages) == pytest.approx([0.5])


def test_a_running_mean_averages_its_first_rewards_then_becomes_an_ema():
    baseline = RewardBaseline(key="prompt", momentum=0.75)  # plain mean of the first 4, then EMA(0.75)
    for reward in (1.0, 0.0, 1.0, 0.0):
        baseline.update(*one_turn(trajectory(1, reward)))
    assert baseline.value(trajectory(1, 0.0)) == pytest.approx(0.5)  # an EMA from the first reward: 0.58
    baseline.update(*one_turn(trajectory(1, 1.0)))
    assert baseline.value(trajectory(1, 0.0)) == pytest.approx(0.75 * 0.5 + 0.25 * 1.0)


def test_state_dict_round_trip_and_old_checkpoints_still_load():
    baseline = RewardBaseline(key="prompt", momentum=0.9)
    _train(baseline, [trajectory(1, 1.0), trajectory(2, 0.0), trajectory(1, 0.0)])
    restored = RewardBaseline(key="prompt", momentum=0.9)
    restored.load_state_dict(baseline.state_dict())
    for question in (1, 2, 77):
        assert restored.value(trajectory(question, 0.0)) == baseline.value(trajectory(question, 0.0))
    restored.update(*one_turn(trajectory(1, 1.0)))
    baseline.update(*one_turn(trajectory(1, 1.0)))
    assert restored.value(trajectory(1, 0.0)) == baseline.value(trajectory(1, 0.0))  # counts came along

    # A checkpoint from before prompt keys and counts: env (and task) values, plain EMAs.
    old = RewardBaseline(key="prompt", momentum=0.9)
    old.load_state_dict({"key": "env", "momentum": 0.9, "values": {"env:arithmetic": 0.4, "task:t1": 1.0}})
    assert old.value(trajectory(5, 0.0)) == pytest.approx(0.4)  # the env value is the fallback
    old.update(*one_turn(trajectory(5, 1.0)))
    assert old.value(trajectory(6, 0.0)) == pytest.approx(0.9 * 0.4 + 0.1 * 1.0)  # still a warmed-up EMA
    assert old.value(trajectory(5, 0.0)) == 1.0  # a new key starts from its first reward


def test_least_recently_updated_prompts_are_dropped_beyond_max_keys():
    baseline = RewardBaseline(key="prompt", momentum=0.9, max_keys=3)  # env + 2 prompts
    for question, reward in ((1, 1.0), (2, 1.0), (1, 1.0), (3, 0.0)):
        baseline.update(*one_turn(trajectory(question, reward)))
    assert len(baseline.values) == 3 and "env:arithmetic" in baseline.values
    env = baseline.values["env:arithmetic"]
    assert baseline.value(trajectory(2, 0.0)) == env  # 2 was the least recently updated: gone
    assert baseline.value(trajectory(1, 0.0)) == 1.0 and baseline.value(trajectory(3, 1.0)) == 0.0
    assert set(baseline.counts) == set(baseline.values)


def test_arithmetic_tasks_asking_the_same_question_share_a_prompt_key(tiny_config, chat):
    from sao.envs.arithmetic import ArithmeticEnv
    from sao.envs.registry import make_tasks

    tasks = make_tasks(tiny_config.env, 60)
    by_question: dict[str, list] = {}
    for task in tasks:
        by_question.setdefault(task.spec["question_sha256"], []).append(task)
    first, again = next(group for group in by_question.values() if len(group) > 1)[:2]
    other = next(group for group in by_question.values() if group[0] is not first)[0]
    env = ArithmeticEnv.from_config(tiny_config.env)
    digests = [prompt_digest(chat.prompt(env.reset(task.spec))) for task in (first, again, other)]
    assert first.task_id != again.task_id
    assert digests[0] == digests[1] != digests[2]
