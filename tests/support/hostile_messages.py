"""Hypothesis strategies for hostile messages on any topic, and a bounded, deterministic way to draw many.

A message is one of: random bytes (sometimes valid msgpack of the wrong shape); a random map wearing
the envelope (`schema`, `kind`) and some of the real field names; or a valid message's wire map with
one place changed: a hostile number (NaN, inf, 1e39, -5, 2^64-1 ...), a value of the wrong type, a key
removed or added, a list resized, or a packed array given hostile elements, another width or a broken
dtype, shape or data. Maps are returned unpacked, so a test can stamp ids before `pack`.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sao.schema import SCHEMA_VERSION, pack_array

Message = dict | bytes
Path = tuple  # keys and list indices from the top of a wire map
_PER_EXAMPLE = 50  # messages per example hypothesis runs: it spends ~1 ms on each run, drawn values aside

INT64 = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
HOSTILE_INTS = st.one_of(st.sampled_from([-(2**63), -(2**31), -5, -1, 0, 1, 2, 3, 2**31 - 1, 2**31, 10**6, 2**62 + 1,
                                          2**63, 2**64 - 1]), INT64)
HOSTILE_FLOATS = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 1e39, -1e39, 1e300, 3.4e38, 1e4 + 1, 1e-30,
                                            -1e30, -80.5, 0.0, -0.0, 1e-3]), st.floats())
WRONG_TYPES = st.one_of(st.none(), st.booleans(), HOSTILE_INTS, HOSTILE_FLOATS, st.text(max_size=8),
                        st.binary(max_size=8), st.lists(st.integers(0, 9), max_size=3),
                        st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2))
_INT32 = st.one_of(st.sampled_from([-(2**31), -5, -1, 0, 3, 49151, 49152, 10**6, 2**31 - 1]),
                   st.integers(-(2**31), 2**31 - 1))
_FLOAT32 = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 3.4e38, -1e30, -80.5, 0.0, 1e-30]),
                     st.floats(width=32))
_WIDTHS = st.sampled_from([0, 1, 7, 383, 384, 385])


def _is_packed_array(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"dtype", "shape", "data"}


def _places(wire: Any, path: Path = ()) -> Iterator[Path]:
    """Every place in a wire map; a packed array is one place (`_hostile_array` breaks its packing)."""
    if _is_packed_array(wire):
        return
    children = (wire.items() if isinstance(wire, dict) else enumerate(wire) if isinstance(wire, list) else ())
    for key, value in children:
        yield (*path, key)
        yield from _places(value, (*path, key))


def _hostile_array(draw, packed: dict) -> dict:
    """Same dtype with hostile elements, a long or empty array, another width, or broken packing."""
    dtype = np.dtype(packed["dtype"])
    how = draw(st.sampled_from(["elements", "elements", "elements", "length", "broken-dtype", "broken-shape",
                                "broken-data"]))
    if how == "broken-dtype":
        return {**packed, "dtype": draw(st.sampled_from(["<i8", "<f8", ">i4", "|u1", "O", "", "<f2"]))}
    if how == "broken-shape":
        return {**packed, "shape": draw(st.one_of(st.lists(st.integers(-3, 10**9), max_size=3), WRONG_TYPES))}
    if how == "broken-data":
        return {**packed, "data": draw(st.one_of(st.binary(max_size=16), WRONG_TYPES))}
    if len(packed["shape"]) == 2:  # memory vectors: slots x width
        slots = draw(st.integers(0, 3))
        return pack_array(np.full((slots, draw(_WIDTHS)), draw(st.integers(-128, 127)), np.int8), np.int8)
    if how == "length":  # sizes: empty or long (bounded: a test may score whatever passes)
        # Now and then very long: one array holds every step's tokens, so this is how a message outgrows a size bound.
        count = draw(st.integers(0, 128)) if draw(st.integers(0, 9)) else 4096
        return pack_array(np.full(count, 0.0 if dtype.kind == "f" else 5), dtype)
    # Mostly as many elements as before: a length that no longer matches its neighbours' is the schema's job.
    count = packed["shape"][0] if draw(st.integers(0, 2)) else draw(st.integers(0, 8))
    elements = draw(st.lists(_FLOAT32 if dtype.kind == "f" else _INT32, min_size=count, max_size=count))
    return pack_array(np.array(elements), dtype)


def _hostile_value(draw, value: Any) -> Any:
    """A value for the place that held `value`: hostile of its own kind, or of another type."""
    if _is_packed_array(value):
        return _hostile_array(draw, value)
    if isinstance(value, bool):
        return draw(WRONG_TYPES)
    of_its_kind = draw(st.integers(0, 3)) > 0  # mostly: a wrong type is the schema's job, the rest validation's
    if isinstance(value, int) and of_its_kind:
        return draw(HOSTILE_INTS)
    if isinstance(value, float) and of_its_kind:
        return draw(HOSTILE_FLOATS)
    if isinstance(value, str) and of_its_kind:
        return draw(st.text(max_size=40))
    if isinstance(value, list) and value:  # e.g. steps: none, or many
        return value * draw(st.integers(0, 12))
    return draw(WRONG_TYPES)


def one_place_changed(base: dict) -> st.SearchStrategy[dict]:
    """`base` (a wire map) with one place changed: a hostile value, a key removed, or a key added."""
    return _changed(base, sorted(_places(base), key=repr))


@st.composite
def _changed(draw, base: dict, places: list[Path]) -> dict:
    path = draw(st.sampled_from(places))
    wire = copy.deepcopy(base)
    parent = wire
    for key in path[:-1]:
        parent = parent[key]
    how = draw(st.sampled_from(["value", "value", "value", "remove", "add"]))
    if how == "remove" and isinstance(parent, dict):
        del parent[path[-1]]
    elif how == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=12))] = draw(WRONG_TYPES)
    else:
        parent[path[-1]] = _hostile_value(draw, parent[path[-1]])
    return wire


def garbage() -> st.SearchStrategy[bytes]:
    """Bytes that are not a message: random, empty, or msgpack of something else."""
    structures = st.one_of(WRONG_TYPES, st.lists(WRONG_TYPES, max_size=3))
    return st.one_of(st.binary(max_size=200), st.just(b""), structures.map(pack))


def envelope_maps(kind: str, field_names: list[str]) -> st.SearchStrategy[dict]:
    """Maps with (mostly) the right envelope and any of the real field names, holding anything."""
    version = SCHEMA_VERSION  # mostly the current one, so that the fields behind the envelope are reached
    envelope = st.fixed_dictionaries({"schema": st.sampled_from([version, version, version, 0, version - 1,
                                                                 version + 1, str(version), None]),
                                      "kind": st.sampled_from([kind, kind, "task", 7])})
    fields = st.dictionaries(st.sampled_from(field_names), WRONG_TYPES, max_size=6)
    return st.tuples(envelope, fields).map(lambda pair: {**pair[1], **pair[0]})


def pack(message: Any) -> bytes:
    return message if isinstance(message, bytes) else msgpack.packb(message, use_bin_type=True)


def hostile_messages(bases: list[dict], kind: str, count: int, check: Callable[[Message], None]) -> list[Message]:
    """`count` hostile messages of `kind`, the same on every run, in a fixed shuffled order: 70% a base
    with one place changed, 15% envelope maps, 15% garbage. `check(message)` runs on each as it is drawn,
    so hypothesis shrinks a failing one to its simplest form before the test sees the error."""
    field_names = sorted({name for base in bases for name in base if name not in ("schema", "kind")})
    changed = st.one_of([one_place_changed(base) for base in bases])
    envelopes = garbages = count * 15 // 100
    shares = [(changed, count - envelopes - garbages), (envelope_maps(kind, field_names), envelopes),
              (garbage(), garbages)]
    drawn = [message for strategy, share in shares for message in draw(strategy, share, check)]
    random.Random(0).shuffle(drawn)
    return drawn


def draw(strategy: st.SearchStrategy, count: int, check: Callable[[Any], None]) -> list:
    """`count` examples of `strategy`, the same on every run, each passed to `check` as it is drawn."""
    drawn: list = []

    @settings(max_examples=-(-count // _PER_EXAMPLE), derandomize=True, database=None, deadline=None,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(st.lists(strategy, min_size=_PER_EXAMPLE, max_size=_PER_EXAMPLE))
    def collect(examples: list) -> None:
        for example in examples:
            check(example)
        drawn.extend(examples)

    collect()
    assert len(drawn) >= count, f"hypothesis drew {len(drawn)} examples of {count}"
    return drawn[:count]
