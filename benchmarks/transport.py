"""Trajectory transport: sao's producer -> consumer path against bare confluent-kafka, same broker, same sizes.

    python benchmarks/transport.py [--sizes 1KB,10KB,50KB,1MB] [--messages 400] [--repeats 2] [--json PATH]

One embedded Tansu broker (started here) carries every arm. Per trajectory size, each arm moves
the same number of messages of that size through a fresh topic with sao's trajectory partition
count, from a producer process to a consumer in this process (the sampler and the trainer are
separate processes too):

- `bare`: a plain confluent-kafka Producer and Consumer, librdkafka's defaults (acks=all, no
  idempotence, linger 5 ms) plus only what this broker and these sizes need (message.max.bytes;
  the consumer's fetch.wait.max.ms 20, which is Tansu's latency floor, the same as sao's). The
  producer sends pre-encoded bytes of the trajectory's size without waiting; nothing is decoded.
- `sao`: what a sampler does per finished trajectory, `encode(trajectory)` and
  `Outbox.send` (sao/sampler/outbox.py: a RenewingProducer with `producer_config`, acks=all and
  idempotence; the task finishes on the acknowledgement, served by `Outbox.poll`, while the
  sampler goes on), and what the trainer does to get a trajectory into its buffer:
  `TrajectoryStream.poll` (sao's consumer settings, size check, msgpack decode, dedup,
  `TrajectoryValidator`, staleness gate).
- `sao-blocking`: the same, but the producer blocks on each acknowledgement
  (`deliver_and_wait`), as sao's sampler did before the outbox: the difference to `sao` is the
  per-message wait, the difference of `sao` to `bare` is settings + encode + decode + validation.

Arms alternate order from one size and repeat to the next, so a contended machine hurts each
alike. Two phases per run: throughput (all messages as fast as the path goes: first produce call
to last message consumed) and latency (messages paced at --latency-interval-ms, or at twice the
bulk phase's time per message if that is longer, so nothing queues; end-to-end = produce call,
encode included, to consumed, decoded and validated). The producer's send times and the
consumer's arrival times use the same monotonic clock. CPU per message is reported for the
producer process, the consumer and the broker (from /proc, the broker's from the producer's start
to the last bulk message): on a shared machine throughput follows it.

Headline: sao / bare messages per second at the median size (the upper middle one for an even
count); `ratio_geomean` is the geometric mean of the ratio over all sizes. No figure is asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

ARMS = ("bare", "sao", "sao-blocking")
MEMORY_WIDTH = 384  # all-MiniLM-L6-v2, the default encoder
VOCAB = 49152  # SmolLM2's vocabulary, the default policy
_UNITS = {"B": 1, "KB": 1024, "MB": 1024 * 1024}
# Bare librdkafka refuses messages over 1,000,000 bytes by default; room for framing at 1 MiB.
_BARE_MESSAGE_MAX = 4 * 1024 * 1024
# The bare consumer: librdkafka's defaults, a new group reading from the start, and sao's fetch wait
# (Tansu answers an empty fetch only when it expires, so at the default 500 ms bare would lose on latency).
_BARE_CONSUMER = {"auto.offset.reset": "earliest", "fetch.wait.max.ms": 20}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for unit in ("KB", "MB", "B"):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * _UNITS[unit])
    return int(text)


def trajectory_of_size(num_bytes: int):
    """A valid trajectory whose msgpack encoding is about `num_bytes`: several turns, memory, long actions.

    Shaped like a sampler's output (a prompt, observations, actions with their log-probs, one INT8
    memory row per earlier turn) rather than one long array, so decode and validation do the work
    of a real multi-turn trajectory.
    """
    from sao.schema import Memory, Step, Trajectory, encode

    rng = np.random.default_rng(0)
    turns = int(np.clip(num_bytes // 4096, 1, 32))

    def build(action_tokens: int) -> Trajectory:
        rows = turns - 1
        memory = Memory(vectors=rng.integers(-127, 128, (rows, MEMORY_WIDTH)).astype(np.int8),
                        scales=np.full(rows, 1 / 127, np.float32),
                        spans=np.stack([np.arange(rows), np.arange(rows)], axis=1).astype(np.int32),
                        reward_sums=np.zeros(rows, np.float32))
        steps = [Step(observation_ids=rng.integers(3, VOCAB, 24).astype(np.int32),
                      action_ids=rng.integers(3, VOCAB, action_tokens).astype(np.int32),
                      behaviour_logprobs=-rng.random(action_tokens).astype(np.float32) * 5,
                      reward=float(i == turns - 1), done=i == turns - 1, memory_count=i)
                 for i in range(turns)]
        return Trajectory(trajectory_id="bench-0#0", task_id="bench-0", env="arithmetic", sampler_id="bench",
                          behaviour_version=0, prompt_ids=rng.integers(3, VOCAB, 48).astype(np.int32), steps=steps,
                          memory=memory, temperature=1.0, encoder="all-MiniLM-L6-v2", recent_window=1,
                          timings={"rollout_s": 1.0}, compression={"kept_steps": float(turns)})

    fixed = len(encode(build(1))) - 8 * turns  # 8 bytes per action token: its id and its log-prob
    return build(max(1, (num_bytes - fixed) // (8 * turns)))


# --- producer process ----------------------------------------------------------------------------


def produce(arm: str, bootstrap: str, topic: str, size: int, messages: int, latency_messages: int,
            interval_s: float, out: Path) -> None:
    """Send `messages` as fast as the arm goes, wait for "go" on stdin, then `latency_messages` paced ones."""
    from sao.schema import encode

    template = trajectory_of_size(size)
    payload = encode(template)
    send, finish = _sender(arm, bootstrap)
    # Connect (and, idempotent, get a producer id) before the clock starts: samplers live long.
    send(f"{topic}.dlq", payload, b"warm-up")
    finish()
    sent: list[float] = []
    cpu_started = time.process_time()  # all of this process's threads: librdkafka's included

    def one(index: int) -> None:
        started = time.perf_counter()
        if arm == "bare":
            send(topic, payload, str(index).encode())
        else:  # sao's encode is part of its path: each trajectory is its own message
            task_id = f"bench-{index}"
            trajectory = replace(template, trajectory_id=f"{task_id}#0", task_id=task_id, created_at=time.time())
            send(topic, encode(trajectory), task_id)
        sent.append(started)

    for index in range(messages):
        one(index)
    finish()
    acked_at, bulk_cpu_s = time.perf_counter(), time.process_time() - cpu_started
    # The consumer has everything, and says how far apart to send so that nothing queues.
    interval_s = max(interval_s, float(sys.stdin.readline().split()[1]))
    start = time.perf_counter()
    for j in range(latency_messages):
        time.sleep(max(0.0, start + j * interval_s - time.perf_counter()))
        one(messages + j)
    finish()
    out.write_text(json.dumps({"sent": sent, "acked_at": acked_at, "bulk_cpu_s": bulk_cpu_s, "bytes": len(payload)}))


def _sender(arm: str, bootstrap: str):
    """(send(topic, value, key), finish()) for an arm: finish waits until every message is acknowledged."""
    from confluent_kafka import Producer

    if arm == "bare":
        producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": _BARE_MESSAGE_MAX})
        return _async_send(producer), lambda: _flush(producer)

    from sao.sampler.outbox import Outbox
    from sao.transport.health import BrokerWatch
    from sao.transport.kafka import RenewingProducer, deliver_and_wait

    watch = BrokerWatch(bootstrap, f"bench-{arm}", loss_timeout_s=60)
    producer = RenewingProducer(bootstrap, watch)  # the sampler's producer, with producer_config
    if arm == "sao-blocking":
        return (lambda topic, value, key: deliver_and_wait(producer, topic, value, key=key)), lambda: _flush(producer)
    outboxes: dict[str, Outbox] = {}

    def send(topic: str, value: bytes, key) -> None:
        outbox = outboxes.setdefault(topic, Outbox(producer, topic))
        outbox.send(value, key, lambda _ack_s: None)  # a sampler finishes the task here
        outbox.poll()  # as the sampler's loop does between generation steps

    def finish() -> None:
        for outbox in outboxes.values():
            outbox.drain(timeout_s=60)

    return send, finish


def _async_send(producer):
    def send(topic: str, value: bytes, key) -> None:
        while True:
            try:
                producer.produce(topic, value=value, key=key)
                producer.poll(0)
                return
            except BufferError:  # the local queue is full: serve delivery reports, then try again
                producer.poll(0.05)
    return send


def _flush(producer) -> None:
    left = producer.flush(60)
    if left:
        raise RuntimeError(f"{left} message(s) were not acknowledged within 60 s")


# --- consumer side (this process) ------------------------------------------------------------------


class BareReader:
    """A plain consumer assigned every partition from the start: no group join, no decode."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-bare-{uuid.uuid4().hex[:8]}",
                                  **_BARE_CONSUMER})
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])

    def ready(self) -> bool:
        return True

    def read(self, timeout: float) -> list[tuple[int, float]]:
        msg = self.consumer.poll(timeout)
        if msg is None or msg.error() is not None:
            return []
        len(msg.value())  # the bytes are there; nothing decodes them
        return [(int(msg.key()), time.perf_counter())]

    def close(self) -> None:
        self.consumer.close()


