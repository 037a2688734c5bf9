"""Announcements on the policy topic are untrusted: through the real broker, a sampler with the tiny
policy refuses every unsafe or wrong weights file (logged once, never fatal, never read again) and
goes on to load the next valid version."""

from __future__ import annotations

import builtins
import hashlib
import logging
import os
import threading
import uuid
from pathlib import Path

import pytest
import torch

from sao.policy.weights import WeightsMismatch, read_weights_into, unique_state_dict, write_weights
from sao.run_dir import RunDir
from sao.sampler.loop import Sampler
from sao.sampler.weight_sync import WeightSync
from sao.schema import PolicyAnnouncement, encode
from sao.transport import announcements
from sao.transport.announcements import PolicyFollower, ensure_announce_key, read_announce_key, sign
from sao.transport.kafka import deliver_and_wait, make_producer
from sao.transport.topics import ensure_topics
from support.policy_topic import wait_until_read

HUGE = 2**64 - 1


@pytest.fixture(scope="module")
def built_sampler(kafka_bootstrap, tiny_config):
    """One sampler for the module (building one takes seconds); `reload` below makes it new again."""
    config = tiny_config.model_copy(deep=True)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    config.topics.tasks, config.topics.sampler_group = f"{prefix}.tasks", f"{prefix}-s"
    config.metrics.sampler_port = 0
    config.sampler.precision = "fp32"  # a version's weights land exactly, so each test can tell which loaded
    sampler = Sampler(config, kafka_bootstrap, "s-trust")
    version_0 = {name: tensor.clone() for name, tensor in sampler.policy.state_dict().items()}
    yield sampler, version_0
    sampler.close()


class Reload:
    """The module's sampler as if just started with a fresh policy topic and an empty policy folder."""

    def __init__(self, sampler: Sampler, bootstrap: str, topic: str, policy_dir: Path):
        self.sampler, self.bootstrap, self.topic, self.policy_dir = sampler, bootstrap, topic, policy_dir
        self.producer = make_producer(bootstrap)
        self.sent = 0
        self.key: bytes | None = None  # set: announcements are signed with it (and the follower checks them)

    def weights(self, version: int, state: dict | None = None, path: Path | None = None) -> Path:
        """Write a file (by default the valid one for `version`, its projector bias set to version / 10)."""
        if state is None:
            state = unique_state_dict(self.sampler.policy.state_dict())
            state["projector.bias"] = torch.full_like(state["projector.bias"], version / 10)
        path = path or self.path_of(version)
        write_weights(state, path)
        return path

    def path_of(self, version: int) -> Path:
        return RunDir(self.policy_dir.parent).weights(version)

    def announce(self, version: int, weights_path: Path | str, sha256: str | None = None,
                 num_bytes: int | None = None) -> None:
        """Announce `weights_path` (its real hash and size unless given) and wait until the sampler read it."""
        if sha256 is None:
            sha256 = hashlib.sha256(Path(weights_path).read_bytes()).hexdigest()
        if num_bytes is None:
            num_bytes = os.stat(weights_path).st_size
        announcement = PolicyAnnouncement(version, str(weights_path), sha256, num_bytes, version)
        self.send(encode(sign(announcement, self.key) if self.key else announcement))

    def send(self, value: bytes) -> None:
        deliver_and_wait(self.producer, self.topic, value, key="policy")
        self.sent += 1
        self._wait_until_read()

    def _wait_until_read(self) -> None:
        wait_until_read(self.sampler.policy_follower, self.sent)

    def restart(self) -> None:
        """A new life of the sampler: version 0, a new follower that reads the whole topic again."""
        self.sampler.policy_follower.close()
        self.sampler.policy_follower = PolicyFollower(self.bootstrap, self.topic)
        self.sampler.weight_sync.version, self.sampler.pending = 0, None
        self._wait_until_read()

    def settle(self) -> int:
        """Let the sampler handle everything on offer (no episode live); the version it ends on."""
        for _ in range(10):
            self.sampler._follow_policy(reload_now=True)
        return self.sampler.policy_version

    def loaded_bias(self) -> float:
        return round(float(self.sampler.policy.projector.bias.detach()[0]), 4)


