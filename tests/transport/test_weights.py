"""Weights through Kafka, the transport alone (real broker): a file in chunks comes back bit-identical, and what a
reader fetches is bounded and checked before it is written (sao/transport/weights.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import msgpack
import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from sao.schema import ChunkRange, PolicyAnnouncement, WeightsChunk, decode, encode
from sao.transport.kafka import deliver_and_wait, make_producer
from sao.transport.weights import BadChunks, ChunksMissing, WeightsFetcher, WeightsSender, weights_topic_config

CHUNK = 64 * 1024


@pytest.fixture
def link(kafka_bootstrap, unique_topic_prefix):
    """A sender and a fetcher on a fresh weights topic (the sender creates it at its first file)."""
    topic = f"{unique_topic_prefix}.weights"
    sender = WeightsSender(make_producer(kafka_bootstrap), kafka_bootstrap, topic, CHUNK, chain_length=4)
    fetcher = WeightsFetcher(kafka_bootstrap, topic, timeout_s=1.0)
    yield sender, fetcher
    fetcher.close()


def _file(tmp_path, name: str, size: int) -> tuple:
    path = tmp_path / name
    path.write_bytes(os.urandom(size))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def _announcement(version: int, path, sha: str, chunks: ChunkRange) -> PolicyAnnouncement:
    return PolicyAnnouncement(version, str(path), sha, path.stat().st_size, version, chunks=chunks)


def test_a_file_of_several_chunks_and_one_of_less_than_a_chunk_come_back_bit_identical(link, tmp_path):
    sender, fetcher = link
    for version, size in ((1, 3 * CHUNK + 123), (2, 1000)):
        path, sha = _file(tmp_path, f"v{version}", size)
        chunks = sender.send(path, version, sha)
        assert chunks.count == -(-size // CHUNK) and chunks.topic == sender.topic
        fetched = tmp_path / f"fetched-v{version}"
        fetcher.fetch(_announcement(version, path, sha, chunks), fetched, max_bytes=size)
        assert fetched.read_bytes() == path.read_bytes()


def test_the_weights_topic_is_created_with_a_size_bound_sized_from_the_first_snapshot(link, tmp_path,
                                                                                        kafka_bootstrap):
    sender, _ = link
    path, sha = _file(tmp_path, "v1", 2 * CHUNK)
    sender.send(path, 1, sha)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    [future] = admin.describe_configs([ConfigResource("topic", sender.topic)]).values()
    settings = {name: entry.value for name, entry in future.result().items()}
    wanted = weights_topic_config(2 * CHUNK, chain_length=4, chunk_bytes=CHUNK)
    assert {name: settings.get(name) for name in wanted} == wanted
    # Two chains at their largest (a snapshot and three deltas, each at most half a snapshot) and a segment.
    assert int(wanted["retention.bytes"]) == 2 * (2 * CHUNK * 2.5) + 4 * CHUNK and wanted["retention.ms"] == "-1"


def test_chunks_that_are_not_there_leave_the_version_not_ready(link, tmp_path, kafka_bootstrap):
    sender, fetcher = link
    path, sha = _file(tmp_path, "v1", 2 * CHUNK)
    chunks = sender.send(path, 1, sha)
    # The first of two chunks only (a send cut short), and chunks announced where none are yet.
    data = path.read_bytes()
    deliver_and_wait(make_producer(kafka_bootstrap), sender.topic, encode(WeightsChunk(1, sha, 0, 2, 0, data[:CHUNK])),
                     key="weights")
    partial = dataclasses.replace(chunks, offset=chunks.offset + chunks.count)
    ahead = dataclasses.replace(chunks, offset=chunks.offset + 1000)
    fetched = tmp_path / "fetched"
    for missing in (partial, ahead):
        with pytest.raises(ChunksMissing):
            fetcher.fetch(_announcement(1, path, sha, missing), fetched, max_bytes=10 * CHUNK)
        assert not fetched.exists()  # nothing half-written is left behind
    fetcher.fetch(_announcement(1, path, sha, chunks), fetched, max_bytes=10 * CHUNK)  # the reader goes on
    assert fetched.read_bytes() == data


def test_an_announcement_over_the_bound_is_refused_before_any_chunk_is_read(link, tmp_path, monkeypatch):
    sender, fetcher = link
    path, sha = _file(tmp_path, "v1", 2 * CHUNK)
    chunks = sender.send(path, 1, sha)
    polled = []
    monkeypatch.setattr(fetcher, "consumer", type("Spy", (), {"poll": lambda *_: polled.append(1)})())
    announcement = _announcement(1, path, sha, chunks)
    cases = {"too-large": (announcement, 2 * CHUNK - 1),
             "chunks": (dataclasses.replace(announcement, chunks=dataclasses.replace(chunks, count=2 * CHUNK + 1)),
                        10 * CHUNK),
             "no-chunks": (dataclasses.replace(announcement, chunks=None), 10 * CHUNK)}
    for reason, (claim, max_bytes) in cases.items():
        with pytest.raises(BadChunks) as refused:
            fetcher.fetch(claim, tmp_path / "fetched", max_bytes=max_bytes)
        assert refused.value.reason == reason
    assert polled == []


@pytest.mark.parametrize("forgery", ["past-the-size", "a-gap", "another-file", "not-a-chunk"])
def test_a_forged_chunk_is_refused_without_writing_past_the_announced_size(link, tmp_path, kafka_bootstrap, forgery):
    sender, fetcher = link
    path, sha = _file(tmp_path, "v1", CHUNK)  # creates the topic; its chunk is not used
    first = sender.send(path, 1, sha)
    producer = make_producer(kafka_bootstrap)
    chunks = {"past-the-size": [WeightsChunk(2, sha, 0, 1, 0, b"x" * (CHUNK + 1))],
              "a-gap": [WeightsChunk(2, sha, 0, 2, 0, b"x" * 10), WeightsChunk(2, sha, 1, 2, 11, b"x" * 10)],
              "another-file": [WeightsChunk(1, "0" * 64, 0, 1, 0, b"x" * CHUNK)]}.get(forgery)
    values = [encode(chunk) for chunk in chunks] if chunks else [msgpack.packb({"kind": "weights-chunk"})]
    offsets = [deliver_and_wait(producer, sender.topic, value, key="weights").offset() for value in values]
    assert offsets[0] == first.offset + first.count
    forged = PolicyAnnouncement(2, str(path), sha, CHUNK if forgery != "a-gap" else 20, 2,
                                chunks=ChunkRange(sender.topic, 0, offsets[0], len(values)))
    fetched = tmp_path / "fetched"
    with pytest.raises(BadChunks) as refused:
        fetcher.fetch(forged, fetched, max_bytes=10 * CHUNK)
    assert refused.value.reason == ("chunk-format" if forgery == "not-a-chunk" else "chunks")
    assert not fetched.exists()


def test_a_folder_announcement_is_signed_and_sent_exactly_as_before_chunks_existed():
    announcement = PolicyAnnouncement(3, "/run/policy/policy-v000003.safetensors", "a" * 64, 100, 7, created_at=1.5)
    assert announcement.signed_fields() == msgpack.packb([3, announcement.weights_path, "a" * 64, 100, 7, 1.5])
    assert "chunks" not in announcement.to_wire()
    chunked = dataclasses.replace(announcement, chunks=ChunkRange("sao.weights", 0, 40, 2))
    assert chunked.signed_fields() == msgpack.packb([3, announcement.weights_path, "a" * 64, 100, 7, 1.5,
                                                     ["sao.weights", 0, 40, 2]])
    assert decode(encode(chunked), PolicyAnnouncement) == chunked
