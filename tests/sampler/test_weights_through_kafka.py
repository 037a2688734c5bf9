"""policy.transport = "kafka", through the real broker: the real publisher sends bf16 snapshots and deltas in
chunks on the weights topic, and a sampler with the tiny policy and no policy folder follows them, refuses or waits
on what is wrong or not there yet, re-syncs, and a sampler that starts late catches up from the log alone."""

from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest
import torch

from sao.policy.weights import unique_state_dict
from sao.run_dir import RunDir
from sao.sampler.loop import Sampler
from sao.sampler.weight_source import KafkaSource
from sao.sampler.weight_sync import WeightSync
from sao.schema import ChunkRange, PolicyAnnouncement, WeightsChunk, encode
from sao.trainer import publisher as publisher_module
from sao.trainer.publisher import PolicyPublisher
from sao.transport import announcements
from sao.transport.announcements import PolicyFollower, read_announce_key_file, sign
from sao.transport.kafka import deliver_and_wait, make_producer
from sao.transport.topics import ensure_topics
from sao.transport.weights import WeightsSender
from support.policy_topic import wait_until_read

CHUNK = 1 << 20  # the tiny policy's bf16 snapshot (~6 MB) takes several


@pytest.fixture(scope="module")
def built_sampler(kafka_bootstrap, tiny_config, tmp_path_factory):
    """One sampler with policy.transport = kafka for the module; `KafkaRun.start_sampler` makes it new again."""
    config = tiny_config.model_copy(deep=True)
    prefix = f"k{tmp_path_factory.mktemp('ids').name[-6:]}"
    config.topics.tasks, config.topics.sampler_group = f"{prefix}.tasks", f"{prefix}-s"
    config.policy.transport, config.metrics.sampler_port = "kafka", 0
    sampler = Sampler(config, kafka_bootstrap, "s-kafka")
    assert sampler.policy_dir is None  # it reads no trainer folder
    version_0 = {name: tensor.clone() for name, tensor in sampler.policy.state_dict().items()}
    yield sampler, version_0
    sampler.close()


class KafkaRun:
    """A trainer publishing through Kafka (the real PolicyPublisher and WeightsSender) and the module's sampler on
    the same topics, in a run directory of its own that has no policy folder."""

    def __init__(self, built, bootstrap: str, prefix: str, tmp_path, snapshot_every: int):
        self.sampler, self.version_0 = built
        self.bootstrap = bootstrap
        self.policy_topic, self.weights_topic = f"{prefix}.policy", f"{prefix}.weights"
        ensure_topics(bootstrap, {self.policy_topic: 1})
        self.trainer_dir, self.sampler_dir = RunDir(tmp_path / "trainer"), RunDir(tmp_path / "sampler")
        self.producer = make_producer(bootstrap)
        self.sender = WeightsSender(self.producer, bootstrap, self.weights_topic, CHUNK, chain_length=snapshot_every)
        self.publisher = PolicyPublisher(self.producer, self.policy_topic, self.trainer_dir, 100, "bf16", deltas=True,
                                         snapshot_every=snapshot_every, weights=self.sender)
        # The key is all a remote sampler gets from the trainer's machine: a copy of it.
        self.sampler_dir.root.mkdir(parents=True)
        self.key_file = self.sampler_dir.root / "announce-key"
        shutil.copy(self.trainer_dir.policy_dir / ".announce-key", self.key_file)
        self.sent = 0  # announcements on the policy topic
        self.base = unique_state_dict({name: tensor.clone() for name, tensor in self.version_0.items()})
        self.start_sampler()

    def start_sampler(self) -> None:
        """The sampler as if just started: v0, a follower that reads the policy topic from the beginning, a new
        weights reader."""
        sampler = self.sampler
        sampler.policy.load_state_dict(self.version_0)
        sampler.config.topics.weights = self.weights_topic
        sampler.config.sampler.announce_key_file = str(self.key_file)
        sampler.weights_source.close()
        sampler.weights_source = KafkaSource(self.bootstrap, self.weights_topic, timeout_s=1.0)
        sampler.policy_follower.close()
        sampler.policy_follower = PolicyFollower(self.bootstrap, self.policy_topic,
                                                 sampler.config.sampler.max_version_jump,
                                                 key=lambda: read_announce_key_file(self.key_file))
        sampler.weight_sync = WeightSync(sampler.policy)
        sampler.pending, sampler.missing_refused, sampler.behind = None, set(), False
        sampler.config.sampler.max_weights_bytes = 8 << 30

    def state(self, version: int) -> dict[str, torch.Tensor]:
        """What the trainer holds at `version`: about 1 % of every tensor's values moved."""
        state = {name: tensor.clone() for name, tensor in self.base.items()}
        for tensor in state.values():
            tensor.view(-1)[version::97] += 0.01 * version
        return state

    def publish(self, version: int) -> PolicyAnnouncement:
        announcement = self.publisher.publish_state(self.state(version), version, version)
        self.sent += 1
        return announcement

    def send(self, announcement: PolicyAnnouncement) -> None:
        """Announce `announcement` as given (signed with the run's key), as a trainer or a forger would."""
        announcements.announce(self.producer, self.policy_topic, sign(announcement, self.publisher.key))
        self.sent += 1

    def settle(self) -> int:
        """Let the sampler read every announcement and handle what is on offer (no episode live); its version."""
        wait_until_read(self.sampler.policy_follower, self.sent)
        for _ in range(10):
            self.sampler._follow_policy(reload_now=True)
        return self.sampler.policy_version

    def holds(self, version: int) -> bool:
        """Whether the sampler's model is exactly the trainer's bf16 cast of `version`."""
        model = self.sampler.policy.state_dict()
        return all(torch.equal(model[name], tensor.bfloat16().float()) for name, tensor in self.state(version).items())


