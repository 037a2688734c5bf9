"""The embedded broker: start, health, loopback-only listener, stop, detached mode."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import psutil
import pytest

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
from sao.transport.topics import ensure_topics


def test_tansu_binary_is_an_executable_file() -> None:
    binary = tansu_binary()
    assert binary.is_file() and os.access(binary, os.X_OK)


def test_embedded_broker_answers_then_stops(tmp_path: Path) -> None:
    broker = EmbeddedBroker(log_path=tmp_path / "tansu.log")
    bootstrap = broker.start()
    assert bootstrap == f"127.0.0.1:{broker.port}" == broker.bootstrap_servers
    pid = broker.pid
    assert pid is not None and psutil.pid_exists(pid)
    status = broker_status(bootstrap)
    assert status["reachable"], status
    assert [(b["host"], b["port"]) for b in status["brokers"]] == [("127.0.0.1", broker.port)]

    broker.stop()
    assert broker.pid is None
    assert not psutil.pid_exists(pid)
    assert not broker_status(bootstrap, timeout=1.0)["reachable"]
    assert "listening on: tcp://127.0.0.1" in (tmp_path / "tansu.log").read_text()


def test_embedded_broker_listens_on_loopback_only() -> None:
    with EmbeddedBroker() as broker:
        assert broker.pid is not None
        listeners = [
            conn.laddr
            for conn in psutil.Process(broker.pid).net_connections(kind="inet")
            if conn.status == psutil.CONN_LISTEN
        ]
    assert listeners, "the broker process has no listening socket"
    assert {(addr.ip, addr.port) for addr in listeners} == {("127.0.0.1", broker.port)}


def test_start_fails_clearly_when_the_port_is_taken() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        broker = EmbeddedBroker(port=port)
        with pytest.raises(BrokerUnavailable, match="exited"):
            broker.start(timeout=10)
    assert broker.pid is None


def test_wait_until_ready_names_the_address_when_nothing_listens() -> None:
    bootstrap = f"127.0.0.1:{free_port()}"
    with pytest.raises(BrokerUnavailable, match=bootstrap) as raised:
        wait_until_ready(bootstrap, timeout=1.0)
    assert "sao broker start" in str(raised.value)


def test_detached_broker_round_trip(tmp_path: Path) -> None:
    state = start_detached(tmp_path, free_port())
    try:
        recorded = json.loads((tmp_path / "broker.json").read_text())
        assert recorded["pid"] == state["pid"] and recorded["bootstrap"] == state["bootstrap"]
        assert Path(recorded["log_path"]).is_file()
        # Its own session: a Ctrl-C in the terminal that started it does not reach it.
        assert os.getsid(state["pid"]) != os.getsid(0)

        ensure_topics(state["bootstrap"], {"detached-check": 2})
        status = broker_status(state["bootstrap"])
        assert status["reachable"] and status["topics"] == {"detached-check": 2}

        again = start_detached(tmp_path, free_port())
        assert again["already_running"] and again["pid"] == state["pid"]
    finally:
        stopped = stop_detached(tmp_path)
    assert stopped
    assert not psutil.pid_exists(state["pid"])
    assert not (tmp_path / "broker.json").exists()
    assert not broker_status(state["bootstrap"], timeout=1.0)["reachable"]
    assert stop_detached(tmp_path) is False
