"""Export a consumer's lag per assigned partition as `sao_transport_consumer_lag`.

Lag = the partition's high watermark minus the consumer's position (next offset it will read).
On Apache Kafka this is the standard figure. The embedded Tansu broker reports wrong high
watermarks (see docs/design.md), so on it the gauge is exported but not meaningful; nothing in
sao acts on it, it is only watched (dashboard, `SaoConsumerLagGrowing` alert).
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import Consumer, KafkaException, TopicPartition

from sao.metrics import TRANSPORT_CONSUMER_LAG

log = logging.getLogger(__name__)


class LagReporter:
    """Call `maybe_report()` from the consumer's own thread; it asks the broker every `interval_s`."""

    def __init__(self, consumer: Consumer, group: str, interval_s: float = 5.0):
        self.consumer = consumer
        self.group = group
        self.interval_s = interval_s
        self._next_report = time.monotonic() + interval_s
        self._reported: set[tuple[str, int]] = set()

    def maybe_report(self) -> None:
        # Until the first report, try on every call: the group assigns partitions only after a join.
        if self._reported and time.monotonic() < self._next_report:
            return
        self._next_report = time.monotonic() + self.interval_s
        try:
            self.report()
        except KafkaException as err:
            # A watermark query can time out during a rebalance; the next interval tries again.
            log.debug("consumer lag of group %s not updated: %s", self.group, err)

    def report(self) -> dict[tuple[str, int], int]:
        """Query watermarks now; set and return the lag of every assigned partition."""
        assignment = self.consumer.assignment()
        lags: dict[tuple[str, int], int] = {}
        for tp in self.consumer.position(assignment) if assignment else []:
            low, high = self.consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=1.0)
            # Before its first message a consumer's position is a logical offset (< 0); count from the
            # log start then (an overestimate for a group with committed offsets, until it reads).
            position = tp.offset if tp.offset >= 0 else low
            lags[(tp.topic, tp.partition)] = lag = max(0, high - position)
            TRANSPORT_CONSUMER_LAG.labels(group=self.group, topic=tp.topic, partition=str(tp.partition)).set(lag)
        for topic, partition in self._reported - lags.keys():  # moved to another member in a rebalance
            TRANSPORT_CONSUMER_LAG.remove(self.group, topic, str(partition))
        self._reported = set(lags)
        return lags
