"""A run is aborted for stalling, not for taking long: what counts as progress (`sao/launcher.py`)."""

import pytest

from sao.config import load_config
from sao.launcher import _progress

SAMPLERS = {"s0": {"produced": 3, "dead_lettered": 1, "idle_s": 5.0}}
TRAINER = {"trajectories_trained": 8, "dead_lettered": 0, "step": 1, "shadow": {"scores": {"0": 0.4}}}


@pytest.mark.parametrize("change", [
    lambda s, t: s["s0"].update(produced=4),
    lambda s, t: s["s0"].update(dead_lettered=2),
    lambda s, t: t.update(trajectories_trained=9),
    lambda s, t: t.update(dead_lettered=1),
    lambda s, t: t.update(step=2),
    lambda s, t: t["shadow"]["scores"].update({"2": 0.5}),  # the final score, after the last step
])
def test_work_of_any_process_is_progress(change):
    samplers, trainer = {"s0": dict(SAMPLERS["s0"])}, {**TRAINER, "shadow": {"scores": dict(TRAINER["shadow"]["scores"])}}
    before = _progress(samplers, trainer)
    change(samplers, trainer)
    assert _progress(samplers, trainer) != before


def test_a_sampler_that_only_idles_is_not_progress():
    samplers = {"s0": dict(SAMPLERS["s0"])}
    before = _progress(samplers, TRAINER)
    samplers["s0"]["idle_s"] = 60.0  # alive and writing its status, but no work done
    assert _progress(samplers, TRAINER) == before
    assert _progress({}, {}) == (0, 0, 0, 0, 0)  # before any status file exists


def test_the_wall_clock_limit_is_off_by_default_and_the_stall_limit_on():
    run = load_config(environ={}).run
    assert run.timeout_s is None and run.stall_timeout_s > 0


@pytest.mark.parametrize("terminal", [False, True])
def test_without_a_terminal_progress_is_one_line_every_15_seconds(terminal):
    """Output to a file (CI, nohup) gets no live bars from rich: a line instead, at most every 15 s."""
    import io
    import time

    from rich.console import Console
    from rich.progress import Progress, TextColumn

    from sao.launcher import PLAIN_PROGRESS_EVERY_S, _plain_progress

    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=200)
    bars = Progress(TextColumn("{task.description}"), console=console)
    bars.add_task("produced", total=96, completed=40, info="samplers on v3,v3")
    bars.add_task("trained ", total=96, completed=32, info="step 4 policy v4 reward(last 16) 0.31")
    now = time.time()
    assert _plain_progress(console, now, now - 20, bars) == now  # printed a moment ago: nothing yet
    due = now - PLAIN_PROGRESS_EVERY_S - 0.1
    printed = _plain_progress(console, due, now - 20, bars)
    if terminal:  # the live bars show it
        assert printed == due and out.getvalue() == ""
    else:
        assert printed >= now and out.getvalue().splitlines() == [
            "20 s: produced 40/96 samplers on v3,v3; trained 32/96 step 4 policy v4 reward(last 16) 0.31"]
