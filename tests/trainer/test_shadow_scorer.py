"""The shadow scorer process as the trainer drives it: it scores what it is asked (the base model
first), and a scorer that dies costs the run its scores, never its training."""

import os
import signal
import subprocess
import sys
import time

import pytest

from sao.config import load_config, to_toml
from sao.run_dir import RunDir
from sao.trainer.shadow import ShadowScorerProcess, background_cpus
from support.pids import is_running


@pytest.fixture
def scorer(tmp_path):
    config = load_config(overrides=['policy.model="tiny"', "policy.max_new_tokens=4", "run.heldout_cap=2",
                                    "trainer.shadow_tasks=3", f'run.heldout_cache_dir="{tmp_path / "cache"}"'],
                         environ={})
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    (tmp_path / "config.toml").write_text(to_toml(config))
    process = ShadowScorerProcess(run_dir, tmp_path / "config.toml")
    yield process
    process.stop()


@pytest.mark.slow
def test_it_scores_the_base_model_on_its_own_validation_tasks(scorer):
    scorer.request(0)
    assert not scorer.idle
    score = scorer.wait(300)
    assert score is not None and score.version == 0 and scorer.idle
    assert score.n == 3  # trainer.shadow_tasks distinct tasks after the final comparison's 2
    assert all(task.startswith("eval/") for task in score.successes)
    assert scorer.cpu_s > 0


@pytest.mark.slow
def test_a_dead_scorer_is_reported_and_never_waited_for(scorer):
    scorer.process.kill()
    scorer.process.wait()
    scorer.request(0)
    started = time.monotonic()
    assert scorer.wait(300) is None
    assert time.monotonic() - started < 5  # noticed at once, not after the timeout
    assert scorer.failed is not None and "exited" in scorer.failed
    assert not scorer.idle  # nothing more is handed to it


def test_a_pinned_trainers_scorer_runs_on_the_samplers_cpus(tmp_path):
    """It takes the CPU the samplers leave idle, never a share of the pinned trainer's (which would lengthen a step)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: one for the samplers, one for the trainer")
    samplers, trainer = [cpus[0]], [cpus[1]]
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    os.sched_setaffinity(0, trainer)  # as `sao trainer` pins itself: the scorer would inherit this
    try:
        config = load_config(overrides=[f"sampler.cpu_affinity={samplers}", f"trainer.cpu_affinity={trainer}"],
                             environ={})
        process = ShadowScorerProcess(run_dir, tmp_path / "config.toml", background_cpus(config))
    finally:
        os.sched_setaffinity(0, cpus)
    try:
        assert os.sched_getaffinity(process.process.pid) == set(cpus) - set(trainer)
        assert os.getpriority(os.PRIO_PROCESS, process.process.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 10
    finally:
        process.stop()


# A trainer's stand-in: starts the scorer as the trainer does, then fails (as a refused resume does), or waits
# for the test's signal; the real trainer's start-up takes longer than the scorer's imports, so this is harsher.
TRAINER_STAND_IN = """
import sys, time
from pathlib import Path
from sao.run_dir import RunDir
from sao.trainer.shadow import ShadowScorerProcess
scorer = ShadowScorerProcess(RunDir(sys.argv[1]), Path(sys.argv[2]))
print(scorer.process.pid, flush=True)
sys.stdin.readline()  # the test has seen the scorer alive
if sys.argv[3] == "raise":
    raise RuntimeError("resume refused")
time.sleep(600)
"""


@pytest.mark.parametrize("end", ["raise", signal.SIGTERM])  # SIGKILL takes the path SIGTERM does here
def test_the_scorer_never_outlives_the_trainer_that_started_it(end, tmp_path):
    config = load_config(overrides=['policy.model="tiny"'], environ={})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "config.toml").write_text(to_toml(config))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_STAND_IN, str(run_dir), str(tmp_path / "config.toml"),
                                "raise" if end == "raise" else "wait"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    scorer_pid = int(trainer.stdout.readline())
    assert is_running(scorer_pid)  # still importing: it has not yet seen who its parent is
    if end == "raise":
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
    else:
        trainer.send_signal(end)
    trainer.wait(60)
    deadline = time.monotonic() + 40  # the trainer's stop gives the scorer 30 s to end
    while is_running(scorer_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_running(scorer_pid), f"the shadow scorer (pid {scorer_pid}) outlived its trainer ({end})"
