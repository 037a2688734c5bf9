"""Where a sampler gets an announced version's file: the trainer's policy folder, or the weights topic.

`policy.transport` picks one. Both offer the same two calls, so the loop reads alike for either:
`check` refuses an announcement on arrival, before anything is read (a refused one never pauses
admission), and `opened` gives a path to the announced file for sao/sampler/weight_sync.py, whose
readers check it (size, sha256, tensors, finite values) exactly as they do for the folder. A file
fetched from Kafka is the sampler's own, in a folder it made, and removed once applied.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sao.config import SaoConfig
from sao.metrics import SAMPLER_WEIGHTS_FETCH_SECONDS
from sao.policy.weights import WeightsMismatch, announced_weights_path
from sao.schema import PolicyAnnouncement
from sao.transport.announcements import ANNOUNCE_KEY_NAME, read_announce_key_file
from sao.transport.kafka import DEFAULT_FETCH_WAIT_MS
from sao.transport.weights import BadChunks, WeightsFetcher


class FolderSource:
    """policy.transport = "folder": the announced file, directly inside the trainer's policy folder."""

    def __init__(self, policy_dir: Path | None):
        self.policy_dir = policy_dir  # None: every announcement is refused (said once)

    def check(self, announcement: PolicyAnnouncement, max_bytes: int) -> None:
        self._path(announcement)

    @contextmanager
    def opened(self, announcement: PolicyAnnouncement, max_bytes: int) -> Iterator[Path]:
        yield self._path(announcement)

    def announce_key(self) -> bytes | None:
        return read_announce_key_file(self.policy_dir / ANNOUNCE_KEY_NAME) if self.policy_dir else None

    def close(self) -> None:
        pass

    def _path(self, announcement: PolicyAnnouncement) -> Path:
        if self.policy_dir is None:
            raise WeightsMismatch("no policy folder is configured (sampler.policy_dir, or `sao sampler --run-dir`), "
                                  "so no announced file can be trusted", "no-policy-dir")
        return announced_weights_path(announcement.weights_path, announcement.policy_version, self.policy_dir,
                                      delta=announcement.kind == "delta")


class KafkaSource:
    """policy.transport = "kafka": the announced file's chunks on the weights topic, fetched into a file of its own."""

    policy_dir = None  # reads no folder but its own

    def __init__(self, bootstrap: str, topic: str, timeout_s: float, fetch_wait_ms: int = DEFAULT_FETCH_WAIT_MS):
        self.fetcher = WeightsFetcher(bootstrap, topic, timeout_s, fetch_wait_ms)
        self.folder = Path(tempfile.mkdtemp(prefix="sao-weights-"))  # mode 0700: this sampler's alone

    def check(self, announcement: PolicyAnnouncement, max_bytes: int) -> None:
        try:
            self.fetcher.check(announcement, max_bytes)
        except BadChunks as err:
            raise WeightsMismatch(str(err), err.reason) from err

    @contextmanager
    def opened(self, announcement: PolicyAnnouncement, max_bytes: int) -> Iterator[Path]:
        """The fetched file (ChunksMissing, a FileNotFoundError, while its chunks are not all there)."""
        path = self.folder / f"{announcement.kind}-v{announcement.policy_version}.safetensors"
        started = time.perf_counter()
        try:
            self.fetcher.fetch(announcement, path, max_bytes)
        except BadChunks as err:
            raise WeightsMismatch(str(err), err.reason) from err
        SAMPLER_WEIGHTS_FETCH_SECONDS.labels(kind=announcement.kind).observe(time.perf_counter() - started)
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        self.fetcher.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def weight_source(config: SaoConfig, bootstrap: str) -> FolderSource | KafkaSource:
    """The source `policy.transport` names."""
    if config.policy.transport.type == "kafka":
        return KafkaSource(bootstrap, config.topics.weights, config.sampler.weights_fetch_timeout_s,
                           config.broker.fetch_wait_ms)
    return FolderSource(Path(config.sampler.policy_dir) if config.sampler.policy_dir else None)


def announce_key_reader(config: SaoConfig, source: FolderSource | KafkaSource):
    """A function giving the run's announcement key (None while there is none): `sampler.announce_key_file` where
    set, else the key beside the weights in the policy folder."""
    if config.sampler.announce_key_file:
        path = Path(config.sampler.announce_key_file)
        return lambda: read_announce_key_file(path)
    return source.announce_key if isinstance(source, FolderSource) else lambda: None
