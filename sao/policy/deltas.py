"""Sparse deltas between two published states: the state hash, encoding, checked reading, applying.

A published state is the policy's tensors cast to `trainer.publish_dtype`, one per storage (tied
weights once). A delta holds, per tensor that changed, the flat positions whose bits changed and
their new values. Positions are sorted, so they travel as gaps (each minus one) in LEB128 varints:
a byte per position while changes are dense, never more than five for any tensor sao trains.
Comparing bits rather than values keeps the chain bit-exact (-0.0 and 0.0 differ; so would NaNs).

The file is safetensors (never pickle): `NAME/gaps` (uint8 varints) and `NAME/values` (the publish
dtype) for each changed tensor. Like a whole file, a delta is untrusted input: every check below
runs before anything is applied.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from sao.policy.weights import WeightsMismatch, first_few, verified_file, write_weights

PUBLISH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Same-width integers: a delta compares and copies bit patterns, never values.
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16"}
_GAPS, _VALUES = "/gaps", "/values"
_VARINT_MAX_BYTES = 5  # 35 bits: far beyond any tensor's length
# A delta larger than this share of a whole file is published whole instead (sao/trainer/publisher.py): past it
# the delta saves little, and coding and applying its positions costs more than writing and loading every value.
DELTA_MAX_SNAPSHOT_SHARE = 0.5
_HASH_THREADS = min(8, os.cpu_count() or 1)


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` as a published state: contiguous CPU tensors in `dtype` (the same tensors where they already are)."""
    return {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in state.items()}


