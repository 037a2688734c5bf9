"""The code sandbox against hostile programs: each test asserts what really happened on the host."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psutil
import pytest

from sao.config import SandboxConfig
from sao.envs import sandbox_cgroup
from sao.envs.guard import EnvFailure, call_env
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
    assert {"netns", "mountns", "pidns", "ipcns", "newroot", "tmpfs", "uid", "rlimits"} <= set(layers)
    seen = run("import os; print(os.getuid(), os.getpid(), sorted(os.listdir('/root')))")
    uid, pid, home = seen.stdout_tail.split(" ", 2)
    assert int(uid) == seen.uid >= UID_BASE
    if "proc" in layers:
        assert int(pid) == 2  # PID 1 is the sandbox's init; the host's processes are out of sight
    assert home.strip() in ("[]", "['.pyenv']")  # root's home is hidden except the interpreter


@pytest.mark.slow
def test_infinite_loop_hits_the_cpu_limit():
    result = run("while True: pass")
    assert result.status == "timeout" and result.returncode == -signal.SIGXCPU
    assert result.wall_s < LIMITS.wall_time_s + GRACE_S


@pytest.mark.slow
def test_ignoring_sigxcpu_gets_sigkill_at_the_hard_limit():
    # The wall limit only has to come after ~2 s of CPU: on cores shared with other jobs that takes longer.
    limits = LIMITS.model_copy(update={"wall_time_s": 30})
    result = run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass", limits)
    assert result.status == "timeout" and result.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_sleep_hits_the_wall_clock_limit():
    result = run("import time\ntime.sleep(1000)", LIMITS.model_copy(update={"wall_time_s": 1}))
    assert result.status == "timeout" and result.returncode is None
    assert 1 <= result.wall_s < 1 + GRACE_S


@pytest.mark.slow
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


def test_sysv_shared_memory_stays_in_the_sandbox(layers):
    needs(layers, "ipcns")
    key = 0x5A000000 | secrets.randbelow(1 << 24)
    result = run(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        IPC_CREAT = 0o1000
        print(libc.shmget({key}, 1 << 20, IPC_CREAT | 0o600))  # never removed: it would outlive the run
    """)
    assert result.status == "passed" and int(result.stdout_tail) >= 0, result.stderr_tail  # it was made, inside
    host_keys = [int(line.split()[0]) for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    assert key not in host_keys


def _listening_socket(directory: Path, name: str):
    """Yields (server, path) of a UNIX socket anyone on the host may connect to; removes it and `directory` after."""
    path = directory / name
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(str(path))
            os.chmod(path, 0o777)  # anyone on the host may connect: only the sandbox's view stops it
            server.listen()
            server.settimeout(0.5)
            yield server, path
    finally:
        path.unlink(missing_ok=True)
        directory.rmdir()


@pytest.fixture
def host_socket_in_run():
    """A listening UNIX socket in the host's /run, as a daemon's would be."""
    directory = Path("/run") / f"sao-test-{secrets.token_hex(4)}"
    try:
        directory.mkdir(mode=0o755)
    except OSError as err:
        pytest.skip(f"cannot make a directory in /run here: {err}")
    yield from _listening_socket(directory, "daemon.sock")


def test_host_unix_sockets_in_run_are_out_of_sight(layers, host_socket_in_run):
    needs(layers, "mountns", "tmpfs")
    server, path = host_socket_in_run
    result = run(f"""
        import os, socket
        print("visible" if os.path.exists({str(path)!r}) else "hidden")
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect({str(path)!r})
            print("connected")
        except OSError as err:
            print("refused", err.strerror)
    """)
    assert result.status == "passed", result.stderr_tail
    assert result.stdout_tail.splitlines()[0] == "hidden" and "connected" not in result.stdout_tail
    with pytest.raises(TimeoutError):
        server.accept()  # nothing ever connected


def _root_entries_allowed() -> set[str]:
    """What / may hold in the new root: its own dirs, the library dirs, the interpreter's top dirs."""
    interpreter = [os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(sys.executable))]
    return {"dev", "proc", "tmp", "lib", "lib32", "lib64", "usr"} | {path.split("/")[1] for path in interpreter}


