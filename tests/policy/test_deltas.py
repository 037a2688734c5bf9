"""Sparse deltas: the chain a sampler applies gives exactly the trainer's cast, a small step travels
light, and pruning keeps every file a kept version's chain needs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sao.policy.chain import ChainReader, chain_versions, read_version_into
from sao.policy.deltas import DELTA_MAX_SNAPSHOT_SHARE, PUBLISH_DTYPES, decode_gaps, encode_gaps
from sao.policy.weights import build_policy, unique_state_dict
from sao.run_dir import RunDir
from sao.sampler.weight_sync import WeightSync
from sao.trainer import publisher as publisher_module
from sao.trainer.publisher import PolicyPublisher
from sao.trainer.shadow import link_best

DIM = 16


def _policy(tiny_config):
    torch.manual_seed(0)
    return build_policy(tiny_config.policy, DIM)


def _adam_steps(policy, count: int, lr: float = 3e-5):
    """The policy's state after each of `count` AdamW steps of language modelling on random tokens, and a
    random linear loss on the projector (which the language-model loss does not reach)."""
    parameters = list(policy.parameters())
    for parameter in parameters:
        parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW(parameters, lr=lr)
    generator = torch.Generator().manual_seed(1)
    for _ in range(count):
        optimizer.zero_grad()
        tokens = torch.randint(0, policy.lm.config.vocab_size, (4, 32), generator=generator)
        logits = policy.lm(input_ids=tokens).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss = loss + sum((p * torch.randn(p.shape, generator=generator)).sum() for p in policy.projector.parameters())
        loss.backward()
        optimizer.step()
        yield unique_state_dict(policy.state_dict())


def _publisher(tmp_path: Path, monkeypatch, dtype: str, snapshot_every: int, keep: int = 100,
               max_delta_share: float = float("inf")):
    """A publisher of deltas; by default one that never falls back to a whole file, so a chain is what it is told."""
    announced = []
    monkeypatch.setattr(publisher_module, "announce", lambda _producer, _topic, a: announced.append(a))
    publisher = PolicyPublisher(None, "policy", RunDir(tmp_path), keep, dtype, deltas=True,
                                snapshot_every=snapshot_every, max_delta_share=max_delta_share)
    return publisher, announced


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[tensor.dtype])


def test_gap_code_round_trips_and_refuses_what_is_out_of_range():
    positions = np.array([0, 1, 2, 130, 131, 20000, 2**31 + 5], np.int64)
    code = encode_gaps(positions)
    assert code.dtype == np.uint8 and len(code) < 4 * len(positions)
    np.testing.assert_array_equal(decode_gaps(code, len(positions), 2**32), positions)
    with pytest.raises(ValueError, match="out of"):
        decode_gaps(code, len(positions), 2**31 + 5)
    with pytest.raises(ValueError, match="positions for"):
        decode_gaps(code, len(positions) - 1, 2**32)
    with pytest.raises(ValueError, match="ends inside"):
        decode_gaps(code[:-1], len(positions), 2**32)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_snapshot_and_deltas_give_exactly_the_trainers_cast(tiny_config, tmp_path, monkeypatch, dtype):
    trainer_side = _policy(tiny_config)
    publisher, announced = _publisher(tmp_path, monkeypatch, dtype, snapshot_every=3)
    sampler_side = WeightSync(_policy(tiny_config))
    expected_by_version = {}
    for version, state in enumerate(_adam_steps(trainer_side, 5), start=1):
        expected = expected_by_version[version] = {name: t.to(PUBLISH_DTYPES[dtype]) for name, t in state.items()}
        announcement = publisher.publish_state(state, version, version)
        sampler_side.apply(announcement, Path(announcement.weights_path))
        assert sampler_side.version == version and sampler_side.held_sha256 == announcement.state_sha256
        model = sampler_side.policy.state_dict()
        for name, tensor in expected.items():
            assert torch.equal(_bits(sampler_side.held[name]), _bits(tensor)), name
            assert torch.equal(model[name], tensor.float()), name  # the fp32 sampler holds the cast exactly
    assert [a.kind for a in announced] == ["snapshot", "delta", "delta", "snapshot", "delta"]
    assert [a.base_version for a in announced if a.kind == "delta"] == [1, 2, 4]
    # Readers without Kafka (sao eval, the shadow scorer) rebuild a delta version from the sidecars.
    fresh = _policy(tiny_config)
    read_version_into(fresh, RunDir(tmp_path), 3)
    rebuilt = fresh.state_dict()
    for name, tensor in expected_by_version[3].items():
        assert torch.equal(rebuilt[name], tensor.float()), name


def test_a_small_adam_step_travels_as_a_delta_much_smaller_than_a_snapshot(tiny_config, tmp_path, monkeypatch):
    # The tiny model's weights are small (std 0.02), so lr 1e-5 is already a relative step of about a
    # quarter of a bf16 ulp: a realistic share of bf16 values changes.
    publisher, announced = _publisher(tmp_path, monkeypatch, "bf16", snapshot_every=10)
    states = list(_adam_steps(_policy(tiny_config), 2, lr=1e-5))
    for version, state in enumerate(states, start=1):
        publisher.publish_state(state, version, version)
    snapshot, delta = announced
    changed = sum(int((a.bfloat16().view(torch.int16) != b.bfloat16().view(torch.int16)).sum())
                  for a, b in zip(states[0].values(), states[1].values()))
    total = sum(t.numel() for t in states[1].values())
    assert 0 < changed < 0.3 * total
    # Each change costs its bf16 value and, while changes are this dense, one byte of position.
    header = 4096
    assert delta.kind == "delta" and delta.num_bytes <= 3 * changed + header
    assert delta.num_bytes < 0.5 * snapshot.num_bytes


def test_pruning_keeps_the_snapshot_and_deltas_a_kept_version_rests_on(tiny_config, tmp_path, monkeypatch):
    publisher, _ = _publisher(tmp_path, monkeypatch, "bf16", snapshot_every=4, keep=2)
    publisher.pinned = lambda: {2}  # shadow validation's best
    run_dir = RunDir(tmp_path)
    for version, state in enumerate(_adam_steps(_policy(tiny_config), 7), start=1):
        publisher.publish_state(state, version, version)
    # v1 snapshot, v2-v4 deltas, v5 snapshot, v6-v7 deltas. Kept: v6, v7 (and their chain v5), pinned v2 (and v1).
    assert run_dir.kept_versions() == [1, 2, 5, 6, 7]
    assert chain_versions(run_dir, 7) == {5, 6, 7}
    for version in (1, 5):
        assert run_dir.weights(version).is_file() and not run_dir.weights_delta(version).exists()
    for version in (2, 6, 7):
        assert run_dir.weights_delta(version).is_file() and run_dir.weights_sidecar(version).is_file()
    fresh = _policy(tiny_config)
    read_version_into(fresh, run_dir, 2)  # the pinned version still loads through its chain
    publisher.pinned = set
    publisher.publish_state(next(_adam_steps(_policy(tiny_config), 1)), 8, 8)
    assert run_dir.kept_versions() == [5, 6, 7, 8]  # v7, v8 kept; v8 and v7 rest on v5 and v6


def _bf16_chain(tiny_config, tmp_path, monkeypatch, count: int) -> tuple[RunDir, dict]:
    """`count` versions published in bf16 on one snapshot (v1, then deltas), and each version's state."""
    publisher, _ = _publisher(tmp_path, monkeypatch, "bf16", snapshot_every=10)
    states = {}
    for version, state in enumerate(_adam_steps(_policy(tiny_config), count), start=1):
        states[version] = {name: tensor.bfloat16() for name, tensor in state.items()}
        publisher.publish_state(state, version, version)
    return RunDir(tmp_path), states


