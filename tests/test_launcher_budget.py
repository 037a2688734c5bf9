"""`sao run --minutes N` (run.max_minutes): at the budget the feeder stops and the trainer is asked to stop."""

import signal
import time

from sao import launcher
from sao.config import load_config


class _Process:
    def __init__(self):
        self.signals = []

    def send_signal(self, number):
        self.signals.append(number)


def _config(minutes):
    return load_config(overrides=[f"run.max_minutes={minutes}"], environ={})


def test_the_trainer_is_signalled_once_when_the_budget_is_spent():
    trainer, started = _Process(), time.time()
    assert not launcher._over_budget(_config(1), started, {"step": 0}, trainer, False)  # a minute to go
    spent = started - 61
    assert not launcher._over_budget(_config(1), spent, {}, trainer, False)  # no progress yet: its handler may not be set
    assert launcher._over_budget(_config(1), spent, {"step": 3}, trainer, False)
    assert launcher._over_budget(_config(1), spent, {"step": 4}, trainer, True)
    assert trainer.signals == [signal.SIGTERM]
    assert not launcher._over_budget(load_config(environ={}), spent, {"step": 3}, trainer, False)  # no budget


def test_minutes_is_run_max_minutes_and_must_be_positive():
    from typer.testing import CliRunner

    from sao.cli import app

    result = CliRunner().invoke(app, ["run", "--minutes", "0"])  # refused at start, before any process
    assert result.exit_code != 0 and "run.max_minutes" in result.output
