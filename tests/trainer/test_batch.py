"""Advantages per algorithm: group means for the GRPO baseline, running baselines for SAO."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from sao.config import GrpoAlgorithm, TrainerConfig
from sao.schema import Memory, Step, Trajectory
from sao.trainer.baselines import RewardBaseline
from sao.trainer.batch import plan_batch, record_rewards, turn_returns
from sao.trainer.objectives import LossInputs, policy_loss
from support.advantages import flat, one_turn
from support.trainer_runs import synthetic_trajectory


class CpuEngine:
    """What rank_loss needs of an engine: a callable module and its device."""

    def __init__(self, module):
        self.module, self.device = module, torch.device("cpu")

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def trajectory(task_id: str, reward: float, copy: int = 0, version: int = 0, prompt_token: int = 0) -> Trajectory:
    step = Step(np.zeros(2, np.int32), np.ones(3, np.int32), np.full(3, -1.0, np.float32), reward, True, 0)
    return Trajectory(f"{task_id}#{copy}", task_id, "arithmetic", "s", version,
                      np.full(4, prompt_token, np.int32), [step],
                      Memory.empty(8), 1.0, "enc", 0)


def test_grpo_uses_group_means():
    batch = [trajectory("a", 1.0, 0), trajectory("a", 0.0, 1), trajectory("b", 1.0, 0), trajectory("b", 1.0, 1)]
    cfg = TrainerConfig(algorithm=GrpoAlgorithm(group_size=2), batch_size=4, scale_advantages=False)
    plan = plan_batch(batch, RewardBaseline(), cfg, policy_version=3)
    assert flat(plan.advantages) == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert plan.staleness == [3, 3, 3, 3]


def test_sao_uses_the_running_baseline_and_updates_it_only_once_the_step_is_applied():
    baseline = RewardBaseline(key="env", momentum=0.5)
    baseline.update(*one_turn(trajectory("warmup", 0.5)))
    cfg = TrainerConfig(scale_advantages=False)
    plan = plan_batch([trajectory("a", 1.0), trajectory("b", 0.0)], baseline, cfg, policy_version=0)
    assert flat(plan.advantages) == pytest.approx([0.5, -0.5])
    assert baseline.value(trajectory("c", 0.0)) == 0.5  # planning leaves it alone: the step may yet be skipped
    record_rewards(plan, baseline)
    assert baseline.value(trajectory("c", 0.0)) == pytest.approx(0.5 * (0.5 * 0.5 + 0.5 * 1.0) + 0.5 * 0.0)


def _gradient(cfg: TrainerConfig, baseline: RewardBaseline) -> torch.Tensor:
    # One trajectory per task, as SAO samples: rewards differ, but every group has size 1.
    batch = [trajectory(f"t{i}", r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    plan = plan_batch(batch, baseline, cfg, policy_version=0)
    logprobs = torch.full((4, 3), -1.0, requires_grad=True)
    loss, _ = policy_loss(LossInputs(logprobs, torch.full((4, 3), -1.0), torch.ones(4, 3, dtype=torch.bool),
                                     torch.tensor(flat(plan.advantages))[:, None].expand(4, 3), torch.arange(4), 4), cfg)
    loss.backward()
    return logprobs.grad


def test_single_trajectory_gradient_is_zero_with_group_means_but_not_with_sao():
    baseline = RewardBaseline(key="env", momentum=0.9)
    baseline.update(*one_turn(trajectory("seen-before", 0.3)))
    assert _gradient(TrainerConfig(), baseline).abs().sum() > 0
    grpo = TrainerConfig().model_copy(update={"algorithm": GrpoAlgorithm.model_construct(group_size=1)})
    assert _gradient(grpo, RewardBaseline()).abs().sum() == 0



def retry(task_id: str, second_reward: float, prompt_token: int = 0) -> Trajectory:
    """A retry episode: a wrong first answer (reward 0), then a second answer earning `second_reward`."""
    wrong = Step(np.zeros(2, np.int32), np.ones(3, np.int32), np.full(3, -1.0, np.float32), 0.0, False, 0)
    second = Step(np.zeros(2, np.int32), np.ones(3, np.int32), np.full(3, -1.0, np.float32), second_reward, True, 0)
    return replace(trajectory(task_id, 0.0, prompt_token=prompt_token), steps=[wrong, second])


def test_turn_returns_credit_a_turn_with_its_own_reward_or_what_follows():
    episode = retry("a", 0.5)
    assert turn_returns(episode, "own_reward") == [0.0, 0.5]
    assert turn_returns(episode, "reward_to_go") == [0.5, 0.5]
    assert turn_returns(episode, "auto") == [0.5, 0.5]  # unresolved auto: reward_to_go


def test_own_reward_stops_a_retry_from_rewarding_the_wrong_first_answer():
    # Three one-turn failures and a retry that succeeded: with reward_to_go the wrong first answer of
    # the retry is the batch's best action; with own_reward it is no better than any other wrong one.
    batch = [trajectory("a", 0.0), trajectory("b", 0.0), trajectory("c", 1.0), retry("d", 0.5)]
    to_go = plan_batch(batch, RewardBaseline(), TrainerConfig(turn_credit="reward_to_go"), 0).advantages
    own = plan_batch(batch, RewardBaseline(), TrainerConfig(turn_credit="own_reward"), 0).advantages
    assert to_go[3][0] > to_go[0][0]
    assert own[3][0] == pytest.approx(own[0][0])
    assert own[3][1] > 0 and own[2][0] > own[3][1]  # the right retry is reinforced, less than a right first answer


def test_an_all_failed_batch_reinforces_no_failure_unless_the_batch_mean_is_subtracted():
    # Every answer wrong; the baselines differ by turn and by what the env has seen. Subtracting
    # the batch mean on top of the baselines turns the failures with the smaller baselines into
    # reinforced actions; scaling alone keeps every advantage's sign.
    baseline = RewardBaseline(key="env", momentum=0.5)
    history = [trajectory("h1", 1.0), retry("h2", 0.5), retry("h3", 0.5)]
    cfg = TrainerConfig(turn_credit="own_reward", scale_advantages=False)
    record_rewards(plan_batch(history, baseline, cfg, 0), baseline)
    failed = [trajectory("a", 0.0), retry("b", 0.0), retry("c", 0.0)]
    scaled = flat(plan_batch(failed, baseline, TrainerConfig(turn_credit="own_reward"), 0).advantages)
    centred = flat(plan_batch(failed, baseline, TrainerConfig(turn_credit="own_reward", center_advantages=True), 0)
                   .advantages)
    assert max(scaled) < 0 and sum(a * a for a in scaled) / len(scaled) == pytest.approx(1.0, abs=1e-4)
    assert max(centred) > 0


def test_each_turn_has_its_own_running_baseline():
    baseline = RewardBaseline(key="prompt", momentum=0.5)
    cfg = TrainerConfig(turn_credit="own_reward", scale_advantages=False)
    record_rewards(plan_batch([retry("a", 0.5), trajectory("b", 1.0)], baseline, cfg, 0), baseline)
    assert baseline.value(retry("z", 0.0), turn=0) == pytest.approx(0.5)  # first answers: 0 and 1
    assert baseline.value(retry("z", 0.0), turn=1) == pytest.approx(0.5)  # second answers: one, worth 0.5
    plan = plan_batch([retry("c", 0.0)], baseline, cfg, 0)
    assert plan.advantages == [[pytest.approx(-0.5), pytest.approx(-0.5)]]
    assert "env:arithmetic" in baseline.values and "env:arithmetic:turn1" in baseline.values


def test_grpo_compares_each_turn_with_the_group_copies_that_reached_it():
    batch = [trajectory("a", 1.0, 0), retry("a", 0.5), retry("a", 0.0)]
    batch[1], batch[2] = replace(batch[1], trajectory_id="a#1"), replace(batch[2], trajectory_id="a#2")
    cfg = TrainerConfig(algorithm=GrpoAlgorithm(group_size=3), batch_size=3, scale_advantages=False,
                        turn_credit="own_reward")
    advantages = plan_batch(batch, RewardBaseline(), cfg, 0).advantages
    assert advantages[0] == pytest.approx([1.0 - 1 / 3])
    assert advantages[1] == pytest.approx([-1 / 3, 0.25]) and advantages[2] == pytest.approx([-1 / 3, -0.25])


def test_auto_turn_credit_follows_the_env(tiny_config):
    from sao.envs.registry import turn_credit

    assert turn_credit(tiny_config.model_copy(update={"env": tiny_config.env.model_copy(update={"name": "arithmetic"})})) \
        == "own_reward"
    textworld = tiny_config.model_copy(update={"env": tiny_config.env.model_copy(update={"name": "textworld"})})
    assert turn_credit(textworld) == "reward_to_go"
    explicit = textworld.model_copy(update={"trainer": textworld.trainer.model_copy(update={"turn_credit": "own_reward"})})
    assert turn_credit(explicit) == "own_reward"

def test_value_head_learns_returns_and_sets_advantages(tiny_config):
    from sao.policy.weights import build_policy
    from sao.trainer.batch import all_rows, rank_loss

    policy = build_policy(tiny_config.policy, 8, value_head=True)
    cfg = TrainerConfig(value_head=True, value_coef=1.0, scale_advantages=False)
    batch = [trajectory("a", 1.0, prompt_token=100), trajectory("b", 0.0, prompt_token=200)]  # different states
    plan = plan_batch(batch, RewardBaseline(), cfg, policy_version=0)
    optimizer = torch.optim.Adam(policy.value_head.parameters(), lr=0.05)
    first = None
    for _ in range(60):
        loss, stats = rank_loss(CpuEngine(policy), plan, all_rows(plan, [0, 1]), 2, cfg, 8)
        first = stats.value_loss if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # V starts at 0 (zero-initialised head): squared errors 1 and 0 over 2 trajectories.
    assert first == pytest.approx(0.5)
    assert stats.value_loss < 0.05 * first


def _uneven_batch(memory_width: int) -> list[Trajectory]:
    """Trajectories of one and two steps with prompts and answers of very different lengths, some with memory."""
    rng = np.random.default_rng(3)
    batch = []
    for index in range(6):
        steps = [Step(rng.integers(3, 400, int(rng.integers(2, 6))).astype(np.int32),
                      rng.integers(3, 400, int(rng.integers(2, 30))).astype(np.int32),
                      rng.normal(-3, 1, 0).astype(np.float32), float(index % 2), False, min(turn, 1))
                 for turn in range(1 + index % 2)]
        steps = [Step(s.observation_ids, s.action_ids, rng.normal(-3, 1, len(s.action_ids)).astype(np.float32),
                      s.reward, s.done, s.memory_count) for s in steps]
        memory = Memory(rng.integers(-127, 128, (1, memory_width)).astype(np.int8), np.full(1, 0.01, np.float32),
                        np.zeros((1, 2), np.int32), np.zeros(1, np.float32))
        batch.append(Trajectory(f"u{index}#0", f"u{index}", "arithmetic", "s", 0,
                                rng.integers(3, 400, int(rng.integers(4, 40))).astype(np.int32), steps, memory, 1.0,
                                "enc", 0))
    return batch


@pytest.mark.parametrize("knobs", [{}, {"importance_level": "sequence"}, {"value_head": True},
                                   {"objective": {"type": "ppo"}}])
def test_length_buckets_give_the_same_loss_and_gradient(tiny_config, knobs):
    import copy

    from sao.policy.context import training_inputs
    from sao.policy.weights import build_policy
    from sao.trainer.batch import all_rows, length_buckets, rank_loss

    batch = _uneven_batch(8)
    lengths = [x.positions for t in batch for x in training_inputs(t)]
    assert len(length_buckets(lengths, 3)) > 1  # the batch is uneven enough to be split
    torch.manual_seed(0)
    policy = build_policy(tiny_config.policy, 8, value_head=knobs.get("value_head", False))
    with torch.no_grad():  # a projector that reads memory, so memory rows matter to the gradient
        policy.projector.weight.normal_(0, 0.02)
    results = []
    for buckets in (1, 3):
        model = copy.deepcopy(policy)
        cfg = TrainerConfig(length_buckets=buckets, scale_advantages=False, **knobs)
        plan = plan_batch(batch, RewardBaseline(), cfg, policy_version=0)
        loss, stats = rank_loss(CpuEngine(model), plan, all_rows(plan, list(range(len(batch)))), len(batch), cfg, 8)
        loss.backward()
        results.append((loss.detach(), stats, {name: p.grad.clone() for name, p in model.named_parameters()
                                               if p.grad is not None}))
    (loss_one, stats_one, grads_one), (loss_many, stats_many, grads_many) = results
    assert torch.allclose(loss_one, loss_many, atol=1e-5, rtol=1e-5)
    assert stats_one.tokens == stats_many.tokens and stats_one.ratio_mean == pytest.approx(stats_many.ratio_mean, abs=1e-5)
    assert grads_one.keys() == grads_many.keys() and "projector.weight" in grads_one
    for name, grad in grads_one.items():
        assert torch.allclose(grad, grads_many[name], atol=1e-5, rtol=1e-4), name


def test_length_buckets_cut_where_padding_is_largest():
    from sao.trainer.batch import length_buckets

    lengths = [60, 90, 61, 88, 59, 91]
    assert [sorted(bucket) for bucket in length_buckets(lengths, 1)] == [[0, 1, 2, 3, 4, 5]]
    assert sorted(map(sorted, length_buckets(lengths, 2))) == [[0, 2, 4], [1, 3, 5]]
    assert len(length_buckets(lengths, 4)) == 2  # a third cut would save under 5% of the positions
    assert len(length_buckets([50, 50, 51], 3)) == 1  # nothing worth cutting


def test_auto_turn_credit_falls_back_when_the_trainer_cannot_import_a_plugin_env(tiny_config, caplog):
    from sao.envs.registry import turn_credit

    plugin = tiny_config.model_copy(update={"env": tiny_config.env.model_copy(update={"name": "not_installed.envs:Game"})})
    assert turn_credit(plugin) == "reward_to_go"
    assert "trainer.turn_credit" in caplog.text and "not_installed" in caplog.text


def test_micro_batches_hold_every_row_once_within_the_token_budget():
    """A step's passes are what bounds the trainer's memory: none over the budget, no row lost or twice."""
    from sao.policy.context import training_inputs
    from sao.trainer.batch import micro_batches

    rng = np.random.default_rng(3)
    batch = [synthetic_trajectory(i, rng) for i in range(12)]
    plan = plan_batch(batch, RewardBaseline(), TrainerConfig(), 0)
    length = {(i, (turn,)): len(x.prompt_ids) + len(x.context_ids) + len(x.action_ids) + len(x.memory)
              for i, t in enumerate(batch) for turn, x in enumerate(training_inputs(t))}
    budget = 3 * max(length.values())
    passes = micro_batches(plan, list(range(12)), budget, whole_trajectories=False)
    assert sorted(row for rows in passes for row in rows) == sorted(length)
    assert len(passes) > 1 and all(len(rows) * max(length[r] for r in rows) <= budget for rows in passes)
    # Sequence-level importance: a trajectory's rows share one pass.
    whole = micro_batches(plan, list(range(12)), budget, whole_trajectories=True)
    assert sorted(row for rows in whole for row in rows) == sorted(length)
    for index in range(12):
        assert len({n for n, rows in enumerate(whole) for i, _ in rows if i == index}) == 1
    assert micro_batches(plan, [], budget, False) == []


def test_retry_hindsight_teaches_the_first_turn_the_right_retry_as_a_plain_policy_gradient(tiny_config):
    """A right retry after a wrong first try also trains the first turn's context with the retry's answer,
    at the retry's advantage and ratio 1 (it was never sampled there); the baselines learn only real turns."""
    from sao.policy.weights import build_policy
    from sao.trainer.batch import all_rows, plan_rows, rank_loss

    right_retry = retry("a", 0.5)
    right_retry.steps[1] = replace(right_retry.steps[1], action_ids=np.array([7, 8, 9, 2], np.int32),
                                   behaviour_logprobs=np.full(4, -1.0, np.float32))
    batch = [right_retry, retry("b", -0.5), trajectory("c", 1.0)]
    cfg = TrainerConfig(retry_hindsight=True, turn_credit="own_reward", scale_advantages=False)
    baseline = RewardBaseline(key="env")
    plan = plan_batch(batch, baseline, cfg, policy_version=0)
    assert plan.hindsight == {0: 1}  # a wrong retry teaches nothing
    first, second, taught = plan_rows(plan, 0)
    assert np.array_equal(taught.context_ids, first.context_ids) and np.array_equal(taught.action_ids, second.action_ids)
    assert plan.advantages[0] == pytest.approx([0.0, 0.5, 0.5]) and len(plan.advantages[1]) == 2
    assert all_rows(plan, [0]) == [(0, (0,)), (0, (1,)), (0, (2,))]  # recent_window 0: no turn begins the next
    assert plan_batch(batch, baseline, TrainerConfig(retry_hindsight=True), 0).hindsight == {}  # reward_to_go credit
    assert plan_batch(batch, baseline, cfg.model_copy(update={"retry_hindsight": False}), 0).hindsight == {}
    tight = cfg.model_copy(update={"micro_batch_tokens": taught.positions - 1})  # the row would overflow a pass
    assert plan_batch(batch, baseline, tight, 0).hindsight == {}
    grpo = cfg.model_copy(update={"algorithm": GrpoAlgorithm.model_construct(group_size=1)})
    assert plan_batch(batch, baseline, grpo, 0).hindsight == {}  # the comparison baseline stays plain GRPO

    # trainer.hindsight_reply = corrected: the first reply in its own words, its answer put right by the retry's.
    from sao.policy.chat import ChatFormat
    from sao.trainer.hindsight import hindsight_replies

    corrected = tiny_config.model_copy(update={"trainer": cfg.model_copy(update={"hindsight_reply": "corrected"})})
    reply = hindsight_replies(corrected)
    text = lambda ids: reply.tokenizer.decode(ids)  # noqa: E731
    said = lambda words: np.array(reply.tokenizer.encode(words, add_special_tokens=False), np.int32)  # noqa: E731
    worded = replace(right_retry, steps=[replace(right_retry.steps[0], action_ids=said("3 - 5 = 2<|im_end|>")),
                                         replace(right_retry.steps[1], action_ids=said("Not 2: it is -2.<|im_end|>"))])
    assert text(plan_rows(plan_batch([worded], baseline, cfg, 0, reply), 0)[2].action_ids) == "3 - 5 = -2<|im_end|>"
    # Judged as a first try (0.5 earned at attempt 1 is 1.0 at attempt 0) against the first try's baseline, so
    # retries that only copy a revealed answer, whose own advantage fades, still teach the question.
    assert plan_batch([worded], baseline, cfg, 0, reply).advantages[0] == pytest.approx([0.0, 0.5, 1.0])
    unsaid = replace(worded, steps=[replace(worded.steps[0], action_ids=said("I cannot say.<|im_end|>")),
                                    worded.steps[1]])  # no answer to correct: the retry's reply is taught
    assert text(plan_rows(plan_batch([unsaid], baseline, cfg, 0, reply), 0)[2].action_ids) == "Not 2: it is -2.<|im_end|>"
    assert plan_batch([unsaid], baseline, cfg, 0, reply).advantages[0] == pytest.approx([0.0, 0.5, 0.5])
    cut = replace(worded, steps=[replace(worded.steps[0], action_ids=said("To find 3 - 5, subtract 5")),
                                 worded.steps[1]])  # cut off: its last number is an operand, not its answer
    assert text(plan_rows(plan_batch([cut], baseline, cfg, 0, reply), 0)[2].action_ids) == "-2<|im_end|>"
    asked = replace(cut, prompt_ids=ChatFormat(reply.tokenizer, "You are a calculator.").prompt("Calculate 3 - 5."))
    assert text(plan_rows(plan_batch([asked], baseline, cfg, 0, reply), 0)[2].action_ids) == "3 - 5 = -2<|im_end|>"

    policy = build_policy(tiny_config.policy, 8)
    loss, stats = rank_loss(CpuEngine(policy), plan, [(0, (2,))], 1, cfg, 8)
    assert stats.ratio_mean == pytest.approx(1.0) and stats.tokens == 4 and torch.isfinite(loss)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    record_rewards(plan, baseline)
    assert set(baseline.values) == {"env:arithmetic", "env:arithmetic:turn1"}


