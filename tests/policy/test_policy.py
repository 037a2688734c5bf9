"""The memory policy: sampling log-probs are what the trainer recomputes; memory is wired in."""

import numpy as np
import pytest
import torch

from sao.policy.context import TurnInput
from sao.policy.model import collate_turns
from sao.policy.sampling import StopRule
from sao.policy.weights import WeightsMismatch, build_policy, read_weights_into, unique_state_dict, write_weights

DIM = 16
NEVER = StopRule(frozenset())  # sample the full max_new_tokens


@pytest.fixture()
def policy(tiny_config):
    torch.manual_seed(0)
    return build_policy(tiny_config.policy, DIM).eval()


def _step(memory_rows: int, action=None) -> TurnInput:
    rng = np.random.default_rng(memory_rows)
    return TurnInput(prompt_ids=np.arange(10, 20, dtype=np.int32), memory=rng.normal(size=(memory_rows, DIM)).astype(np.float32),
                     context_ids=np.arange(30, 35, dtype=np.int32),
                     action_ids=np.zeros(0, np.int32) if action is None else action)


def test_sampled_logprobs_match_batched_scoring(policy):
    torch.nn.init.normal_(policy.projector.weight, std=0.5)  # make memory matter
    generator = torch.Generator().manual_seed(1)
    samples = [(m, *policy.sample(_step(m), 12, 0.7, NEVER, generator=generator)) for m in (0, 1, 3)]
    batch = collate_turns([_step(m, action) for m, action, _ in samples], DIM, [0.7] * 3)
    with torch.no_grad():
        scored = policy(batch)
    for row, (_, action, logprobs) in enumerate(samples):
        assert len(action) == 12
        np.testing.assert_allclose(scored[row][batch.action_mask[row]].numpy(), logprobs, atol=1e-4)


def test_memory_changes_the_distribution_once_projector_learns(policy):
    step = _step(2, action=np.array([5, 6, 7], np.int32))
    without = _step(0, action=np.array([5, 6, 7], np.int32))
    with torch.no_grad():
        zero_projector = policy(collate_turns([step], DIM))[0, -3:]
        torch.nn.init.normal_(policy.projector.weight, std=0.5)
        trained_projector = policy(collate_turns([step], DIM))[0, -3:]
        no_memory = policy(collate_turns([without], DIM))[0, -3:]
    assert not torch.allclose(zero_projector, trained_projector, atol=1e-4)
    assert not torch.allclose(trained_projector, no_memory, atol=1e-4)


def test_collate_layout():
    batch = collate_turns([_step(2, np.array([1, 2], np.int32)), _step(0, np.array([3], np.int32))], DIM)
    assert batch.token_ids.shape == (2, 10 + 2 + 5 + 2)
    assert batch.memory_mask[0, 10:12].all() and not batch.memory_mask[1].any()
    assert batch.action_mask[0].nonzero().flatten().tolist() == [17, 18]
    assert batch.action_mask[1].nonzero().flatten().tolist() == [15]
    assert batch.attention_mask[1].sum() == 16


def test_weights_round_trip_and_hash_check(policy, tiny_config, tmp_path):
    torch.nn.init.normal_(policy.projector.weight)
    path = tmp_path / "v1.safetensors"
    sha = write_weights(unique_state_dict(policy.state_dict()), path)
    fresh = build_policy(tiny_config.policy, DIM)
    read_weights_into(fresh, path, sha)
    for (name, a), (_, b) in zip(policy.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    assert fresh.lm.lm_head.weight.data_ptr() == fresh.lm.get_input_embeddings().weight.data_ptr()  # still tied
    with pytest.raises(WeightsMismatch, match="sha256"):
        read_weights_into(fresh, path, "0" * 64)


def test_batched_sampling_is_exactly_rescored_row_by_row(policy):
    """Left padding and position ids: each row of a batch samples from what it would see alone."""
    torch.nn.init.normal_(policy.projector.weight, std=0.5)
    steps = [_step(0), _step(3), _step(1)]
    steps[1] = TurnInput(np.arange(10, 30, dtype=np.int32), steps[1].memory, steps[1].context_ids, steps[1].action_ids)
    samples = policy.sample_batch(steps, 10, 1.0, StopRule(frozenset({7, 8, 9})), generator=torch.Generator().manual_seed(0))
    for step, (action, logprobs) in zip(steps, samples):
        assert 1 <= len(action) <= 10 and len(action) == len(logprobs)
        assert all(t not in {7, 8, 9} for t in action[:-1].tolist())  # a row stops at its first stop token
        scored_batch = collate_turns([TurnInput(step.prompt_ids, step.memory, step.context_ids, action)], DIM)
        with torch.no_grad():
            scored = policy(scored_batch)[0][scored_batch.action_mask[0]]
        np.testing.assert_allclose(scored.numpy(), logprobs, atol=1e-4)
    greedy = policy.sample_batch(steps, 5, 1.0, NEVER, greedy=True)
    alone = [policy.sample(step, 5, 1.0, NEVER, greedy=True)[0].tolist() for step in steps]
    assert [g[0].tolist() for g in greedy] == alone


def test_any_hf_model_folder_is_a_policy_with_a_projector_sized_from_both(tiny_config, encoder, tmp_path):
    """`policy.model = PATH`: an HF folder (config, weights, tokenizer) of another width."""
    from transformers import AutoModelForCausalLM

    from sao.compression.temporal import load_temporal_filter
    from sao.envs.registry import make_tasks
    from sao.policy.loading import load_tokenizer
    from sao.policy.loading import tiny_config as tiny_lm_config
    from sao.sampler.rollout import Roller

    tokenizer = load_tokenizer("tiny", tiny_config.policy.cache_dir)
    lm_config = tiny_lm_config(len(tokenizer))
    lm_config.hidden_size, lm_config.intermediate_size = 96, 160
    AutoModelForCausalLM.from_config(lm_config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = tiny_config.model_copy(deep=True)
    config.policy.model, config.policy.max_new_tokens = str(tmp_path), 4
    policy = build_policy(config.policy, encoder.dim).eval()
    assert tuple(policy.projector.weight.shape) == (96, encoder.dim)
    trajectory = Roller(config, policy, encoder, load_temporal_filter(), "s-path").rollout(
        make_tasks(config.env, 1)[0], 0)
    assert all(1 <= len(step.action_ids) <= 4 for step in trajectory.steps)
