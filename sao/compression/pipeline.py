"""The trajectory compressor: online in the sampler (one step at a time) and its batch twin.

Memory is a table of slots. A kept step creates a slot holding its INT8 embedding (with a bottleneck: its
INT8 coordinates in the bottleneck's basis); a redundant step merges into the latest slot, which only
extends that slot's span and reward sum. A slot's vector never changes, so a context built from the
memory earlier stays reproducible.

The table is also the episode's index: `OnlineCompressor.recall` ranks the visible slots by how close
each is to the turn about to be played and names the turns the nearest ones stand for, which the
sampler puts back in the context as text (`compression.recall_turns`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sao.compression.bottleneck import Bottleneck
from sao.compression.quantize import dequantize_int8, quantize_int8
from sao.compression.temporal import Decision, TemporalFilter

if TYPE_CHECKING:
    from sao.compression.semantic import SemanticEncoder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryTable:
    """Snapshot of a trajectory's memory: one row per slot, K slots."""

    vectors: np.ndarray  # int8 [K, memory_width]: the encoder's width, or the bottleneck's
    scales: np.ndarray  # float32 [K], per-vector absmax / 127
    spans: np.ndarray  # int32 [K, 2], first and last turn the slot stands for
    reward_sums: np.ndarray  # float32 [K], rewards of every turn in the span
    created_at_turn: np.ndarray  # int32 [K], the turn whose embedding the vector is

    def __len__(self) -> int:
        return len(self.scales)


@dataclass(frozen=True)
class CompressionStats:
    """Counts, sizes and time spent per stage for one trajectory (named as the wire's `compression`
    stats are: `steps` and `merged_steps` count the episode's turns)."""

    steps: int
    kept_slots: int
    merged_steps: int
    fp32_bytes: int  # every step's embedding in float32, i.e. without stages 2 and 3
    int8_bytes: int  # kept vectors in int8 (narrowed by the bottleneck, if any) plus one float32 scale each
    encode_seconds: float
    filter_seconds: float
    quantize_seconds: float

    @property
    def ratio(self) -> float:
        """How many times smaller the memory is than the fp32 embeddings of all steps."""
        return self.fp32_bytes / self.int8_bytes if self.int8_bytes else 0.0


def visible_slots_at(created_at_turn: Sequence[int], turn: int, recent_window: int) -> list[int]:
    """Slots the policy sees at `turn`: those created before the last `recent_window` finished turns.

    The last `recent_window` finished turns reach the policy as full text instead. Slots are
    created in turn order, so the visible ones are always a prefix.
    """
    horizon = turn - 1 - recent_window
    return [i for i, created in enumerate(created_at_turn) if created <= horizon]


def recall_turns(slot_vectors: np.ndarray, spans: np.ndarray, query: np.ndarray, turns: int, before: int) -> list[int]:
    """Up to `turns` turn indices below `before`, ascending: those of the slots nearest `query` (cosine),
    nearest slot first. The slots are the visible ones (each created before `before`).

    A slot gives the turn its vector encodes, then the other turns it stands for (merged into it as
    redundant), latest first: a merged turn has no vector of its own, so only its slot can find it.
    Turns from `before` on are still in the recent window, shown as text already.
    """
    if turns <= 0 or not len(slot_vectors):
        return []
    norms = np.linalg.norm(slot_vectors, axis=1) * (np.linalg.norm(query) or 1.0)
    similarity = slot_vectors @ query / np.where(norms > 0, norms, 1.0)
    chosen: list[int] = []
    for slot in np.argsort(-similarity, kind="stable"):
        first, last = (int(t) for t in spans[slot])
        for turn in [first, *range(min(last, before - 1), first, -1)]:
            if len(chosen) == turns:
                return sorted(chosen)
            chosen.append(turn)
    return sorted(chosen)


class _SlotTable:
    """The slot bookkeeping both paths share, so they cannot drift apart: an OnlineCompressor is one, filled a
    turn at a time, and compress_batch fills one at once."""

    def __init__(self, dim: int, recent_window: int, bottleneck: Bottleneck | None = None):
        if recent_window < 0:
            raise ValueError(f"recent_window must be >= 0, got {recent_window}")
        if bottleneck is not None and bottleneck.dim != dim:
            raise ValueError(f"the bottleneck reads {bottleneck.dim}-d embeddings but the encoder gives {dim}-d")
        self.bottleneck, self.recent_window = bottleneck, recent_window
        self.memory_width = bottleneck.width if bottleneck is not None else dim
        self.turns = 0
        self.vectors: list[np.ndarray] = []
        self.scales: list[float] = []
        self.spans: list[list[int]] = []
        self.reward_sums: list[float] = []  # python floats: exact-as-possible sums, cast on export
        self.created_at: list[int] = []

    def visible_slots(self) -> list[int]:
        """Slots the policy sees for the step about to be generated."""
        return visible_slots_at(self.created_at, self.turns, self.recent_window)

    def add(self, embedding: np.ndarray, reward: float, decision: Decision) -> None:
        turn = self.turns
        if decision.keep:
            vector = embedding[None, :] if self.bottleneck is None else self.bottleneck.encode(embedding[None, :])
            codes, scales = quantize_int8(vector)
            self.vectors.append(codes[0])
            self.scales.append(float(scales[0]))
            self.spans.append([turn, turn])
            self.reward_sums.append(float(reward))
            self.created_at.append(turn)
        elif not self.spans:
            raise RuntimeError("the first turn of a trajectory must be kept; call start() first")
        else:
            self.spans[-1][1] = turn
            self.reward_sums[-1] += float(reward)
        self.turns += 1

    def memory(self) -> MemoryTable:
        """A snapshot copy of the slot table."""
        return MemoryTable(vectors=np.array(self.vectors, dtype=np.int8).reshape(len(self.vectors), self.memory_width),
                           scales=np.array(self.scales, dtype=np.float32),
                           spans=np.array(self.spans, dtype=np.int32).reshape(len(self.spans), 2),
                           reward_sums=np.array(self.reward_sums, dtype=np.float32),
                           created_at_turn=np.array(self.created_at, dtype=np.int32))

    def dequantized(self, slot_indices: Sequence[int]) -> np.ndarray:
        """float32 [k, width] vectors of the given slots, as the policy consumes them."""
        indices = list(slot_indices)
        if not indices:
            return np.zeros((0, self.memory_width), dtype=np.float32)
        codes = np.stack([self.vectors[i] for i in indices])
        return dequantize_int8(codes, np.array([self.scales[i] for i in indices], dtype=np.float32))


