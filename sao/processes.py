"""Processes and threads: children that end with the process that started them (Linux's PR_SET_PDEATHSIG), one
call on a thread of its own, and when this process started."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

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


def in_background(function: Callable, *args) -> Future:
    """`function(*args)` on a thread of its own; `result()` waits for it and raises what it raised."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-call")
    try:
        return pool.submit(function, *args)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its call


@functools.cache  # it never changes, and progress files ask at every write
def process_started_at() -> float:
    """Unix time this process started (imports included)."""
    import psutil  # a DeepSpeed dependency, so always installed with the trainer

    return psutil.Process().create_time()
