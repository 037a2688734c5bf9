"""Child side of the code sandbox: isolate, drop privileges, set limits, run one program, report.

Started by `sao.envs.sandbox.run_python` as `python -I sandbox_launch.py '<plan as JSON>'` (the
limits, how much stdout to return) with the program's source on stdin, inside the run's cgroup
(`run_python` moves it there). It prints one JSON report on stdout; the program's own
stdout/stderr go to files the launcher reads back (so nothing the program prints can be
mistaken for the report, and the parent never buffers more than the kept tails).

Layers, each recorded by name in the report's `layers`:
- `netns`, `mountns`, `pidns`, `ipcns`: new namespaces (as root; otherwise inside a new `userns`).
  No network at all (not even loopback); mounts made here never reach the host; the program's
  supervisor is PID 1 of the new pid namespace, and when it exits the kernel kills every
  process left in it (fork bombs, daemons that called setsid); SysV IPC objects and POSIX
  message queues are private and go with the namespace.
- `readonly`: every inherited mount is read-only, and so is every bind made from one.
- `newroot`: the program's / is a small tmpfs holding only the interpreter's prefix and the
  system's library directories (/lib*, /usr/lib*: all `python -I -S` and the stdlib's extension
  modules load), bound at their host paths; a /dev of null, zero, random and urandom (bound) and
  links (fd, std*, and shm to /tmp); a /proc; a /tmp. pivot_root sets the host's tree aside;
  init detaches it once it has mounted /proc (a user namespace may mount a fresh proc only while
  a full one is in sight), then makes / read-only. So no other host file is in reach: not the
  checkout, not /etc, not a home, not a UNIX socket file anywhere. Abstract UNIX sockets have no
  file: they belong to a network namespace, and `netns` leaves the host's behind. Where the
  kernel refuses (pivot_root needs a real root mount), the layer is absent and the host's tree
  stays in sight, read-only, with the tmpfs below over its writable directories and /run.
- `tmpfs`: a fresh size-limited tmpfs at /tmp, so the program can write only to memory that
  vanishes with it. Without `newroot`, also over the host's /var/tmp and /dev/shm, and over
  /run (and /var/run), which hides the host's daemons' UNIX sockets.
- `proc`: a /proc of the new pid namespace (the program sees no host processes).
- `uid`: as root, the program runs as a uid of its own (UID_BASE + launcher pid), so it can
  signal nothing else and RLIMIT_NPROC, which root ignores, bounds its processes.
- `rlimits`: CPU, address space, file size, open files, processes, no core dumps.

Stdlib only, imported light: this starts for every run of generated code.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import stat
import sys
import time

UID_BASE = 200_000
SCRATCH = "/tmp/sandbox"  # the program's cwd, HOME and TMPDIR when the mount namespace applies
OUTPUT_DIR = "/tmp/.sandbox-output"  # root-only tmpfs holding the program's stdout/stderr
STAGING_DIR = "/tmp/.sandbox-staging"  # where the interpreter is bind-mounted before moving into place
NEW_ROOT = "/tmp"  # where the new root is built: a directory every host has, and one hidden anyway
OLD_ROOT = "/.old-root"  # where pivot_root leaves the host's tree until init detaches it
LIBRARY_DIRS = ("/lib", "/lib32", "/lib64", "/usr/lib", "/usr/lib32", "/usr/lib64")
DEVICES = ("null", "zero", "random", "urandom")
DEVICE_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                "stderr": "/proc/self/fd/2", "shm": "/tmp"}  # shm: POSIX semaphores (multiprocessing) in /tmp
MAX_OPEN_FILES = 64

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_MOVE = 1, 2, 4, 8, 32, 4096, 8192
MS_REC, MS_PRIVATE, MNT_DETACH = 16384, 1 << 18, 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), f"prctl({option})")


def enter_namespaces() -> list[str]:
    """New net, mount, pid and IPC namespaces; the next fork becomes PID 1 of the new pid namespace."""
    flags = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC
    names = ["netns", "mountns", "pidns", "ipcns"]
    if os.geteuid() == 0:
        return names if _libc.unshare(flags) == 0 else []
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(flags | CLONE_NEWUSER) != 0:
        return []
    # Unprivileged: only our own ids can be mapped; root inside maps to us outside.
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"0 {uid} 1"),
                       ("/proc/self/gid_map", f"0 {gid} 1")):
        with open(path, "w") as file:
            file.write(text)
    return ["userns", *names]


def _blocked_ancestor(path: str) -> str | None:
    """The topmost directory above `path` that other users cannot traverse, if any."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:depth])
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


