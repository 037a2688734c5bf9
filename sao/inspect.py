"""`sao inspect`: read a topic from the beginning and show its messages as a table."""

from __future__ import annotations

from rich.table import Table

from sao.config import SaoConfig
from sao.schema import PolicyAnnouncement, SchemaError, Trajectory, decode
from sao.transport.dlq import describe_dlq_message
from sao.transport.kafka import read_all


def inspect_topic(config: SaoConfig, bootstrap: str, what: str, limit: int) -> Table:
    topic = {"trajectories": config.topics.trajectories, "dlq": config.topics.dlq, "policy": config.topics.policy}[what]
    messages = read_all(bootstrap, topic, timeout=10.0, max_messages=limit)
    table = Table(title=f"{topic}: {len(messages)} message(s) shown (limit {limit})")
    if what == "dlq":
        for column in ("offset", "reason", "source", "detail"):
            table.add_column(column)
        for msg in messages:
            info = describe_dlq_message(msg)
            source = f"{info.get('source_topic')}[{info.get('source_partition')}]@{info.get('source_offset')}"
            table.add_row(str(msg.offset()), info.get("reason", ""), source, info.get("detail", ""))
        return table
    if what == "policy":
        for column in ("version", "step", "bytes", "sha256", "path"):
            table.add_column(column)
        for msg in messages:
            ann = decode(msg.value(), PolicyAnnouncement)
            table.add_row(str(ann.policy_version), str(ann.trainer_step), str(ann.num_bytes), ann.sha256[:12], ann.weights_path)
        return table
    for column in ("partition@offset", "trajectory", "sampler", "v_b", "steps", "reward", "memory", "ratio", "bytes"):
        table.add_column(column)
    for msg in messages:
        try:
            t = decode(msg.value(), Trajectory)
        except SchemaError as err:
            table.add_row(f"{msg.partition()}@{msg.offset()}", f"[red]invalid: {err}[/]", "", "", "", "", "", "", "")
            continue
        table.add_row(f"{msg.partition()}@{msg.offset()}", t.trajectory_id, t.sampler_id, str(t.behaviour_version),
                      str(len(t.steps)), f"{t.total_reward:.2f}", str(len(t.memory.vectors)),
                      f"{t.compression.get('ratio', 0):.2f}", str(len(msg.value())))
    return table
