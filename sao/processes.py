"""Child processes that end with the process that started them (Linux's PR_SET_PDEATHSIG)."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """A subprocess preexec_fn: the kernel sends the child SIGTERM when the thread that started it exits, however
    it exits (an exception, a signal, SIGKILL); a child whose parent is already gone exits at once.

    Bind the parent's pid first (`functools.partial(die_with_parent, os.getpid())`): in the child, os.getpid() is
    the child's own.
    """
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        os._exit(1)
