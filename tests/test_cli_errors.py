"""A newcomer's mistakes at the command line: each gets one line naming what is wrong, exit code 2, no traceback."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from sao.cli import app
from sao.transport.broker import free_port

CONNECT_TIMEOUT_S = 1.0


@pytest.fixture(scope="module", autouse=True)
def _datasets_imported():
    """reasoning-gym takes seconds to import: done once here, so a command's time is its own."""
    from sao.config import EnvConfig
    from sao.envs.registry import check_env_config

    check_env_config(EnvConfig())


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def _one_line(output: str, words: str) -> None:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], output
    assert "Traceback" not in output


@pytest.mark.parametrize("command", [
    ["feed"], ["topics"], ["inspect", "trajectories"], ["audit", "--run-dir", "{run}"],
    ["sampler", "--run-dir", "{run}", "--metrics-port", "0"], ["trainer", "--run-dir", "{run}", "--metrics-port", "0"],
    ["run", "--run-dir", "{run}", "--metrics-port", "0"],
])
def test_every_command_that_talks_to_a_broker_names_an_unreachable_one_within_the_timeout(command, tmp_path):
    run = tmp_path / "run"
    (run / "policy").mkdir(parents=True)  # a run folder, so that audit gets as far as the broker
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    result = _invoke(*(part.format(run=run) for part in command), "--bootstrap-servers", address,
                     "--set", f"broker.connect_timeout_s={CONNECT_TIMEOUT_S}")
    elapsed = time.monotonic() - started
    assert result.exit_code == 2, result.output
    _one_line(result.output, f"no broker answers at {address}")
    assert "broker.connect_timeout_s" in result.output and "--bootstrap-servers" in result.output
    assert CONNECT_TIMEOUT_S <= elapsed < CONNECT_TIMEOUT_S + 5  # waited for the broker, then gave up at once


@pytest.mark.parametrize("command, flag", [
    (["feed", "--start-index", "-3"], "--start-index"),
    (["inspect", "--limit", "0"], "--limit"),
    (["sampler", "--max-tasks", "0"], "--max-tasks"),
    (["trainer", "--expect", "-1"], "--expect"),
    (["audit", "--run-dir", ".", "--quiet-s", "0"], "--quiet-s"),
    (["eval", "--num-tasks", "0"], "--num-tasks"),
    (["sampler", "--metrics-port", "70000"], "--metrics-port"),
    (["compression", "record", "--out", "x.jsonl", "--start-index", "-1"], "--start-index"),
    (["compression", "train", "--max-messages", "0"], "--max-messages"),
])
def test_a_numeric_flag_out_of_range_is_refused_naming_it(command, flag):
    result = _invoke(*command)
    assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output, result.output
    assert "Traceback" not in result.output


def test_the_sao_command_says_a_usage_mistake_in_one_line(capsys):
    """What a user types goes through `main`: a bad value or an unknown flag is one line on stderr, exit 2."""
    import sys

    from sao.cli import main

    for argv, names in ((["feed", "--start-index", "-3"], "--start-index"), (["feed", "--nope"], "--nope")):
        sys.argv = ["sao", *argv]
        with pytest.raises(SystemExit) as stopped:
            main()
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.count("\n") == 1 and names in err and "sao feed --help" in err, err


@pytest.mark.parametrize("command, field", [
    (["feed", "--bootstrap-servers", "127.0.0.1:1"], "env.dataset_options.allow_parentheses: chain_sum has no such option"),
    (["eval"], "env.dataset_options.allow_parentheses: chain_sum has no such option"),
])
def test_a_dataset_option_the_dataset_lacks_is_refused_before_anything_starts(command, field, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "a" / "policy").mkdir(parents=True)
    result = _invoke(*command, "--set", 'env.dataset="chain_sum"',
                     "--set", "env.dataset_options.allow_parentheses=true")
    assert result.exit_code == 2, result.output
    assert field in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("made", [None, "empty"])
def test_audit_of_a_folder_that_holds_no_run_fails_saying_so(made, tmp_path):
    run = tmp_path / "typo"
    if made:
        run.mkdir()
    result = _invoke("audit", "--run-dir", str(run), "--bootstrap-servers", "127.0.0.1:1")
    assert result.exit_code == 2
    _one_line(result.output, f"--run-dir {run} holds no run")


def test_eval_export_and_shadow_use_the_newest_run_and_name_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for command in (["eval"], ["export", "--out", "out"], ["shadow"]):
        result = _invoke(*command)
        assert result.exit_code == 2
        _one_line(result.output, "no run under runs/: pass --run-dir")
    for name in ("older", "newer"):
        (tmp_path / "runs" / name / "policy").mkdir(parents=True)
        time.sleep(0.02)  # distinct modification times
    (tmp_path / "runs" / "not-a-run").mkdir()
    result = _invoke("export", "--out", "out", "--version", "latest")
    assert result.exit_code == 2 and "`best` or `final`" in result.output
    assert "run directory: runs/newer (the newest under runs/" in result.output
    assert not (tmp_path / "out").exists()  # never the base model, silently
    # eval reads the run's own config: its dataset here, with an option that dataset lacks.
    (tmp_path / "runs" / "newer" / "config.toml").write_text(
        '[env]\ndataset = "chain_sum"\ndataset_options = { allow_parentheses = false }\n')
    result = _invoke("eval")
    assert result.exit_code == 2 and "env.dataset_options.allow_parentheses: chain_sum" in result.output
