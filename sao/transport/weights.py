"""Weights through Kafka: a published file in chunks on the weights topic, and the reader that fetches it back.

With `policy.transport = "kafka"` the trainer sends each file it publishes (the very bytes it wrote into its
policy folder) as WeightsChunk messages on one partition of `topics.weights`, waits until the broker has
acknowledged every chunk, and only then announces the version, naming where the chunks are (ChunkRange). A
sampler fetches them by offset with an assigned consumer (no group, nothing committed) into a file it owns, so
the checks of the folder transport (size, sha256, names, shapes, dtypes, finite values: sao/policy/weights.py)
run unchanged on what it fetched.

What a sampler fetches is untrusted. The announced size is bounded by `sampler.max_weights_bytes` before any
chunk is read; every chunk must be the next one of the announced file and continue it exactly where the last
one ended, within that size, so neither an announcement nor a chunk can make a sampler read or write more. A
chunk that is not there (not yet, or no longer: retention) leaves the version not ready (ChunksMissing, a
FileNotFoundError, retried later like a missing file); a chunk that is there but wrong refuses it (BadChunks).
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

from confluent_kafka import KafkaError, TopicPartition

from sao.policy.deltas import DELTA_MAX_SNAPSHOT_SHARE
from sao.schema import ChunkRange, PolicyAnnouncement, SchemaError, WeightsChunk, decode, encode
from sao.transport.kafka import (
    DEFAULT_FETCH_WAIT_MS,
    MAX_MESSAGE_BYTES,
    DeliveryFailed,
    await_acknowledgements,
    make_consumer,
    produce_when_room,
)
from sao.transport.topics import ensure_topics

log = logging.getLogger(__name__)

_KEY = "weights"  # one key: every chunk of every file in one partition, in order
# Chunks handed to the producer and not yet acknowledged, at most: bounds what a send holds in memory.
_IN_FLIGHT_CHUNKS = 8
_SEND_TIMEOUT_S = 120.0
# What the reader's consumer queues ahead of the fetch (librdkafka's queued.max.messages.kbytes).
_QUEUED_KBYTES = 32 * 1024
_MAX_SEGMENT_BYTES = 1 << 30


class ChunksMissing(FileNotFoundError):
    """A chunk of an announced version is not on the weights topic (not yet, or removed by retention)."""


class BadChunks(ValueError):
    """Chunks that are there but not the announced file's: refused, with a short `reason`."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def weights_topic_config(snapshot_bytes: int, chain_length: int, chunk_bytes: int) -> dict[str, str]:
    """The weights topic's settings: bounded by size alone, with room for two whole chains.

    A sampler needs the newest snapshot and the deltas after it (`chain_length` versions at most, its
    trainer.snapshot_every); keeping two such chains at their largest means the one a late sampler is reading
    is not deleted under it. Never by age: a paused run must not lose its snapshot. Segments are about a
    snapshot large, since Kafka deletes whole segments.
    """
    # The trainer publishes a delta only while it is at most DELTA_MAX_SNAPSHOT_SHARE of a whole file (else the file
    # is whole): retention is sized on that worst case.
    chain = snapshot_bytes * (1 + DELTA_MAX_SNAPSHOT_SHARE * (chain_length - 1))
    segment = min(max(snapshot_bytes, 4 * chunk_bytes), _MAX_SEGMENT_BYTES)
    return {"max.message.bytes": str(MAX_MESSAGE_BYTES), "cleanup.policy": "delete", "retention.ms": "-1",
            "retention.bytes": str(int(2 * chain) + segment), "segment.bytes": str(segment)}


