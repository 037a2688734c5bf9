"""README.md's Quick start and the first five `sao` commands after it, read from README.md itself, work as written.

Each runs in a cheap form that still proves it: the Makefile targets resolve (`make -n`), the venv the
Quick start activates holds `sao`, `sao run` parses its flags, validates the config and builds the env
and its tasks (the loop itself is replaced: tests/test_run_integration.py runs it), the plugin env is
the template docs/envs.md gives, and the broker starts and stops (on a free port, not 9092, which
another process may hold on a shared machine).
"""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import sao.launcher
from sao.cli import app
from sao.envs.registry import make_env, make_tasks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FIRST_AFTER_QUICK_START = 5


def _blocks(text: str) -> list[list[str]]:
    """Each fenced code block's commands: one per line, the trailing `# comment` dropped."""
    blocks = []
    for body in re.findall(r"^```\w*\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        lines = [line.split("  #")[0].strip() for line in body.splitlines()]
        blocks.append([line.rstrip("&").strip() for line in lines if line and not line.startswith("#")])
    return blocks


def quick_start_and_next() -> tuple[list[str], list[str]]:
    """(the Quick start's commands, the first `sao` commands of the code blocks after it)."""
    text = README.read_text()
    _, quick = text.split("## Quick start", 1)
    blocks = _blocks(quick)
    assert blocks, "README: the Quick start has no code block"
    after = [line for block in blocks[1:] for line in block if line.startswith("sao ")]
    return blocks[0], after[:FIRST_AFTER_QUICK_START]


QUICK_START, NEXT = quick_start_and_next()


def test_the_readme_has_a_quick_start_and_five_commands_after_it():
    assert any(line.startswith("make run") for line in QUICK_START), QUICK_START
    assert len(NEXT) == FIRST_AFTER_QUICK_START, NEXT


@pytest.mark.parametrize("command", QUICK_START)
def test_a_quick_start_command_works_as_written(command):
    words = shlex.split(command)
    venv = Path(sys.prefix)
    if words[0] == "make":
        dry = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert dry.returncode == 0, dry.stderr
        if words[1:] == ["run"]:  # what `make run` runs is the `sao` the Quick start then puts on the PATH
            assert ".venv/bin/sao run" in dry.stdout, dry.stdout
    elif words[0] == "source":
        assert words[1] == ".venv/bin/activate", "the Quick start activates another venv than the Makefile's"
        assert (venv / "bin" / "activate").is_file() and (venv / "bin" / "sao").is_file(), venv
    elif words[0] == "sao":
        result = subprocess.run([str(venv / "bin" / "sao"), *words[1:]], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    else:
        pytest.fail(f"README's Quick start has a command this test does not know how to check: {command!r}")


ECHO_TEMPLATE = re.compile(r"A template:\n\n```python\n(.*?)```", re.DOTALL)


@pytest.fixture
def plugin_env(tmp_path, monkeypatch):
    """`my_pkg.my_module:MyEnv` on the path: docs/envs.md's template under the name README gives it."""
    template = ECHO_TEMPLATE.search((ROOT / "docs" / "envs.md").read_text())
    assert template, "docs/envs.md: the env template is gone"
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "my_module.py").write_text(template.group(1) + "\n\nMyEnv = EchoEnv\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("my_pkg.my_module", "my_pkg"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("command", NEXT)
def test_a_command_after_the_quick_start_works_as_written(command, plugin_env, monkeypatch, tmp_path):
    words = shlex.split(command)
    assert words[0] == "sao"
    if words[1] == "run":
        seen = []

        def loop(cfg, console):  # everything `sao run` does before its loop, then the env's tasks and a reset
            tasks = make_tasks(cfg.env, 2)
            make_env(cfg.env).reset(tasks[0].spec)
            seen.append(cfg)

        monkeypatch.setattr(sao.launcher, "run", loop)
        monkeypatch.setenv("SAO__METRICS__LAUNCHER_PORT", "0")  # the default port may be taken on a shared machine
        result = CliRunner().invoke(app, words[1:])
        assert result.exit_code == 0, result.output
        assert len(seen) == 1
        flags = dict(zip(words[2::2], words[3::2], strict=False))
        if "--env" in flags:
            assert seen[0].env.name == flags["--env"]
        if "--policy-model" in flags:
            assert seen[0].policy.model == flags["--policy-model"]
    elif words[1:3] == ["broker", "start"]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        args = [*words[1:], "--state-dir", str(tmp_path / "broker")]
        args[args.index("--port") + 1] = str(port)
        sao_bin = Path(sys.prefix) / "bin" / "sao"
        started = subprocess.run([str(sao_bin), *args], capture_output=True, text=True, timeout=60)
        try:
            assert started.returncode == 0, started.stdout + started.stderr
            assert f"127.0.0.1:{port}" in started.stdout + started.stderr  # the console writes to stderr
        finally:
            stopped = subprocess.run([str(sao_bin), "broker", "stop", "--state-dir", str(tmp_path / "broker")],
                                     capture_output=True, text=True, timeout=60)
        assert "broker stopped" in stopped.stdout + stopped.stderr, stopped.stdout + stopped.stderr
    else:
        pytest.fail(f"README's next commands include one this test does not know how to check: {command!r}")
