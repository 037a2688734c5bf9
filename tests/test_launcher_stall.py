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