class SaoReader:
    """The trainer's intake: a TrajectoryStream (its consumer, decode, dedup, validation) with its own group."""

    def __init__(self, bootstrap: str, topic: str, dlq_topic: str) -> None:
        from sao.config import TrainerConfig
        from sao.trainer.trajectory_stream import TrajectoryStream
        from sao.trainer.validation import TrajectoryValidator
        from sao.transport.dlq import DeadLetterQueue
        from sao.transport.kafka import make_producer

        trainer = TrainerConfig()
        validator = TrajectoryValidator(VOCAB, MEMORY_WIDTH, trainer.max_abs_reward, trainer.max_trajectory_bytes)
        group = f"bench-sao-{uuid.uuid4().hex[:8]}"
        self.stream = TrajectoryStream(bootstrap, topic, DeadLetterQueue(make_producer(bootstrap), dlq_topic),
                                       max_staleness=trainer.max_staleness, validator=validator, group_id=group)

    def ready(self) -> bool:
        self.stream.poll(1, policy_version=0, timeout=0.2)  # joins the group; nothing is produced yet
        return bool(self.stream.consumer.assignment())

    def read(self, timeout: float) -> list[tuple[int, float]]:
        # One at a time, so each arrival is timed when it is in the trainer's hands.
        return [(int(entry.trajectory.task_id.rsplit("-", 1)[1]), time.perf_counter())
                for entry in self.stream.poll(1, policy_version=0, timeout=timeout)]

    def close(self) -> None:
        self.stream.dlq.flush(5)
        self.stream.close()


