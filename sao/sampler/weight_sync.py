"""The sampler's place in the published chain: what state it holds, and the files that bring it to a version.

A snapshot is loaded whole (sao/policy/weights.py). A delta (sao/policy/deltas.py) is applied in
place, to the held copy of the published state and to the model, only when its base is the held
version and its base sha256 the held state's; after applying, the held state must hash to the
delta's result, or the change is undone and the delta refused. A base that does not match means
the held state is not what the trainer thinks it is: the sampler drops it (a re-sync) and comes
back through the newest snapshot and the deltas after it. A LoRA run's state is its adapters: the
model is merged again from the held state after each delta (sao/policy/lora.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from sao.metrics import SAMPLER_POLICY_RESYNCS, record_policy_applied
from sao.policy.deltas import apply_changes, read_delta, state_sha256
from sao.policy.model import MemoryPolicy
from sao.policy.weights import WeightsMismatch, check_content, load_published, read_weights_into
from sao.schema import PolicyAnnouncement


class Resync(WeightsMismatch):
    """A delta whose base is not the held state: the state is dropped, and the delta is offered again after
    the snapshot (refused for good only if it does not fit there either)."""


class WeightSync:
    def __init__(self, policy: MemoryPolicy):
        self.policy = policy
        self.version = 0
        # The published state the model holds (publish dtype) and its hash; None while no delta can apply to it.
        self.held: dict[str, torch.Tensor] | None = None
        self.held_sha256 = ""
        self.resyncs = 0
        self._resynced_for: set[tuple[int, str]] = set()  # deltas that made the sampler re-sync once already

    def chain_to(self, target: PolicyAnnouncement, announced: Mapping[int, PolicyAnnouncement]
                 ) -> list[PolicyAnnouncement]:
        """The announcements to apply, in order, to reach `target`: from the held version if `target`'s
        deltas lead back to it, else from the snapshot they rest on. WeightsMismatch (`broken-chain`) when
        a link is not among `announced` (never read, refused, or past what a follower remembers)."""
        chain = [target]
        while chain[-1].kind == "delta" and not (self.held is not None and chain[-1].base_version == self.version):
            base = announced.get(chain[-1].base_version)
            if base is None:
                raise WeightsMismatch(f"policy v{target.policy_version} is a delta whose chain needs "
                                      f"v{chain[-1].base_version}, which this sampler has not got (refused, or never "
                                      "read); it waits for the next snapshot", "broken-chain")
            chain.append(base)
        chain.reverse()
        # Checked on the announcements before any file is read: a chain that does not hold together would
        # take the sampler back to its snapshot and stop there.
        for base, delta in itertools.pairwise(chain):
            if not base.state_sha256 or delta.base_sha256 != base.state_sha256:
                raise WeightsMismatch(f"policy v{delta.policy_version}'s base sha256 is not the state_sha256 announced "
                                      f"for v{base.policy_version}", "base-sha256")
        return chain

    def apply(self, announcement: PolicyAnnouncement, path: Path, max_bytes: int | None = None) -> None:
        """Bring the model to `announcement`'s version with its file (at most `max_bytes`); WeightsMismatch or
        OSError leave it as it was."""
        started = time.perf_counter()
        check_content(self.policy, announcement)
        if announcement.kind == "delta":
            self._apply_delta(announcement, path, max_bytes)
        else:
            state = read_weights_into(self.policy, path, announcement.sha256, num_bytes=announcement.num_bytes,
                                      max_bytes=max_bytes)
            # Kept only where deltas can follow (the trainer hashed the state); else the model is all there is.
            self.held = state if announcement.state_sha256 else None
            self.held_sha256 = announcement.state_sha256
        self.version = announcement.policy_version
        record_policy_applied(announcement.kind, announcement.num_bytes, time.perf_counter() - started)

    def _apply_delta(self, announcement: PolicyAnnouncement, path: Path, max_bytes: int | None) -> None:
        if self.held is None or announcement.base_version != self.version:
            raise WeightsMismatch(f"a delta on v{announcement.base_version}, but this sampler holds v{self.version}"
                                  f"{'' if self.held is not None else ' whole, not as a published state'}",
                                  "base-mismatch")
        if announcement.base_sha256 != self.held_sha256:
            claim = (announcement.policy_version, announcement.sha256)
            detail = (f"its base sha256 {announcement.base_sha256} is not that of the v{self.version} held "
                      f"({self.held_sha256})")
            if claim in self._resynced_for:  # it did not fit a state fresh from the snapshot either: the delta is wrong
                raise WeightsMismatch(detail, "base-sha256")
            self._resynced_for.add(claim)
            self.resync()
            raise Resync(f"{detail}; re-syncing from the newest snapshot", "base-sha256")
        changes = read_delta(path, announcement.sha256, self.held, num_bytes=announcement.num_bytes,
                             max_bytes=max_bytes)
        replaced = apply_changes(self.held, changes)
        if state_sha256(self.held) != announcement.state_sha256:
            apply_changes(self.held, replaced)
            raise WeightsMismatch("applied to the held state it does not give the announced state_sha256",
                                  "result-sha256")
        if self.policy.adapters is not None:  # a LoRA run's adapters: every adapted layer is merged again
            load_published(self.policy, self.held)
        else:
            model = self.policy.state_dict()  # views of the parameters: writing into them changes the model
            apply_changes(model, changes)
        self.held_sha256 = announcement.state_sha256

    def resync(self) -> None:
        """Forget the held state: the next version comes through a snapshot."""
        self.held, self.held_sha256 = None, ""
        self.resyncs += 1
        SAMPLER_POLICY_RESYNCS.inc()
