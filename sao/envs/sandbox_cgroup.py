"""A cgroup for each sandbox run: one memory and process limit for all of the run's processes together.

`run_python` makes it, and moves the launcher into it before the launcher starts anything, so
everything the program forks is counted, and its tmpfs files too (the launcher and the
sandbox's supervisor as well: a few MiB). cgroup v2 (`memory.max`, `memory.swap.max`,
`pids.max`) where sao's own cgroup can hand the memory and pids controllers to child cgroups
(the kernel refuses that to a non-root cgroup that holds processes, e.g. a plain systemd
service); else cgroup v1 (`memory.limit_in_bytes`, `memory.memsw.limit_in_bytes`, and
`pids.max` in the pids hierarchy). Without root, or where neither can be made, there is none:
then the only bound on the whole sandbox is its rlimits, max_processes x memory_mb
(RLIMIT_NPROC, which needs the uid layer, times RLIMIT_AS).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

REMOVE_TIMEOUT_S = 2.0  # a killed run's processes leave the cgroup as the kernel tears them down
_names = itertools.count()


@dataclass(frozen=True)
class RunCgroup:
    version: int  # 2, or 1
    directories: tuple[Path, ...]  # v2: one; v1: the memory one, then the pids one if any

    def add(self, pid: int) -> bool:
        """Move process `pid` in; False (and a warning) where the kernel refuses."""
        try:
            for directory in self.directories:
                (directory / "cgroup.procs").write_text(str(pid))
        except OSError as err:
            _warn_once(f"could not move the sandbox into its cgroup ({err})")
            return False
        return True

    def oom_kills(self) -> int:
        """Processes the kernel killed because the run hit its memory limit."""
        events = self.directories[0] / ("memory.events" if self.version == 2 else "memory.oom_control")
        for line in _read(events).splitlines():
            name, _, count = line.partition(" ")
            if name == "oom_kill":
                return int(count)
        return 0

    def remove(self) -> None:
        """Kill whatever is still in it (only after run_python killed the launcher), then remove it."""
        deadline = time.monotonic() + REMOVE_TIMEOUT_S
        for directory in self.directories:
            while True:
                try:
                    directory.rmdir()
                    break
                except OSError:  # EBUSY: processes still in it
                    if time.monotonic() > deadline:
                        log.warning("could not remove the sandbox cgroup %s: processes are still in it", directory)
                        break
                    _kill_members(directory)
                    time.sleep(0.01)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _kill_members(directory: Path) -> None:
    for pid in _read(directory / "cgroup.procs").split():
        try:
            handle = os.pidfd_open(int(pid))  # from here on the pid cannot name another process
        except OSError:
            continue  # already gone
        try:
            if pid in _read(directory / "cgroup.procs").split():
                signal.pidfd_send_signal(handle, signal.SIGKILL)
        except OSError:
            pass  # it ended meanwhile
        finally:
            os.close(handle)


def create(memory_mb: int, max_processes: int) -> RunCgroup | None:
    """A fresh cgroup limited to `memory_mb` (no swap) and `max_processes` plus the launcher and
    the supervisor; None where no cgroup can be made here."""
    parents = _parent_cgroups()
    if parents is None:
        return None
    version, memory_parent, pids_parent = parents
    name = f"sao-sandbox-{os.getpid()}-{next(_names)}"
    made: list[Path] = []
    memory_bytes, pids = str(memory_mb << 20), str(max_processes + 2)
    try:
        for parent in (memory_parent, pids_parent):
            if parent is not None and (directory := parent / name) not in made:
                directory.mkdir()
                made.append(directory)
        memory_dir = made[0]
        if version == 2:
            _write(memory_dir / "memory.max", memory_bytes)
            _write(memory_dir / "memory.swap.max", "0", optional=True)
            _write(memory_dir / "pids.max", pids)
        else:
            _write(memory_dir / "memory.limit_in_bytes", memory_bytes)
            _write(memory_dir / "memory.memsw.limit_in_bytes", memory_bytes, optional=True)  # after: memsw >= limit
            if pids_parent is not None:
                _write(made[-1] / "pids.max", pids)
    except OSError as err:
        _warn_once(f"could not set up a cgroup for the sandbox ({err})")
        RunCgroup(version, tuple(made)).remove()
        return None
    return RunCgroup(version, tuple(made))


def _write(path: Path, value: str, optional: bool = False) -> None:
    if optional and not path.exists():
        return  # e.g. no swap accounting: then there is no swap to limit either
    path.write_text(value)


@cache
def _warn_once(message: str) -> None:
    log.warning("%s; the sandbox's memory bound is max_processes x memory_mb (rlimits)", message)


@cache
def _parent_cgroups() -> tuple[int, Path, Path | None] | None:
    """(version, where memory limits go, where pids limits go): sao's own cgroups, found once."""
    if os.geteuid() != 0:
        return None  # a delegated subtree would do, but sao does not look for one
    mounts, own = _cgroup_mounts(), _own_cgroups()
    found: tuple[int, Path, Path | None] | None = None
    if "cgroup2" in mounts and "" in own:
        directory = mounts["cgroup2"] / own[""].lstrip("/")
        if _enable_v2_controllers(directory):
            found = 2, directory, directory
    if found is None and "memory" in mounts and "memory" in own:
        memory = mounts["memory"] / own["memory"].lstrip("/")
        pids = mounts["pids"] / own["pids"].lstrip("/") if "pids" in mounts and "pids" in own else None
        found = 1, memory, pids
    for parent in set(found[1:] if found else ()) - {None}:
        _remove_stale(parent)
    return found


def _remove_stale(parent: Path) -> None:
    """Empty run cgroups that a sao process which has since died left behind (it was killed mid-run)."""
    for directory in parent.glob("sao-sandbox-*-*"):
        owner = directory.name.split("-")[2]
        try:
            os.kill(int(owner), 0)
            continue  # that sao process still runs: its cgroups are its own business
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue
        with contextlib.suppress(OSError):  # not empty: something still runs in it; leave it be
            directory.rmdir()


def _cgroup_mounts() -> dict[str, Path]:
    """Mount point of cgroup2 (key "cgroup2") and of each v1 controller hierarchy (key: controller)."""
    mounts: dict[str, Path] = {}
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        fields = line.split(" - ")
        if len(fields) != 2:
            continue
        mount_point = Path(fields[0].split()[4])
        fstype, _, options = (fields[1].split() + ["", ""])[:3]
        if fstype == "cgroup2":
            mounts.setdefault("cgroup2", mount_point)
        elif fstype == "cgroup":
            for option in options.split(","):
                mounts.setdefault(option, mount_point)
    return mounts


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" its v2 path."""
    own: dict[str, str] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            own[controller] = path
    return own


def _enable_v2_controllers(directory: Path) -> bool:
    """memory and pids available to child cgroups of `directory`, enabling them if need be."""
    wanted = {"memory", "pids"}
    if not wanted <= set(_read(directory / "cgroup.controllers").split()):
        return False
    if wanted <= set(_read(directory / "cgroup.subtree_control").split()):
        return True
    try:  # refused (EBUSY) where `directory` holds processes and is not the root: then v1, or none
        (directory / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError:
        return False
    return True
