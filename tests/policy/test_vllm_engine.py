"""The vLLM engine against sao's own model at the same weights (real SmolLM2, real vLLM CPU engine).

One engine serves the module (starting one takes seconds to tens of seconds); the tests that change
its weights restore the base weights after themselves.
"""

import numpy as np
import pytest
import torch

from sao.config import load_config
from sao.policy.context import TurnInput
from sao.policy.loading import resolve_model_path
from sao.policy.model import collate_turns
from sao.policy.sampling import StopRule, nucleus
from sao.policy.vllm_engine import EngineStale, VllmEngine
from sao.policy.weights import build_policy, place_for_sampling
from support.vllm_required import require_vllm

require_vllm()

pytestmark = pytest.mark.slow
WIDTH = 384  # the default encoder's: the shipped projector maps it into SmolLM2


@pytest.fixture(scope="module")
def config():
    return load_config(overrides=['policy.model="smollm2-135m-instruct"'], environ={})


@pytest.fixture(scope="module")
def policy(config):
    torch.manual_seed(0)
    return place_for_sampling(build_policy(config.policy, WIDTH, encoder="default"), "cpu", "fp32")


@pytest.fixture(scope="module")
def engine(config, policy):
    return VllmEngine(policy, resolve_model_path(config.policy.model, config.policy.cache_dir), seed=0,
                      kv_cache_gib=1)


@pytest.fixture()
def base_weights(policy):
    """The base weights, put back (and pushed into the engine) after a test that changes them."""
    saved = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
    yield saved
    policy.load_state_dict(saved)


def _contexts(memory_rows: int) -> list[TurnInput]:
    rng = np.random.default_rng(0)
    rows = []
    for row in range(4):
        memory = rng.normal(size=(3 if row < memory_rows else 0, WIDTH)).astype(np.float32) * 0.05
        rows.append(TurnInput(rng.integers(200, 20000, 12 + row).astype(np.int32), memory,
                              rng.integers(200, 20000, 6).astype(np.int32), np.zeros(0, np.int32)))
    return rows


def _behaviour_reference(policy, contexts, samples, temperature, top_p):
    """Per row: sao's own log-probs of the sampled tokens under the distribution sampled (logits /
    temperature, then the top-p nucleus), from one teacher-forced pass over [context | action]."""
    inputs = [TurnInput(c.prompt_ids, c.memory, c.context_ids, action) for c, (action, _) in zip(contexts, samples)]
    batch = collate_turns(inputs, WIDTH, [temperature] * len(inputs))
    with torch.no_grad():
        if top_p >= 1.0:  # what the trainer recomputes: exactly the behaviour distribution
            scored = policy(batch)
            return [scored[row][batch.action_mask[row]].numpy() for row in range(len(inputs))]
        embeds = policy._embed(batch.token_ids, batch.memory_vectors, batch.memory_mask)
        logits = policy.lm(inputs_embeds=embeds).logits.float()
    reference = []
    for row in range(len(inputs)):
        positions = batch.action_mask[row].nonzero().squeeze(-1)
        logprobs = nucleus(torch.log_softmax(logits[row, positions - 1] / temperature, dim=-1), top_p)
        reference.append(logprobs.gather(-1, batch.token_ids[row, positions][:, None]).squeeze(-1).numpy())
    return reference


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_behaviour_logprobs_equal_sao_recomputation_with_and_without_memory(engine, policy, top_p):
    contexts = _contexts(memory_rows=2)  # two rows reach the engine as prompt embeddings, two as token ids
    samples = engine.sample_batch(contexts, 24, 0.7, StopRule(frozenset()), torch.Generator().manual_seed(1),
                                  top_p=top_p)
    assert [len(action) for action, _ in samples] == [24] * 4
    reference = _behaviour_reference(policy, contexts, samples, 0.7, top_p)
    gaps = np.concatenate([np.abs(logprobs - expected) for (_, logprobs), expected in zip(samples, reference)])
    assert np.all(np.isfinite(gaps))
    assert gaps.mean() <= 1e-4 and gaps.max() <= 1e-3, (gaps.mean(), gaps.max())


