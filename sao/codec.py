"""Msgpack splicing: a message's large arrays are copied straight into its bytes, once.

`sao/schema.py` says what a message holds; this module only writes it faster. A large array built
from many pieces (`joined_array`) is not concatenated first: the map around it is written key by
key, and at the array the pieces are laid end to end into the message itself. No concatenated
array and no growing pack buffer are allocated, and for large messages the page faults of those
fresh allocations cost more than the copying (measured: benchmarks/README.md). Any msgpack reader
sees exactly the map that `msgpack.packb` would write (tests/test_codec.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

# Below this many bytes, the pieces are concatenated in one numpy call and msgpack packs the message in one call:
# cheaper for small buffers than a step of Python per piece.
SPLICE_BYTES = 64 * 1024


@dataclass(slots=True)
class _Joined:
    """Arrays that travel as the data of one packed array, laid end to end only as `packb` writes the message."""

    arrays: list[np.ndarray]
    nbytes: int


class _Spliced(dict):
    """A map with a `_Joined` inside, which `packb` writes key by key (any other map msgpack packs whole)."""


def joined_array(arrays: list[np.ndarray], dtype: type) -> dict[str, Any]:
    """The wire array (`schema.pack_array`'s map) of 1-d `arrays` laid end to end; spliced when large."""
    little = np.dtype(dtype).newbyteorder("<")
    count = sum(map(len, arrays))
    if count * little.itemsize < SPLICE_BYTES:
        joined = np.concatenate(arrays, dtype=little, casting="unsafe") if arrays else np.zeros(0, little)
        return {"dtype": little.str, "shape": [count], "data": memoryview(joined)}  # msgpack copies it from there
    arrays = [np.ascontiguousarray(array, dtype=little) for array in arrays]
    return _Spliced(dtype=little.str, shape=[count], data=_Joined(arrays, count * little.itemsize))


def spliced_map(wire: dict[str, Any]) -> dict[str, Any]:
    """`wire`, marked to be written key by key if a value in it is spliced (only `packb` can write those)."""
    return _Spliced(wire) if _Spliced in map(type, wire.values()) else wire


def packb(wire: dict[str, Any]) -> bytes:
    """The msgpack bytes of a wire map: `msgpack.packb`'s, written in pieces when the map holds spliced arrays."""
    wire = spliced_map(wire)
    if type(wire) is not _Spliced:
        return msgpack.packb(wire, use_bin_type=True)
    packer = msgpack.Packer(use_bin_type=True, autoreset=False, buf_size=16 * 1024)
    parts: list[Any] = []
    _write(wire, packer, parts)
    parts.append(packer.bytes())
    return b"".join(parts)  # the one allocation of the message's size


def _write(value: Any, packer: msgpack.Packer, parts: list[Any]) -> None:
    """Pack `value` into `packer`, a `_Spliced` key by key; at a `_Joined`, move what is packed to `parts`, then
    its arrays."""
    if type(value) is _Spliced:
        packer.pack_map_header(len(value))
        for key, item in value.items():
            packer.pack(key)
            _write(item, packer, parts)
    elif type(value) is _Joined:
        # msgpack's bin 32 header (0xc6, big-endian length) is valid for any length; readers need no other.
        parts += (packer.bytes(), struct.pack(">BI", 0xC6, value.nbytes), *value.arrays)
        packer.reset()
    else:
        packer.pack(value)