class Arrivals(NamedTuple):
    times: dict[int, float]  # message index -> when it was in the consumer's hands
    duplicates: int
    bulk_cpu_s: float  # this process's CPU seconds until the last bulk message arrived
    broker_cpu_s: float  # the broker's CPU seconds from the producer's start until then


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) of process `pid` so far; NaN where /proc does not say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(arm: str, bootstrap: str, size: int, messages: int, latency_messages: int, interval_s: float,
             partitions: int, workdir: Path, timeout_s: float, broker_pid: int | None = None) -> dict:
    """One arm at one size: a fresh topic, the reader ready first, then the producer process."""
    from sao.transport.topics import ensure_topics

    topic = f"bench-{arm}-{uuid.uuid4().hex[:8]}"
    ensure_topics(bootstrap, {topic: partitions, f"{topic}.dlq": 1})
    reader = BareReader(bootstrap, topic, partitions) if arm == "bare" else SaoReader(bootstrap, topic, f"{topic}.dlq")
    try:
        deadline = time.monotonic() + 60
        while not reader.ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {arm} consumer got no partitions of {topic} within 60 s")
        out = workdir / f"{topic}.json"
        broker_cpu_started = process_cpu_s(broker_pid)
        producer = subprocess.Popen(
            [sys.executable, __file__, "--producer", arm, "--bootstrap", bootstrap, "--topic", topic,
             "--size", str(size), "--messages", str(messages), "--latency-messages", str(latency_messages),
             "--latency-interval-ms", str(interval_s * 1000), "--out", str(out)],
            stdin=subprocess.PIPE, text=True)
        arrivals = _collect(reader, producer, messages, latency_messages, timeout_s,
                            lambda: process_cpu_s(broker_pid) - broker_cpu_started)
        if producer.wait(timeout=120) != 0:
            raise RuntimeError(f"the {arm} producer exited with {producer.returncode}")
        produced = json.loads(out.read_text())
        counters = reader.stream.counters if isinstance(reader, SaoReader) else None
    finally:
        reader.close()
        _delete_topics(bootstrap, [topic, f"{topic}.dlq"])
    return _figures(arm, size, messages, produced, arrivals, counters)


