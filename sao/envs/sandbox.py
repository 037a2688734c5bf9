"""Run an untrusted Python program in a sandboxed subprocess and say how it ended.

The parent side makes the run's cgroup (`sandbox_cgroup`), starts `sandbox_launch.py` (which
isolates, limits and runs the program; its docstring lists the layers), waits with a wall-clock
limit, turns the launcher's JSON report into a `SandboxResult`, and removes the cgroup. No
`preexec_fn`: samplers have threads, and forking with a Python callback in the child can
deadlock on a lock another thread held.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from sao.config import SandboxConfig
from sao.envs import sandbox_cgroup

log = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("sandbox_launch.py")
GRACE_S = 3.0  # launcher start, namespace setup and teardown, on top of the program's wall_time_s
FULL_ISOLATION = frozenset({"netns", "mountns", "pidns", "ipcns", "tmpfs"})

Status = Literal["passed", "failed", "timeout", "memory", "killed"]


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): the launcher crashed or could not isolate."""


@dataclass(frozen=True)
class SandboxResult:
    """How one program run ended.

    status: passed (exit 0) | failed (non-zero exit, e.g. an uncaught exception) | timeout
    (wall-clock or CPU limit) | memory (MemoryError under the address-space limit, or a process
    the kernel killed at the cgroup's limit) | killed (another signal, e.g. SIGSEGV).
    """

    status: Status
    returncode: int | None  # exit code; -N when signal N ended it; None when the wall clock did
    stdout_tail: str
    stderr_tail: str
    wall_s: float
    isolation: tuple[str, ...]  # layers that applied, e.g. ("netns", "mountns", "pidns", "uid", ...)
    uid: int | None = None  # the program's own uid (as root), to look for leftovers


def run_python(source: str, limits: SandboxConfig, stdout_chars: int | None = None) -> SandboxResult:
    """Run `source` as a Python script under `limits`; never leaves a process behind.

    `stdout_chars`: how much of the end of stdout comes back (default `limits.output_chars`;
    stdout is at most `max_file_mb`), for a program that reports data there.
    """
    started = time.monotonic()
    cgroup = sandbox_cgroup.create(limits.total_memory_mb, limits.max_processes) if limits.cgroup else None
    try:
        plan = {"limits": limits.model_dump(), "stdout_chars": stdout_chars}
        launcher, in_cgroup = _launch(source, plan, limits.wall_time_s + GRACE_S, cgroup)
        oom_kills = cgroup.oom_kills() if cgroup else 0
    finally:
        if cgroup:
            cgroup.remove()
    wall_s = time.monotonic() - started
    if launcher.returncode == -signal.SIGKILL and not launcher.stdout:  # the backstop, or the OOM killer
        return SandboxResult("memory" if oom_kills else "timeout", None, "", "", wall_s, ())
    report = _report(launcher.returncode, launcher.stdout, launcher.stderr, oom_kills)
    isolation = tuple(report["layers"]) + (("cgroup",) if in_cgroup else ())
    _warn_weak_isolation(isolation, limits.cgroup)
    if oom_kills:
        status, returncode = "memory", report.get("code")  # init itself may be the one killed: no code then
    elif report["wall_timeout"]:
        status, returncode = "timeout", None
    else:
        returncode = report["code"]
        status = classify(returncode, report["cpu_s"], report["stderr"], limits)
    return SandboxResult(status, returncode, report["stdout"], report["stderr"], wall_s, isolation, report["uid"])


def _launch(source: str, plan: dict, timeout_s: float,
            cgroup: sandbox_cgroup.RunCgroup | None) -> tuple[subprocess.CompletedProcess, bool]:
    """Run the launcher to its end, or kill its process group at `timeout_s` or on any exception.
    Also says whether it ran in `cgroup`."""
    command = [sys.executable, "-I", str(LAUNCHER), json.dumps(plan)]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    stdout, stderr, in_cgroup = b"", b"", False
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=env, start_new_session=True) as launcher:
        try:
            # The launcher waits for its stdin before it forks: all it starts is in the cgroup. Moving
            # it costs a kernel grace period, which overlaps its interpreter's start.
            in_cgroup = cgroup is not None and cgroup.add(launcher.pid)
            stdout, stderr = launcher.communicate(source.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass  # the launcher enforces wall_time_s itself; this is the backstop
        finally:
            # Also on any exception while waiting (e.g. the env guard's SIGALRM): killing the
            # launcher's group makes its init die (PDEATHSIG), which tears the pid namespace down.
            if launcher.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # it ended between poll() and here
                    os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    return subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr), in_cgroup


def classify(returncode: int, cpu_s: float, stderr_tail: str, limits: SandboxConfig) -> Status:
    """Tell the ways a program can end apart, from its exit code, CPU time and last error line."""
    if returncode == 0:
        return "passed"
    if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and cpu_s >= limits.cpu_time_s):
        return "timeout"  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
    if returncode < 0:
        return "killed"
    lines = stderr_tail.strip().splitlines()
    return "memory" if lines and lines[-1].startswith("MemoryError") else "failed"


def _report(returncode: int, stdout: bytes, stderr: bytes, oom_kills: int) -> dict:
    try:
        report = json.loads(stdout) if returncode == 0 else None
    except ValueError:
        report = None
    if report is not None and oom_kills:
        return report  # the kernel killed a process at the memory limit, perhaps the supervisor: not a sandbox failure
    if report is None or "error" in report:
        why = report["error"] if report else stderr.decode(errors="replace")[-2000:].strip()
        raise SandboxError(f"the code sandbox failed (launcher exit {returncode}): {why}")
    if stderr:
        log.debug("sandbox launcher: %s", stderr.decode(errors="replace")[-2000:])
    return report


@cache
def _warn_weak_isolation(layers: tuple[str, ...], cgroup_wanted: bool) -> None:
    """Once per distinct set of layers: say what is missing, and what that exposes."""
    missing = sorted(FULL_ISOLATION - set(layers))
    if missing:
        log.warning("code sandbox runs without %s (unshare refused here): generated code may reach the network "
                    "or the host's /tmp, and daemons it starts may outlive the run; only rlimits%s apply",
                    ", ".join(missing), " and a uid of its own" if "uid" in layers else "")
    elif "newroot" not in layers:
        log.warning("code sandbox runs without a root of its own (pivot_root refused here): generated code can "
                    "read the host's files and connect to UNIX socket files outside /run and /tmp")
    if "cgroup" not in layers:
        bound = ("max_processes x memory_mb (RLIMIT_NPROC of its own uid, RLIMIT_AS)" if "uid" in layers
                 else "none: only memory_mb per process (RLIMIT_AS), for any number of processes")
        log.log(logging.WARNING if cgroup_wanted else logging.INFO,
                "code sandbox runs without a cgroup%s: the bound on the memory of all its processes together is %s",
                "" if cgroup_wanted else " (env.sandbox.cgroup = false)", bound)