def state_sha256(state: dict[str, torch.Tensor], tensor_digests: dict[str, bytes] | None = None) -> str:
    """sha256 of a published state: over each tensor by name, `name NUL dtype NUL shape NUL` then the
    sha256 of its raw bytes (`tensor_sha256s`, computed here unless given).

    It names what a sampler holds whatever files brought it there, so a delta can say which state it
    applies to and which it makes; no file written.
    """
    digests = tensor_digests if tensor_digests is not None else tensor_sha256s(state)
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        digest.update(f"{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        digest.update(digests[name])
    return digest.hexdigest()


def tensor_sha256s(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """The sha256 of each tensor's raw bytes, by name. Hashed tensor by tensor, so on several cores at once
    (hashlib releases the GIL while it hashes a buffer)."""
    names = sorted(state)

    def tensor_digest(name: str) -> bytes:
        return hashlib.sha256(state[name].reshape(-1).view(torch.uint8).numpy()).digest()

    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:
        return dict(zip(names, pool.map(tensor_digest, names)))


def encode_delta(base: dict[str, torch.Tensor], result: dict[str, torch.Tensor], max_bytes: float = float("inf")
                 ) -> dict[str, torch.Tensor] | None:
    """The tensors of the delta file that turns `base` into `result` (same names, shapes, dtypes), or None as soon
    as they would hold more than `max_bytes` (each change costs its value and at least a byte of position)."""
    changed_positions = {}
    size = 0
    for name in sorted(result):
        bits = _BITS[result[name].dtype]
        changed = result[name].reshape(-1).view(bits) != base[name].reshape(-1).view(bits)
        changed_positions[name] = np.flatnonzero(changed.numpy())  # sorted, and counted for free
        size += len(changed_positions[name]) * (result[name].element_size() + 1)
        if size > max_bytes:
            return None
    tensors = {}
    for name, positions in changed_positions.items():
        if len(positions) == 0:
            continue
        tensors[name + _GAPS] = torch.from_numpy(encode_gaps(positions))
        tensors[name + _VALUES] = result[name].reshape(-1)[torch.from_numpy(positions)].clone()
    return tensors


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """The bytes of `tensors`' values (a file of them is this plus its header)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def write_delta(base: dict[str, torch.Tensor], result: dict[str, torch.Tensor], path: Path) -> str:
    """Write the delta from `base` to `result` atomically; return the file's sha256."""
    return write_weights(encode_delta(base, result), path)


def encode_gaps(positions: np.ndarray) -> np.ndarray:
    """Strictly increasing positions as LEB128 varints of their gaps minus one (the first from -1)."""
    gaps = np.diff(positions.astype(np.int64), prepend=-1).astype(np.uint64) - np.uint64(1)
    widths = np.ones(len(gaps), np.int64)
    for group in range(1, _VARINT_MAX_BYTES):
        widths += gaps >= np.uint64(1 << (7 * group))
    starts = np.cumsum(widths) - widths
    out = np.empty(int(widths.sum()), np.uint8)
    for group in range(int(widths.max(initial=0))):
        has = widths > group
        low = (gaps[has] >> np.uint64(7 * group)) & np.uint64(0x7F)
        more = (widths[has] > group + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + group] = (low | more).astype(np.uint8)
    return out


def decode_gaps(data: np.ndarray, count: int, length: int) -> np.ndarray:
    """The `count` positions coded in `data`, each checked below `length`; ValueError when they are not."""
    if count == 0 or len(data) == 0 or data[-1] >= 0x80:
        raise ValueError("the position code is empty or ends inside a number")
    ends = data < 0x80
    if int(ends.sum()) != count:
        raise ValueError(f"{int(ends.sum())} positions for {count} values")
    owner = np.cumsum(ends) - ends  # the number each byte belongs to
    first_byte = np.flatnonzero(np.concatenate(([True], ends[:-1])))
    place = np.arange(len(data)) - first_byte[owner]
    if place.max() >= _VARINT_MAX_BYTES:
        raise ValueError("a position gap is longer than any tensor")
    # Each byte's 7 bits in their place, summed per number: one pass however many bytes a number has.
    parts = (data & 0x7F).astype(np.uint64) << (7 * place).astype(np.uint64)
    gaps = np.add.reduceat(parts, first_byte)
    if int(gaps.max()) >= length:  # also keeps the sum below from overflowing
        raise ValueError(f"a position gap over the tensor's {length} values")
    positions = np.cumsum(gaps + np.uint64(1)).astype(np.int64) - 1
    if positions[-1] >= length:
        raise ValueError(f"position {positions[-1]} is out of the tensor's {length} values")
    return positions


def read_delta(path: Path | str, sha256: str, held: dict[str, torch.Tensor], *, num_bytes: int | None = None,
               max_bytes: int | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A delta file's changes as {name: (positions, values)}, once the file is the announced one and
    every change fits `held`: known names, the held dtype, positions strictly increasing and in
    range, finite values. Raises WeightsMismatch (reason `format`, `tensors`, `positions`, `non-finite`)."""
    with verified_file(path, sha256, num_bytes=num_bytes, max_bytes=max_bytes) as source:
        try:
            with safe_open(source, framework="pt") as handle:
                _check_header(handle, held, path)
                raw = {key: handle.get_tensor(key) for key in handle.keys()}
        except SafetensorError as err:
            raise WeightsMismatch(f"{path}: not a safetensors file ({err})", "format") from err
    changes = {}
    for key in sorted(raw):
        if not key.endswith(_VALUES):
            continue
        name = key[:-len(_VALUES)]
        values = raw[key]
        try:
            positions = decode_gaps(raw[name + _GAPS].numpy(), values.numel(), held[name].numel())
        except ValueError as err:
            raise WeightsMismatch(f"{path}: {name}: {err}", "positions") from err
        # The trainer never publishes a non-finite step (see _checked_tensors in weights.py).
        if not bool(torch.isfinite(values).all()):
            raise WeightsMismatch(f"{path}: {name} holds NaN or infinity", "non-finite")
        changes[name] = (torch.from_numpy(positions), values)
    return changes


def _check_header(handle, held: dict[str, torch.Tensor], path: Path | str) -> None:
    """Every key is NAME/gaps (1-d uint8) or NAME/values (1-d, the held dtype) of a held tensor, in pairs."""
    problems = []
    keys = set(handle.keys())
    for key in sorted(keys):
        name, _, part = key.rpartition("/")
        header = handle.get_slice(key)
        shape, dtype = header.get_shape(), header.get_dtype()
        if name not in held or f"/{part}" not in (_GAPS, _VALUES):
            problems.append(f"unexpected {key}")
        elif {f"{name}{_GAPS}", f"{name}{_VALUES}"} - keys:
            problems.append(f"{name} lacks its gaps or values")
        elif len(shape) != 1:
            problems.append(f"{key} has shape {shape}, not 1-d")
        elif part == "gaps" and dtype != "U8":
            problems.append(f"{key} has dtype {dtype}, not U8")
        elif part == "values" and (dtype != _SAFETENSORS_DTYPE.get(held[name].dtype) or
                                   not 0 < shape[0] <= held[name].numel()):
            problems.append(f"{key} has dtype {dtype} and {shape[0]} values; the held tensor is "
                            f"{held[name].dtype} with {held[name].numel()}")
    if problems:
        raise WeightsMismatch(f"{path}: tensors do not fit the held weights: {first_few(problems)}", "tensors")


def apply_changes(state: dict[str, torch.Tensor], changes: dict[str, tuple[torch.Tensor, torch.Tensor]]
                  ) -> dict[str, torch.Tensor]:
    """Write `changes` into `state` in place; return the values they replaced (to undo with this same call)."""
    replaced = {}
    with torch.no_grad():
        for name, (positions, values) in changes.items():
            flat = state[name].view(-1)
            positions = positions.to(flat.device)  # the model may sit on a GPU, in its own dtype
            replaced[name] = (positions, flat[positions].clone())
            flat[positions] = values.to(flat.device, flat.dtype)
    return replaced
