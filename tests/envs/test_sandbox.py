"""The code sandbox against hostile programs: each test asserts what really happened on the host."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import textwrap
import uuid
from pathlib import Path

import psutil
import pytest

from sao.config import SandboxConfig
from sao.envs.sandbox import GRACE_S, classify, run_python
from sao.envs.sandbox_launch import UID_BASE

LIMITS = SandboxConfig(cpu_time_s=1, wall_time_s=2, memory_mb=256, max_processes=8, max_file_mb=2, output_chars=500)
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="the uid layer (own uid, NPROC) needs root")
REPO = Path(__file__).resolve().parents[2]


def run(source: str, limits: SandboxConfig = LIMITS):
    return run_python(textwrap.dedent(source), limits)


def sandbox_processes(uid: int | None = None) -> list[psutil.Process]:
    """Live processes of one sandbox uid, or of any sandbox uid."""
    found = []
    for process in psutil.process_iter(["uids"]):
        uids = process.info["uids"]
        if uids and (uids.real == uid if uid is not None else uids.real >= UID_BASE):
            found.append(process)
    return found


@pytest.fixture(scope="module")
def layers() -> tuple[str, ...]:
    return run("pass").isolation


def needs(layers: tuple[str, ...], *names: str) -> None:
    """As root every layer must apply (a missing one fails); otherwise skip when one is missing."""
    missing = [name for name in names if name not in layers]
    if missing and IS_ROOT:
        pytest.fail(f"running as root, yet the sandbox lacks {missing}")
    if missing:
        pytest.skip(f"this host refuses {missing} to non-root users")


def test_passing_and_failing_programs():
    passed = run("print('hello')")
    assert (passed.status, passed.returncode, passed.stdout_tail) == ("passed", 0, "hello\n")
    failed = run("assert 1 + 1 == 3, 'arithmetic is broken'")
    assert failed.status == "failed" and failed.returncode == 1
    assert "AssertionError: arithmetic is broken" in failed.stderr_tail


@needs_root
def test_full_isolation_as_root(layers):
    assert {"netns", "mountns", "pidns", "tmpfs", "uid", "rlimits"} <= set(layers)
    seen = run("import os; print(os.getuid(), os.getpid(), sorted(os.listdir('/root')))")
    uid, pid, home = seen.stdout_tail.split(" ", 2)
    assert int(uid) == seen.uid >= UID_BASE
    if "proc" in layers:
        assert int(pid) == 2  # PID 1 is the sandbox's init; the host's processes are out of sight
    assert home.strip() in ("[]", "['.pyenv']")  # root's home is hidden except the interpreter


def test_infinite_loop_hits_the_cpu_limit():
    result = run("while True: pass")
    assert result.status == "timeout" and result.returncode == -signal.SIGXCPU
    assert result.wall_s < LIMITS.wall_time_s + GRACE_S


def test_ignoring_sigxcpu_gets_sigkill_at_the_hard_limit():
    limits = LIMITS.model_copy(update={"wall_time_s": 4})
    result = run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass", limits)
    assert result.status == "timeout" and result.returncode == -signal.SIGKILL


def test_sleep_hits_the_wall_clock_limit():
    result = run("import time\ntime.sleep(1000)", LIMITS.model_copy(update={"wall_time_s": 1}))
    assert result.status == "timeout" and result.returncode is None
    assert 1 <= result.wall_s < 1 + GRACE_S


@needs_root
def test_fork_bomb_is_contained_and_leaves_nothing(layers):
    needs(layers, "pidns", "uid")
    result = run("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    assert result.status == "timeout" and result.wall_s < LIMITS.wall_time_s + GRACE_S
    assert sandbox_processes(result.uid) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


@needs_root
def test_daemon_that_escapes_its_session_dies_with_the_run(layers):
    needs(layers, "pidns", "uid")
    result = run("""
        import os, time
        ready, announce = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:  # a grandchild in a session of its own: a daemon
                os.write(announce, b"daemon up")
                time.sleep(60)
            os._exit(0)
        os.close(announce)
        print(os.read(ready, 9).decode())
    """)
    assert result.status == "passed" and "daemon up" in result.stdout_tail
    assert result.wall_s < 10  # did not wait for the daemon's sleep
    assert sandbox_processes(result.uid) == []


@pytest.mark.parametrize("allocation", ["b'x' * (4 << 30)", "bytearray(10**10)"])
def test_huge_allocation_is_a_memory_error(allocation):
    result = run(f"data = {allocation}")
    assert result.status == "memory" and result.stderr_tail.strip().endswith("MemoryError")


def test_segfault_is_killed():
    result = run("import ctypes\nctypes.string_at(0)")
    assert result.status == "killed" and result.returncode == -signal.SIGSEGV


def test_writes_outside_the_sandbox_never_reach_the_host(layers, tmp_path):
    needs(layers, "mountns", "tmpfs")
    marker = f"sao-sandbox-test-{uuid.uuid4().hex}"
    targets = [REPO / "should_not_exist.txt", tmp_path / "escape.txt", Path("/tmp") / marker,
               Path("/var/tmp") / marker, Path("/dev/shm") / marker]
    result = run(f"""
        for path in {[str(path) for path in targets]!r}:
            try:
                with open(path, "w") as file:
                    file.write("escaped")
                print("wrote", path)
            except OSError as err:
                print("refused", path, err.strerror)
        with open("scratch.txt", "w") as file:
            file.write("scratch")
        import os
        print("scratch", os.path.abspath("scratch.txt"))
    """)
    assert result.status == "passed", result.stderr_tail
    assert f"wrote /tmp/{marker}" in result.stdout_tail  # the program may use /tmp: its own tmpfs
    scratch = Path(result.stdout_tail.split("scratch ")[-1].strip())
    for path in [*targets, scratch]:
        assert not path.exists(), f"{path} leaked onto the host"


def test_files_larger_than_the_limit_fail():
    result = run("open('big.bin', 'wb').write(b'x' * (3 << 20))")  # max_file_mb=2
    assert result.status == "failed"
    assert "File too large" in result.stderr_tail or "No space left" in result.stderr_tail


def test_endless_output_is_cut_to_a_bounded_tail():
    result = run("while True: print('y' * 1000)")
    assert result.status == "failed"  # its output file hit max_file_mb
    assert len(result.stdout_tail) <= LIMITS.output_chars and set(result.stdout_tail) <= {"y", "\n"}


def test_no_network_even_to_the_hosts_loopback(layers):
    needs(layers, "netns")
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.5)
        port = server.getsockname()[1]
        result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert result.status == "failed" and "OSError" in result.stderr_tail
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever connected


def test_classify_maps_exit_codes_to_statuses():
    assert classify(0, 0.1, "", LIMITS) == "passed"
    assert classify(1, 0.1, "Traceback ...\nMemoryError\n", LIMITS) == "memory"
    assert classify(1, 0.1, "Traceback ...\nValueError: x\n", LIMITS) == "failed"
    assert classify(-signal.SIGXCPU, 1.0, "", LIMITS) == "timeout"
    assert classify(-signal.SIGKILL, 2.0, "", LIMITS) == "timeout"  # past the hard CPU limit
    assert classify(-signal.SIGKILL, 0.1, "", LIMITS) == "killed"
    assert classify(-signal.SIGSEGV, 0.1, "", LIMITS) == "killed"