@pytest.fixture
def reload(built_sampler, kafka_bootstrap, unique_topic_prefix, tmp_path) -> Reload:
    sampler, version_0 = built_sampler
    topic = f"{unique_topic_prefix}.policy"
    ensure_topics(kafka_bootstrap, {topic: 1})
    sampler.policy_follower.close()
    sampler.policy_follower = PolicyFollower(kafka_bootstrap, topic, sampler.config.sampler.max_version_jump)
    sampler.policy.load_state_dict(version_0)
    sampler.pending, sampler.counters["refused"] = None, 0
    sampler.weights_source.policy_dir = tmp_path / "run" / "policy"
    sampler.policy_dir.mkdir(parents=True)
    sampler.config.sampler.max_weights_bytes = 8 << 30
    sampler.weight_sync = WeightSync(sampler.policy)  # holds v0
    return Reload(sampler, kafka_bootstrap, topic, sampler.policy_dir)


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused policy" in r.getMessage()]


def _finishes_quickly(call, seconds: float = 20.0) -> None:
    """Run `call` in a thread: a read of /dev/zero or a FIFO would never return."""
    errors: list[BaseException] = []
    worker = threading.Thread(target=lambda: _capture(call, errors), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s"
    if errors:
        raise errors[0]


def _capture(call, errors: list) -> None:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - handed to the test's thread, which re-raises it
        errors.append(err)


def test_a_valid_version_loads(reload):
    reload.announce(1, reload.weights(1))
    assert reload.settle() == 1 and reload.loaded_bias() == 0.1


def test_a_path_outside_the_policy_folder_is_neither_opened_nor_hashed(reload, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    passwd = Path("/etc/passwd").read_bytes()
    passwd_sha = hashlib.sha256(passwd).hexdigest()
    opened = []
    for module, name in ((os, "open"), (builtins, "open")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda path, *a, _real=real, **k: (opened.append(str(path)),
                                                                              _real(path, *a, **k))[1])
    # A wrong hash (the old code logged the file's real one), then the right one (it would have parsed the file).
    reload.send(encode(PolicyAnnouncement(1, "/etc/passwd", "0" * 64, len(passwd), 1)))
    reload.send(encode(PolicyAnnouncement(2, "/etc/passwd", passwd_sha, len(passwd), 2)))

    assert reload.settle() == 0
    assert "/etc/passwd" not in opened
    assert passwd_sha not in caplog.text
    refusals = _refusals(caplog)
    assert len(refusals) == 2 and all("outside-folder" in line and "outside the policy folder" in line
                                      for line in refusals)
    monkeypatch.undo()
    reload.announce(3, reload.weights(3))  # the sampler goes on to the next valid version
    assert reload.settle() == 3


def test_a_symlink_from_inside_the_folder_to_a_valid_file_outside_is_refused(reload, caplog, tmp_path):
    outside = reload.weights(1, path=tmp_path / "elsewhere" / "policy-v000001.safetensors")  # a perfect file
    reload.path_of(1).symlink_to(outside)
    reload.announce(1, reload.path_of(1))
    assert reload.settle() == 0
    assert "outside-folder" in _refusals(caplog)[0]


@pytest.mark.parametrize("make", ["directory", "fifo"])
def test_a_directory_or_a_fifo_is_refused_at_once(reload, caplog, make):
    path = reload.path_of(1)
    path.mkdir() if make == "directory" else os.mkfifo(path)
    reload.send(encode(PolicyAnnouncement(1, str(path), "ab" * 32, 1000, 1)))
    _finishes_quickly(reload.settle)
    assert reload.sampler.policy_version == 0
    assert "not-a-file" in _refusals(caplog)[0]
    reload.announce(2, reload.weights(2))
    assert reload.settle() == 2  # and the sampler is not stuck on it


def test_dev_zero_is_refused_at_once_as_announced_linked_to_or_read_directly(reload, caplog, built_sampler):
    reload.send(encode(PolicyAnnouncement(1, "/dev/zero", "ab" * 32, 1000, 1)))
    reload.path_of(2).symlink_to("/dev/zero")
    reload.send(encode(PolicyAnnouncement(2, str(reload.path_of(2)), "ab" * 32, 1000, 2)))
    _finishes_quickly(reload.settle)
    assert reload.sampler.policy_version == 0
    assert [line.count("outside-folder") for line in _refusals(caplog)] == [1, 1]
    # Even where no folder confines the path (`sao eval` reads its own run's files), a device is not read.
    with pytest.raises(WeightsMismatch, match="character device"):
        _finishes_quickly(lambda: read_weights_into(reload.sampler.policy, "/dev/zero", "ab" * 32))


def test_the_hash_is_checked_before_the_file_is_parsed(reload, caplog, monkeypatch):
    from sao.policy import weights

    parsed = []
    real_open = weights.safe_open
    monkeypatch.setattr(weights, "safe_open", lambda *a, **k: (parsed.append(a[0]), real_open(*a, **k))[1])
    reload.announce(1, reload.weights(1), sha256="ab" * 32)
    assert reload.settle() == 0 and parsed == []
    assert "(sha256)" in _refusals(caplog)[0]
    reload.announce(2, reload.weights(2))
    assert reload.settle() == 2 and len(parsed) == 1


def test_a_file_with_the_right_hash_but_not_safetensors_is_refused(reload, caplog):
    path = reload.path_of(1)
    path.write_bytes(b"#!/bin/sh\necho this is not a weights file\n" * 100)
    reload.announce(1, path)
    assert reload.settle() == 0
    assert "(format)" in _refusals(caplog)[0]


def test_a_file_with_the_right_hash_but_a_wrong_tensor_shape_is_refused_before_loading(reload, caplog):
    state = unique_state_dict(reload.sampler.policy.state_dict())
    state["projector.bias"] = torch.full((state["projector.bias"].numel() + 1,), 7.0)
    reload.announce(1, reload.weights(1, state))
    state = unique_state_dict(reload.sampler.policy.state_dict())
    del state["projector.weight"]
    state["projector.bias"] = torch.full_like(state["projector.bias"], 7.0)
    reload.announce(2, reload.weights(2, state))

    assert reload.settle() == 0 and reload.loaded_bias() == 0.0  # nothing of either file was loaded
    shape, missing = _refusals(caplog)[-2:][::-1]  # newest first: v2 is tried before v1
    assert "(tensors)" in shape and "projector.bias has shape" in shape
    assert "(tensors)" in missing and "missing projector.weight" in missing


def test_sizes_are_bounded_before_anything_is_read(reload, caplog, monkeypatch):
    from sao.policy import weights

    hashed = []
    real_hash = weights._sha256_of_open_file
    monkeypatch.setattr(weights, "_sha256_of_open_file", lambda fd, size, path: (hashed.append(path),
                                                                                 real_hash(fd, size, path))[1])
    path = reload.weights(1)
    size = path.stat().st_size
    reload.announce(1, path, num_bytes=size + 1)  # not the file's size
    assert reload.settle() == 0
    reload.sampler.config.sampler.max_weights_bytes = size - 1
    reload.announce(2, reload.weights(2))  # announced honestly: over the bound
    reload.announce(3, reload.weights(3), num_bytes=size - 1)  # under the bound by its announcement only
    assert reload.settle() == 0
    assert hashed == []
    reasons = [line.split("(")[1].split(")")[0] for line in _refusals(caplog)]
    assert reasons == ["size", "too-large", "too-large"]
    v3, v2 = _refusals(caplog)[1:]  # newest first; v3 is caught by the file's size, v2 by its announcement
    assert "announced size" not in v3 and "announced size" in v2


def test_a_huge_version_is_refused_and_the_next_valid_version_still_loads(reload, caplog):
    reload.announce(1, reload.weights(1))
    assert reload.settle() == 1
    reload.send(encode(PolicyAnnouncement(HUGE, str(reload.path_of(1)), "ab" * 32, 1000, 2)))
    reload.announce(2, reload.weights(2))
    assert reload.settle() == 2 and reload.loaded_bias() == 0.2


def test_a_refused_version_is_read_once_and_does_not_shadow_lower_ones(reload, caplog):
    """v500 is plausible but its file is missing; v2, announced after it, is loaded all the same."""
    reload.announce(1, reload.weights(1))
    reload.send(encode(PolicyAnnouncement(500, str(reload.path_of(500)), "ab" * 32, 1000, 500)))
    reload.announce(2, reload.weights(2))
    assert reload.settle() == 2
    reload.send(encode(PolicyAnnouncement(500, str(reload.path_of(500)), "ab" * 32, 1000, 500)))  # again
    assert reload.settle() == 2
    assert len(_refusals(caplog)) == 1 and "(missing)" in _refusals(caplog)[0]


def test_a_version_named_after_another_file_is_refused(reload, caplog):
    """Relabelling v1's (valid, hashed) file as v900 would hide v2..v899 behind it."""
    reload.announce(900, reload.weights(1))
    reload.announce(2, reload.weights(2))
    assert reload.settle() == 2
    assert "(wrong-name)" in _refusals(caplog)[0]


def test_a_restarted_sampler_meets_the_same_bad_announcements_without_failing(reload):
    reload.announce(1, "/etc/passwd")
    reload.send(b"\xc1 not msgpack")
    reload.send(encode(PolicyAnnouncement(HUGE, "/dev/zero", "ab" * 32, 1000, 2)))
    reload.path_of(3).mkdir()
    reload.announce(4, reload.weights(4))
    reload.send(encode(PolicyAnnouncement(3, str(reload.path_of(3)), "ab" * 32, 1000, 3)))
    for _ in range(2):  # the first life, then a restart that reads the topic from the beginning
        reload.restart()
        assert reload.settle() == 4


def test_without_a_policy_folder_every_version_is_refused_and_it_is_said_once(reload, caplog):
    reload.sampler.weights_source.policy_dir = None
    reload.announce(1, reload.weights(1))
    reload.announce(2, reload.weights(2))
    assert reload.settle() == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "refused" in r.getMessage()]
    assert len(warnings) == 1 and "no-policy-dir" in warnings[0] and "every later version" in warnings[0]
    assert reload.sampler.counters["refused"] == 2


def test_sao_sampler_without_a_policy_folder_refuses_to_start():
    from typer.testing import CliRunner

    from sao.cli import app

    result = CliRunner().invoke(app, ["sampler", "--bootstrap-servers", "127.0.0.1:1", "--metrics-port", "0"])
    assert result.exit_code == 2
    assert "no policy folder" in result.output


# --- issue 27: announcements are signed, and version order cannot be starved ------------------------

@pytest.fixture
def signed(reload) -> Reload:
    """`reload` as a real sampler reads: the trainer's key beside the weights, only signed announcements read."""
    sampler = reload.sampler
    reload.key = ensure_announce_key(reload.policy_dir)
    sampler.policy_follower.close()
    sampler.policy_follower = PolicyFollower(reload.bootstrap, reload.topic, sampler.config.sampler.max_version_jump,
                                             key=lambda: read_announce_key(sampler.policy_dir))
    sampler.missing_refused, sampler.behind = set(), False
    return reload


def _ignored(reason: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("sao_transport_announcements_refused_total", {"reason": reason}) or 0.0


def test_the_trainer_makes_one_private_key_per_run(tmp_path):
    policy_dir = tmp_path / "run" / "policy"
    key = ensure_announce_key(policy_dir)
    assert ensure_announce_key(policy_dir) == key == read_announce_key(policy_dir)  # made once, then read
    assert (policy_dir / ".announce-key").stat().st_mode & 0o777 == 0o600
    assert RunDir(policy_dir.parent).kept_versions() == []  # not mistaken for a weights file
    assert ensure_announce_key(tmp_path / "other" / "policy") != key


def test_unsigned_and_mis_signed_announcements_are_ignored_and_counted(signed, caplog):
    before = {reason: _ignored(reason) for reason in ("unsigned", "bad-signature")}
    key = signed.key
    signed.key = None
    signed.announce(1, signed.weights(1))  # a valid file, announced without a signature
    signed.key = b"0" * 64
    signed.announce(2, signed.weights(2))  # signed with another key
    signed.key = key
    assert signed.settle() == 0 and signed.sampler.policy_follower.newest_read is None
    assert {reason: _ignored(reason) - before[reason] for reason in before} == {"unsigned": 1, "bad-signature": 1}
    assert "ignoring policy announcement v1" in caplog.text and "bad-signature" in caplog.text
    signed.announce(3, signed.weights(3))
    assert signed.settle() == 3 and signed.loaded_bias() == 0.3


def test_future_versions_announced_without_files_cannot_hide_the_real_ones(signed, caplog):
    """Issue 27's livelock: 20 announcements of future versions whose files did not exist (right names, zero
    sha256) were refused as missing and their versions never offered again, so the real ones published later were
    ignored for good and the trainer dead-lettered everything after as too-stale."""
    signed.announce(1, signed.weights(1))
    assert signed.settle() == 1
    for version in range(2, 22):
        signed.announce(version, signed.path_of(version), sha256="0" * 64, num_bytes=1000)
    assert signed.settle() == 1
    for version in range(2, 13):  # the trainer publishes the real v2..v12
        signed.announce(version, signed.weights(version))
    assert signed.settle() == 12 and signed.loaded_bias() == 1.2
    missing = [line for line in _refusals(caplog) if "(missing)" in line]
    assert len(missing) == len(set(missing))  # each missing version said once, however often it is retried


def test_a_version_whose_file_was_missing_loads_once_the_file_is_there(signed, monkeypatch):
    monkeypatch.setattr(announcements, "MISSING_RETRY_S", 0.0)
    path = signed.weights(1)
    sha, size = hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size
    hidden = path.rename(path.with_name("not-yet"))
    signed.announce(1, signed.path_of(1), sha256=sha, num_bytes=size)  # a shared mount that lags behind
    assert signed.settle() == 0
    hidden.rename(path)
    assert signed.settle() == 1 and signed.loaded_bias() == 0.1


def test_a_sampler_far_behind_the_newest_announced_version_says_so(signed, caplog):
    from prometheus_client import REGISTRY

    limit = signed.sampler.config.trainer.max_staleness
    for version in range(1, limit + 3):
        signed.announce(version, signed.path_of(version), sha256="0" * 64, num_bytes=1000)  # none loadable
    assert signed.settle() == 0
    behind = [r for r in caplog.records if r.levelno == logging.ERROR and "versions behind" in r.getMessage()]
    assert len(behind) == 1 and "trainer.max_staleness" in behind[0].getMessage()
    assert REGISTRY.get_sample_value("sao_sampler_versions_behind", {"sampler": "s-trust"}) == limit + 2
    signed.announce(limit + 3, signed.weights(limit + 3))
    assert signed.settle() == limit + 3
    assert REGISTRY.get_sample_value("sao_sampler_versions_behind", {"sampler": "s-trust"}) == 0


def _forged_delta(path: Path, fault: str) -> None:
    """Rewrite the delta file at `path` with one position out of range or one value not finite."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    name = next(key for key in sorted(tensors) if key.endswith("/values"))[:-len("/values")]
    if fault == "out-of-range":
        beyond = torch.tensor([0xFF, 0xFF, 0x7F], dtype=torch.uint8)  # a last gap of 2^21 - 1
        tensors[name + "/gaps"] = torch.cat([tensors[name + "/gaps"][:-1], beyond])
    else:
        tensors[name + "/values"][0] = float("nan")
    path.unlink()
    write_weights(tensors, path)


@pytest.mark.parametrize("fault", ["flipped-byte", "wrong-base-sha256", "out-of-range", "non-finite", "reordered"])
def test_a_bad_delta_is_refused_and_the_sampler_resyncs_to_the_trainers_weights(reload, monkeypatch, caplog, fault):
    import dataclasses

    from sao.trainer import publisher as publisher_module
    from sao.trainer.publisher import PolicyPublisher

    run_dir = RunDir(reload.policy_dir.parent)
    published = []
    monkeypatch.setattr(publisher_module, "announce", lambda _producer, _topic, a: published.append(a))
    publisher = PolicyPublisher(None, "policy", run_dir, 100, "bf16", deltas=True, snapshot_every=3)
    base = unique_state_dict(reload.sampler.policy.state_dict())
    states = []
    for version in range(1, 6):  # v1 snapshot, v2 v3 deltas, v4 snapshot, v5 delta
        state = {name: tensor.clone() for name, tensor in base.items()}
        for tensor in state.values():
            tensor.view(-1)[version::97] += 0.01 * version
        states.append(state)
        publisher.publish_state({name: tensor.clone() for name, tensor in state.items()}, version, version)
    assert [a.kind for a in published] == ["snapshot", "delta", "delta", "snapshot", "delta"]
    v1, v2, v3, v4, v5 = published
    if fault == "flipped-byte":
        data = bytearray(run_dir.weights_delta(2).read_bytes())
        data[-1] ^= 0x01
        run_dir.weights_delta(2).write_bytes(bytes(data))
    elif fault == "wrong-base-sha256":
        v2 = dataclasses.replace(v2, base_sha256="0" * 64)
    elif fault in ("out-of-range", "non-finite"):
        _forged_delta(run_dir.weights_delta(2), fault)
        path = run_dir.weights_delta(2)
        v2 = dataclasses.replace(v2, sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                                 num_bytes=path.stat().st_size)
    order = [v1, v3, v2, v4, v5] if fault == "reordered" else [v1, v2, v3, v4, v5]
    for announcement in order[:3]:
        reload.send(encode(announcement))
        reload.settle()
    reasons = {"flipped-byte": "sha256", "wrong-base-sha256": "base-sha256", "out-of-range": "positions",
               "non-finite": "non-finite", "reordered": "broken-chain"}
    assert any(f"({reasons[fault]})" in message for message in _refusals(caplog)), _refusals(caplog)
    assert reload.sampler.policy_version == (2 if fault == "reordered" else 1)
    if fault == "wrong-base-sha256":
        assert reload.sampler.weight_sync.resyncs == 1  # dropped what it held once, then refused the delta
    for announcement in order[3:]:
        reload.send(encode(announcement))
    assert reload.settle() == 5
    model = reload.sampler.policy.state_dict()
    for name, tensor in states[-1].items():
        assert torch.equal(model[name], tensor.bfloat16().float()), name
