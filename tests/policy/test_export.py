"""`sao export`: a published version as a plain HF model folder that computes what the run's policy computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from sao.config import LoraConfig
from sao.policy.chain import read_version_state
from sao.policy.export import MEMORY_FILE, export_version
from sao.policy.lora import add_lora, attach_adapter_merge, trainable_state
from sao.policy.weights import build_policy, unique_state_dict
from sao.run_dir import RunDir
from sao.trainer import publisher as publisher_module
from sao.trainer.publisher import PolicyPublisher

DIM = 16
LORA = LoraConfig(rank=4, alpha=8.0)


def _config(tiny_config, dtype: str, lora: LoraConfig):
    return tiny_config.model_copy(update={"trainer": tiny_config.trainer.model_copy(
        update={"publish_dtype": dtype, "lora": lora})})


def _publisher(run_dir: Path, monkeypatch, dtype: str, lora: bool) -> PolicyPublisher:
    monkeypatch.setattr(publisher_module, "announce", lambda *_: None)
    return PolicyPublisher(None, "policy", RunDir(run_dir), 100, dtype, deltas=True, snapshot_every=10,
                           max_delta_share=float("inf"), lora=lora)


def _moved(policy, seed: int, scale: float = 0.05):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in (trainable_state(policy) if hasattr(policy.lm, "peft_config") else policy.state_dict()).values():
            tensor.add_(scale * torch.randn(tensor.shape, generator=generator))
    return policy


def _logits(lm, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return lm(input_ids=tokens).logits.float()


def test_a_lora_version_exports_as_a_plain_model_that_computes_what_the_peft_policy_computes(
        tiny_config, tmp_path, monkeypatch):
    config = _config(tiny_config, "fp32", LORA)
    torch.manual_seed(0)
    trainer_side = build_policy(config.policy, DIM)
    add_lora(trainer_side, LORA)
    _moved(trainer_side, seed=1)
    _publisher(tmp_path, monkeypatch, "fp32", lora=True).publish_state(
        unique_state_dict(trainable_state(trainer_side)), 1, 1)
    torch.manual_seed(0)
    sampler_side = attach_adapter_merge(build_policy(config.policy, DIM).eval(), LORA)
    facts = export_version(config, sampler_side, tmp_path, 1, tmp_path / "export")

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")  # transformers alone: no sao, no peft
    tokens = torch.randint(0, exported.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(exported, tokens), _logits(trainer_side.lm, tokens), rtol=1e-5, atol=1e-5)
    base = build_policy(config.policy, DIM).lm
    assert float((_logits(exported, tokens) - _logits(base, tokens)).abs().max()) > 1e-3  # the adapters are in it
    memory = load_file(tmp_path / "export" / MEMORY_FILE)
    assert torch.equal(memory["projector.weight"], trainer_side.projector.weight.detach())
    assert facts["lora_merged"] and json.loads((tmp_path / "export" / "sao-export.json").read_text())["version"] == 1
    assert AutoTokenizer.from_pretrained(tmp_path / "export").vocab_size > 0


def test_a_bf16_delta_chain_exports_bit_for_bit_in_the_publish_dtype(tiny_config, tmp_path, monkeypatch):
    config = _config(tiny_config, "bf16", LoraConfig())
    publisher = _publisher(tmp_path, monkeypatch, "bf16", lora=False)
    torch.manual_seed(0)
    trainer_side = build_policy(config.policy, DIM)
    for version in (1, 2):
        _moved(trainer_side, seed=version, scale=1e-3)
        announcement = publisher.publish_state(unique_state_dict(trainer_side.state_dict()), version, version)
    assert announcement.kind == "delta"
    torch.manual_seed(0)
    export_version(config, build_policy(config.policy, DIM).eval(), tmp_path, 2, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", torch_dtype="auto")
    published = read_version_state(RunDir(tmp_path), 2)
    for name, tensor in exported.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, published.get(f"lm.{name}", tensor)), name
    assert {f"lm.{name}" for name in exported.state_dict()} & set(published)


def test_export_never_writes_into_a_folder_that_holds_something(tiny_config, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        export_version(tiny_config, build_policy(tiny_config.policy, DIM), tmp_path, 0, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_an_unknown_version_name_is_refused_naming_the_ones_export_takes(tmp_path):
    from typer.testing import CliRunner

    from sao.cli import app

    (tmp_path / "policy").mkdir()  # a trainer's run folder
    result = CliRunner().invoke(app, ["export", "--run-dir", str(tmp_path), "--out", str(tmp_path / "out"),
                                      "--version", "latest"])
    assert result.exit_code == 2 and "`best` or `final`" in result.output and "'latest'" in result.output
    assert not (tmp_path / "out").exists()
