"""Finished trajectories on their way to the broker: generation goes on while the broker acknowledges.

A sampler hands each finished trajectory to the producer and returns to its other live episodes
at once. The task counts as finished only when the broker acknowledges its trajectory (acks=all),
so its offset is committed only then, and a crash before that redoes the task (the trainer drops
a duplicate by trajectory_id). Blocking on each acknowledgement instead stalled every live episode
of the continuous batch for one broker round trip per finished episode: milliseconds against the
embedded broker, tens of milliseconds against a replicated cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from confluent_kafka import KafkaError, Message

from sao.transport.kafka import DeliveryFailed, RenewingProducer, await_acknowledgements, produce_when_room


class Outbox:
    """Messages to one topic through a RenewingProducer; `on_acked` runs from `poll` once the broker has one."""

    def __init__(self, producer: RenewingProducer, topic: str, enqueue_timeout_s: float = 30) -> None:
        self.producer = producer
        self.topic = topic
        self.enqueue_timeout_s = enqueue_timeout_s
        self.in_flight = 0
        self._failure: DeliveryFailed | None = None

    def send(self, value: bytes, key: str, on_acked: Callable[[float], None]) -> None:
        """Queue `value`; `on_acked(seconds from send to acknowledgement)` runs once it is acknowledged."""
        sent = time.perf_counter()

        def report(error: KafkaError | None, _message: Message) -> None:
            self.in_flight -= 1
            if error is not None:  # after librdkafka's own retries (message.timeout.ms): the task is not finished
                self._failure = self._failure or DeliveryFailed(
                    f"Delivery to topic {self.topic!r} failed: {error.str()}", error)
                return
            on_acked(time.perf_counter() - sent)

        produce_when_room(self.producer, time.monotonic() + self.enqueue_timeout_s, self.topic, value, key,
                          on_delivery=report)
        self.in_flight += 1
        self.producer.poll(0)

    def poll(self) -> None:
        """Serve the acknowledgements that arrived; raise DeliveryFailed if the broker refused a message for good
        (as a blocking send did: the sampler stops, and its unfinished tasks go to another sampler)."""
        self.producer.poll(0)
        if self._failure is not None:
            raise self._failure

    def drain(self, timeout_s: float = 30) -> None:
        """Wait until every queued message is acknowledged (before a sampler stops).

        An outage does not count against `timeout_s`: the producer's watch bounds it
        (`broker.loss_timeout_s`) and raises BrokerLost or BrokerReplaced from here.
        """
        await_acknowledgements(self.producer, lambda: not self.in_flight, time.monotonic() + timeout_s, timeout_s,
                               lambda: f"{self.in_flight} message(s) to topic {self.topic!r} not acknowledged within "
                               f"{timeout_s:.0f} s")
        self.poll()