def _check_compatible(encoder: SemanticEncoder, temporal_filter: TemporalFilter) -> None:
    if encoder.dim != temporal_filter.dim:
        raise ValueError(f"encoder {encoder.name!r} gives {encoder.dim}-d embeddings but the temporal filter "
                         f"was trained on {temporal_filter.dim}-d; train a filter for this encoder")
    trained_on = temporal_filter.meta.get("encoder")
    if trained_on and trained_on != encoder.name:
        logger.warning("temporal filter was trained on %r embeddings, used with %r", trained_on, encoder.name)


class OnlineCompressor(_SlotTable):
    """Compresses one trajectory as it is generated.

    It restarts `temporal_filter`, whose online state it then owns: give each trajectory in
    flight its own TemporalFilter.
    """

    def __init__(self, encoder: SemanticEncoder, temporal_filter: TemporalFilter,
                 recent_window: int = 1, bottleneck: Bottleneck | None = None):
        _check_compatible(encoder, temporal_filter)
        self.encoder, self.temporal_filter = encoder, temporal_filter
        super().__init__(encoder.dim, recent_window, bottleneck)
        self._seconds = {"encode": 0.0, "filter": 0.0, "quantize": 0.0}
        temporal_filter.start()

    def finish_turn(self, text: str, reward: float) -> Decision:
        """Record a finished turn (observation + action text, reward): keep it or merge it."""
        started = time.perf_counter()
        embedding = self.encoder.encode([text])[0]
        encoded = time.perf_counter()
        decision = self.temporal_filter.observe(embedding, reward)
        filtered = time.perf_counter()
        self.add(embedding, reward, decision)
        self._seconds["encode"] += encoded - started
        self._seconds["filter"] += filtered - encoded
        self._seconds["quantize"] += time.perf_counter() - filtered
        return decision

    def query(self, observation: str) -> np.ndarray:
        """`observation`'s embedding in the slots' coordinates (float32 [memory_width]): what recall ranks by."""
        started = time.perf_counter()
        embedding = self.encoder.encode([observation])
        self._seconds["encode"] += time.perf_counter() - started
        return (embedding if self.bottleneck is None else self.bottleneck.encode(embedding))[0]

    def recall(self, observation: str, turns: int) -> list[int]:
        """Earlier turns to show as text beside the visible memory: up to `turns` of them, those of the visible
        slots nearest `observation` (the turn about to be played)."""
        visible = self.visible_slots()
        if turns <= 0 or not visible:
            return []
        spans = np.array([self.spans[i] for i in visible], dtype=np.int32)
        return recall_turns(self.dequantized(visible), spans, self.query(observation), turns,
                            before=self.turns - self.recent_window)

    def stats(self) -> CompressionStats:
        return CompressionStats(steps=self.turns, kept_slots=len(self.scales),
                                merged_steps=self.turns - len(self.scales),
                                fp32_bytes=self.turns * self.encoder.dim * 4,
                                int8_bytes=len(self.scales) * (self.memory_width + 4),
                                encode_seconds=self._seconds["encode"], filter_seconds=self._seconds["filter"],
                                quantize_seconds=self._seconds["quantize"])


def compress_batch(texts: Sequence[str], rewards: Sequence[float], encoder: SemanticEncoder,
                   temporal_filter: TemporalFilter, recent_window: int = 1, embeddings: np.ndarray | None = None,
                   bottleneck: Bottleneck | None = None) -> tuple[MemoryTable, list[list[int]], list[Decision]]:
    """Compress a finished trajectory at once; equals running OnlineCompressor step by step.

    `embeddings`, if given, are `encoder.encode(texts)` computed earlier (saves encoding twice).
    Returns the memory table, the slots visible before each step, and each step's decision.
    """
    if len(texts) != len(rewards):
        raise ValueError(f"{len(texts)} step texts but {len(rewards)} rewards")
    _check_compatible(encoder, temporal_filter)
    if embeddings is None:
        embeddings = encoder.encode(list(texts))
    elif embeddings.shape != (len(texts), encoder.dim):
        raise ValueError(f"embeddings {embeddings.shape} do not match {len(texts)} texts of {encoder.dim} dims")
    decisions = temporal_filter.filter_batch(embeddings, rewards)
    slots = _SlotTable(encoder.dim, recent_window, bottleneck)
    visible: list[list[int]] = []
    for embedding, reward, decision in zip(embeddings, rewards, decisions):
        visible.append(slots.visible_slots())
        slots.add(embedding, reward, decision)
    return slots.memory(), visible, decisions