def test_a_reader_holding_a_version_reads_only_the_deltas_after_it(tiny_config, tmp_path, monkeypatch):
    run_dir, expected = _bf16_chain(tiny_config, tmp_path, monkeypatch, 4)
    reader = ChainReader(_policy(tiny_config))
    reader.read(run_dir, 2)  # v1's snapshot, then v2's delta
    run_dir.weights(1).unlink()  # the snapshot gone: a reader holding v2 needs only v3's and v4's deltas
    reader.read(run_dir, 4)
    model = reader.policy.state_dict()
    assert all(torch.equal(model[name], tensor.float()) for name, tensor in expected[4].items())
    with pytest.raises(FileNotFoundError):
        read_version_into(_policy(tiny_config), run_dir, 4)  # a fresh reader starts from the snapshot


def test_the_best_link_names_a_whole_file_even_when_the_best_version_is_a_delta(tiny_config, tmp_path, monkeypatch):
    run_dir, states = _bf16_chain(tiny_config, tmp_path, monkeypatch, 3)
    link_best(run_dir, 3)  # v3 is a delta on v2 on v1: written whole once, and linked
    assert run_dir.best_weights.resolve() == run_dir.best_export(3).resolve()
    alone = load_file(str(run_dir.best_weights))
    assert alone.keys() == states[3].keys()
    assert all(torch.equal(_bits(alone[name]), _bits(tensor)) for name, tensor in states[3].items())
    link_best(run_dir, 1)  # a snapshot: linked as it is, and v3's export goes
    assert run_dir.best_weights.resolve() == run_dir.weights(1).resolve()
    assert run_dir.best_exports() == []
    link_best(run_dir, 0)  # the base model: no link
    assert not run_dir.best_weights.is_symlink()


def test_a_step_that_changes_most_values_is_published_whole(tiny_config, tmp_path, monkeypatch):
    publisher, announced = _publisher(tmp_path, monkeypatch, "bf16", snapshot_every=10,
                                      max_delta_share=DELTA_MAX_SNAPSHOT_SHARE)
    sampler_side = WeightSync(_policy(tiny_config))
    small, large = 1e-5, 1e-2  # a quarter of a bf16 ulp of the tiny model's weights; then many ulps
    steps = _adam_steps(_policy(tiny_config), 3, lr=small)
    states = [next(steps), next(steps)]
    states.append({name: tensor + large for name, tensor in states[-1].items()})  # every value moves
    for version, state in enumerate(states, start=1):
        announcement = publisher.publish_state(state, version, version)
        sampler_side.apply(announcement, Path(announcement.weights_path))
    assert [a.kind for a in announced] == ["snapshot", "delta", "snapshot"]
    expected = {name: tensor.bfloat16() for name, tensor in states[-1].items()}
    assert all(torch.equal(_bits(sampler_side.held[name]), _bits(tensor)) for name, tensor in expected.items())