@pytest.fixture
def run(built_sampler, kafka_bootstrap, unique_topic_prefix, tmp_path) -> KafkaRun:
    return KafkaRun(built_sampler, kafka_bootstrap, unique_topic_prefix, tmp_path, snapshot_every=3)


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused policy" in r.getMessage()]


def test_snapshots_and_deltas_come_through_the_weights_topic_bit_identical_and_apply(run, tmp_path):
    published = [run.publish(version) for version in range(1, 5)]  # v1 snapshot, v2 v3 deltas, v4 snapshot
    assert [a.kind for a in published] == ["snapshot", "delta", "delta", "snapshot"]
    snapshot, delta = published[0], published[1]
    assert snapshot.chunks.count > 1 and delta.chunks.count == 1  # a snapshot spans several chunks
    assert delta.chunks.offset == snapshot.chunks.offset + snapshot.chunks.count
    for announcement, path in ((snapshot, run.trainer_dir.weights(1)), (delta, run.trainer_dir.weights_delta(2))):
        fetched = tmp_path / f"fetched-v{announcement.policy_version}"
        run.sampler.weights_source.fetcher.fetch(announcement, fetched, max_bytes=8 << 30)
        assert fetched.read_bytes() == path.read_bytes()  # exactly the bytes the folder transport writes
    assert run.settle() == 4 and run.holds(4)
    run.publish(5)  # a delta on v4, applied in place
    assert run.settle() == 5 and run.holds(5)
    assert run.sampler.weight_sync.resyncs == 0
    assert not run.sampler_dir.policy_dir.exists()
    assert list(run.sampler.weights_source.folder.iterdir()) == []  # each fetched file is gone once applied