def test_a_turn_that_begins_the_next_turns_row_is_scored_inside_it_with_the_same_loss_and_gradient(tiny_config):
    """With the recent window holding the first try, the retry's row begins with the first try's whole row:
    one row scores both turns, each token at its own turn's advantage, and the loss and gradient are
    those of two separate rows. Memory that changed between the turns keeps them apart."""
    from sao.policy.weights import build_policy
    from sao.schema import Memory
    from sao.trainer.batch import all_rows, rank_loss, sequences

    rng = np.random.default_rng(5)
    steps = [Step(rng.integers(3, 400, 3).astype(np.int32), rng.integers(3, 400, length).astype(np.int32),
                  np.full(length, -2.0, np.float32), reward, reward > 0, 0) for length, reward in ((4, 0.0), (3, 1.0))]
    chained = replace(trajectory("a", 0.0), steps=steps, recent_window=1)
    batch = [chained, trajectory("b", 1.0), trajectory("c", 0.0)]
    cfg = TrainerConfig(turn_credit="own_reward", retry_hindsight=False)
    plan = plan_batch(batch, RewardBaseline(), cfg, policy_version=0)
    assert plan.advantages[0][0] != plan.advantages[0][1]
    assert sequences(plan, 0) == [(0, 1)] and sequences(replace(plan, merge_turns=False), 0) == [(0,), (1,)]
    one_slot = Memory(np.ones((1, 8), np.int8), np.ones(1, np.float32), np.zeros((1, 2), np.int32), np.zeros(1, np.float32))
    with_memory = replace(chained, memory=one_slot, steps=[steps[0], replace(steps[1], memory_count=1)])
    assert sequences(replace(plan, trajectories=[with_memory, *batch[1:]]), 0) == [(0,), (1,)]

    policy = build_policy(tiny_config.policy, 8)
    results = []
    for merge in (True, False):
        policy.zero_grad()
        merged = replace(plan, merge_turns=merge)
        rows = all_rows(merged, [0, 1, 2])
        assert len(rows) == (3 if merge else 4)
        loss, stats = rank_loss(CpuEngine(policy), merged, rows, 3, cfg, 8)
        loss.backward()
        results.append((loss.detach(), stats.tokens, [p.grad.clone() for p in policy.parameters() if p.grad is not None]))
    (merged_loss, merged_tokens, merged_grads), (loss, tokens, grads) = results
    assert merged_tokens == tokens == 4 + 3 + 3 + 3
    assert torch.allclose(merged_loss, loss, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(merged_grads, grads)) and len(grads) > 0
