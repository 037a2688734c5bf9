"""Decoding rules: top-p draws only from the nucleus and records its log-probs; stop rules; bf16."""

import numpy as np
import pytest
import torch

from sao.policy import precision
from sao.policy.context import TurnInput
from sao.policy.model import collate_turns
from sao.policy.precision import cpu_has_native_bf16
from sao.policy.sampling import StopRule, nucleus
from sao.policy.weights import build_policy, place_for_sampling

DIM = 16


@pytest.fixture()
def policy(tiny_config):
    torch.manual_seed(0)
    return build_policy(tiny_config.policy, DIM).eval()


def _step() -> TurnInput:
    return TurnInput(np.arange(10, 20, dtype=np.int32), np.zeros((0, DIM), np.float32),
                     np.arange(30, 35, dtype=np.int32), np.zeros(0, np.int32))


def test_nucleus_keeps_the_smallest_set_reaching_top_p_and_renormalises():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    truncated = nucleus(probs.log(), 0.7).exp()
    # 0.5 alone is below 0.7, 0.5 + 0.3 reaches it: two tokens stay, renormalised over 0.8.
    torch.testing.assert_close(truncated, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.equal(nucleus(probs.log(), 1.0), probs.log())
    torch.testing.assert_close(nucleus(probs.log(), 0.1).exp(), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_top_p_samples_only_nucleus_tokens_and_records_their_truncated_logprobs(policy):
    step, top_p, temperature = _step(), 0.5, 1.3
    samples = policy.sample_batch([step] * 6, 8, temperature, StopRule(frozenset()),
                                  torch.Generator().manual_seed(0), top_p=top_p)
    for action, logprobs in samples:
        inputs = TurnInput(step.prompt_ids, step.memory, step.context_ids, action)
        batch = collate_turns([inputs], DIM, [temperature])
        with torch.no_grad():
            full = policy(batch)[0][batch.action_mask[0]]  # what the trainer computes: no truncation
        # Under truncation each sampled token's probability is p / Z with Z <= 1, so >= p ...
        assert np.all(logprobs >= full.numpy() - 1e-5)
        # ... and exactly log p - log Z, where Z is the nucleus mass at that position.
        for position in range(len(action)):
            prefix = TurnInput(step.prompt_ids, step.memory, step.context_ids, action[:position])
            with torch.no_grad():
                logits = policy.lm(input_ids=torch.from_numpy(np.concatenate(
                    [prefix.prompt_ids, prefix.context_ids, prefix.action_ids]).astype(np.int64))[None]).logits[0, -1]
            expected = nucleus(torch.log_softmax(logits / temperature, dim=-1)[None], top_p)[0]
            assert torch.isfinite(expected[action[position]])
            assert abs(float(expected[action[position]]) - logprobs[position]) < 1e-4


class _Decoder:
    """Token id -> one character, so stop strings can be checked by hand."""

    alphabet = "abcdefghij"

    def __call__(self, ids):
        return "".join(self.alphabet[i % 10] for i in ids)


def test_stop_string_ends_the_action_at_the_completing_token():
    rule = StopRule(frozenset({99}), ("cde",), _Decoder())
    tokens = [0, 1, 2, 3, 4, 5]
    ends = [rule.ends(tokens[:n]) for n in range(1, len(tokens) + 1)]
    assert ends == [False, False, False, False, True, True]  # "abcde" completes "cde" at token 4
    assert rule.ends([0, 99]) and not StopRule(frozenset({99})).ends([0, 1])
    assert rule.cut("xxcdeyy") == "xxcde" and rule.cut("none here") == "none here"
    with pytest.raises(ValueError, match="decode"):
        StopRule(frozenset(), ("x",))


def test_bf16_sampling_runs_and_stays_close_to_fp32_rescoring(tiny_config, policy):
    """The GPU path samples in bf16; its recorded log-probs are what rho corrects against fp32."""
    torch.nn.init.normal_(policy.projector.weight, std=0.5)
    step = TurnInput(np.arange(10, 20, dtype=np.int32), np.random.default_rng(0).normal(size=(2, DIM)).astype(np.float32),
                     np.arange(30, 35, dtype=np.int32), np.zeros(0, np.int32))
    half = build_policy(tiny_config.policy, DIM)
    half.load_state_dict(policy.state_dict())  # fp32 weights cast on load, as a published version is
    half = half.to(torch.bfloat16).eval()
    action, logprobs = half.sample(step, 6, 1.0, StopRule(frozenset()), torch.Generator().manual_seed(0))
    assert len(action) == 6 and np.all(np.isfinite(logprobs))
    batch = collate_turns([TurnInput(step.prompt_ids, step.memory, step.context_ids, action)], DIM)
    with torch.no_grad():
        rescored = place_for_sampling(policy, "cpu", "fp32")(batch)[0][batch.action_mask[0]].numpy()
    assert np.max(np.abs(rescored - logprobs)) < 0.1  # bf16 rounding, not a different distribution


def test_cuda_placement_is_refused_without_a_gpu(policy):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(RuntimeError, match=r"sampler\.device"):
        place_for_sampling(policy, "cuda")
    assert next(place_for_sampling(policy, "auto", "fp32").parameters()).dtype == torch.float32
    native = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert next(place_for_sampling(policy, "auto").parameters()).dtype == native
    assert next(place_for_sampling(policy, "cpu", "bf16").parameters()).dtype == torch.bfloat16


def test_precision_takes_bf16_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert [precision.uses_bf16(p, "cpu") for p in ("auto", "fp32", "bf16")] == [False, False, True]
    assert [precision.uses_bf16(p, "cuda") for p in ("auto", "fp32", "bf16")] == [True, False, True]
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert precision.uses_bf16("auto", "cpu")


def test_cpu_autocast_keeps_fp32_weights_gradients_and_close_log_probs(tiny_config, policy):
    """The trainer on a CPU with native bf16: the decoder computes in bf16, what it trains stays fp32."""
    torch.nn.init.normal_(policy.projector.weight, std=0.5)
    step = TurnInput(np.arange(10, 20, dtype=np.int32), np.random.default_rng(0).normal(size=(2, DIM)).astype(np.float32),
                     np.arange(30, 35, dtype=np.int32), np.arange(40, 46, dtype=np.int32))
    batch = collate_turns([step], DIM)
    exact = policy(batch)[batch.action_mask].detach()
    policy.cpu_autocast_bf16 = True
    scored = policy(batch)
    assert scored.dtype == torch.float32
    scored[batch.action_mask].sum().backward()
    assert {p.grad.dtype for p in policy.parameters() if p.grad is not None} == {torch.float32}
    assert 0 < torch.max(torch.abs(scored[batch.action_mask].detach() - exact)) < 0.1  # bf16 rounding, no more
