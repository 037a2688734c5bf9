"""The policy topic through the real broker: implausible versions are refused, so that one bad
announcement neither shadows every later version nor overflows a resumed trainer's counter."""

import time
from dataclasses import replace

import torch
from prometheus_client import REGISTRY

from sao.schema import PolicyAnnouncement, encode
from sao.transport import announcements
from sao.transport.announcements import (
    MAX_POLICY_VERSION,
    PolicyFollower,
    announce,
    latest_announced_version,
    sign,
)
from sao.transport.kafka import deliver_and_wait, make_producer
from sao.transport.topics import ensure_topics

HUGE = 2**64 - 1  # what the finding announced: uint64 max, valid msgpack


def _announcement(version: int) -> PolicyAnnouncement:
    return PolicyAnnouncement(version, f"/runs/t/policy/policy-v{version:06d}.safetensors", "ab" * 32, 10, version)


def _topic_holding(bootstrap: str, topic: str, *items) -> None:
    """Announce each item in order: a version number, or raw bytes produced as they are."""
    ensure_topics(bootstrap, {topic: 1})
    producer = make_producer(bootstrap)
    for item in items:
        if isinstance(item, bytes):
            deliver_and_wait(producer, topic, item, key="policy")
        else:
            announce(producer, topic, _announcement(item))
    producer.flush(10)


def _drained(follower: PolicyFollower, messages: int) -> PolicyFollower:
    for _ in range(100):
        if follower.messages_read >= messages:
            break
        follower.poll(0.2)
    assert follower.messages_read == messages
    return follower


def _refused(reason: str) -> float:
    return REGISTRY.get_sample_value("sao_transport_announcements_refused_total", {"reason": reason}) or 0.0


def test_latest_announced_version_ignores_absurd_versions_and_fits_an_int64(kafka_bootstrap, unique_topic_prefix):
    topic = f"{unique_topic_prefix}.policy"
    _topic_holding(kafka_bootstrap, topic, 1, 2, HUGE, -5, 2 + 1001, b"\x00garbage", 3)
    refused_before = _refused("version")

    latest = latest_announced_version(kafka_bootstrap, topic)

    assert latest == 3
    assert _refused("version") - refused_before == 3  # HUGE, -5 and the jump of 1001
    # What `sao trainer --resume` does with it (_next_free_version): no overflow.
    assert int(torch.tensor([max(0, latest)], dtype=torch.long)) == 3


def test_latest_announced_version_stops_at_the_ceiling_however_it_is_approached(kafka_bootstrap, unique_topic_prefix):
    """Steps within the jump rule cannot climb past MAX_POLICY_VERSION either."""
    topic = f"{unique_topic_prefix}.policy"
    _topic_holding(kafka_bootstrap, topic, 1)
    follower = _drained(PolicyFollower(kafka_bootstrap, topic, max_version_jump=2**63), 1)
    try:
        assert follower.implausible(MAX_POLICY_VERSION) is None
        assert "largest version" in follower.implausible(MAX_POLICY_VERSION + 1)
        assert "negative" in follower.implausible(-1)
    finally:
        follower.close()


def test_a_huge_version_does_not_shadow_the_next_valid_one(kafka_bootstrap, unique_topic_prefix):
    topic = f"{unique_topic_prefix}.policy"
    _topic_holding(kafka_bootstrap, topic, 1, HUGE)
    follower = _drained(PolicyFollower(kafka_bootstrap, topic), 2)
    try:
        assert follower.latest.policy_version == 1 and follower.newest_read == 1
        follower.loaded(1)
        _topic_holding(kafka_bootstrap, topic, 2)
        assert _drained(follower, 3).latest.policy_version == 2
    finally:
        follower.close()


