"""Publish policy versions: gather the weights (ZeRO-3's partitions), write safetensors + sha256, announce on Kafka.

Weights go to the trainer's policy folder. With `policy.transport = "folder"` samplers read them
there (local disk for `sao run`, a shared volume or mount in a cluster) and only the small
announcement travels through Kafka; with "kafka" each file also travels in chunks on the weights
topic (sao/transport/weights.py) before its announcement, which names where. A LoRA run
(`trainer.lora.rank` > 0) publishes only its adapters and projector (sao/policy/lora.py). Each version is written
whole in `trainer.publish_dtype`, or with `trainer.publish_deltas` as a sparse delta on the
version before (sao/policy/deltas.py) with a whole snapshot every `trainer.snapshot_every`
versions, first in each trainer's life, and whenever the delta would be over half a whole
file. A delta is always against what this publisher last
published, so a version republished after a rollback chains like any other. The last
`keep_versions` versions are kept, with the files their deltas rest on, so a lagging sampler can
still load the one it was told about.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import torch

from sao import metrics
from sao.config import KafkaTransport, SaoConfig
from sao.policy.chain import chain_versions
from sao.policy.deltas import (
    DELTA_MAX_SNAPSHOT_SHARE,
    PUBLISH_DTYPES,
    cast_state,
    encode_delta,
    state_sha256,
    tensor_bytes,
    tensor_sha256s,
)
from sao.policy.weights import write_weights
from sao.run_dir import RunDir
from sao.schema import PolicyAnnouncement
from sao.trainer.engine import gather_adapter_state, gather_full_state
from sao.transport.announcements import announce, ensure_announce_key, sign
from sao.transport.weights import WeightsSender

log = logging.getLogger(__name__)


def policy_state(engine, lora: bool) -> dict[str, torch.Tensor]:
    """Collective: what a version publishes, gathered in fp32 on CPU: the whole policy, or with `lora` its adapters
    and projector. Samplers act with the policy only; the trainer's value head stays in its checkpoints."""
    state = gather_adapter_state(engine) if lora else gather_full_state(engine)
    return {name: tensor for name, tensor in state.items() if not name.startswith("value_head.")}


