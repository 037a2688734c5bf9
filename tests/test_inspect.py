"""`sao inspect` on topics holding garbage, through the real broker: every message gets a row, an
undecodable one says why, and text from a message is shown literally, never as rich markup."""

import io

import msgpack
import pytest
from rich.console import Console

from sao.inspection import inspect_topic
from sao.schema import PolicyAnnouncement, encode
from sao.transport.kafka import deliver_and_wait, make_producer
from sao.transport.topics import ensure_topics

GARBAGE = [b"\xc1\xff not msgpack", msgpack.packb([1, 2, 3]), msgpack.packb({"schema": 1, "kind": "policy"}),
           msgpack.packb({"schema": 99, "kind": "trajectory"}), b"[/oops] [bold]"]


def _rendered(table) -> str:
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(table)
    return out.getvalue()


@pytest.fixture
def config(tiny_config, unique_topic_prefix, kafka_bootstrap):
    config = tiny_config.model_copy(deep=True)
    p = unique_topic_prefix
    config.topics.trajectories, config.topics.dlq, config.topics.policy = f"{p}.traj", f"{p}.dlq", f"{p}.policy"
    ensure_topics(kafka_bootstrap, {config.topics.trajectories: 1, config.topics.dlq: 1, config.topics.policy: 1})
    return config


@pytest.mark.parametrize("what", ["trajectories", "policy"])
def test_each_garbage_message_gets_a_row_saying_why_it_could_not_be_decoded(config, kafka_bootstrap, what):
    topic = config.topics.trajectories if what == "trajectories" else config.topics.policy
    producer = make_producer(kafka_bootstrap)
    for value in GARBAGE:
        deliver_and_wait(producer, topic, value)
    text = _rendered(inspect_topic(config, kafka_bootstrap, what, limit=20))
    assert text.count("could not decode") == len(GARBAGE)
    assert "(decode-error)" in text and "(schema-version)" in text


def test_a_policy_announcement_with_markup_and_a_huge_version_is_shown_literally(config, kafka_bootstrap):
    producer = make_producer(kafka_bootstrap)
    deliver_and_wait(producer, config.topics.policy,
                     encode(PolicyAnnouncement(2**64 - 1, "[/evil][red]/etc/passwd", "ab" * 32, 1, 1)))
    deliver_and_wait(producer, config.topics.policy, b"\x00")
    text = _rendered(inspect_topic(config, kafka_bootstrap, "policy", limit=20))
    assert str(2**64 - 1) in text and "[/evil][red]/etc/passwd" in text and "could not decode" in text


def test_garbage_on_the_dead_letter_topic_is_shown_literally(config, kafka_bootstrap):
    producer = make_producer(kafka_bootstrap)
    deliver_and_wait(producer, config.topics.dlq, b"\xc1 no headers at all")
    producer.produce(config.topics.dlq, value=b"x", headers=[("sao-dlq-reason", b"[/bad-reason]"),  # not sao's writer
                                                             ("sao-dlq-detail", b"[bold]detail[/] [/unclosed]")])
    producer.produce(config.topics.dlq, value=None, headers=[("sao-dlq-reason", b"\xff\xfe not utf-8"),
                                                             ("sao-source-offset", b"-x")])
    producer.flush(10)
    text = _rendered(inspect_topic(config, kafka_bootstrap, "dlq", limit=20))
    assert "[/bad-reason]" in text and "[bold]detail[/] [/unclosed]" in text
    assert len([line for line in text.splitlines() if "@" in line and line.strip().startswith("│ 0@")]) == 3


def test_the_cli_survives_a_garbage_policy_topic(config, kafka_bootstrap):
    from typer.testing import CliRunner

    from sao.cli import app

    deliver_and_wait(make_producer(kafka_bootstrap), config.topics.policy, b"\xc1 garbage")
    result = CliRunner().invoke(app, ["inspect", "policy", "--bootstrap-servers", kafka_bootstrap,
                                      "--set", f'topics.policy="{config.topics.policy}"'])
    assert result.exit_code == 0, result.output
    assert "could not decode" in result.output
