"""In-memory snapshots of the ZeRO-3 optimizer (master weights + AdamW state) per policy version.

A rollback (sao/trainer/shadow.py) returns training to a published version exactly: the fp32
master partitions and the AdamW moments as they were when that version was published. The
moments matter: restarted from zero, Adam's first steps move every weight by about the learning
rate whatever the gradient's noise, a jolt of the kind a rollback exists to undo. Each rank
snapshots its own partition, so this is as collective as the step itself.
"""

from __future__ import annotations

from typing import Any

import torch


def _cloned(value: Any) -> Any:
    """A deep copy in which every tensor is detached and cloned (the state dict aliases live tensors)."""
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _cloned(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(item) for item in value)
    return value


class OptimizerSnapshots:
    """version -> this rank's optimizer state at that version; at most the versions asked to be kept."""

    def __init__(self) -> None:
        self._by_version: dict[int, dict] = {}

    def __contains__(self, version: int) -> bool:
        return version in self._by_version

    def versions(self) -> list[int]:
        return sorted(self._by_version)

    def take(self, engine, version: int) -> None:
        self._by_version[version] = _cloned(engine.optimizer.state_dict())

    def restore(self, engine, version: int) -> None:
        """Master weights, module weights and AdamW state back to `version` (every rank calls it)."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        # DeepSpeed reads the entry of this rank's index: each rank passes its own snapshot there.
        engine.optimizer.load_state_dict([_cloned(self._by_version[version])] * world, load_optimizer_states=True)

    def relabel(self, version: int, as_version: int) -> None:
        """The snapshot of `version` now stands for `as_version` (a rollback republished its weights)."""
        self._by_version[as_version] = self._by_version.pop(version)

    def keep_only(self, versions: set[int]) -> None:
        for version in set(self._by_version) - versions:
            del self._by_version[version]