@pytest.mark.parametrize("fault", ["corrupted-chunk", "missing-chunks", "over-the-bound", "reordered"])
def test_a_bad_or_absent_version_is_refused_or_waited_on_and_the_sampler_ends_on_the_trainers_weights(
        run, monkeypatch, caplog, tmp_path, fault):
    monkeypatch.setattr(announcements, "MISSING_RETRY_S", 0.0)
    held_back: list[PolicyAnnouncement] = []
    real_announce = publisher_module.announce
    monkeypatch.setattr(publisher_module, "announce", lambda producer, topic, a: held_back.append(a))
    v1 = run.publisher.publish_state(run.state(1), 1, 1)
    v2 = run.publisher.publish_state(run.state(2), 2, 2)
    v3 = run.publisher.publish_state(run.state(3), 3, 3)
    monkeypatch.setattr(publisher_module, "announce", real_announce)
    if fault == "corrupted-chunk":  # v2's chunks carry one flipped byte; its announcement names them
        corrupted = tmp_path / "corrupted"
        data = bytearray(run.trainer_dir.weights_delta(2).read_bytes())
        data[len(data) // 2] ^= 0x01
        corrupted.write_bytes(bytes(data))
        v2 = dataclasses.replace(v2, chunks=run.sender.send(corrupted, 2, v2.sha256))
    elif fault == "missing-chunks":  # announced where its chunks are not (yet): the next ones to be written
        end = v3.chunks.offset + v3.chunks.count
        run.sampler.weights_source.fetcher.timeout_s = 0.3  # each try waits this long for the chunk
        v2 = dataclasses.replace(v2, chunks=ChunkRange(run.weights_topic, 0, end, v2.chunks.count))
    elif fault == "over-the-bound":  # a signed announcement claiming more than max_weights_bytes, and lying chunks
        run.sampler.config.sampler.max_weights_bytes = 2 * v1.num_bytes
        huge = dataclasses.replace(v2, num_bytes=2 * v1.num_bytes + 1)
        liar = WeightsChunk(2, v2.sha256, 0, 1, 0, b"x" * (v2.num_bytes + 1))  # runs past the announced size
        offset = deliver_and_wait(run.producer, run.weights_topic, encode(liar), key="weights").offset()
        v2 = dataclasses.replace(v2, chunks=ChunkRange(run.weights_topic, 0, offset, 1))
        run.send(huge)
    fetched = []
    real_fetch = run.sampler.weights_source.fetcher.fetch
    monkeypatch.setattr(run.sampler.weights_source.fetcher, "fetch",
                        lambda a, *args, **kw: (fetched.append(a.policy_version), real_fetch(a, *args, **kw))[1])
    order = [v1, v3, v2] if fault == "reordered" else [v1, v2, v3]
    for announcement in order:
        run.send(announcement)
        run.settle()
    reasons = {"corrupted-chunk": "(sha256)", "missing-chunks": "(missing)", "over-the-bound": "(chunks)",
               "reordered": "(broken-chain)"}
    assert any(reasons[fault] in line for line in _refusals(caplog)), _refusals(caplog)
    if fault == "over-the-bound":
        assert any("(too-large)" in line for line in _refusals(caplog))  # refused before any chunk was fetched
        assert fetched.count(2) == 1  # the liar's chunk was read once, then refused for good
    if fault == "missing-chunks":
        assert run.sampler.policy_version == 1  # v2 waits; v3, a delta on it, cannot come before
        assert fetched.count(2) >= 2  # tried again, not refused for good
        assert run.sender.send(run.trainer_dir.weights_delta(2), 2, v2.sha256) == v2.chunks  # the chunks arrive
        assert run.settle() == 3 and run.holds(3)
    else:
        assert run.sampler.policy_version == (2 if fault == "reordered" else 1)
    for version in (4, 5):  # the trainer goes on: a snapshot, then a delta
        run.publish(version)
    assert run.settle() == 5 and run.holds(5)


def test_a_sampler_without_a_policy_folder_that_starts_after_version_8_catches_up_from_the_log_alone(
        built_sampler, kafka_bootstrap, unique_topic_prefix, tmp_path, monkeypatch):
    run = KafkaRun(built_sampler, kafka_bootstrap, unique_topic_prefix, tmp_path, snapshot_every=4)
    for version in range(1, 4):  # the sampler follows the first versions as they come
        run.publish(version)
        assert run.settle() == version and run.holds(version)
    for version in range(4, 11):  # v5 and v9 are snapshots, the rest deltas
        run.publish(version)
    shutil.rmtree(run.trainer_dir.policy_dir)  # nothing of the trainer's folder is left to read
    run.start_sampler()  # a sampler that starts now, after v10
    fetched = []
    real_fetch = run.sampler.weights_source.fetcher.fetch
    monkeypatch.setattr(run.sampler.weights_source.fetcher, "fetch",
                        lambda a, *args, **kw: (fetched.append((a.policy_version, a.kind)), real_fetch(a, *args, **kw))[1])
    assert run.settle() == 10 and run.holds(10)
    assert fetched == [(9, "snapshot"), (10, "delta")]  # the newest snapshot and the delta after it


def test_sao_sampler_with_the_kafka_transport_and_no_key_refuses_to_start():
    from typer.testing import CliRunner

    from sao.cli import app

    result = CliRunner().invoke(app, ["sampler", "--bootstrap-servers", "127.0.0.1:1", "--metrics-port", "0",
                                      "--set", "policy.transport=kafka"])
    assert result.exit_code == 2
    assert "no announcement key" in result.output


def test_a_sampler_with_the_kafka_transport_ignores_announcements_not_signed_with_its_key(run, caplog):
    caplog.set_level(logging.WARNING)
    run.publish(1)
    unsigned = dataclasses.replace(run.publish(2), policy_version=3, signature="")  # v2's chunks, claimed as v3
    announcements.announce(run.producer, run.policy_topic, unsigned)
    run.sent += 1
    assert run.settle() == 2 and run.holds(2)
    assert "unsigned" in caplog.text
