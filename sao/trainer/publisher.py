"""Publish policy versions: gather ZeRO-3 weights, write safetensors + sha256, announce on Kafka.

Weights go to a directory every sampler can read (local disk for `sao run`, a shared volume or
mount in a cluster); only the small announcement travels through Kafka. The last
`keep_versions` files are kept so a lagging sampler can still load the one it was told about.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import torch

from sao.policy.weights import write_weights
from sao.run_dir import RunDir
from sao.schema import PolicyAnnouncement
from sao.trainer.engine import gather_full_state
from sao.transport.announcements import announce, ensure_announce_key, sign

log = logging.getLogger(__name__)


class PolicyPublisher:
    def __init__(self, producer, topic: str, run_dir: RunDir, keep_versions: int):
        self.producer = producer
        self.topic = topic
        self.run_dir = run_dir
        self.keep_versions = keep_versions
        # Versions kept beyond keep_versions (shadow validation's best and the one it is scoring).
        self.pinned: Callable[[], set[int]] = set
        # Samplers read only announcements signed with the run's key, kept beside the weights (made once per run).
        self.key = ensure_announce_key(run_dir.policy_dir)

    def publish(self, engine, version: int, trainer_step: int) -> PolicyAnnouncement | None:
        """Collective: every rank must call it. Rank 0 writes and announces; others get None."""
        state = gather_full_state(engine)
        if torch.distributed.get_rank() != 0:
            return None
        path = self.run_dir.weights(version)
        # Samplers act with the policy only; the trainer's value head stays in its checkpoints.
        sha256 = write_weights({k: v for k, v in state.items() if not k.startswith("value_head.")}, path)
        announcement = PolicyAnnouncement(policy_version=version, weights_path=str(path.resolve()), sha256=sha256,
                                          num_bytes=path.stat().st_size, trainer_step=trainer_step)
        announcement = sign(announcement, self.key)
        # The same facts next to the file, so `sao eval` can verify a version without Kafka.
        self.run_dir.weights_sidecar(version).write_text(json.dumps(announcement.to_wire()))
        announce(self.producer, self.topic, announcement)
        self._prune(version)
        return announcement

    def _prune(self, newest: int) -> None:
        for old in self.run_dir.kept_versions():
            if old <= newest - self.keep_versions and old not in self.pinned():
                self.run_dir.weights(old).unlink(missing_ok=True)
                self.run_dir.weights_sidecar(old).unlink(missing_ok=True)
