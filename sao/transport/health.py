"""Broker health for a long-running process: is the broker there, is it the same cluster, how long has it been gone.

librdkafka retries a lost broker forever and logs every failed reconnect. A process needs more
than that: to say once, plainly, that the broker is gone (and that it is back), to give up after
`broker.loss_timeout_s` naming what it held, and to notice a broker that came back as a different
cluster - a restarted in-memory broker is one, since sao starts each with a fresh cluster id -
whose log no longer holds what the process was working on.

`BrokerWatch` learns this from a probe thread (a cheap DescribeCluster every few seconds) and from
the error callbacks of the clients it is given; the owner calls `check()` in its loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from sao.metrics import record_broker_up

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors that mean "every broker is unreachable" (all of them) or "a connection failed" (look now).
_ALL_DOWN = KafkaError._ALL_BROKERS_DOWN
_CONNECTION_ERRORS = {KafkaError._TRANSPORT, KafkaError._RESOLVE, KafkaError._TIMED_OUT}


class BrokerGone(RuntimeError):
    """The broker a process depends on is gone; `in_flight` (set by the owner) says what it held."""

    exit_code = 3  # what `sao sampler` / `sao trainer` exit with, so supervisors can tell it from a crash

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.in_flight = ""

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text} In flight when it stopped: {self.in_flight}." if self.in_flight else text


class BrokerLost(BrokerGone):
    """No broker answered for longer than `broker.loss_timeout_s`."""


class BrokerReplaced(BrokerGone):
    """A different cluster answers at the address: the log and offsets the process relied on are not there."""


def ask_cluster_id(admin: AdminClient, timeout: float) -> str | None:
    """The id of the cluster `admin` talks to; raises KafkaException when no broker answers in `timeout` s."""
    try:
        return admin.describe_cluster(request_timeout=timeout).result().cluster_id
    except KafkaException as err:
        if err.args[0].code() != KafkaError._UNSUPPORTED_FEATURE:
            raise
    return admin.list_topics(timeout=timeout).cluster_id  # an old broker: metadata carries the id too


def cluster_id_of(bootstrap: str, timeout: float = 10.0) -> str | None:
    """The cluster id of the broker at `bootstrap`, asked once (None if it has none)."""
    return ask_cluster_id(AdminClient({"bootstrap.servers": bootstrap, "logger": client_log}), timeout)


class _ThrottleReconnectNoise(logging.Filter):
    """Pass a client's FAIL lines (one per failed reconnect, several a second while a broker is down)
    at most once per `interval` seconds; `BrokerWatch` reports the outage itself, once."""

    def __init__(self, interval: float = 30.0) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # confluent-kafka logs as logger.log(level, "%s [%s] %s", facility, client name, text).
        if not (isinstance(args, tuple) and len(args) == 3 and args[0] == "FAIL"):
            return True
        now, client = time.monotonic(), str(args[1])
        if now - self._last.get(client, float("-inf")) < self.interval:
            return False
        self._last[client] = now
        return True


# The logger every sao Kafka client is given (`"logger": client_log`).
client_log = logging.getLogger("sao.transport.client")
client_log.addFilter(_ThrottleReconnectNoise())


class BrokerWatch:
    """Watches one broker (cluster) on behalf of one process named `process`.

    `generation` grows by one each time the broker answers again after an outage, so a producer
    can tell that it should start afresh (`RenewingProducer`).
    """

    def __init__(self, bootstrap: str, process: str, loss_timeout_s: float, probe_interval_s: float = 2.0,
                 probe_timeout_s: float = 3.0) -> None:
        self.bootstrap = bootstrap
        self.process = process
        self.loss_timeout_s = loss_timeout_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.generation = 0
        self._lock = threading.Lock()
        self._last_answer = time.monotonic()
        self._down = False
        self._cluster_id: str | None = None
        self._replaced_by: str | None = None
        self._gave_up = False
        self._admin = AdminClient({"bootstrap.servers": bootstrap, "reconnect.backoff.ms": 100,
                                   "reconnect.backoff.max.ms": 1000, "logger": client_log, "error_cb": self.on_error})
        self._wake = threading.Event()
        self._closed = threading.Event()
        self.probe()  # first contact, synchronous: the cluster this process starts on
        self._thread = threading.Thread(target=self._probe_forever, name=f"broker-watch-{process}", daemon=True)
        self._thread.start()

    # --- what the owner asks ----------------------------------------------------------------

    @property
    def is_up(self) -> bool:
        with self._lock:
            return not self._down

    @property
    def cluster_id(self) -> str | None:
        """The cluster this process started on (None until the broker first answered)."""
        with self._lock:
            return self._cluster_id

    @property
    def gone(self) -> bool:
        """True once `check()` raises: another cluster answers, or none did for `loss_timeout_s`."""
        return self._replaced_by is not None or self.lost_for() > self.loss_timeout_s

    def lost_for(self) -> float:
        """Seconds since the broker last answered, while it does not; 0 while it does."""
        with self._lock:
            return time.monotonic() - self._last_answer if self._down else 0.0

    def check(self) -> None:
        """Raise `BrokerReplaced` or `BrokerLost` if the broker is gone for good; return otherwise."""
        if self._replaced_by is not None:  # set once and never cleared, so read without the lock
            raise BrokerReplaced(
                f"{self.process}: the broker at {self.bootstrap} is now Kafka cluster {self._replaced_by!r}, not "
                f"{self.cluster_id!r}: a broker that restarted without durable storage (the embedded in-memory one "
                "does) or another cluster. The topics, offsets and groups this process worked on are not there, so it "
                "stops instead of going on silently on an empty log. Start the run again, and use durable storage if "
                "a broker restart must not lose the run (docs/reliability.md).")
        lost_for = self.lost_for()
        if lost_for > self.loss_timeout_s:
            with self._lock:
                first = not self._gave_up
                self._gave_up = True
            if first:
                log.error("%s: giving up on the broker at %s after %.0f s without an answer", self.process,
                          self.bootstrap, lost_for)
            raise BrokerLost(
                f"{self.process}: the Kafka broker at {self.bootstrap} has not answered for {lost_for:.0f} s "
                f"(broker.loss_timeout_s = {self.loss_timeout_s:g}), so this process stops. If the broker kept its "
                "log (durable storage), restart the process once the broker is back; with the embedded in-memory "
                "broker the log is gone: start the run again (docs/reliability.md).")

    def expect_cluster(self, cluster_id: str | None, what: str) -> None:
        """Refuse to go on if `what` (e.g. a checkpoint) was made against another cluster than this one."""
        if cluster_id is None:
            return  # recorded before sao tracked clusters
        with self._lock:
            current = self._cluster_id
            if current is None:  # not reachable yet: the first answer is compared with it instead
                self._cluster_id = cluster_id
                return
        if current != cluster_id:
            raise BrokerReplaced(
                f"{self.process}: {what} was taken against Kafka cluster {cluster_id!r}, but the broker at "
                f"{self.bootstrap} is cluster {current!r}. Its offsets point into a log this broker does not hold "
                "(an in-memory broker that restarted, or another cluster), so resuming would silently skip or "
                "repeat data. Resume against the broker that holds the run's log (durable storage, "
                "docs/reliability.md), or start a new run in a new run directory.")

    def retry(self, action: Callable[[], T], what: str) -> T:
        """`action()`, retried with backoff while the broker is away; `check()` bounds the wait.

        A KafkaException while the broker answers is the request's own failure and is raised.
        """
        delay = 0.2
        while True:
            try:
                return action()
            except KafkaException as err:
                self.probe()  # now, not at the next tick: is it the broker or the request?
                self.check()
                if self.is_up:
                    raise
                log.debug("%s: could not %s (%s); retrying while the broker is away", self.process, what, err)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=self.probe_timeout_s + 1)

    # --- what the clients and the probe report ------------------------------------------------

    def on_error(self, error: KafkaError) -> None:
        """librdkafka `error_cb` of the process's clients: every broker down, or a connection failed."""
        if error.code() == _ALL_DOWN:
            self._mark_down(error.str())
        if error.code() == _ALL_DOWN or error.code() in _CONNECTION_ERRORS:
            self._wake.set()  # probe at once rather than at the next tick

    def probe(self) -> None:
        """Ask the broker who it is; note the answer (or its absence)."""
        try:
            cluster_id = ask_cluster_id(self._admin, self.probe_timeout_s)
        except KafkaException as err:
            self._mark_down(err.args[0].str() if err.args else str(err))
            return
        self._mark_up(cluster_id)

    def _probe_forever(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.probe_interval_s)
            self._wake.clear()
            if not self._closed.is_set():
                self.probe()

    def _mark_down(self, reason: str) -> None:
        with self._lock:
            if self._down:
                return
            self._down = True
        record_broker_up(self.bootstrap, False)
        log.warning("%s: the Kafka broker at %s does not answer (%s); retrying for up to %.0f s "
                    "(broker.loss_timeout_s)", self.process, self.bootstrap, reason, self.loss_timeout_s)

    def _mark_up(self, cluster_id: str | None) -> None:
        with self._lock:
            was_down, outage = self._down, time.monotonic() - self._last_answer
            self._down = False
            self._last_answer = time.monotonic()
            if was_down:
                self.generation += 1
            if self._cluster_id is None:  # first contact: the cluster this process works on
                self._cluster_id = cluster_id
            newly_replaced = cluster_id != self._cluster_id and self._replaced_by is None
            if newly_replaced:
                self._replaced_by = cluster_id
            old = self._cluster_id
        record_broker_up(self.bootstrap, True)
        if newly_replaced:
            log.error("%s: the broker at %s answers again, but as Kafka cluster %r instead of %r: a new, empty broker "
                      "(its topics and offsets are not the ones this process used)", self.process, self.bootstrap,
                      cluster_id, old)
        elif was_down:
            log.warning("%s: the Kafka broker at %s answers again after %.1f s (same cluster %r)", self.process,
                        self.bootstrap, outage, cluster_id)
