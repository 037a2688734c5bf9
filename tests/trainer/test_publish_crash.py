"""A trainer killed (SIGKILL) in the middle of writing a version: samplers stay on the last complete
version, and the restarted trainer publishes the next one over the leftovers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from sao.policy.chain import read_version_into
from sao.policy.weights import build_policy, unique_state_dict
from sao.run_dir import RunDir
from sao.sampler.weight_sync import WeightSync
from sao.schema import PolicyAnnouncement
from sao.trainer import publisher as publisher_module
from sao.trainer.publisher import PolicyPublisher

DIM = 16

# The trainer's side: publish v1, then v2 with the file write stopped half-way until it is killed.
TRAINER = r"""
import json, os, sys, time
from pathlib import Path
from safetensors.torch import load_file
import sao.policy.weights as weights
from sao.run_dir import RunDir
from sao.trainer import publisher as publisher_module
from sao.trainer.publisher import PolicyPublisher

run, first, second = (Path(arg) for arg in sys.argv[1:4])
announced = run / "announced.jsonl"

def announce(_producer, _topic, announcement):
    with announced.open("a") as out:
        out.write(json.dumps(announcement.to_wire()) + "\n")

publisher_module.announce = announce
publisher = PolicyPublisher(None, "policy", RunDir(run), 3, "bf16", deltas=True, snapshot_every=10)
publisher.publish_state(load_file(first), 1, 1)

def half_a_file(tensors, filename):
    with open(filename, "wb") as out:
        out.write(b"\x10" * 4096)
        out.flush()
        os.fsync(out.fileno())
    (run / "writing").touch()
    time.sleep(600)

weights.save_file = half_a_file
publisher.publish_state(load_file(second), 2, 2)
"""


def _announced(run: Path) -> list[PolicyAnnouncement]:
    return [PolicyAnnouncement.from_wire(json.loads(line)) for line in (run / "announced.jsonl").read_text().splitlines()]


def test_a_trainer_killed_mid_publish_leaves_samplers_on_the_last_complete_version(tiny_config, tmp_path, monkeypatch):
    torch.manual_seed(0)
    state = unique_state_dict(build_policy(tiny_config.policy, DIM).state_dict())
    states = [{name: tensor + 0.01 * step for name, tensor in state.items()} for step in (1, 2)]
    for index, one in enumerate(states, start=1):
        save_file(one, tmp_path / f"state{index}.safetensors")
    run = tmp_path / "run"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(run), str(tmp_path / "state1.safetensors"),
                                str(tmp_path / "state2.safetensors")])
    deadline = time.monotonic() + 120
    while not (run / "writing").exists():
        assert trainer.poll() is None and time.monotonic() < deadline, "the trainer never reached v2's write"
        time.sleep(0.1)
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()

    # Only v1 was ever announced; v2 left half a temporary file and no sidecar.
    announced = _announced(run)
    assert [a.policy_version for a in announced] == [1]
    assert list((run / "policy").glob("*.tmp")) and not RunDir(run).weights_sidecar(2).exists()
    assert RunDir(run).kept_versions() == [1]
    sampler = WeightSync(build_policy(tiny_config.policy, DIM).eval())
    sampler.apply(announced[0], Path(announced[0].weights_path))
    assert sampler.version == 1

    # The restarted trainer publishes v2 again (a fresh publisher holds no base: a snapshot), over the leftovers.
    published = []
    monkeypatch.setattr(publisher_module, "announce", lambda _producer, _topic, a: published.append(a))
    restarted = PolicyPublisher(None, "policy", RunDir(run), 3, "bf16", deltas=True, snapshot_every=10)
    restarted.publish_state({name: tensor.clone() for name, tensor in states[1].items()}, 2, 2)
    assert published[0].kind == "snapshot"
    sampler.apply(published[0], Path(published[0].weights_path))
    fresh = build_policy(tiny_config.policy, DIM).eval()
    read_version_into(fresh, RunDir(run), 2)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(sampler.policy.state_dict()[name], tensor), name
        if name in states[1]:
            assert torch.equal(tensor, states[1][name].to(torch.bfloat16).float()), name
