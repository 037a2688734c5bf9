"""A child started with die_with_parent ends with its parent, however the parent ends; a run's children share cores politely."""

import signal
import subprocess
import sys
import time

import pytest

from support.pids import is_running

PARENT = """
import functools, os, subprocess, sys, time
from sao.processes import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         preexec_fn=functools.partial(die_with_parent, os.getpid()))
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("end", [signal.SIGKILL, signal.SIGTERM])
def test_the_child_ends_with_its_parent(end):
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert is_running(child)
    parent.send_signal(end)  # no handler, no finally: only the kernel can end the child now
    parent.wait(10)
    deadline = time.monotonic() + 10
    while is_running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_running(child)


def test_a_runs_processes_wait_for_openmp_work_asleep_unless_told_otherwise(monkeypatch, tmp_path):
    from sao import launcher

    seen = []
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *args, env=None, **kwargs: seen.append(env["OMP_WAIT_POLICY"]))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    launcher._spawn(["trainer"], tmp_path / "trainer.log")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a user's choice wins
    launcher._spawn(["trainer"], tmp_path / "trainer.log")
    assert seen == ["PASSIVE", "ACTIVE"]
