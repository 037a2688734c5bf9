"""Snapshots of the trainer's weights and AdamW state per policy version, on disk.

A rollback (sao/trainer/shadow_validation.py) returns training to a published version exactly:
the weights (ZeRO's fp32 master partitions, or the trainable parameters of an engine without ZeRO)
and the AdamW moments as they were when that version was published (`engine.training_state`).
The moments matter: restarted from zero, Adam's first steps move every weight by about the
learning rate whatever the gradient's noise, a jolt of the kind a rollback exists to undo.
Each rank snapshots its own partition, so this is as collective as the step itself.

The tensors go to a safetensors file per version (three times the model's size in fp32: held in
memory, two or three of them would double the trainer's footprint); the rest of the state dict
(a few scalars and the loss scaler object) stays in memory. The files are this process's own.

`take` copies the tensors on the trainer's thread (a memory copy; on a GPU the copy to the host it
needs anyway) into one set of host buffers kept for the run, since fresh buffers of that size cost
the trainer page faults, and page-cache reclaim under the run's file writes, at every snapshot.
A background thread, niced and on the run's background CPUs (`cpus`, from
`shadow.background_cpus`), writes the copy. So no optimizer update waits for a write: on a pinned
trainer those CPUs are the samplers', and busy samplers can hold a niced write up for longer than a
step. One copy at a time: `take` waits for the previous write first (versions are offered for
scoring far apart, so that one is normally done) and logs how long it waited and how long it
copied. `settle` is called before any restore, relabel or drop. A write that fails costs that
version its snapshot, never the training.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sao.trainer.engine import restore_training_state, training_state
from sao.trainer.shadow import run_in_background

log = logging.getLogger(__name__)

_TENSOR = "__tensor__"  # marks where a tensor stood in the state dict's skeleton


def _split(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    """The state dict with every tensor moved into `tensors` (under its path) and a marker left behind."""
    if torch.is_tensor(value):
        tensors[path] = value.detach()
        return (_TENSOR, path)
    if isinstance(value, dict):
        return {key: _split(item, tensors, f"{path}/{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_split(item, tensors, f"{path}/{index}") for index, item in enumerate(value))
    return value


def _join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, tuple) and len(skeleton) == 2 and skeleton[0] == _TENSOR:
        return tensors[skeleton[1]]
    if isinstance(skeleton, dict):
        return {key: _join(item, tensors) for key, item in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_join(item, tensors) for item in skeleton)
    return skeleton


class OptimizerSnapshots:
    """version -> this rank's optimizer state at that version, in `folder`; at most the versions asked to be kept."""

    def __init__(self, folder: Path, cpus: set[int] | None = None) -> None:
        self.folder = Path(folder)
        self._skeletons: dict[int, Any] = {}
        self._writes: dict[int, Future] = {}  # versions whose file is being written
        self._buffers: dict[str, torch.Tensor] = {}  # path in the state dict -> the host copy being written
        self._writer = ThreadPoolExecutor(1, "sao-snapshot-writer", initializer=run_in_background, initargs=(cpus,))

    def __contains__(self, version: int) -> bool:
        """Whether a rollback can return to `version`: its snapshot is taken, and written if it was still being
        written."""
        if version in self._writes:
            self.settle()
        return version in self._skeletons

    def versions(self) -> list[int]:
        return sorted(self._skeletons)

    def _file(self, version: int) -> Path:
        return self.folder / f"v{version:06d}.safetensors"

    def take(self, engine, version: int) -> None:
        """Copy this rank's optimizer state as `version` and start writing the copy."""
        started = time.perf_counter()
        self.settle()  # the buffers are free again
        copying = time.perf_counter()
        live: dict[str, torch.Tensor] = {}
        skeleton = _split(training_state(engine), live, "")
        copies = {path: self._copy(path, tensor) for path, tensor in live.items()}
        self.folder.mkdir(parents=True, exist_ok=True)
        self._writes[version] = self._writer.submit(self._write, copies, version)
        self._skeletons[version] = skeleton
        log.info("optimizer snapshot of v%d: waited %.1f s for the previous write, copied in %.1f s",
                 version, copying - started, time.perf_counter() - copying)

    def _copy(self, path: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into this path's host buffer, made anew only where its shape or dtype changed."""
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[path] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        return buffer.copy_(tensor)

    def _write(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        partial = self._file(version).with_suffix(".tmp")
        save_file(tensors, str(partial))
        partial.replace(self._file(version))

    def settle(self) -> None:
        """Wait until every snapshot taken is on disk. A write that failed (a full disk, say) costs its version its
        snapshot, so no rollback can return there, and never the caller waiting here."""
        writes, self._writes = self._writes, {}
        for version, write in writes.items():
            try:
                write.result()
            except OSError as err:
                log.error("the optimizer snapshot of v%d could not be written (%s): no rollback can return to it",
                          version, err)
                del self._skeletons[version]
                self._file(version).with_suffix(".tmp").unlink(missing_ok=True)

    def close(self) -> None:
        self.settle()
        self._writer.shutdown()
        self._buffers.clear()

    def restore(self, engine, version: int) -> None:
        """Master weights, module weights and AdamW state back to `version` (every rank calls it)."""
        self.settle()
        restore_training_state(engine, _join(self._skeletons[version], load_file(str(self._file(version)))))

    def relabel(self, version: int, as_version: int) -> None:
        """The snapshot of `version` now stands for `as_version` (a rollback republished its weights)."""
        self.settle()
        self._file(version).replace(self._file(as_version))
        self._skeletons[as_version] = self._skeletons.pop(version)

    def keep_only(self, versions: set[int]) -> None:
        dropped = set(self._skeletons) - versions
        if dropped & set(self._writes):  # a file still being written goes once it is whole
            self.settle()
        for version in dropped:
            del self._skeletons[version]
            self._file(version).unlink(missing_ok=True)
