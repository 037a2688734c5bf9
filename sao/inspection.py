"""`sao inspect`: read a topic from the beginning and show its messages as a table.

What a topic holds is untrusted: a message that cannot be decoded, or even shown, becomes a row
saying so and why, and every text from a message is shown literally (never as rich markup).
"""

from __future__ import annotations

from collections.abc import Callable

from rich.table import Table
from rich.text import Text

from sao.config import SaoConfig
from sao.schema import PolicyAnnouncement, SchemaError, Trajectory, decode
from sao.transport.dlq import describe_dlq_message
from sao.transport.kafka import read_all


def _trajectory_row(msg) -> list:
    t = decode(msg.value(), Trajectory)
    return [t.trajectory_id, t.sampler_id, t.behaviour_version, len(t.steps), f"{t.total_reward:.2f}",
            len(t.memory.vectors), f"{float(t.compression.get('ratio', 0)):.2f}", len(msg.value())]


def _dlq_row(msg) -> list:
    info = describe_dlq_message(msg)
    source = f"{info.get('source_topic')}[{info.get('source_partition')}]@{info.get('source_offset')}"
    return [info.get("reason", ""), source, info.get("detail", "")]


def _policy_row(msg) -> list:
    ann = decode(msg.value(), PolicyAnnouncement)
    return [ann.policy_version, ann.trainer_step, ann.num_bytes, ann.sha256[:12], ann.weights_path]


# Each topic kind (also the name of its knob in `topics`): its row of a message, and the columns of that row.
_VIEWS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "trajectories": (_trajectory_row, ("trajectory", "sampler", "v_b", "steps", "reward", "memory", "ratio", "bytes")),
    "dlq": (_dlq_row, ("reason", "source", "detail")),
    "policy": (_policy_row, ("version", "step", "bytes", "sha256", "path")),
}


def inspect_topic(config: SaoConfig, bootstrap: str, what: str, limit: int) -> Table:
    """One row per message of a `what` topic; an undecodable one gets a row with the reason instead."""
    topic = getattr(config.topics, what)
    messages = read_all(bootstrap, topic, timeout=10.0, max_messages=limit)
    describe, columns = _VIEWS[what]
    table = Table("partition@offset", *columns, title=f"{topic}: {len(messages)} message(s) shown (limit {limit})")
    for msg in messages:
        try:
            cells = [Text(str(cell)) for cell in describe(msg)]
        except Exception as err:  # noqa: BLE001 - a viewer of untrusted bytes shows every message, whatever it holds
            reason = err.reason if isinstance(err, SchemaError) else type(err).__name__
            cells = [Text(f"could not decode ({reason}): {err}", style="red")]
        table.add_row(f"{msg.partition()}@{msg.offset()}", *cells)  # rich leaves the cells not given empty
    return table