def test_host_files_are_out_of_sight(layers):
    needs(layers, "mountns", "newroot")
    host_files = [Path(__file__), REPO / "pyproject.toml", Path("/etc/passwd"), Path("/etc/hostname")]
    assert all(path.exists() for path in host_files[:3])  # the test could fail
    result = run_python(textwrap.dedent(f"""
        import json, os
        seen = {{"root": sorted(os.listdir("/")), "dev": sorted(os.listdir("/dev")), "read": []}}
        for path in {[str(path) for path in host_files]!r}:
            try:
                with open(path, "rb") as file:
                    seen["read"].append(path)
            except (FileNotFoundError, PermissionError):
                pass
        print(json.dumps(seen))
    """), LIMITS, stdout_chars=1 << 20)  # the host's /dev, seen without newroot, exceeds output_chars
    assert result.status == "passed", result.stderr_tail
    seen = json.loads(result.stdout_tail)
    assert seen["read"] == []
    assert {"dev", "proc", "tmp"} <= set(seen["root"]) <= _root_entries_allowed(), seen["root"]
    assert set(seen["dev"]) == {"null", "zero", "random", "urandom", "fd", "stdin", "stdout", "stderr", "shm"}


@pytest.fixture
def socket_in_the_checkout():
    """A listening UNIX socket in a directory of the checkout, as a hostile user found one."""
    directory = REPO / f".sao-test-{secrets.token_hex(4)}"
    directory.mkdir(mode=0o755)
    for server, path in _listening_socket(directory, "s.sock"):
        yield server, str(path)


@pytest.fixture
def abstract_socket():
    """A listening UNIX socket in the abstract namespace: no file, reachable by name from the same netns."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(f"\0sao-test-{secrets.token_hex(4)}")
        server.listen()
        server.settimeout(0.5)
        yield server, server.getsockname()


_CONNECT = """
    import socket
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect({address!r})
        print("connected")
    except OSError as err:
        print("refused", type(err).__name__)
