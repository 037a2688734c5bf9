"""Success per attempt: first and second attempts, in the trainer's records and in the summary."""

import json
from dataclasses import asdict

import pytest

from sao.config import SaoConfig
from sao.report import attempts_by_version, build_summary, sampler_phases, time_lines, trainer_phases, write_report
from sao.status import attempt_success, trainer_steps, write_status
from support.records import step_record


@pytest.mark.parametrize("rewards, expected", [
    ([1.0], (1.0, None)),  # right at once: no second attempt
    ([0.0, 0.5], (0.0, 1.0)),  # right at the second (discounted reward)
    ([0.0, 0.0], (0.0, 0.0)),  # wrong twice
    ([0.0], (0.0, None)),  # a one-attempt episode has no second attempt
    ([0.0, 0.0, 0.25], (0.0, 0.0)),  # right only at the third: the second was still wrong
])
def test_attempt_success_from_step_rewards(rewards, expected):
    assert attempt_success(rewards) == expected


def test_attempts_are_grouped_by_behaviour_version_and_old_records_are_left_out():
    steps = [step_record(behaviour_versions=[2, 1, 1], first_attempt_success=[1.0, 0.0, 0.0],
                         second_attempt_success=[None, 1.0, 0.0]),
             step_record(behaviour_versions=[2, 2], rewards=[0.0, 0.0], first_attempt_success=[0.0, 0.0],
                         second_attempt_success=[1.0, 1.0]),
             step_record(behaviour_versions=[1, 1, 1])]  # written before attempts were kept: no lists
    groups = attempts_by_version(steps)
    assert [(g["version"], g["first_n"], g["second_n"]) for g in groups] == [(1, 2, 2), (2, 3, 2)]
    assert [(g["first_success"], g["second_success"]) for g in groups] == [(0.0, 0.5), (pytest.approx(1 / 3), 1.0)]
    assert groups[0]["second_stderr"] == pytest.approx(0.5) and groups[1]["second_stderr"] == 0


def test_summary_and_report_show_first_and_second_attempt_success(tmp_path):
    records = [step_record(step=1, policy_version=0, behaviour_versions=[0, 0, 0, 0], rewards=[1.0, 0.5, 0.0, 0.0],
                           first_attempt_success=[1.0, 0.0, 0.0, 0.0], second_attempt_success=[None, 1.0, 0.0, 0.0]),
               step_record(step=2, policy_version=1, behaviour_versions=[1, 1], rewards=[0.5, 1.0],
                           first_attempt_success=[0.0, 1.0], second_attempt_success=[1.0, None])]
    write_status(tmp_path / "status" / "trainer.json", {"step": 2, "policy_version": 2,
                                                        "steps": [asdict(record) for record in records]})
    assert trainer_steps(json.loads((tmp_path / "status" / "trainer.json").read_text())) == records  # round trip
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "heldout.json").write_text(json.dumps(
        {"heldout_base": 0.25, "heldout_final": 0.5, "heldout_gain": 0.25, "heldout_gain_stderr": 0.05,
         "heldout_n": 100, "heldout_second_try_base": 0.04, "heldout_second_try_base_stderr": 0.02,
         "heldout_second_try_base_n": 75, "heldout_second_try_final": 0.3, "heldout_second_try_final_stderr": 0.07,
         "heldout_second_try_n": 50, "heldout_second_try_penalised_base": 0.95,
         "heldout_second_try_penalised_final": 0.1, "per_task": {}}))
    summary = build_summary(SaoConfig(), tmp_path, duration_s=1.0)
    assert summary["heldout_second_try_base"] == 0.04 and summary["heldout_second_try_n"] == 50
    assert summary["heldout_second_try_base_n"] == 75 and summary["heldout_second_try_final_stderr"] == 0.07
    assert [(g["version"], g["first_n"], g["first_success"], g["second_n"], g["second_success"])
            for g in summary["attempts_by_version"]] == [(0, 4, 0.25, 3, pytest.approx(1 / 3)), (1, 2, 0.5, 1, 1.0)]
    text = write_report(tmp_path, summary).read_text()
    assert ("the second attempt was right 0.04 ± 0.02 of the time for the base model (n = 75 tasks it got wrong "
            "first) and 0.3 ± 0.07 for the final version (n = 50)") in text
    assert "The env penalised 0.95 of the base model's second attempts and 0.1 of the final version's" in text
    assert "| 0 | 4 | 0.25 | 0.25 | 3 | 0.3333 | 0.3333 |" in text and "| 1 | 2 | 0.5 | 0.5 | 1 | 1 | - |" in text


def test_a_run_without_heldout_evaluation_says_nothing_of_second_tries(tmp_path):
    write_status(tmp_path / "status" / "trainer.json", {"step": 0})
    summary = build_summary(SaoConfig(), tmp_path, duration_s=1.0)
    assert summary["heldout_second_try_base"] is None and summary["attempts_by_version"] == []
    assert "second attempt was right" not in write_report(tmp_path, summary).read_text()
    assert "The env penalised" not in write_report(tmp_path, summary).read_text()


def test_the_time_table_splits_each_process_s_wall_time_and_the_rest_is_other(tmp_path):
    records = [step_record(step=1, wait_s=2.0, forward_backward_s=5.0, optimizer_s=1.0, publish_s=0.5),
               step_record(step=2, wait_s=0.5, forward_backward_s=6.0, optimizer_s=1.0, publish_s=0.5)]
    trainer = {"startup_s": {"model": 1.0, "engine": 3.0}, "checkpoint_s": 4.0, "wall_s": 30.0,
               "shadow": {"snapshot_s": 1.5, "scorer_cpu_s": 9.0}}
    phases = trainer_phases(trainer, records)
    assert phases["waiting for a batch"] == 2.5 and phases["forward and backward"] == 11.0
    assert phases["other"] == pytest.approx(30.0 - (4.0 + 2.5 + 11.0 + 2.0 + 1.0 + 4.0 + 1.5))
    sampler = sampler_phases({"sampler-0": {"run_s": 20.0, "idle_s": 5.0, "reload_s": 2.0, "wall_s": 24.0},
                              "sampler-1": {"run_s": 20.0, "idle_s": 7.0, "reload_s": 2.0, "wall_s": 22.0}})
    assert sampler == {"episodes live": 12.0, "loading versions": 2.0, "idle, no episode live": 6.0, "start-up": 3.0}
    text = "\n".join(time_lines(trainer, {}, records))
    assert "| trainer | forward and backward | 11 | 37% |" in text and "used 9 CPU seconds" in text
