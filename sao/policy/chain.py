"""A published version on disk, however it was published: the files it rests on and its whole state.

Each version's sidecar (RUN_DIR/policy/policy-vNNNNNN.json) holds its announcement; a delta's names
the version it applies to. Readers without Kafka (`sao eval`, the shadow scorer, pruning) follow
those links back to the snapshot and forward again.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from sao.policy.deltas import apply_changes, read_delta, state_sha256
from sao.policy.model import MemoryPolicy
from sao.policy.weights import WeightsMismatch, check_content, load_published, read_weights_into, verified_file
from sao.run_dir import RunDir
from sao.schema import PolicyAnnouncement


def sidecar_announcement(run_dir: RunDir, version: int) -> PolicyAnnouncement | None:
    """The announcement of `version` kept beside its file (None once pruned)."""
    try:
        return PolicyAnnouncement.from_wire(json.loads(run_dir.weights_sidecar(version).read_text()))
    except FileNotFoundError:
        return None


def chain_versions(run_dir: RunDir, version: int) -> set[int]:
    """`version` and every version its file rests on, back to a snapshot (or to where sidecars end)."""
    chain = {version}
    announcement = sidecar_announcement(run_dir, version)
    while announcement is not None and announcement.kind == "delta" and announcement.base_version not in chain:
        chain.add(announcement.base_version)
        announcement = sidecar_announcement(run_dir, announcement.base_version)
    return chain


def read_version_into(policy: MemoryPolicy, run_dir: RunDir, version: int) -> None:
    """Load published `version` into `policy`: its snapshot, then each delta after it, every file checked.

    Raises FileNotFoundError when a file of the chain was pruned, WeightsMismatch when one is not
    what its sidecar says.
    """
    ChainReader(policy).read(run_dir, version)


class ChainReader:
    """Loads published versions into one policy and holds the last one's state, so that a later version on the same
    chain costs only the deltas after it, not its snapshot and every delta again: the shadow scorer loads versions a
    few apart, each up to trainer.snapshot_every files from its snapshot. Every file read is checked as above, and
    each delta's result against its state_sha256, so the held state gives what a fresh read would."""

    def __init__(self, policy: MemoryPolicy):
        self.policy = policy
        self.version: int | None = None  # the version `state` (and the policy) holds; None: nothing held
        self.state: dict[str, torch.Tensor] | None = None

    def read(self, run_dir: RunDir, version: int) -> None:
        """Bring the policy to published `version`; raises as `read_version_into`, and then holds nothing."""
        snapshot, deltas = _chain_back(run_dir, version)
        for announcement in (snapshot, *deltas):
            check_content(self.policy, announcement)
        chain = [snapshot.policy_version, *(delta.policy_version for delta in deltas)]
        state, held = self.state, self.version
        self.state = self.version = None  # nothing held until this read has succeeded
        if state is not None and held in chain:
            deltas = deltas[chain.index(held):]  # those after the held version
        else:
            state = read_weights_into(self.policy, run_dir.weights(snapshot.policy_version), snapshot.sha256)
        _apply_deltas(state, run_dir, deltas)
        if deltas:
            load_published(self.policy, state)
        self.state, self.version = state, version


def read_version_state(run_dir: RunDir, version: int) -> dict[str, torch.Tensor]:
    """Published `version`'s state (the publish dtype) without a model: for the trainer's own files, every
    file checked against its sidecar as above."""
    snapshot, deltas = _chain_back(run_dir, version)
    with verified_file(run_dir.weights(snapshot.policy_version), snapshot.sha256) as source:
        state = load_file(source)
    _apply_deltas(state, run_dir, deltas)
    return state


def _chain_back(run_dir: RunDir, version: int) -> tuple[PolicyAnnouncement, list[PolicyAnnouncement]]:
    """The snapshot `version` rests on and the deltas from it up to `version`, in order."""
    chain = []
    at = version
    while True:
        announcement = sidecar_announcement(run_dir, at)
        if announcement is None:
            raise FileNotFoundError(f"policy v{at} (needed for v{version}) is not in {run_dir.policy_dir} (kept: "
                                    f"{run_dir.kept_versions() or 'none'}; raise trainer.keep_versions to keep more)")
        chain.append(announcement)
        if announcement.kind == "snapshot":
            break
        at = announcement.base_version
    snapshot, *deltas = reversed(chain)
    return snapshot, deltas


def _apply_deltas(state: dict[str, torch.Tensor], run_dir: RunDir, deltas: list[PolicyAnnouncement]) -> None:
    for delta in deltas:
        apply_changes(state, read_delta(run_dir.weights_delta(delta.policy_version), delta.sha256, state))
        if state_sha256(state) != delta.state_sha256:
            raise WeightsMismatch(f"policy v{delta.policy_version}: the chain's state does not hash to its "
                                  f"state_sha256", "result-sha256")
