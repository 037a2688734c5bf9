"""`sao bench NAME [ARGS...]`: lists the benchmarks, refuses an unknown one, runs one with its arguments."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import sao.cli
from sao.cli import app

REPO_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_without_a_name_it_lists_every_benchmark_with_its_summary():
    result = CliRunner().invoke(app, ["bench"])
    assert result.exit_code == 0, result.output
    names = sorted(p.stem for p in REPO_BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
    assert {"compression", "learning", "sampler_throughput", "zero3_memory"} <= set(names)
    for name in names:
        assert name in result.stdout
    assert "held-out" in result.stdout  # learning.py's one-line docstring, read without importing it


def test_an_unknown_name_is_refused_naming_it_and_the_list_is_shown():
    result = CliRunner().invoke(app, ["bench", "no_such_benchmark"])
    assert result.exit_code == 2
    assert "unknown benchmark 'no_such_benchmark'" in result.stderr
    assert "zero3_memory" in result.stdout


def test_a_name_that_escapes_the_folder_is_refused():
    result = CliRunner().invoke(app, ["bench", "../sao/cli"])
    assert result.exit_code == 2
    assert "unknown benchmark" in result.stderr


def test_without_the_benchmarks_folder_it_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(sao.cli, "BENCHMARKS_DIR", tmp_path / "absent")
    result = CliRunner().invoke(app, ["bench", "learning"])
    assert result.exit_code == 2
    assert "no benchmarks folder" in result.stderr and "pip install -e" in result.stderr


def test_arguments_after_the_name_reach_the_benchmark_and_its_exit_status_comes_back(monkeypatch, tmp_path):
    (tmp_path / "echo_args.py").write_text(
        '"""Writes its arguments and the interpreter it runs on, then exits 3."""\n'
        "import json, pathlib, sys\n"
        "pathlib.Path(__file__).with_name('argv.json').write_text(json.dumps([sys.executable, sys.argv[1:]]))\n"
        "sys.exit(3)\n")
    monkeypatch.setattr(sao.cli, "BENCHMARKS_DIR", tmp_path)
    result = CliRunner().invoke(app, ["bench", "echo_args", "--json", "out.json", "--help", "-x", "plain"])
    assert result.exit_code == 3
    interpreter, argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv == ["--json", "out.json", "--help", "-x", "plain"]  # options after NAME are the benchmark's, --help too
    assert interpreter == sys.executable


def test_a_real_benchmark_answers_its_own_help():
    # Its own session: were --help lost on the way, the benchmark would start a real run; the group is then killed.
    process = subprocess.Popen([sys.executable, "-m", "sao.cli", "bench", "learning", "--help"], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 0, stderr
    assert "usage: learning.py" in stdout and "--seeds" in stdout
