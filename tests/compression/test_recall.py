"""Memory as the episode's index: the slots nearest the current turn put their turns back as text, the trajectory
names them, and the trainer rebuilds exactly the context the sampler sampled from."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sao.compression.bottleneck import resolve_bottleneck
from sao.compression.pipeline import recall_turns
from sao.compression.temporal import load_temporal_filter
from sao.envs.recall import build_episode
from sao.envs.registry import make_tasks
from sao.policy.context import training_inputs
from sao.policy.model import collate_turns
from sao.policy.weights import build_policy
from sao.sampler.rollout import Roller
from sao.schema import SchemaError, Trajectory, decode, encode
from sao.trainer.validation import TrajectoryValidator

SPANS = np.array([[0, 0], [1, 3], [4, 4]], np.int32)  # slot 1 stands for turns 1-3 (2 and 3 merged into it)
VECTORS = np.array([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7]], np.float32)


def test_the_nearest_slot_comes_first_and_brings_its_merged_turns_latest_first():
    query = np.array([0.1, 1.0], np.float32)  # nearest slot 1, then slot 2, then slot 0
    assert recall_turns(VECTORS, SPANS, query, 1, before=5) == [1]
    assert recall_turns(VECTORS, SPANS, query, 2, before=5) == [1, 3]
    assert recall_turns(VECTORS, SPANS, query, 4, before=5) == [1, 2, 3, 4]
    assert recall_turns(VECTORS, SPANS, query, 9, before=5) == [0, 1, 2, 3, 4]
    assert recall_turns(VECTORS, SPANS, np.array([1.0, 0.0], np.float32), 1, before=5) == [0]


def test_turns_still_in_the_recent_window_are_never_recalled():
    query = np.array([0.1, 1.0], np.float32)
    # At turn 4 with a window of 1, turn 3 is text already and slot 2 not yet made: slot 1 gives turns 1 and 2 only.
    assert recall_turns(VECTORS[:2], SPANS[:2], query, 3, before=3) == [0, 1, 2]
    assert recall_turns(VECTORS[:2], SPANS[:2], query, 2, before=3) == [1, 2]
    assert recall_turns(VECTORS, SPANS, query, 0, before=5) == []
    assert recall_turns(VECTORS[:0], SPANS[:0], query, 2, before=5) == []


@pytest.fixture(scope="module")
def recall_roller(tiny_config, encoder):
    config = tiny_config.model_copy(deep=True)
    config.env.name, config.env.max_turns, config.compression.recall_turns = "recall", 16, 1
    policy = build_policy(config.policy, 64).eval()  # the shipped basis: 64 coordinates a slot
    torch.nn.init.normal_(policy.projector.weight, std=0.05)  # memory must matter for the exactness check
    return Roller(config, policy, encoder, load_temporal_filter(), "recall-test", seed=3,
                  bottleneck=resolve_bottleneck("auto", encoder.name))


def test_the_question_recalls_the_turn_that_stated_its_fact(recall_roller):
    """Real encoder and shipped basis: played with the replies the rules ask for, each question's one recalled
    turn is the one that stated its fact (or, merged, holds it), in every episode whose fact left the window."""
    found = 0
    for task in make_tasks(recall_roller.config.env, 6, split="eval"):
        turns = build_episode(task.spec).turns
        episode = recall_roller.start(task, 0)
        for turn in turns[:-1]:
            episode.next_input()
            episode.advance(recall_roller.chat.action_ids(turn.reply), np.zeros(0, np.float32))
        seen = episode.next_input()
        stated = next(i for i, t in enumerate(turns) if t.text == turns[-1].fact.statement)
        if stated < len(turns) - 1 - recall_roller.config.compression.recent_window:
            assert len(episode.recalled) == 1
            spans = episode.compressor.memory().spans
            assert any(first <= stated <= last and first <= episode.recalled[0] <= last for first, last in spans)
            text = recall_roller.chat.tokenizer.decode(seen.context_ids.tolist())
            found += turns[stated].text in text and episode.recalled == [stated]
    assert found >= 4  # merged facts aside, the slot named is the fact's own


def test_recalled_turns_travel_and_the_trainer_rescores_exactly(recall_roller):
    task = make_tasks(recall_roller.config.env, 1, split="eval")[0]
    trajectory = decode(encode(recall_roller.rollout(task, behaviour_version=1)), Trajectory)
    assert all(len(s.recalled) == 1 for s in trajectory.steps[2:]) and not trajectory.steps[1].recalled
    inputs = training_inputs(trajectory)
    plain = training_inputs(dataclasses.replace(
        trajectory, steps=[dataclasses.replace(s, recalled=()) for s in trajectory.steps]))
    assert all(len(a.context_ids) > len(b.context_ids) for a, b in zip(inputs[2:], plain[2:]))
    batch = collate_turns(inputs, 64, [trajectory.temperature] * len(inputs))
    with torch.no_grad():
        scored = recall_roller.policy(batch)
    for row, step in enumerate(trajectory.steps):
        np.testing.assert_allclose(scored[row][batch.action_mask[row]].numpy(), step.behaviour_logprobs, atol=1e-4)


def test_a_replayed_episode_recalls_what_the_live_sampler_recalled(recall_roller):
    """Alignment and the benchmarks replay recorded episodes (`replay_episode`): the same turns recalled as live."""
    from sao.offline.episodes import recall_episodes, replay_episode

    config = recall_roller.config
    for recorded in recall_episodes(config.env, 3, split="eval"):
        task = next(t for t in make_tasks(config.env, 3, split="eval") if t.task_id == recorded.task_id)
        live = recall_roller.start(task, 0)
        for step in recorded.steps:
            live.next_input()
            live.advance(recall_roller.chat.action_ids(step.action), np.zeros(0, np.float32))
            if live.done:
                break
        replayed, _ = replay_episode(recorded, recall_roller.chat, recall_roller.encoder,
                                     recall_roller.temporal_filter.fork(), recent_window=1,
                                     bottleneck=recall_roller.bottleneck, recall_turns=1)
        assert [s.recalled for s in replayed.steps] == [s.recalled for s in live.steps]
        assert any(s.recalled for s in replayed.steps)


def wire_with(trajectory: Trajectory, recalled: list) -> bytes:
    import msgpack

    message = msgpack.unpackb(encode(trajectory), raw=False)
    message["steps"]["recalled"] = recalled
    return msgpack.packb(message, use_bin_type=True)


@pytest.mark.parametrize("bad, why", [
    (lambda n: [[]] * (n - 1) + [[n - 1]], "in the recent window"),
    (lambda n: [[]] * (n - 1) + [[2, 1]], "not ascending"),
    (lambda n: [[]] * (n - 1) + [[-1]], "negative"),
    (lambda n: [[]] * (n - 1) + [["1"]], "not an integer"),
    (lambda n: [[]] * n + [[]], "one list too many"),
    (lambda n: [[]] * (n - 1) + [list(range(10**5))], "over the bound, refused before its entries are read"),
])
def test_recalled_turns_a_step_could_not_have_seen_are_refused(recall_roller, bad, why):
    trajectory = recall_roller.rollout(make_tasks(recall_roller.config.env, 1, split="eval")[0], 1)
    with pytest.raises(SchemaError) as err:
        decode(wire_with(trajectory, bad(len(trajectory.steps))), Trajectory)
    assert "recalled" in err.value.field, why


def test_a_message_without_recall_decodes_as_recalling_nothing(recall_roller):
    import msgpack

    trajectory = recall_roller.rollout(make_tasks(recall_roller.config.env, 1, split="eval")[0], 1)
    message = msgpack.unpackb(encode(trajectory), raw=False)
    del message["steps"]["recalled"]
    decoded = decode(msgpack.packb(message, use_bin_type=True), Trajectory)
    assert all(step.recalled == () for step in decoded.steps)


def test_a_rows_recalled_tokens_count_against_the_models_positions(recall_roller):
    trajectory = recall_roller.rollout(make_tasks(recall_roller.config.env, 1, split="eval")[0], 1)
    longest = max(x.positions for x in training_inputs(trajectory))
    plain = dataclasses.replace(trajectory, steps=[dataclasses.replace(s, recalled=()) for s in trajectory.steps])
    plain_longest = max(x.positions for x in training_inputs(plain))
    assert plain_longest < longest
    validator = TrajectoryValidator(vocab_size=10**6, memory_width=64, max_abs_reward=100.0, max_bytes=10**8,
                                    memory_basis=trajectory.memory_basis, max_positions=longest - 1)
    validator.validate(plain, policy_version=1)
    with pytest.raises(SchemaError, match="recalled"):
        validator.validate(trajectory, policy_version=1)
