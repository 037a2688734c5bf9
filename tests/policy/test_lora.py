"""LoRA (trainer.lora.rank > 0): the trainer's peft policy publishes only adapters and the projector, a sampler's
plain model merged with them computes what the peft model computes, and a file that does not fit is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sao.config import LoraConfig
from sao.policy.chain import read_version_into
from sao.policy.lora import AdapterMerge, adapted_linears, add_lora, attach_adapter_merge, trainable_state
from sao.policy.weights import WeightsMismatch, build_policy, read_weights_into, sha256_file, unique_state_dict
from sao.run_dir import RunDir
from sao.sampler.weight_sync import WeightSync
from sao.trainer import publisher as publisher_module
from sao.trainer.publisher import PolicyPublisher

DIM = 16
LORA = LoraConfig(rank=4, alpha=8.0)


def _policy(tiny_config):
    torch.manual_seed(0)
    return build_policy(tiny_config.policy, DIM)


def _trained_lora_policy(tiny_config, lora: LoraConfig = LORA, seed: int = 1):
    """A trainer-side LoRA policy whose adapters and projector hold random values, as after some training."""
    policy = _policy(tiny_config)
    add_lora(policy, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in trainable_state(policy).values():
            tensor.copy_(0.05 * torch.randn(tensor.shape, generator=generator))
    return policy


def _sampler_policy(tiny_config, lora: LoraConfig = LORA):
    return attach_adapter_merge(_policy(tiny_config).eval(), lora)


def _publisher(tmp_path: Path, monkeypatch, dtype: str = "fp32", deltas: bool = False) -> PolicyPublisher:
    monkeypatch.setattr(publisher_module, "announce", lambda *_: None)
    return PolicyPublisher(None, "policy", RunDir(tmp_path), 100, dtype, deltas=deltas, snapshot_every=10,
                           max_delta_share=float("inf"), lora=True)


def _logits(policy, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return policy.lm(input_ids=tokens).logits


def _tokens(policy) -> torch.Tensor:
    return torch.randint(0, policy.lm.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))


def test_the_trainer_trains_exactly_the_adapters_and_projector_a_sampler_expects(tiny_config):
    trainer_side = _policy(tiny_config)
    before = _logits(trainer_side, _tokens(trainer_side))
    add_lora(trainer_side, LORA)
    trainable = trainable_state(trainer_side)
    layout = AdapterMerge(_policy(tiny_config), LORA).layout()
    assert {name: tuple(t.shape) for name, t in trainable.items()} == {n: tuple(t.shape) for n, t in layout.items()}
    assert {"projector.weight", "projector.bias"} <= set(trainable)
    assert not any(p.requires_grad for name, p in trainer_side.lm.named_parameters() if "lora_" not in name)
    # Every linear layer of the LM but its output layer; B starts at zero, so nothing changes until it trains.
    assert len(adapted_linears(_policy(tiny_config).lm, ["all-linear"])) == 7 * trainer_side.lm.config.num_hidden_layers
    assert torch.equal(_logits(trainer_side, _tokens(trainer_side)), before)


def test_a_target_that_names_no_layer_is_refused_with_the_layers_there_are(tiny_config):
    with pytest.raises(ValueError, match=r"trainer.lora.targets \['qkv'\].*q_proj"):
        add_lora(_policy(tiny_config), LoraConfig(rank=4, targets=["q_proj", "qkv"]))


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"]])
def test_a_merged_plain_model_computes_what_the_peft_model_computes(tiny_config, tmp_path, monkeypatch, targets):
    lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
    trainer_side = _trained_lora_policy(tiny_config, lora)
    announcement = _publisher(tmp_path, monkeypatch).publish_state(unique_state_dict(trainable_state(trainer_side)),
                                                                   1, 1)
    assert announcement.content == "lora"
    sampler = WeightSync(_sampler_policy(tiny_config, lora))
    sampler.apply(announcement, Path(announcement.weights_path))
    tokens = _tokens(trainer_side)
    torch.testing.assert_close(_logits(sampler.policy, tokens), _logits(trainer_side, tokens), rtol=1e-5, atol=1e-5)
    assert torch.equal(sampler.policy.projector.weight, trainer_side.projector.weight)
    # The merge starts from the base weights each time, never from the previous merge.
    again = _trained_lora_policy(tiny_config, lora, seed=3)
    announcement = _publisher(tmp_path, monkeypatch).publish_state(unique_state_dict(trainable_state(again)), 2, 2)
    sampler.apply(announcement, Path(announcement.weights_path))
    torch.testing.assert_close(_logits(sampler.policy, tokens), _logits(again, tokens), rtol=1e-5, atol=1e-5)


def test_bf16_adapter_deltas_reach_the_same_model_as_a_fresh_read_of_the_version(tiny_config, tmp_path, monkeypatch):
    publisher = _publisher(tmp_path, monkeypatch, "bf16", deltas=True)
    sampler = WeightSync(_sampler_policy(tiny_config))
    for version, seed in enumerate([1, 1, 5], start=1):
        trainer_side = _trained_lora_policy(tiny_config, seed=seed)
        with torch.no_grad():  # a small step after the first version: most adapter values keep their bf16 bits
            trainer_side.projector.bias.add_(version)
        announcement = publisher.publish_state(unique_state_dict(trainable_state(trainer_side)), version, version)
        sampler.apply(announcement, Path(announcement.weights_path))
    assert announcement.kind == "delta"
    fresh = _sampler_policy(tiny_config)
    read_version_into(fresh, RunDir(tmp_path), 3)
    tokens = _tokens(fresh)
    assert torch.equal(_logits(fresh, tokens), _logits(sampler.policy, tokens))
    assert torch.equal(fresh.projector.bias, sampler.policy.projector.bias)


def test_an_adapter_file_is_a_small_part_of_a_whole_one(tiny_config, tmp_path, monkeypatch):
    adapters = _publisher(tmp_path / "lora", monkeypatch, "bf16").publish_state(
        unique_state_dict(trainable_state(_trained_lora_policy(tiny_config))), 1, 1)
    whole = PolicyPublisher(None, "policy", RunDir(tmp_path / "full"), 3, "bf16").publish_state(
        unique_state_dict(_policy(tiny_config).state_dict()), 1, 1)
    assert adapters.num_bytes < whole.num_bytes / 10


def _write(path: Path, state: dict[str, torch.Tensor]) -> str:
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path))
    return sha256_file(path)


def _adapters(tiny_config, lora: LoraConfig = LORA) -> dict[str, torch.Tensor]:
    return unique_state_dict(trainable_state(_trained_lora_policy(tiny_config, lora)))


def _with_nan(state):
    state = dict(state)
    name = next(name for name in state if "lora_B" in name)
    state[name] = state[name].clone()
    state[name][0, 0] = float("nan")
    return state


@pytest.mark.parametrize("forge, refusal", [
    (lambda state, tiny: _with_nan(state), "NaN"),
    (lambda state, tiny: {**state, "lm.model.norm.weight": torch.ones(64)}, "unexpected lm.model.norm.weight"),
    (lambda state, tiny: {k: v for k, v in state.items() if "q_proj" not in k}, "missing lm.model.layers.0"),
    (lambda state, tiny: _adapters(tiny, LoraConfig(rank=8, alpha=8.0)), "has shape"),
    (lambda state, tiny: unique_state_dict(_policy(tiny).state_dict()), "missing lm.model.layers.0.mlp.down_proj.lora_A"),
])
def test_an_adapter_file_that_does_not_fit_the_run_s_config_is_refused(tiny_config, tmp_path, forge, refusal):
    sampler = _sampler_policy(tiny_config)
    before = _logits(sampler, _tokens(sampler))
    path = tmp_path / "forged.safetensors"
    sha256 = _write(path, forge(_adapters(tiny_config), tiny_config))
    with pytest.raises(WeightsMismatch, match=refusal):
        read_weights_into(sampler, path, sha256)
    assert torch.equal(_logits(sampler, _tokens(sampler)), before)  # nothing was merged


def test_adapters_announced_to_a_full_model_sampler_and_a_whole_file_to_a_lora_one_are_refused(
        tiny_config, tmp_path, monkeypatch):
    announcement = _publisher(tmp_path, monkeypatch).publish_state(_adapters(tiny_config), 1, 1)
    with pytest.raises(WeightsMismatch, match="holds lora weights, but this process loads full"):
        WeightSync(_policy(tiny_config)).apply(announcement, Path(announcement.weights_path))
    whole = PolicyPublisher(None, "policy", RunDir(tmp_path / "full"), 3, "bf16").publish_state(
        unique_state_dict(_policy(tiny_config).state_dict()), 1, 1)
    with pytest.raises(WeightsMismatch, match="holds full weights, but this process loads lora"):
        WeightSync(_sampler_policy(tiny_config)).apply(whole, Path(whole.weights_path))
