"""Publish policy versions: gather ZeRO-3 weights, write safetensors + sha256, announce on Kafka.

Weights go to a directory every sampler can read (local disk for `sao run`, a shared volume or
mount in a cluster); only the small announcement travels through Kafka. The last
`keep_versions` files are kept so a lagging sampler can still load the one it was told about.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from sao.policy.weights import write_weights
from sao.schema import PolicyAnnouncement, encode
from sao.trainer.engine import gather_full_state
from sao.transport.kafka import deliver_and_wait

log = logging.getLogger(__name__)


class PolicyPublisher:
    def __init__(self, producer, topic: str, weights_dir: Path, keep_versions: int):
        self.producer = producer
        self.topic = topic
        self.weights_dir = weights_dir
        self.keep_versions = keep_versions

    def publish(self, engine, version: int, trainer_step: int) -> PolicyAnnouncement | None:
        """Collective: every rank must call it. Rank 0 writes and announces; others get None."""
        state = gather_full_state(engine)
        if torch.distributed.get_rank() != 0:
            return None
        path = self.weights_dir / f"policy-v{version:06d}.safetensors"
        # Samplers act with the policy only; the trainer's value head stays in its checkpoints.
        sha256 = write_weights({k: v for k, v in state.items() if not k.startswith("value_head.")}, path)
        announcement = PolicyAnnouncement(version=version, weights_path=str(path.resolve()), sha256=sha256,
                                          num_bytes=path.stat().st_size, trainer_step=trainer_step)
        # The same facts next to the file, so `sao eval` can verify a version without Kafka.
        path.with_suffix(".json").write_text(json.dumps(announcement.to_wire()))
        deliver_and_wait(self.producer, self.topic, encode(announcement), key="policy")
        self._prune(version)
        return announcement

    def _prune(self, newest: int) -> None:
        for old in self.weights_dir.glob("policy-v*.safetensors"):
            if int(old.stem.split("-v")[1]) <= newest - self.keep_versions:
                old.unlink(missing_ok=True)
                old.with_suffix(".json").unlink(missing_ok=True)