class WeightsSender:
    """The trainer's end: sends published files as chunks, creating the topic (with its retention) at the first."""

    def __init__(self, producer, bootstrap: str, topic: str, chunk_bytes: int, chain_length: int):
        self.producer, self.bootstrap, self.topic = producer, bootstrap, topic
        self.chunk_bytes, self.chain_length = chunk_bytes, chain_length
        self._topic_ready = False

    def send(self, path: Path, version: int, sha256: str) -> ChunkRange:
        """Send the file at `path` (published `version`, hashing to `sha256`) and wait for every acknowledgement."""
        size = path.stat().st_size
        if not self._topic_ready:  # the first file of a trainer's life is a snapshot: the size retention needs
            ensure_topics(self.bootstrap, {self.topic: 1},
                          config=weights_topic_config(size, self.chain_length, self.chunk_bytes))
            self._topic_ready = True
        count = max(1, -(-size // self.chunk_bytes))
        reports: list[tuple[int, KafkaError | None, object]] = []
        deadline = time.monotonic() + _SEND_TIMEOUT_S
        with open(path, "rb") as source:
            for index in range(count):
                data = source.read(self.chunk_bytes)
                chunk = WeightsChunk(version, sha256, index, count, index * self.chunk_bytes, data)
                produce_when_room(self.producer, deadline, self.topic, encode(chunk), _KEY,
                                  on_delivery=lambda error, msg, i=index: reports.append((i, error, msg)))
                await_acknowledgements(self.producer, lambda sent=index + 1: sent - len(reports) <= _IN_FLIGHT_CHUNKS,
                                       deadline, _SEND_TIMEOUT_S, lambda: self._unacknowledged(version, count, reports))
        await_acknowledgements(self.producer, lambda: len(reports) == count, deadline, _SEND_TIMEOUT_S,
                               lambda: self._unacknowledged(version, count, reports))
        return self._placed(version, count, reports)

    def _placed(self, version: int, count: int, reports: list) -> ChunkRange:
        """Where the acknowledged chunks are; DeliveryFailed unless each is at the next offset of one partition."""
        failed = [(index, error) for index, error, _ in reports if error is not None]
        if failed:
            index, error = failed[0]
            raise DeliveryFailed(f"chunk {index} of policy v{version} was not delivered to {self.topic!r}: "
                                 f"{error.str()}", error)
        places = sorted((index, msg.partition(), msg.offset()) for index, _, msg in reports)
        _, partition, first = places[0]
        if any((p, o) != (partition, first + index) for index, p, o in places):
            # Only a resend after a broker outage could interleave them; the version is not announced.
            raise DeliveryFailed(f"the {count} chunks of policy v{version} are not at consecutive offsets of one "
                                 f"partition of {self.topic!r} ({places[:4]}...); publish again")
        return ChunkRange(self.topic, partition, first, count)

    def _unacknowledged(self, version: int, count: int, reports: list) -> str:
        return (f"{count - len(reports)} of the {count} chunks of policy v{version} on {self.topic!r} were not "
                f"acknowledged within {_SEND_TIMEOUT_S:.0f} s")


class WeightsFetcher:
    """A sampler's end: fetches an announced version's chunks into a file of its own."""

    def __init__(self, bootstrap: str, topic: str, timeout_s: float, fetch_wait_ms: int = DEFAULT_FETCH_WAIT_MS):
        self.topic, self.timeout_s = topic, timeout_s
        # "error": an offset that retention removed is reported, not silently replaced by the earliest one.
        self.consumer = make_consumer(bootstrap, f"sao-weights-reader-{uuid.uuid4().hex[:8]}", fetch_wait_ms=fetch_wait_ms,
                                      **{"auto.offset.reset": "error", "queued.max.messages.kbytes": _QUEUED_KBYTES})

    def check(self, announcement: PolicyAnnouncement, max_bytes: int) -> ChunkRange:
        """The announcement's chunks, if a sampler may fetch them at all; BadChunks before anything is read."""
        chunks = announcement.chunks
        if chunks is None:
            raise BadChunks("the announcement names no chunks on the weights topic (is the trainer's "
                            "policy.transport 'kafka'?)", "no-chunks")
        if chunks.topic != self.topic:
            raise BadChunks(f"its chunks are on {chunks.topic[:100]!r}, not this sampler's weights topic "
                            f"{self.topic!r} (topics.weights)", "chunks")
        if announcement.num_bytes > max_bytes:
            raise BadChunks(f"announced size {announcement.num_bytes} bytes is over sampler.max_weights_bytes = "
                            f"{max_bytes}", "too-large")
        if not 0 < chunks.count <= announcement.num_bytes:
            raise BadChunks(f"{chunks.count} chunks for {announcement.num_bytes} bytes", "chunks")
        return chunks

    def fetch(self, announcement: PolicyAnnouncement, destination: Path, max_bytes: int) -> None:
        """Write the announced file to `destination` from its chunks (nothing is left there if this raises)."""
        chunks = self.check(announcement, max_bytes)
        self.consumer.assign([TopicPartition(chunks.topic, chunks.partition, chunks.offset)])
        try:
            with open(destination, "wb") as out:
                written = 0
                for index in range(chunks.count):
                    chunk = self._next_chunk(announcement, chunks.offset + index)
                    problem = _misfit(chunk, announcement, index, written)
                    if problem is not None:
                        raise BadChunks(f"the chunk at {chunks.topic}[{chunks.partition}]@{chunks.offset + index} "
                                        f"{problem}", "chunks")
                    out.write(chunk.data)
                    written += len(chunk.data)
            if written != announcement.num_bytes:
                raise BadChunks(f"the chunks hold {written} bytes, {announcement.num_bytes} were announced", "size")
        except BaseException:
            destination.unlink(missing_ok=True)
            raise
        finally:
            self.consumer.unassign()

    def _next_chunk(self, announcement: PolicyAnnouncement, offset: int) -> WeightsChunk:
        """The chunk message at `offset`; ChunksMissing when none comes within the timeout or it was removed."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            msg = self.consumer.poll(0.1)
            if msg is None:  # an empty value is falsy, so compare with None
                continue
            if msg.error() is not None:
                if msg.error().code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                    raise ChunksMissing(f"policy v{announcement.policy_version}: its chunk at offset {offset} is no "
                                        f"longer on {self.topic!r} (retention removed it)")
                log.warning("weights topic: %s", msg.error())
                continue
            if msg.offset() < offset:  # fetched ahead for an earlier assignment: not part of this file
                continue
            if msg.offset() > offset:
                raise BadChunks(f"expected the chunk at offset {offset}, the topic gave {msg.offset()}", "chunks")
            try:
                return decode(msg.value(), WeightsChunk)
            except SchemaError as err:
                raise BadChunks(f"the chunk at offset {offset} is not a weights chunk ({err})", "chunk-format") from err
        raise ChunksMissing(f"policy v{announcement.policy_version}: no chunk at {self.topic!r} offset {offset} "
                            f"within sampler.weights_fetch_timeout_s = {self.timeout_s:g} s (not there yet, or the "
                            "broker is slow); tried again later")

    def close(self) -> None:
        self.consumer.close()


def _misfit(chunk: WeightsChunk, announcement: PolicyAnnouncement, index: int, written: int) -> str | None:
    """Why `chunk` is not piece `index` of the announced file, starting at byte `written` (None: it is)."""
    if (chunk.policy_version, chunk.sha256) != (announcement.policy_version, announcement.sha256):
        return f"belongs to v{chunk.policy_version} with sha256 {chunk.sha256[:16]}..., not the announced file"
    if (chunk.index, chunk.count) != (index, announcement.chunks.count):
        return f"is chunk {chunk.index} of {chunk.count}, not {index} of {announcement.chunks.count}"
    if chunk.position != written or not chunk.data:
        return f"starts at byte {chunk.position} with {len(chunk.data)} bytes; the file so far has {written}"
    if written + len(chunk.data) > announcement.num_bytes:
        return f"runs past the announced {announcement.num_bytes} bytes"
    return None