def test_memory_reaches_the_engine(engine):
    """The same tokens with and without memory slots sample different first-token distributions."""
    with_memory, without = _contexts(memory_rows=1)[0], _contexts(memory_rows=0)[0]
    greedy = [engine.sample_batch([context], 1, 1.0, StopRule(frozenset()), torch.Generator().manual_seed(0))[0][1]
              for context in (with_memory, without)]
    assert abs(float(greedy[0][0]) - float(greedy[1][0])) > 1e-3


def test_seeded_rows_reproduce_and_stop_rules_end_actions(engine, policy):
    contexts = _contexts(memory_rows=0)
    first = engine.sample_batch(contexts, 16, 1.0, StopRule(frozenset()), torch.Generator().manual_seed(5))
    again = engine.sample_batch(contexts, 16, 1.0, StopRule(frozenset()), torch.Generator().manual_seed(5))
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(first, again))
    # Stop at the third sampled token of row 0: the action ends with it, as sao's own loop ends it.
    stop_token = int(first[0][0][2])
    stopped = engine.sample_batch(contexts[:1], 16, 1.0, StopRule(frozenset({stop_token})),
                                  torch.Generator().manual_seed(5))[0][0]
    assert int(stopped[-1]) == stop_token and stop_token not in stopped[:-1].tolist() and len(stopped) <= 3


def _prompt_logprobs(engine: VllmEngine, tokens: list[int]) -> np.ndarray:
    """The engine's log-prob of each of `tokens` after the ones before it (one teacher-forced pass)."""
    from vllm import SamplingParams

    output = engine.llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                 use_tqdm=False)[0]
    return np.asarray([step[token].logprob for token, step in zip(tokens[1:], output.prompt_logprobs[1:])])


_FRESH_ENGINE = """
import json, sys
from vllm import LLM, SamplingParams
folder, tokens = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=folder, dtype="float32", max_model_len=int(sys.argv[3]), enforce_eager=True, seed=0)
out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
print("LOGPROBS" + json.dumps([step[t].logprob for t, step in zip(tokens[1:], out.prompt_logprobs[1:])]))
"""


def _fresh_engine_logprobs(policy, tokenizer_dir, tokens: list[int], folder) -> np.ndarray:
    """The same prompt log-probs from a vLLM engine that loads the policy's weights from files, in a process of
    its own (one process holds one engine): a fresh load, no reload involved."""
    import json
    import os
    import subprocess
    import sys

    from sao.policy.export import write_model_folder

    write_model_folder(policy, tokenizer_dir, folder)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    result = subprocess.run([sys.executable, "-c", _FRESH_ENGINE, str(folder), json.dumps(tokens),
                             str(policy.lm.config.max_position_embeddings)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("LOGPROBS"))
    return np.asarray(json.loads(line.removeprefix("LOGPROBS")))


def test_three_in_place_reloads_match_the_weights_loaded(engine, config, policy, base_weights, tmp_path):
    """Each push is checked on the probe; after three the engine scores like the HF model holding the last
    weights, and like a fresh engine started from them (the tied embedding / output layer included: it
    alone is moved the third time, so an engine that kept its old output layer fails both)."""
    generator = torch.Generator().manual_seed(0)
    for reload in range(3):
        names = ["lm.model.embed_tokens.weight"] if reload == 2 else list(base_weights)
        with torch.no_grad():
            state = policy.state_dict()
            for name in names:
                if state[name].is_floating_point():
                    state[name].add_(torch.randn(state[name].shape, generator=generator) * 0.01)
        engine.sync_weights()
    assert engine.check_probe() <= 1e-4
    tokens = np.random.default_rng(1).integers(200, 20000, 96).tolist()
    reloaded = _prompt_logprobs(engine, tokens)
    fresh = _fresh_engine_logprobs(policy, resolve_model_path(config.policy.model, config.policy.cache_dir), tokens,
                                   tmp_path)
    gaps = np.abs(reloaded - fresh)
    assert gaps.max() <= 1e-4, (gaps.mean(), gaps.max())
    # And the check bites: weights the engine was not given fail it.
    with torch.no_grad():
        policy.state_dict()["lm.model.embed_tokens.weight"].mul_(1.05)
    with pytest.raises(EngineStale, match="probe"):
        engine.check_probe()
    policy.load_state_dict(base_weights)
    engine.sync_weights()
