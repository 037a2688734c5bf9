"""docs/wire-format.md names every key a real message carries: tasks, trajectories and announcements
are built by sao's own code, decoded with plain msgpack, and each key (through nested maps) must
appear in the doc."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgpack
import pytest

from sao.compression.temporal import load_temporal_filter
from sao.envs.registry import make_tasks
from sao.policy.weights import build_policy
from sao.sampler.rollout import Roller
from sao.schema import ChunkRange, PolicyAnnouncement, WeightsChunk, encode

WIRE_DOC = Path(__file__).resolve().parent.parent / "docs" / "wire-format.md"


def documented_names(text: str) -> set[str]:
    """Every identifier inside a `code span` of the doc: field names, nested keys, spec keys."""
    return {name for span in re.findall(r"`([^`\n]+)`", text) for name in re.findall(r"[A-Za-z_]\w*", span)}


# Maps whose keys belong to someone else, which the doc points to instead of copying: an arithmetic task's
# `spec.options` are the reasoning-gym dataset's own arguments (env.dataset_options, passed on as they are).
OPAQUE = {"spec.options"}


def keys(message: Any, path: str = "") -> dict[str, str]:
    """Every map key in a decoded message, recursively, with where it sits (for the failure message)."""
    found: dict[str, str] = {}
    if isinstance(message, dict) and path.lstrip(".") not in OPAQUE:
        for key, value in message.items():
            found.setdefault(key, f"{path}.{key}".lstrip("."))
            found.update({k: v for k, v in keys(value, f"{path}.{key}").items() if k not in found})
    elif isinstance(message, list):
        for item in message:
            found.update({k: v for k, v in keys(item, f"{path}[]").items() if k not in found})
    return found


def undocumented(message: bytes, doc: str) -> list[str]:
    names = documented_names(doc)
    return sorted(where for key, where in keys(msgpack.unpackb(message, raw=False)).items() if key not in names)


def test_the_key_check_fails_on_a_key_the_doc_does_not_name():
    doc = "| `schema` | int |\n| `kind` | str |\n| `spec` | map | `{dataset, index}` |"
    message = msgpack.packb({"schema": 2, "kind": "task", "spec": {"dataset": "x", "index": 1, "secret": 3}})
    assert undocumented(message, doc) == ["spec.secret"]


@pytest.fixture(scope="module")
def rolled_out(tiny_config, encoder):
    """A trajectory from the real rollout path (tiny model), as a sampler produces it."""
    config = tiny_config.model_copy(deep=True)
    config.env.max_turns, config.compression.recent_window = 3, 1  # three turns: memory slots travel
    policy = build_policy(config.policy, encoder.dim).eval()
    roller = Roller(config, policy, encoder, load_temporal_filter(), "s-doc", seed=3)
    return roller.rollout(make_tasks(config.env, 1)[0], 0)


def test_every_key_of_a_real_task_trajectory_and_announcement_is_in_the_wire_doc(tiny_config, rolled_out):
    doc = WIRE_DOC.read_text()
    task = make_tasks(tiny_config.env, 1)[0]
    announcement = PolicyAnnouncement(policy_version=1, weights_path="policy/v1.safetensors", sha256="0" * 64,
                                      num_bytes=10, trainer_step=1, chunks=ChunkRange("sao.weights", 0, 0, 1))
    chunk = WeightsChunk(policy_version=1, sha256="0" * 64, index=0, count=1, position=0, data=b"0" * 10)
    assert rolled_out.timings and rolled_out.compression and len(rolled_out.steps) > 1  # what the doc must cover
    for message in (task, rolled_out, announcement, chunk):
        assert undocumented(encode(message), doc) == [], f"{type(message).__name__}: keys docs/wire-format.md lacks"


def documented_reasons(text: str) -> list[str]:
    """The codes in the first column of the doc's dead-letter reasons table."""
    section = text.split("### Dead-letter reasons", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^\| `([a-z-]+)` \|", section, flags=re.MULTILINE)


def test_the_dead_letter_reasons_are_the_wire_doc_s_table_and_each_is_used():
    from sao.dead_letters import DeadLetterReason

    documented = documented_reasons(WIRE_DOC.read_text())
    assert len(documented) == len(set(documented)), "a reason is listed twice in docs/wire-format.md"
    assert set(documented) == {reason.value for reason in DeadLetterReason}, \
        "docs/wire-format.md's dead-letter reasons and sao/dead_letters.py differ"
    package = Path(__file__).resolve().parent.parent / "sao"
    code = "".join(path.read_text() for path in package.rglob("*.py") if path.name != "dead_letters.py")
    unused = [reason.name for reason in DeadLetterReason if f"DeadLetterReason.{reason.name}" not in code]
    assert unused == [], f"reasons no writer sends: {unused}"
