"""Processes a fault test starts and kills: whatever still runs when the test ends (it failed) is killed."""

import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def spawn():
    """`spawn(command, log, **popen)`: start `command` with its stderr in `log`; killed at the end if still running."""
    started: list[subprocess.Popen] = []

    def start(command: list[str], log: Path, **popen) -> subprocess.Popen:
        with open(log, "w") as stderr:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, **popen)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()
