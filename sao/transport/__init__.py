"""Kafka transport: the embedded broker, topic setup, client factories and the dead-letter queue."""

from sao.transport.broker import (
    BrokerUnavailable,
    EmbeddedBroker,
    broker_status,
    free_port,
    start_detached,
    stop_detached,
    tansu_binary,
    wait_until_ready,
)
from sao.transport.dlq import DeadLetterQueue, describe_dlq_message
from sao.transport.kafka import (
    MAX_MESSAGE_BYTES,
    DeliveryFailed,
    consumer_config,
    deliver_and_wait,
    make_consumer,
    make_producer,
    producer_config,
    read_all,
)
from sao.transport.topics import TopicSetupError, ensure_topics

__all__ = [
    "MAX_MESSAGE_BYTES",
    "BrokerUnavailable",
    "DeadLetterQueue",
    "DeliveryFailed",
    "EmbeddedBroker",
    "TopicSetupError",
    "broker_status",
    "consumer_config",
    "deliver_and_wait",
    "describe_dlq_message",
    "ensure_topics",
    "free_port",
    "make_consumer",
    "make_producer",
    "producer_config",
    "read_all",
    "start_detached",
    "stop_detached",
    "tansu_binary",
    "wait_until_ready",
]