class PolicyPublisher:
    def __init__(self, producer, topic: str, run_dir: RunDir, keep_versions: int, publish_dtype: str = "fp32",
                 deltas: bool = False, snapshot_every: int = 1, weights: WeightsSender | None = None,
                 max_delta_share: float = DELTA_MAX_SNAPSHOT_SHARE, lora: bool = False):
        self.producer = producer
        self.weights = weights  # policy.transport = "kafka": every file travels in chunks before its announcement
        self.topic = topic
        self.run_dir = run_dir
        self.keep_versions = keep_versions
        self.dtype = PUBLISH_DTYPES[publish_dtype]
        self.deltas = deltas
        self.snapshot_every = snapshot_every
        self.max_delta_share = max_delta_share
        self.content = "lora" if lora else "full"  # lora: only the adapters and the projector are published
        # The last published state (publish dtype), its version, hash, and the version of the snapshot it rests on.
        self.previous: dict[str, torch.Tensor] | None = None
        self.previous_version = self.previous_sha256 = self.snapshot_version = None
        # With `hash_states` (the trajectory log is kept) every version's state is hashed, whole files too: the
        # last one's hash and its tensors' hashes, for the log (sao/trainer/archive.py).
        self.hash_states = False
        self.last_state_sha256: str = ""
        self.last_tensor_sha256: dict[str, bytes] | None = None
        # Versions kept beyond keep_versions (shadow validation's best and the one it is scoring).
        self.pinned: Callable[[], set[int]] = set
        # Samplers read only announcements signed with the run's key, kept beside the weights (made once per run).
        self.key = ensure_announce_key(run_dir.policy_dir)

    @classmethod
    def for_trainer(cls, config: SaoConfig, producer, bootstrap: str, run_dir: RunDir) -> PolicyPublisher:
        """The trainer's publisher as `trainer.*` and `policy.transport` say (`producer` None off rank 0)."""
        cfg = config.trainer
        weights = None
        if isinstance(transport := config.policy.transport, KafkaTransport) and producer is not None:
            weights = WeightsSender(producer, bootstrap, config.topics.weights, transport.chunk_bytes,
                                    chain_length=cfg.snapshot_every if cfg.publish_deltas else 1)
        publisher = cls(producer, config.topics.policy, run_dir, cfg.keep_versions, cfg.publish_dtype,
                        cfg.publish_deltas, cfg.snapshot_every, weights, lora=cfg.lora.rank > 0)
        publisher.hash_states = cfg.keep_trajectory_log  # the trajectory log records every version's hashes
        return publisher

    def publish(self, engine, version: int, trainer_step: int) -> PolicyAnnouncement | None:
        """Collective: every rank must call it. Rank 0 writes and announces; others get None."""
        state = policy_state(engine, self.content == "lora")
        if torch.distributed.get_rank() != 0:
            return None
        return self.publish_state(state, version, trainer_step)

    def publish_state(self, state: dict[str, torch.Tensor], version: int, trainer_step: int) -> PolicyAnnouncement:
        """Write `state` (one tensor per storage) as `version`, announce it, prune what no kept version needs.

        With deltas the publisher keeps `state`'s tensors as the next delta's base: nobody may change them.
        """
        announcement = self.write_version(state, version, trainer_step)
        announce(self.producer, self.topic, announcement)
        metrics.TRAINER_POLICY_BYTES.labels(kind=announcement.kind).observe(announcement.num_bytes)
        self._prune(version)
        return announcement

    def write_version(self, state: dict[str, torch.Tensor], version: int, trainer_step: int) -> PolicyAnnouncement:
        """Write `version`'s file (whole or a delta) and its sidecar, and with the Kafka transport send the file's
        chunks; the signed announcement, not yet sent."""
        published = cast_state(state, self.dtype)
        facts = self._write(published, version)
        path = self.run_dir.weights_delta(version) if facts.get("kind") == "delta" else self.run_dir.weights(version)
        if self.weights is not None:
            started = time.perf_counter()
            facts["chunks"] = self.weights.send(path, version, facts["sha256"])
            metrics.TRAINER_WEIGHTS_SEND_SECONDS.observe(time.perf_counter() - started)
        announcement = PolicyAnnouncement(policy_version=version, weights_path=str(path.resolve()),
                                          num_bytes=path.stat().st_size, trainer_step=trainer_step,
                                          content=self.content, **facts)
        announcement = sign(announcement, self.key)
        # The same facts next to the file, so `sao eval` can verify a version without Kafka.
        self.run_dir.weights_sidecar(version).write_text(json.dumps(announcement.to_wire()))
        return announcement

    def _write(self, published: dict[str, torch.Tensor], version: int) -> dict:
        """Write `version`'s file; the announcement's facts about it (sha256, and with deltas the chain's)."""
        self.last_tensor_sha256 = tensor_sha256s(published) if self.deltas or self.hash_states else None
        self.last_state_sha256 = state_sha256(published, self.last_tensor_sha256) if self.last_tensor_sha256 else ""
        if not self.deltas:
            return {"sha256": write_weights(published, self.run_dir.weights(version))}
        result_sha256 = self.last_state_sha256
        delta = None
        if self.previous is not None and version - self.snapshot_version < self.snapshot_every:
            # None when most values changed: a whole file is then as small and cheaper to write and apply.
            delta = encode_delta(self.previous, published, max_bytes=self.max_delta_share * tensor_bytes(published))
        if delta is None:
            facts = {"sha256": write_weights(published, self.run_dir.weights(version)), "state_sha256": result_sha256}
            self.snapshot_version = version
        else:
            facts = {"sha256": write_weights(delta, self.run_dir.weights_delta(version)),
                     "kind": "delta", "base_version": self.previous_version, "base_sha256": self.previous_sha256,
                     "state_sha256": result_sha256}
        self.previous, self.previous_version, self.previous_sha256 = published, version, result_sha256
        return facts

    def _prune(self, newest: int) -> None:
        """Drop every version older than keep_versions and not pinned, unless a kept version's chain needs it."""
        on_disk = self.run_dir.kept_versions()
        needed: set[int] = set()
        for version in on_disk:
            if version > newest - self.keep_versions or version in self.pinned():
                needed |= chain_versions(self.run_dir, version)
        for old in on_disk:
            if old not in needed:
                self.run_dir.weights(old).unlink(missing_ok=True)
                self.run_dir.weights_delta(old).unlink(missing_ok=True)
                self.run_dir.weights_sidecar(old).unlink(missing_ok=True)