def test_a_refused_version_is_never_offered_again_and_the_one_below_it_is(kafka_bootstrap, unique_topic_prefix):
    """v900 is plausible (within the jump) but its file turns out bad: v2, announced after it, still loads."""
    topic = f"{unique_topic_prefix}.policy"
    _topic_holding(kafka_bootstrap, topic, 1, 900, 2)
    follower = _drained(PolicyFollower(kafka_bootstrap, topic), 3)
    try:
        assert follower.latest.policy_version == 900
        follower.refused(900)
        assert follower.latest.policy_version == 2
        follower.loaded(2)
        assert follower.latest is None  # v1 is older than what is loaded
        deliver_and_wait(make_producer(kafka_bootstrap), topic, encode(_announcement(900)), key="policy")
        assert _drained(follower, 4).latest is None  # announced again: still refused, not re-read
    finally:
        follower.close()


def test_a_restarted_reader_meets_the_same_bad_history_and_lands_on_the_newest_good_version(
        kafka_bootstrap, unique_topic_prefix):
    topic = f"{unique_topic_prefix}.policy"
    _topic_holding(kafka_bootstrap, topic, 1, HUGE, b"not msgpack", -1, 2)
    for _ in range(2):  # a first life and a restart: both read everything from the beginning
        follower = _drained(PolicyFollower(kafka_bootstrap, topic), 5)
        try:
            assert follower.latest.policy_version == 2 and follower.newest_read == 2
        finally:
            follower.close()


def test_the_first_version_read_is_the_base_of_the_jump_rule(kafka_bootstrap, unique_topic_prefix):
    """A topic whose early announcements expired (retention) starts high; a later jump is still refused."""
    topic = f"{unique_topic_prefix}.policy"
    _topic_holding(kafka_bootstrap, topic, 5000, 5001, 5001 + 1001, HUGE)
    assert latest_announced_version(kafka_bootstrap, topic) == 5001
    assert latest_announced_version(kafka_bootstrap, f"{unique_topic_prefix}.empty") == 0


def test_a_refused_version_announced_anew_is_offered_and_a_missing_one_again_later(
        kafka_bootstrap, unique_topic_prefix, monkeypatch):
    """Issue 27: refusing a version number for good let announcements of future versions without files shadow the
    real ones published later under those numbers."""
    topic = f"{unique_topic_prefix}.policy"
    _topic_holding(kafka_bootstrap, topic, 1, 2)
    follower = _drained(PolicyFollower(kafka_bootstrap, topic), 2)
    try:
        follower.refused(2)  # a bad file: this announcement is never offered again
        assert follower.latest.policy_version == 1
        real = PolicyAnnouncement(2, _announcement(2).weights_path, "cd" * 32, 10, 2)
        deliver_and_wait(make_producer(kafka_bootstrap), topic, encode(real), key="policy")
        assert _drained(follower, 3).latest == real  # another announcement of v2: a new candidate
        monkeypatch.setattr(announcements, "MISSING_RETRY_S", 0.2)
        follower.refused(2, missing=True)
        assert follower.latest.policy_version == 1
        time.sleep(0.3)
        assert follower.latest == real  # its file may be there now
    finally:
        follower.close()


def test_a_follower_with_a_key_reads_only_announcements_signed_with_it(kafka_bootstrap, unique_topic_prefix):
    topic, key = f"{unique_topic_prefix}.policy", b"k" * 64
    _topic_holding(kafka_bootstrap, topic, encode(sign(_announcement(1), key)), encode(_announcement(5)),
                   encode(sign(_announcement(6), b"x" * 64)),
                   encode(replace(sign(_announcement(7), key), num_bytes=11)),  # altered after signing
                   encode(replace(_announcement(8), signature="é" * 64)))  # not even hex
    follower = _drained(PolicyFollower(kafka_bootstrap, topic, key=lambda: key), 5)
    try:
        assert follower.latest.policy_version == 1 and follower.newest_read == 1 and follower.ignored == 4
    finally:
        follower.close()
    without_key = _drained(PolicyFollower(kafka_bootstrap, topic, key=lambda: None), 5)
    try:  # no key to check with (the trainer has not made one yet): nothing is read
        assert without_key.latest is None and without_key.ignored == 5
    finally:
        without_key.close()