def _collect(reader, producer: subprocess.Popen, messages: int, latency_messages: int,
             timeout_s: float, broker_cpu_s) -> Arrivals:
    """Arrival time per message index, this process's CPU from the first to the last bulk message and the
    broker's (`broker_cpu_s()`) until then.

    Tells the producer to start the paced phase once every bulk message arrived.
    """
    arrived: dict[int, float] = {}
    duplicates = 0
    told = False
    bulk_cpu_s = broker_s = math.nan
    cpu_started: float | None = None  # from the first arrival: idle polling before it is no message's cost
    deadline = time.monotonic() + timeout_s
    while len(arrived) < messages + latency_messages and time.monotonic() < deadline:
        if producer.poll() is not None and producer.returncode != 0:
            break
        for index, when in reader.read(0.2):
            if cpu_started is None:
                cpu_started = time.process_time()
            duplicates += index in arrived
            arrived.setdefault(index, when)
        if not told and sum(1 for i in arrived if i < messages) == messages:
            # Twice the time per message the bulk phase took: the paced phase then never queues.
            bulk_cpu_s, broker_s = time.process_time() - (cpu_started or 0.0), broker_cpu_s()
            bulk = [when for i, when in arrived.items() if i < messages]
            producer.stdin.write(f"go {2 * (max(bulk) - min(bulk)) / max(1, messages - 1):.6f}\n")
            producer.stdin.flush()
            told = True
    if not told:  # let a stuck producer finish so that its exit is not a second error
        producer.stdin.write("go 0\n")
        producer.stdin.flush()
    producer.stdin.close()
    return Arrivals(arrived, duplicates, bulk_cpu_s, broker_s)


def _delete_topics(bootstrap: str, topics: list[str]) -> None:
    """Free the broker's memory (it keeps every byte); a broker that cannot delete just keeps them."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the futures are done
    for future in admin.delete_topics(topics, request_timeout=10).values():
        try:
            future.result()
        except Exception as err:  # noqa: BLE001  # only memory is at stake
            print(f"could not delete a benchmark topic: {err}", file=sys.stderr)


def _figures(arm: str, size: int, messages: int, produced: dict, arrivals: Arrivals, counters) -> dict:
    arrived, duplicates, consumer_cpu_s, broker_cpu_s = arrivals
    sent = produced["sent"]
    bulk = [arrived[i] for i in range(messages) if i in arrived]
    seconds = (max(bulk) - sent[0]) if bulk else math.nan
    latencies = [(arrived[i] - sent[i]) * 1000 for i in range(messages, len(sent)) if i in arrived]
    figures = {
        "arm": arm, "size": size, "message_bytes": produced["bytes"], "sent": len(sent), "received": len(arrived),
        "duplicates": duplicates, "bulk_messages": messages, "bulk_seconds": seconds,
        "messages_per_s": messages / seconds if bulk and len(bulk) == messages else math.nan,
        "producer_acked_s": produced["acked_at"] - sent[0], "latency_ms": latencies,
        # CPU per message of each side's process in the bulk phase: unlike rates, it hardly moves with contention.
        "producer_cpu_us_per_msg": produced["bulk_cpu_s"] / messages * 1e6,
        "consumer_cpu_us_per_msg": consumer_cpu_s / max(1, messages - 1) * 1e6,  # timed from the first
        "broker_cpu_us_per_msg": broker_cpu_s / messages * 1e6,  # the producer's start-up included
    }
    figures["mb_per_s"] = figures["messages_per_s"] * produced["bytes"] / 1e6
    if counters is not None:
        figures["dead_lettered"] = counters.dead_lettered
        figures["stream_duplicates"] = counters.duplicates
    return figures


# --- costs that sao adds, measured in this process ----------------------------------------------


def codec_costs(size: int, repeats: int = 50) -> dict:
    """CPU microseconds per message for sao's encode, decode and validation at this size (no Kafka)."""
    from sao.config import TrainerConfig
    from sao.schema import Trajectory, decode, encode
    from sao.trainer.validation import TrajectoryValidator

    trainer = TrainerConfig()
    validator = TrajectoryValidator(VOCAB, MEMORY_WIDTH, trainer.max_abs_reward, trainer.max_trajectory_bytes)
    trajectory = trajectory_of_size(size)
    data = encode(trajectory)

    def per_call(fn) -> float:
        # CPU time of this thread: on a shared machine, wall time also counts the waits for a core.
        fn()
        started = time.thread_time()
        for _ in range(repeats):
            fn()
        return (time.thread_time() - started) / repeats * 1e6

    decoded = decode(data, Trajectory)
    return {"encode_us": per_call(lambda: encode(trajectory)), "decode_us": per_call(lambda: decode(data, Trajectory)),
            "validate_us": per_call(lambda: validator.validate(decoded, 0))}


