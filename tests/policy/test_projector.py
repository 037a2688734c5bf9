"""Aligned projector weights load only for the (model, encoder) pair they were aligned on."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from sao.compression.semantic import encoder_name
from sao.policy.projector import (
    ProjectorMismatch,
    apply_projector_setting,
    load_projector,
    save_projector,
    shipped_projector_path,
)
from sao.policy.weights import build_policy


def _aligned(path, model="tiny", encoder="all-MiniLM-L6-v2", dim=384, hidden=64) -> nn.Linear:
    projector = nn.Linear(dim, hidden)
    torch.manual_seed(0)
    nn.init.normal_(projector.weight)
    save_projector(projector, path, {"model": model, "encoder": encoder, "corpus": "test"})
    return projector


def test_loads_for_its_own_pair(tmp_path):
    saved = _aligned(tmp_path / "p.safetensors")
    target = nn.Linear(384, 64)
    meta = load_projector(target, tmp_path / "p.safetensors", "tiny", "all-MiniLM-L6-v2")
    assert meta["model"] == "tiny" and meta["memory_width"] == 384
    assert torch.equal(target.weight, saved.weight) and torch.equal(target.bias, saved.bias)


@pytest.mark.parametrize(("model", "encoder", "named"), [
    ("smollm2-135m-instruct", "all-MiniLM-L6-v2", "model 'smollm2-135m-instruct'"),
    ("tiny", "bert-base-uncased", "encoder 'bert-base-uncased'"),
])
def test_refuses_another_model_or_encoder(tmp_path, model, encoder, named):
    _aligned(tmp_path / "p.safetensors")
    target = nn.Linear(384, 64)
    before = target.weight.detach().clone()
    with pytest.raises(ProjectorMismatch, match="aligned for model 'tiny'") as err:
        load_projector(target, tmp_path / "p.safetensors", model, encoder)
    assert named in str(err.value) and "sao compression align" in str(err.value)
    assert torch.equal(target.weight, before)  # nothing was copied


def test_refuses_a_file_without_sidecar_or_of_the_wrong_shape(tmp_path):
    _aligned(tmp_path / "p.safetensors", hidden=32)
    with pytest.raises(ProjectorMismatch, match="the projector needs"):
        load_projector(nn.Linear(384, 64), tmp_path / "p.safetensors", "tiny", "all-MiniLM-L6-v2")
    (tmp_path / "p.json").unlink()
    with pytest.raises(ProjectorMismatch, match="sidecar"):
        load_projector(nn.Linear(384, 32), tmp_path / "p.safetensors", "tiny", "all-MiniLM-L6-v2")


def test_setting_auto_zero_and_path(tmp_path, tiny_config):
    assert encoder_name("default") == "all-MiniLM-L6-v2"
    projector = nn.Linear(384, 64)
    nn.init.zeros_(projector.weight)
    line = apply_projector_setting(projector, "auto", "tiny", "default")  # nothing ships for the tiny model
    assert "zero init" in line and not projector.weight.any()
    _aligned(tmp_path / "p.safetensors")
    assert "aligned" in apply_projector_setting(projector, str(tmp_path / "p.safetensors"), "tiny", "default")
    assert projector.weight.any()
    with pytest.raises(ProjectorMismatch, match="encoder 'other-encoder'"):
        apply_projector_setting(projector, str(tmp_path / "p.safetensors"), "tiny", "other-encoder")
    # build_policy applies policy.projector when it knows the encoder, and refuses a mismatch at start.
    policy_config = tiny_config.policy.model_copy(update={"projector": str(tmp_path / "p.safetensors")})
    policy = build_policy(policy_config, 384, encoder="default")
    assert policy.projector.weight.any()
    with pytest.raises(ProjectorMismatch):
        build_policy(policy_config, 384, encoder="some/other-encoder")


def test_shipped_projector_names_its_pair():
    path = shipped_projector_path("smollm2-135m-instruct", "all-MiniLM-L6-v2")
    if not path.is_file():
        pytest.skip("no aligned projector ships for the default pair")
    meta = json.loads(path.with_suffix(".json").read_text())
    assert (meta["model"], meta["encoder"]) == ("smollm2-135m-instruct", "all-MiniLM-L6-v2")
    assert meta["result"]["kl_aligned"] < meta["result"]["kl_zero"]
    assert meta["command"].startswith("sao compression align")


def test_with_a_bottleneck_the_aligned_projector_is_composed_with_its_basis(tmp_path, tiny_config):
    """Coordinates on the wire give the soft token the full vector they stand for gives the aligned projector."""
    import numpy as np

    from sao.compression.bottleneck import fit_bottleneck
    from sao.compression.quantize import dequantize_int8, quantize_int8

    aligned = _aligned(tmp_path / "p.safetensors")
    rng = np.random.default_rng(0)
    bottleneck = fit_bottleneck(rng.normal(size=(100, 384)), 16, "all-MiniLM-L6-v2")
    policy_config = tiny_config.policy.model_copy(update={"projector": str(tmp_path / "p.safetensors")})
    policy = build_policy(policy_config, 16, encoder="default", bottleneck=bottleneck)
    assert policy.projector.in_features == 16
    coordinates = dequantize_int8(*quantize_int8(bottleneck.encode(rng.normal(size=(5, 384)))))
    with torch.no_grad():
        through_basis = policy.projector(torch.from_numpy(coordinates))
        full_vector = aligned(torch.from_numpy(bottleneck.decode(coordinates)))
    torch.testing.assert_close(through_basis, full_vector, atol=1e-4, rtol=1e-4)
    line = apply_projector_setting(nn.Linear(16, 64), str(tmp_path / "p.safetensors"), "tiny", "default", bottleneck)
    assert f"composed with basis {bottleneck.identity}" in line
    # A projector file must read the encoder's full width: one of the bottleneck's width is refused.
    _aligned(tmp_path / "narrow.safetensors", dim=16)
    with pytest.raises(ProjectorMismatch, match="the projector needs"):
        apply_projector_setting(nn.Linear(16, 64), str(tmp_path / "narrow.safetensors"), "tiny", "default", bottleneck)
