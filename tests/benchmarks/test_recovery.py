"""`benchmarks/recovery.py`: its figures read the audit and the topics as they are, and a tiny run with
a sampler and the trainer killed -9 ends with nothing lost and nothing trained twice."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sao.audit import AuditReport, read_ledger
from support.benchmark_modules import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "recovery.py"


@pytest.fixture(scope="module")
def recovery():
    return load_benchmark("recovery")


def _report(**classes) -> AuditReport:
    fields = dict(finished=True, max_reuse=1, fed=6, fed_messages=6, trained=6, trained_twice={}, dead_lettered={},
                  in_flight_produced=[], in_flight_not_produced=[], lost_produced=[], lost_not_produced=[],
                  undecodable={}, not_fed=0, trained_after_checkpoint=0, checkpoint_step=2,
                  ledger={"steps": 2, "resumes": 1, "rolled_back_steps": 1, "undecodable_lines": 0}, notes=[])
    return AuditReport(**{**fields, **classes})


def test_lost_and_trained_twice_are_what_the_audit_says(recovery):
    assert recovery.audit_figures(_report())["lost"] == 0
    figures = recovery.audit_figures(_report(trained=2, lost_produced=["t-1#0"], lost_not_produced=["t-2#0", "t-3#0"],
                                             trained_twice={"t-4#0": 2}))
    assert (figures["lost"], figures["trained_twice"], figures["clean"]) == (3, 1, False)


def _produced(tid: str, sampler: str, at: float, rollout_s: float) -> dict:
    return {"id": tid, "sampler": sampler, "created_at": at, "rollout_s": rollout_s}


def test_a_trajectory_produced_again_counts_its_redo_and_only_the_killed_episodes_count_as_killed(recovery):
    produced = [_produced("t-0#0", "s-1", 5.0, 2.0),  # ended between the status write and the kill
                _produced("t-1#0", "s-1", 8.0, 3.0),  # delivered before the kill, its offset not committed
                _produced("t-1#0", "s-1-replacement", 30.0, 4.0),  # ... so redone
                _produced("t-2#0", "s-1-replacement", 31.0, 6.0),  # the killed episode, redone
                _produced("t-3#0", "s-0", 60.0, 1.0), _produced("t-3#0", "s-0", 61.0, 1.5)]  # after the trainer crash
    again = recovery.regenerated(produced)
    assert [(r["id"], r["first_by"], r["rollout_s"]) for r in again] == [("t-1#0", "s-1", 4.0), ("t-3#0", "s-0", 1.5)]

    crash = {"victim": "s-1", "killed_at": 10.0, "replaced_at": 12.0, "replacement": "s-1-replacement",
             "status_age_s": 0.01, "trainer_step": 1,
             "live_episodes": [{"task_id": "t-0", "copy": 0, "started_at": 4.0},
                               {"task_id": "t-2", "copy": 0, "started_at": 7.5}]}
    sampler = recovery.sampler_figures(crash, produced, again, trainer_killed_at=50.0)
    assert sampler["killed_episodes"] == 1 and sampler["killed_rollout_s"] == pytest.approx(2.5)
    assert sampler["redo_rollout_s"] == 6.0
    assert (sampler["produced_again"], sampler["generation_seconds_lost"]) == (1, 4.0)  # t-3's redo is not its
    assert sampler["replacement_to_first_trajectory_s"] == pytest.approx(18.0)


def test_what_the_resumed_trainer_trained_is_read_after_the_last_resume_marker(recovery, tmp_path):
    ledger = tmp_path / "trained.jsonl"
    lines = [{"step": 1, "trajectory_ids": ["a#0"]}, {"step": 2, "trajectory_ids": ["b#0"]},
             {"step": 3, "trajectory_ids": ["c#0"]}, {"resumed_from_step": 2}, {"step": 3, "trajectory_ids": ["c#0"]},
             {"step": 4, "trajectory_ids": ["d#0"]}]
    ledger.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert recovery.trained_after_resume(ledger) == {"c#0", "d#0"}


@pytest.mark.slow
def test_a_tiny_run_killed_twice_loses_nothing_and_reports_its_restart(tmp_path):
    out, run_dir, tasks = tmp_path / "recovery.json", tmp_path / "run", 32
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--tasks", str(tasks), "--batch-size", "4",
                           "--seed", "1", "--run-dir", str(run_dir), "--json", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())

    headline = result["headline"]
    assert {"metric", "value", "baseline", "ratio", "unit"} <= headline.keys() and headline["unit"] == "s"
    for key in ("value", "baseline", "ratio"):
        assert math.isfinite(headline[key]) and headline[key] > 0
    assert headline["ratio"] == pytest.approx(headline["value"] / headline["baseline"])
    assert result["lost"] == 0 and result["trained_twice"] == 0
    assert math.isfinite(result["generation_seconds_lost"]) and result["generation_seconds_lost"] >= 0

    # The audit's counts agree with the ledger the run left, read here on its own.
    audit = result["audit"]
    assert audit["clean"] and audit["finished"] and audit["fed"] == audit["trained"] == tasks
    ledger = read_ledger(run_dir / "trained.jsonl")
    assert sorted(ledger.times_trained().values()) == [1] * tasks
    assert audit["ledger"]["resumes"] == ledger.resumes == 1

    trainer = result["trainer_crash"]
    checkpoint_step = int(trainer["checkpoint"].removeprefix("step-"))
    assert 2 <= checkpoint_step <= trainer["step_at_kill"]  # killed past a checkpoint
    # A step may end between the status read and the kill: then one more was rolled back.
    assert trainer["rolled_back_steps"] - (trainer["step_at_kill"] - checkpoint_step) in (0, 1)
    assert trainer["restart_to_first_step_s"] == headline["value"]
    assert trainer["restart_start_up_s"] + trainer["restart_wait_s"] + trainer["restart_step_s"] == pytest.approx(
        trainer["restart_to_first_step_s"])

    sampler = result["sampler_crash"]
    assert sampler["killed_episodes"] >= 1 and sampler["killed_rollout_wall_s"] <= sampler["killed_rollout_s"]
    assert sampler["victim"] in {"sampler-0", "sampler-1"}
