"""Weights through Kafka: time to send a published file in chunks and to fetch it back, on the embedded broker.

    python benchmarks/weights_kafka.py [FILE ...] [--sizes BYTES ...] [--chunk-bytes N] [--json PATH]

Each FILE (a published snapshot or delta), or else a file of random bytes of each size in --sizes
(by default the bf16 snapshot and the bf16 delta of SmolLM2-135M that benchmarks/weight_sync.py
measured, 269,136,392 and 13,658,666 bytes), goes through sao's own transport
(sao/transport/weights.py): WeightsSender until the broker acknowledged every chunk (the trainer's
cost before it announces), then WeightsFetcher into a new file (a sampler's cost before it checks
and applies). The fetched bytes are compared with the sent ones; nothing else is asserted. The
broker is a fresh embedded Tansu (memory storage) on loopback, so this measures the client path
and the broker's own copying, not a network.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from sao.schema import PolicyAnnouncement
from sao.transport.broker import EmbeddedBroker
from sao.transport.kafka import make_producer
from sao.transport.weights import WeightsFetcher, WeightsSender

DEFAULT_SIZES = (269_136_392, 13_658_666)


def measure(bootstrap: str, path: Path, chunk_bytes: int, topic: str) -> dict:
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    sender = WeightsSender(make_producer(bootstrap), bootstrap, topic, chunk_bytes, chain_length=10)
    started = time.perf_counter()
    chunks = sender.send(path, 1, sha256)
    send_s = time.perf_counter() - started
    announcement = PolicyAnnouncement(1, str(path), sha256, path.stat().st_size, 1, chunks=chunks)
    fetcher = WeightsFetcher(bootstrap, topic, timeout_s=30)
    fetched = path.with_suffix(".fetched")
    started = time.perf_counter()
    fetcher.fetch(announcement, fetched, max_bytes=path.stat().st_size)
    fetch_s = time.perf_counter() - started
    fetcher.close()
    identical = fetched.read_bytes() == path.read_bytes()
    fetched.unlink()
    size = path.stat().st_size
    return {"file": path.name, "bytes": size, "chunks": chunks.count, "send_s": round(send_s, 3),
            "fetch_s": round(fetch_s, 3), "send_mb_s": round(size / send_s / 1e6, 1),
            "fetch_mb_s": round(size / fetch_s / 1e6, 1), "bit_identical": identical}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--sizes", nargs="*", type=int, default=list(DEFAULT_SIZES))
    parser.add_argument("--chunk-bytes", type=int, default=4 << 20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as folder, EmbeddedBroker() as broker:
        paths = list(args.files)
        for size in [] if paths else args.sizes:
            path = Path(folder) / f"random-{size}.bin"
            with open(path, "wb") as out:
                for start in range(0, size, 1 << 24):
                    out.write(os.urandom(min(1 << 24, size - start)))
            paths.append(path)
        for index, path in enumerate(paths):
            results.append(measure(broker.bootstrap_servers, path, args.chunk_bytes, f"bench.weights.{index}"))
            print(json.dumps(results[-1]))
    if args.json:
        args.json.write_text(json.dumps({"chunk_bytes": args.chunk_bytes, "results": results}, indent=2))
    return 0 if all(r["bit_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
