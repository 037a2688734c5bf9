"""Create the Kafka topics sao needs, idempotently, and wait until clients can see them."""

from __future__ import annotations

import logging
import re
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ClusterMetadata, NewTopic

from sao.config import SaoConfig
from sao.transport.kafka import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

# Real Kafka rejects records above 1 MiB unless the topic allows more; sao's weight and
# trajectory messages go up to MAX_MESSAGE_BYTES. (Tansu accepts the setting and ignores it.)
DEFAULT_TOPIC_CONFIG = {"max.message.bytes": str(MAX_MESSAGE_BYTES)}


# Kafka's own rule for topic names. Checked here because Tansu accepts any name, and a name
# that works in tests must not fail later on a real cluster.
_LEGAL_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")


class TopicSetupError(RuntimeError):
    """A topic could not be created or did not appear in the broker's metadata."""


def ensure_topics(bootstrap: str, partitions_by_topic: dict[str, int], timeout: float = 15, replication_factor: int = 1,
                  config: dict[str, str] | None = None) -> None:
    """Create each missing topic with its partition count; leave existing topics alone.

    `replication_factor` 1 suits the single embedded broker; a production Kafka wants 3.
    """
    # Tansu creates topics with 0 partitions or any name without complaint; real Kafka refuses.
    for name, partitions in partitions_by_topic.items():
        if not _LEGAL_TOPIC_NAME.fullmatch(name) or name in (".", ".."):
            raise TopicSetupError(f"Topic name {name!r} is not legal in Kafka: use 1-249 of [a-zA-Z0-9._-].")
        if partitions < 1:
            raise TopicSetupError(f"Topic {name!r} needs at least 1 partition, got {partitions}.")
    if replication_factor < 1:
        raise TopicSetupError(f"replication_factor must be at least 1, got {replication_factor}.")
    admin = AdminClient({"bootstrap.servers": bootstrap, "logger": log})
    deadline = time.monotonic() + timeout
    existing = _metadata(admin, bootstrap, timeout).topics
    # Changing the partition count of a live topic remaps keys to partitions, so sao never
    # does it on its own; the operator decides.
    for name, wanted in partitions_by_topic.items():
        if name in existing and len(existing[name].partitions) != wanted:
            log.warning("Topic %s exists with %d partitions, config asks for %d; keeping the existing topic", name,
                        len(existing[name].partitions), wanted)
    missing = [name for name in partitions_by_topic if name not in existing]
    if missing:
        topic_config = DEFAULT_TOPIC_CONFIG if config is None else config
        new_topics = [NewTopic(name, num_partitions=partitions_by_topic[name], replication_factor=replication_factor,
                               config=topic_config) for name in missing]
        for name, future in admin.create_topics(new_topics, request_timeout=timeout).items():
            _check_created(name, future, bootstrap, max(0.1, deadline - time.monotonic()))
    _wait_until_visible(admin, bootstrap, list(partitions_by_topic), deadline)


def _metadata(admin: AdminClient, bootstrap: str, timeout: float) -> ClusterMetadata:
    try:
        return admin.list_topics(timeout=timeout)
    except KafkaException as error:
        raise TopicSetupError(f"Could not read topic metadata from {bootstrap} ({error}); "
                              "is the broker running?") from error


def _check_created(name: str, future: Future[None], bootstrap: str, timeout: float) -> None:
    try:
        future.result(timeout=timeout)
        log.info("Created topic %s", name)
    except KafkaException as error:
        kafka_error: KafkaError = error.args[0]
        if kafka_error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return  # another process created it between our metadata read and create
        raise TopicSetupError(f"Could not create topic {name!r} on {bootstrap}: {kafka_error.str()}") from error
    except FutureTimeout as error:
        raise TopicSetupError(f"Creating topic {name!r} on {bootstrap} got no answer within "
                              f"{timeout:.0f} s.") from error


def _wait_until_visible(admin: AdminClient, bootstrap: str, names: list[str], deadline: float) -> None:
    while True:
        topics = _metadata(admin, bootstrap, max(0.1, deadline - time.monotonic())).topics
        absent = [n for n in names if n not in topics or topics[n].error is not None or not topics[n].partitions]
        if not absent:
            return
        if time.monotonic() > deadline:
            raise TopicSetupError(f"Topics {absent} were created but never appeared in the metadata of {bootstrap}.")
        time.sleep(0.1)


def topic_partitions(config: SaoConfig) -> dict[str, int]:
    """sao's topics and their partition counts, as the config sets them."""
    t = config.topics
    # One policy partition keeps announcements totally ordered.
    return {t.tasks: t.task_partitions, t.trajectories: t.trajectory_partitions, t.policy: 1, t.dlq: 1}