def _expose(paths: list[str]) -> None:
    """Make `paths` reachable by an unprivileged uid: hide each blocking ancestor (e.g. /root,
    where pyenv installs Python) under an empty tmpfs and bind the paths back into it."""
    hidden: dict[str, list[str]] = {}
    for path in sorted(set(paths)):
        blocked = _blocked_ancestor(path)
        if blocked and not any(path.startswith(kept + "/") for kept in hidden.get(blocked, [])):
            hidden.setdefault(blocked, []).append(path)
    if not hidden:
        return
    os.mkdir(STAGING_DIR, 0o700)
    for number, (blocked, inside) in enumerate(hidden.items()):
        stages = []
        for path in inside:
            stages.append(f"{STAGING_DIR}/{number}-{len(stages)}")
            os.mkdir(stages[-1])
            _mount(path, stages[-1], None, MS_BIND | MS_REC)
        _mount("tmpfs", blocked, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for path, stage in zip(inside, stages):
            os.makedirs(path, exist_ok=True)
            _mount(stage, path, None, MS_MOVE)


def _outermost(paths: set[str]) -> list[str]:
    """`paths` less those inside another one, parents first."""
    kept: list[str] = []
    for path in sorted(paths):
        if not any(path == parent or path.startswith(parent.rstrip("/") + "/") for parent in kept):
            kept.append(path)
    return kept


def _bind_into(root: str, path: str) -> None:
    """Bind the host's `path` (a directory or a device node) at the same path under `root`; copy a symlink."""
    target = root + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.mkdir(target)
    else:
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o600))
    _mount(path, target, None, MS_BIND | MS_REC)  # a bind of a read-only mount is read-only


def enter_new_root(interpreter_paths: list[str]) -> bool:
    """Build a root of only what the interpreter needs and pivot into it; the host's tree stays at
    OLD_ROOT for `leave_old_root`. False (nothing changed) where the kernel refuses."""
    _mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=1m")
    try:
        libraries = [path for path in LIBRARY_DIRS if os.path.lexists(path)]
        wanted = {os.path.realpath(path) for path in libraries} | set(interpreter_paths)
        for path in [link for link in libraries if os.path.islink(link)] + _outermost(wanted):
            _bind_into(NEW_ROOT, path)
        for name in DEVICES:
            _bind_into(NEW_ROOT, f"/dev/{name}")
        for name, target in DEVICE_LINKS.items():
            os.symlink(target, f"{NEW_ROOT}/dev/{name}")
        for path in ("/proc", "/tmp", OLD_ROOT):
            os.mkdir(NEW_ROOT + path)
        _libc.pivot_root.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        _check(_libc.pivot_root(NEW_ROOT.encode(), (NEW_ROOT + OLD_ROOT).encode()), "pivot_root")
    except (OSError, AttributeError) as err:  # AttributeError: a libc without pivot_root
        sys.stderr.write(f"sandbox: no new root, the host's tree stays in sight, read-only: {err}\n")
        _libc.umount2(NEW_ROOT.encode(), MNT_DETACH)
        return False
    os.chdir("/")  # a cwd left in the host's tree would keep it reachable for every child
    return True