# --- orchestration and report ---------------------------------------------------------------------


def summarise(runs: list[dict], sizes: list[int]) -> dict:
    table = {}
    for size in sizes:
        row = {}
        for arm in ARMS:
            mine = [r for r in runs if r["size"] == size and r["arm"] == arm]
            if not mine:
                continue
            latency = [x for r in mine for x in r["latency_ms"]]
            rates = [r["messages_per_s"] for r in mine]
            row[arm] = {
                "message_bytes": mine[0]["message_bytes"],
                "messages_per_s": statistics.median(rates), "messages_per_s_runs": rates,
                "mb_per_s": statistics.median(r["mb_per_s"] for r in mine),
                "latency_p50_ms": _percentile(latency, 50), "latency_p99_ms": _percentile(latency, 99),
                "latency_n": len(latency),
                "producer_cpu_us_per_msg": statistics.median(r["producer_cpu_us_per_msg"] for r in mine),
                "consumer_cpu_us_per_msg": statistics.median(r["consumer_cpu_us_per_msg"] for r in mine),
                "broker_cpu_us_per_msg": statistics.median(r["broker_cpu_us_per_msg"] for r in mine),
                "sent": sum(r["sent"] for r in mine), "received": sum(r["received"] for r in mine),
                "duplicates": sum(r["duplicates"] for r in mine),
                "dead_lettered": sum(r.get("dead_lettered", 0) for r in mine),
            }
        for arm in ("sao", "sao-blocking"):
            if arm in row and "bare" in row:
                row[arm]["ratio_to_bare"] = row[arm]["messages_per_s"] / row["bare"]["messages_per_s"]
        table[str(size)] = row
    return table


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def headline(table: dict, sizes: list[int]) -> dict:
    middle = str(sorted(sizes)[len(sizes) // 2])
    value, baseline = table[middle]["sao"]["messages_per_s"], table[middle]["bare"]["messages_per_s"]
    ratios = [table[str(s)]["sao"]["ratio_to_bare"] for s in sizes]
    return {"metric": "sao / bare confluent-kafka throughput, trajectory path", "value": value,
            "baseline": baseline, "ratio": value / baseline, "unit": "messages/s", "size_bytes": int(middle),
            "ratio_geomean": float(np.exp(np.mean(np.log(ratios))))}


def print_table(table: dict, sizes: list[int], costs: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Table(title="Trajectory transport on one Tansu broker: sao vs bare confluent-kafka")
    for column in ("size", "arm", "msgs/s", "MB/s", "ratio to bare", "p50 ms", "p99 ms", "received/sent",
                   "producer CPU µs/msg", "consumer CPU µs/msg", "broker CPU µs/msg", "encode+decode+validate CPU µs"):
        out.add_column(column, justify="right")
    for size in sizes:
        cost = costs[str(size)]
        for arm, row in table[str(size)].items():
            work = "" if arm == "bare" else f"{cost['encode_us'] + cost['decode_us'] + cost['validate_us']:.0f}"
            out.add_row(_human(size), arm, f"{row['messages_per_s']:.0f}", f"{row['mb_per_s']:.1f}",
                        f"{row.get('ratio_to_bare', 1.0):.3f}", f"{row['latency_p50_ms']:.1f}",
                        f"{row['latency_p99_ms']:.1f}", f"{row['received']}/{row['sent']}",
                        f"{row['producer_cpu_us_per_msg']:.0f}", f"{row['consumer_cpu_us_per_msg']:.0f}",
                        f"{row['broker_cpu_us_per_msg']:.0f}", work)
    Console(width=max(180, Console().width)).print(out)  # 12 columns: never squeeze them into 80


def _human(size: int) -> str:
    for unit in ("MB", "KB"):
        if size >= _UNITS[unit] and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return f"{size}B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1KB,10KB,50KB,1MB", help="encoded trajectory sizes, comma-separated")
    parser.add_argument("--messages", type=int, default=400, help="messages per throughput run (capped by --max-mb)")
    parser.add_argument("--max-mb", type=float, default=64, help="at most this many MB per throughput run")
    parser.add_argument("--latency-messages", type=int, default=40, help="paced messages per latency run")
    parser.add_argument("--latency-interval-ms", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=2, help="runs per arm and size, arms in alternating order")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)} (bare and sao needed "
                                                               "for the headline)")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="a run that has not received every message by then reports what is missing")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--producer", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.producer:
        produce(args.producer, args.bootstrap, args.topic, args.size, args.messages, args.latency_messages,
                args.latency_interval_ms / 1000, args.out)
        return

    import tempfile

    from sao.config import TopicsConfig
    from sao.transport.broker import EmbeddedBroker

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    arms = [a.strip() for a in args.arms.split(",")]
    partitions = TopicsConfig().trajectory_partitions
    runs = []
    costs = {str(size): codec_costs(size) for size in sizes}
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            for k, size in enumerate(sizes):
                count = max(1, min(args.messages, int(args.max_mb * 1e6 // size)))
                shift = (repeat + k) % len(arms)
                for arm in arms[shift:] + arms[:shift]:  # a different arm goes first each time
                    runs.append(run_once(arm, broker.bootstrap_servers, size, count, args.latency_messages,
                                         args.latency_interval_ms / 1000, partitions, Path(workdir),
                                         args.timeout_s, broker.pid))
                    print(f"{_human(size)} {arm}: {runs[-1]['messages_per_s']:.0f} msgs/s", file=sys.stderr)
    table = summarise(runs, sizes)
    print_table(table, sizes, costs)
    result = {"headline": headline(table, sizes) if {"bare", "sao"} <= set(arms) else None, "sizes": table,
              "codec_costs_us": costs, "runs": runs,
              "settings": {"partitions": partitions, "repeats": args.repeats, "messages": args.messages,
                           "max_mb": args.max_mb, "latency_messages": args.latency_messages,
                           "latency_interval_ms": args.latency_interval_ms, "bare_consumer": _bare_settings(),
                           "sao_consumer": _sao_settings(), "sao_producer": _sao_producer_settings(),
                           "bare_producer": {"message.max.bytes": _BARE_MESSAGE_MAX}}}
    if result["headline"]:
        h = result["headline"]
        print(f"headline: sao {h['value']:.0f} vs bare {h['baseline']:.0f} msgs/s at {_human(h['size_bytes'])} "
              f"= {h['ratio']:.3f}; geometric mean over sizes {h['ratio_geomean']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def _bare_settings() -> dict:
    return {**_BARE_CONSUMER, "assign": "all partitions, no group"}


def _sao_settings() -> dict:
    from sao.transport.kafka import consumer_config

    return {k: v for k, v in consumer_config("", "sao-trainer").items() if k not in ("bootstrap.servers", "group.id")}


def _sao_producer_settings() -> dict:
    from sao.transport.kafka import producer_config

    return {k: v for k, v in producer_config("").items() if k != "bootstrap.servers"}


if __name__ == "__main__":
    main()