"""


def test_unix_socket_in_the_checkout_is_unreachable(layers, socket_in_the_checkout):
    needs(layers, "mountns", "newroot")
    server, path = socket_in_the_checkout
    result = run(_CONNECT.format(address=path))
    assert result.status == "passed", result.stderr_tail
    assert result.stdout_tail.strip() == "refused FileNotFoundError"
    with pytest.raises(TimeoutError):
        server.accept()  # nothing ever connected


def test_abstract_unix_socket_is_unreachable(layers, abstract_socket):
    needs(layers, "netns")  # abstract names belong to a network namespace
    server, name = abstract_socket
    result = run(_CONNECT.format(address=name))
    assert result.status == "passed", result.stderr_tail
    assert result.stdout_tail.strip() == "refused ConnectionRefusedError"
    with pytest.raises(TimeoutError):
        server.accept()


def test_the_standard_library_still_works():
    modules = ["json", "re", "math", "collections", "itertools", "functools", "typing", "heapq", "string",
               "ctypes", "decimal", "hashlib", "datetime", "random", "subprocess", "locale"]
    result = run(f"""
        import importlib, os, sys
        for name in {modules!r}:
            importlib.import_module(name)
        import hashlib, json, random
        print(json.dumps([hashlib.sha256(b"x").hexdigest()[:8], len(os.urandom(4)), random.random() < 1,
                          sys.getfilesystemencoding()]))
    """)
    assert result.status == "passed", result.stderr_tail
    assert json.loads(result.stdout_tail) == ["2d711642", 4, True, "utf-8"]


def test_hostile_calls_are_refused(layers, monkeypatch):
    needs(layers, "pidns", "proc", "mountns")
    marker = f"sao-secret-{secrets.token_hex(8)}"
    monkeypatch.setenv("SAO_TEST_SECRET", marker)
    result = run(f"""
        import ctypes, json, os, signal
        libc = ctypes.CDLL(None, use_errno=True)
        found = {{}}
        environments = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environments.append(open(f"/proc/{{pid}}/environ", "rb").read().decode(errors="replace"))
            except OSError:
                pass
        found["secret"] = any({marker!r} in text for text in environments)
        found["pids"] = sorted(int(pid) for pid in filter(str.isdigit, os.listdir("/proc")))
        PTRACE_ATTACH = 16
        found["ptrace"] = libc.ptrace(PTRACE_ATTACH, 1, None, None)
        os.mkdir("mnt")
        found["mount"] = libc.mount(b"tmpfs", b"mnt", b"tmpfs", 0, None)
        for target in (1, os.getppid(), {os.getpid()}, -1):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        print(json.dumps(found))
    """)
    assert result.status == "passed", result.stderr_tail  # kill(-1), of PID 1, of sao's pid: the supervisor lives on
    found = json.loads(result.stdout_tail)
    assert found["secret"] is False and found["pids"] == [1, 2]  # no host process, and sao's environment unseen
    assert found["ptrace"] == -1 and found["mount"] == -1


def _memory_hog(child_mb: int) -> str:
    """8 children each fill `child_mb` MiB, then hold it until all have tried; prints how many hold at once."""
    return f"""
        import os, select, time
        report_read, report_write = os.pipe()
        release_read, release_write = os.pipe()
        children = []
        for _ in range(8):
            try:
                pid = os.fork()
            except OSError:
                continue  # the process limit
            if pid == 0:
                try:
                    block = b"x" * ({child_mb} << 20)  # written, so resident: not just address space
                    os.write(report_write, b"+")
                except MemoryError:
                    os.write(report_write, b"-")
                os.read(release_read, 1)
                os._exit(0)
            children.append(pid)
        os.close(report_write)
        alive, reports = set(children), b""
        deadline = time.monotonic() + 10
        while len(reports) < len(alive) and time.monotonic() < deadline:  # a child the kernel kills never reports
            alive -= {{pid for pid in alive if os.waitpid(pid, os.WNOHANG)[0]}}
            if select.select([report_read], [], [], 0.05)[0]:
                reports += os.read(report_read, 8)
        # A child the OOM killer picked may still be exiting (slow on a busy machine): count the ones alive once
        # none has died for half a second.
        settled = time.monotonic() + 0.5
        while time.monotonic() < min(settled, deadline + 2):
            died = {{pid for pid in alive if os.waitpid(pid, os.WNOHANG)[0]}}
            alive -= died
            settled = time.monotonic() + 0.5 if died else settled
            time.sleep(0.02)
        print(len(children), reports.count(b"+"), len(alive))
    """


@pytest.mark.slow
@needs_root
@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup-if-available", "rlimits-only"])
def test_all_processes_together_stay_within_the_memory_bound(cgroup):
    """8 children cannot hold more than the sandbox's bound together: total_memory_mb with a
    cgroup, max_processes x memory_mb without (each case sized so that 8 children would exceed it)."""
    if cgroup:
        limits = LIMITS.model_copy(update={"memory_mb": 256, "total_memory_mb": 512, "max_processes": 16,
                                           "cpu_time_s": 5, "wall_time_s": 15})
        child_mb = 200
    else:
        limits = LIMITS.model_copy(update={"memory_mb": 160, "max_processes": 4, "cgroup": False,
                                           "cpu_time_s": 5, "wall_time_s": 15})
        child_mb = 100
    result = run(_memory_hog(child_mb), limits)
    used_cgroup = "cgroup" in result.isolation
    bound_mb = limits.total_memory_mb if used_cgroup else limits.max_processes * limits.memory_mb
    assert 8 * child_mb > bound_mb  # the test could fail
    forked, filled, holding = map(int, result.stdout_tail.split())
    assert holding * child_mb <= bound_mb and filled >= 1, result
    if used_cgroup:
        assert result.status == "memory"  # the kernel killed the children past the limit
    else:
        assert result.status == "passed" and forked <= limits.max_processes - 1
    assert used_cgroup == (cgroup and cgroup_available())


def cgroup_available() -> bool:
    probe = sandbox_cgroup.create(64, 1)
    if probe:
        probe.remove()
    return probe is not None


def cgroups_left() -> list[Path]:
    """This test process's sandbox cgroups that still exist."""
    parents = sandbox_cgroup._parent_cgroups()
    return [path for parent in (parents or ())[1:] if parent for path in parent.glob(f"sao-sandbox-{os.getpid()}-*")]


@pytest.mark.slow
@needs_root
def test_each_run_removes_its_cgroup_even_when_interrupted(layers):
    if "cgroup" not in layers:
        pytest.skip("no cgroup can be made here: the rlimits bound applies")
    assert cgroups_left() == []
    run("import time; time.sleep(5)", LIMITS.model_copy(update={"wall_time_s": 0.5}))
    assert cgroups_left() == []
    with pytest.raises(EnvFailure):  # as the env guard interrupts a step: run_python kills the launcher
        call_env("env.step", run, "import time; time.sleep(30)", LIMITS.model_copy(update={"wall_time_s": 30}),
                 timeout_s=1)
    assert cgroups_left() == [] and sandbox_processes() == []


@needs_root
def test_cgroups_left_by_a_dead_sao_process_are_removed(layers):
    if "cgroup" not in layers:
        pytest.skip("no cgroup can be made here")
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no process now
    parents = {parent for parent in sandbox_cgroup._parent_cgroups()[1:] if parent}
    stale = [parent / f"sao-sandbox-{dead.pid}-0" for parent in parents]
    for directory in stale:
        directory.mkdir()
    try:
        sandbox_cgroup._parent_cgroups.cache_clear()  # found again, as by a new sao process
        sandbox_cgroup._parent_cgroups()
        assert not any(directory.exists() for directory in stale)
    finally:
        for directory in stale:
            if directory.exists():
                directory.rmdir()