def leave_old_root() -> None:
    """In init, once /proc is mounted: detach the host's tree and make the new root read-only."""
    _check(_libc.umount2(OLD_ROOT.encode(), MNT_DETACH), f"umount {OLD_ROOT}")
    os.rmdir(OLD_ROOT)
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def private_filesystem(max_file_mb: int, interpreter_paths: list[str]) -> list[str]:
    """In the new mount namespace: nothing propagates to the host, the inherited tree is
    read-only, and the program gets a new root; failing that, the world-writable directories
    are fresh tmpfs, and so is /run (host sockets)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # must hold, or our mounts would show on the host
    layers = []
    attr = _MountAttr(attr_set=MOUNT_ATTR_RDONLY)
    if _libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(b"/"),
                     ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))) == 0:
        layers.append("readonly")  # kernels before 5.12 lack mount_setattr; the uid layer still guards
    flags = MS_NOSUID | MS_NODEV
    if enter_new_root(interpreter_paths):
        layers.append("newroot")
    else:
        for path in ("/var/tmp", "/dev/shm"):
            if os.path.isdir(path):
                _mount("tmpfs", path, "tmpfs", flags, f"mode=1777,size={max_file_mb}m")
        for path in ("/run", "/var/run"):  # /var/run is mostly a link to /run, then mounting /run did it
            if os.path.isdir(path) and not os.path.islink(path):
                _mount("tmpfs", path, "tmpfs", flags | MS_NOEXEC, "mode=0755,size=1m")
    _mount("tmpfs", "/tmp", "tmpfs", flags, f"mode=1777,size={max_file_mb}m")
    os.mkdir(OUTPUT_DIR, 0o700)  # stdout + stderr, each at most max_file_mb (RLIMIT_FSIZE)
    _mount("tmpfs", OUTPUT_DIR, "tmpfs", flags | MS_NOEXEC, f"mode=0700,size={2 * max_file_mb + 1}m")
    if "newroot" not in layers:
        _expose(interpreter_paths)  # in the new root every directory above the interpreter is ours
    return layers + ["tmpfs"]


def set_limits(limits: dict, own_uid: bool) -> None:
    cpu = max(1, int(-(-limits["cpu_time_s"] // 1)))
    mebibyte = 1 << 20
    # SIGXCPU at the soft limit; SIGKILL one second later if the program handles SIGXCPU.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mebibyte,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_mb"] * mebibyte,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if own_uid:  # NPROC counts every process of the real uid: only meaningful for a uid of its own
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)


def exec_program(python: str, scratch: str, fds: tuple[int, int, int], uid: int | None, limits: dict,
                 error_pipe: int) -> None:
    """In the forked child: limits, privilege drop, exec. Any failure goes to `error_pipe`."""
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        set_limits(limits, own_uid=uid is not None)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        os.chdir(scratch)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch}
        os.execve(python, [python, "-I", "-S", "solution.py"], env)
    except BaseException as err:  # noqa: BLE001 - report why the program never started
        os.write(error_pipe, f"{type(err).__name__}: {err}".encode())
    finally:
        os._exit(127)


def run_init(python: str, scratch: str, fds: tuple[int, int, int], uid: int | None, limits: dict,
             layers: list[str], report_pipe: int) -> None:
    """PID 1 of the sandbox: start the program, reap whatever it orphans, report how it ended.

    Writes two JSON lines to `report_pipe`: the layers it added, once the program starts, and
    how the program ended (the launcher may never see that one: it kills us on overrun).
    """
    report: dict = {}
    try:
        os.setpgid(0, 0)  # the launcher kills this group on overrun
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the launcher killed by run_python takes us along
        added = []
        if "pidns" in layers and "mountns" in layers:
            try:
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                added.append("proc")
            except OSError:
                pass  # some containers refuse a fresh proc; the uid and pidns layers still apply
        if "newroot" in layers:
            leave_old_root()  # failing, the program never starts: the host's tree is still attached
        os.write(report_pipe, json.dumps({"layers": added}).encode() + b"\n")
        error_read, error_write = os.pipe()
        program = os.fork()
        if program == 0:
            os.close(error_read)
            exec_program(python, scratch, fds, uid, limits, error_write)
        os.close(error_write)
        failure = os.read(error_read, 4096)  # empty: exec succeeded and closed the pipe
        while True:
            pid, status, usage = os.wait4(-1, 0)
            if pid == program:
                break
        if failure:
            report["error"] = "the program did not start: " + failure.decode(errors="replace")
        report.update(code=os.waitstatus_to_exitcode(status), cpu_s=usage.ru_utime + usage.ru_stime)
    except BaseException as err:  # noqa: BLE001 - any failure here is the sandbox's, and is reported
        report["error"] = f"sandbox init failed: {type(err).__name__}: {err}"
    finally:
        os.write(report_pipe, json.dumps(report).encode() + b"\n")
        if "pidns" not in layers:
            os.killpg(0, signal.SIGKILL)  # no namespace teardown: take our process group down ourselves
        os._exit(0)


def wait_for_init(init: int, report_pipe: int, wall_time_s: float) -> tuple[list[str], dict | None]:
    """The layers init added, and its report; None when the program ran past the wall-clock
    limit (then everything is killed)."""
    deadline = time.monotonic() + wall_time_s
    received, ended = b"", False
    while not ended and (remaining := deadline - time.monotonic()) > 0:
        if select.select([report_pipe], [], [], remaining)[0]:
            chunk = os.read(report_pipe, 65536)
            received, ended = received + chunk, not chunk
    if not ended:
        os.killpg(init, signal.SIGKILL)  # killing PID 1 of the pid namespace kills all of it
    os.waitpid(init, 0)  # returns once the pid namespace is empty
    lines = [json.loads(line) for line in received.splitlines()]
    if ended and len(lines) < 2:  # init failed before the program started: its one line says why
        return [], lines[0] if lines and "error" in lines[0] else {"error": "sandbox init ended without a report"}
    return lines[0]["layers"] if lines else [], (lines[1] if ended else None)


def _tail(path: str, chars: int) -> str:
    with open(path, "rb") as file:
        file.seek(max(0, os.fstat(file.fileno()).st_size - 4 * chars))  # UTF-8: at most 4 bytes a char
        return file.read().decode(errors="replace")[-chars:]


def main() -> None:
    plan = json.loads(sys.argv[1])
    limits = plan["limits"]
    source = sys.stdin.buffer.read()  # run_python moves us into the run's cgroup before it writes this
    os.umask(0o022)
    python = os.path.realpath(sys.executable)  # the base interpreter; -S skips the venv anyway
    interpreter_paths = sorted({os.path.dirname(python), os.path.realpath(sys.base_prefix),
                                os.path.realpath(sys.base_exec_prefix)})
    layers = enter_namespaces()
    root = os.geteuid() == 0 and "userns" not in layers
    if "mountns" in layers:
        layers += private_filesystem(limits["max_file_mb"], interpreter_paths)
        scratch, output_dir = SCRATCH, OUTPUT_DIR
        os.mkdir(scratch, 0o700)
    else:
        if root and any(map(_blocked_ancestor, interpreter_paths)):
            raise SystemExit(f"sandbox: cannot drop root: {python} is not reachable by other users and "
                             "no mount namespace is available to expose it")
        import tempfile  # fallback only: scratch space in the host's /tmp, removed afterwards

        scratch, output_dir = tempfile.mkdtemp(prefix="sao-sandbox-"), tempfile.mkdtemp(prefix="sao-output-")
    uid = UID_BASE + os.getpid() if root else None
    with open(os.path.join(scratch, "solution.py"), "wb") as file:
        file.write(source)
    if uid is not None:
        os.chown(scratch, uid, uid)
        os.chown(os.path.join(scratch, "solution.py"), uid, uid)
        layers.append("uid")
    layers.append("rlimits")
    stdout_path, stderr_path = os.path.join(output_dir, "stdout"), os.path.join(output_dir, "stderr")
    fds = (os.open(os.devnull, os.O_RDONLY), os.open(stdout_path, os.O_WRONLY | os.O_CREAT, 0o600),
           os.open(stderr_path, os.O_WRONLY | os.O_CREAT, 0o600))
    report_read, report_write = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(report_read)
        run_init(python, scratch, fds, uid, limits, layers, report_write)
    os.close(report_write)
    added, outcome = wait_for_init(init, report_read, limits["wall_time_s"])
    layers += added
    chars = limits["output_chars"]
    report = {"layers": layers, "uid": uid, "wall_timeout": outcome is None, **(outcome or {}),
              "stdout": _tail(stdout_path, plan["stdout_chars"] or chars), "stderr": _tail(stderr_path, chars)}
    if "mountns" not in layers:
        import shutil

        for path in (scratch, output_dir):
            shutil.rmtree(path, ignore_errors=True)
    sys.stdout.write(json.dumps(report))


if __name__ == "__main__":
    main()
