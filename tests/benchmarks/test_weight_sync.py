"""benchmarks/weight_sync.py: the LoRA arm publishes what a LoRA trainer publishes and the sampler's plain model
takes it (its weights move; every other arm's path is the run's own, tested in tests/policy)."""

from __future__ import annotations

import torch

from support.benchmark_modules import load_benchmark

DIM = 16


def test_the_lora_arm_syncs_adapters_into_a_plain_model(tiny_config, tmp_path, monkeypatch):
    weight_sync = load_benchmark("weight_sync")
    monkeypatch.setattr(weight_sync, "LORA_RANK", 4)
    base, upcoming, policy = weight_sync._lora_versions(tiny_config, DIM)
    assert {"projector.weight", "projector.bias"} <= set(base) and any("lora_A" in name for name in base)
    before = {name: tensor.clone() for name, tensor in policy.lm.state_dict().items()}
    result = weight_sync.sync_once(weight_sync.LORA_ARM, base, upcoming, policy, tmp_path)
    assert result["kind"] == "snapshot"  # every adapter value moved: the whole file is the smaller
    assert 0 < result["bytes"] < sum(t.numel() * 2 for t in base.values()) + 100_000
    assert result["sync_s"] == result["publish_s"] + result["apply_s"] > 0
    moved = [name for name, tensor in policy.lm.state_dict().items() if not torch.equal(tensor, before[name])]
    assert moved and all(name.endswith("proj.weight") for name in moved)
