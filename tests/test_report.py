"""The end-of-run report: report.md and PNG plots from a synthetic run directory."""

import json
import random
import re
from dataclasses import asdict

import pytest

from sao.config import SaoConfig
from sao.report import HELDOUT_KEYS, PLOTS, build_summary, decision_rows, reward_by_version, summary_table, write_report
from sao.status import write_status
from support.records import step_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _synthetic_run(run_dir) -> dict:
    rng = random.Random(0)
    steps, batch = 6, 4
    records = [step_record(step=i + 1, policy_version=i, trained_at=1000.0 + 3 * i,
                           rewards=[rng.random() for _ in range(batch)], advantages=[0.0] * batch,
                           staleness=[rng.randint(0, 2) for _ in range(batch)], behaviour_versions=[i] * batch,
                           compression_ratios=[2 + rng.random() for _ in range(batch)],
                           sampling_to_training_s=[1.0] * batch, loss=0.1 * i,
                           grad_norm=float("nan") if i == steps - 1 else 1.0)
               for i in range(steps)]
    write_status(run_dir / "status" / "trainer.json",
                 {"step": steps, "policy_version": steps, "too_stale": 1, "dlq_reasons": {"too-stale": 1},
                  "steps": [asdict(record) for record in records]})
    for i in range(2):
        write_status(run_dir / "status" / f"sampler-{i}.json",
                     {"produced": 12, "tokens": 300, "reloads": 3, "rollout_s": 24.0, "policy_version": 5})
    (run_dir / "config.toml").write_text("[trainer]\nmax_staleness = 8\n")
    summary = {"heldout_base": 0.375, "heldout_final": 0.5625, "heldout_gain": 0.1875, "heldout_gain_stderr": 0.0625,
               "heldout_n": 128, "trajectories_trained": steps * batch, "trainer_steps": steps,
               "reward_first_version": 0.123, "reward_last_version": 0.789, "policy_version": steps,
               "reward_by_version": [{"version": 0, "n": 4, "mean": 0.123, "stderr": 0.1},
                                     {"version": 5, "n": 4, "mean": 0.789, "stderr": None}],
               "compression_ratio": 2.5, "staleness_mean": 1.0, "duration_s": 42.0, "model": "tiny", "tasks_fed": 24}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return summary


def test_report_writes_markdown_and_plots(tmp_path):
    summary = _synthetic_run(tmp_path)
    report = write_report(tmp_path, summary)
    assert report == tmp_path / "report.md"
    text = report.read_text()
    for name in PLOTS:
        png = tmp_path / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, name
        assert f"(plots/{name}.png)" in text
    # The summary's figures appear, as do the samplers and the dead letters.
    for figure in ("0.123", "0.789", "2.5", "42", "tiny", "trainer_steps"):
        assert figure in text
    # What the run learned leads: held-out figures, and the gain in standard errors.
    assert "from 0.375 (base model) to 0.5625 (final version): a paired gain of 0.1875 ± 0.0625" in text
    assert ": +3.0 standard errors, beyond two" in text
    assert "| 5 | 4 | 0.789 | - |" in text
    assert "| sampler-1 | 12 | 300 | 3 | 2 | 5 |" in text
    assert "| too-stale | 1 |" in text
    assert "busy 0.75" in text


def test_report_reads_summary_from_disk_and_tolerates_missing_series(tmp_path):
    _synthetic_run(tmp_path)
    (tmp_path / "status" / "trainer.json").write_text(json.dumps({"step": 0}))  # a trainer that never stepped
    text = write_report(tmp_path).read_text()
    assert "0.789" in text
    assert all((tmp_path / "plots" / f"{name}.png").is_file() for name in PLOTS)


def test_summary_means_leave_out_a_step_without_a_grad_norm(tmp_path):
    _synthetic_run(tmp_path)  # the last of its 6 steps has a NaN grad norm, the others 1.0
    summary = build_summary(SaoConfig(), tmp_path, duration_s=42.0)
    assert summary["grad_norm_mean"] == 1.0
    assert summary["trajectories_trained"] == 24 and summary["trainer_steps"] == 6
    assert summary["max_behaviour_version"] == 5


def test_summary_leads_with_the_heldout_comparison(tmp_path):
    _synthetic_run(tmp_path)
    assert list(build_summary(SaoConfig(), tmp_path, duration_s=1.0))[:5] == list(HELDOUT_KEYS)
    assert build_summary(SaoConfig(), tmp_path, duration_s=1.0)["heldout_n"] is None  # not evaluated: no figures
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "heldout.json").write_text(json.dumps(
        {"heldout_base": 0.25, "heldout_final": 0.5, "heldout_gain": 0.25, "heldout_gain_stderr": 0.05,
         "heldout_n": 100, "per_task": {}}))
    summary = build_summary(SaoConfig(), tmp_path, duration_s=1.0)
    assert list(summary.items())[:5] == [("heldout_base", 0.25), ("heldout_final", 0.5), ("heldout_gain", 0.25),
                                         ("heldout_gain_stderr", 0.05), ("heldout_n", 100)]
    assert "per_task" not in summary
    text = write_report(tmp_path, summary).read_text()
    assert "+5.0 standard errors" in text


def test_sampled_reward_is_grouped_by_behaviour_version_not_by_completion_order():
    # One batch in completion order: v2's quick successes first, then v1's slow failures.
    steps = [step_record(rewards=[1.0, 1.0, 0.0, 0.0, 0.5], behaviour_versions=[2, 2, 1, 1, 2]),
             step_record(rewards=[0.0, float("nan")], behaviour_versions=[1, 3])]
    groups = reward_by_version(steps)
    assert [(g["version"], g["n"]) for g in groups] == [(1, 3), (2, 3)]  # a NaN reward is left out
    assert [g["mean"] for g in groups] == [0.0, pytest.approx(2.5 / 3)]
    assert groups[0]["stderr"] == 0 and groups[1]["stderr"] == pytest.approx(1 / 6)  # sd(1, 1, .5) / sqrt(3)


def test_summary_accounts_cpu_per_role_and_idle_ratios(tmp_path):
    _synthetic_run(tmp_path)  # 6 steps x 4 trajectories; staleness drawn from 0..2, sampling-to-training 1 s each
    status = tmp_path / "status"
    trainer = json.loads((status / "trainer.json").read_text())
    write_status(status / "trainer.json", {**trainer, "cpu_s": 30.0, "idle_s": 5.0, "run_s": 20.0})
    write_status(status / "sampler-0.json", {"produced": 12, "cpu_s": 10.0, "idle_s": 2.0, "run_s": 40.0})
    write_status(status / "sampler-1.json", {"produced": 12, "cpu_s": 6.0, "idle_s": 6.0, "run_s": 40.0})
    write_status(status / "launcher.json", {"cpu_s": 1.0, "broker_cpu_s": 3.0, "wall_s": 50.0, "cores": 2})
    summary = build_summary(SaoConfig(), tmp_path, duration_s=50.0)
    assert summary["cpu_cores_busy"] == pytest.approx(
        {"trainer": 0.6, "samplers": 0.32, "broker": 0.06, "launcher": 0.02, "total": 1.0})
    assert summary["cores"] == 2 and summary["cpu_utilisation"] == pytest.approx(0.5)
    assert summary["trainer_idle_ratio"] == pytest.approx(0.25)
    assert summary["sampler_idle_ratio"] == pytest.approx((0.05 + 0.15) / 2)
    assert summary["trajectories_per_s"] == pytest.approx(24 / 50)
    assert summary["sampling_to_training_s_p50"] == summary["sampling_to_training_s_p95"] == 1.0
    staleness = sorted(s for record in trainer["steps"] for s in record["staleness"])
    assert summary["sampling_to_training_steps_p50"] == pytest.approx((staleness[11] + staleness[12]) / 2)
    assert summary["sampling_to_training_steps_p95"] <= max(staleness)
    # The report and the run's table say where the CPU went.
    text = write_report(tmp_path, summary).read_text()
    assert "## Where the CPU went" in text and "| trainer | 0.6 |" in text and "Utilisation 0.5 of the cores" in text


def test_summary_without_accounting_files_leaves_the_figures_empty(tmp_path):
    _synthetic_run(tmp_path)  # progress files of a run from before the accounting: no cpu_s, no launcher file
    summary = build_summary(SaoConfig(), tmp_path, duration_s=50.0)
    assert summary["cpu_utilisation"] is None and summary["trainer_idle_ratio"] is None
    assert summary["cpu_cores_busy"]["total"] is None


def test_the_report_names_the_kept_version_even_when_base_and_final_answer_alike(tmp_path):
    summary = _synthetic_run(tmp_path)
    summary.update(heldout_final=0.375, heldout_gain=0.0, heldout_gain_stderr=0.0,  # every answer the same
                   shadow_best={"version": 4, "success": 0.5, "n": 16}, kept_version=4, heldout_kept=0.5,
                   heldout_kept_gain=0.125, heldout_kept_gain_stderr=0.05)
    text = write_report(tmp_path, summary).read_text()
    assert "Shadow validation kept v4" in text and "a paired gain of 0.125" in text


def test_the_summary_and_report_carry_the_skill_figure_and_the_format_ceiling(tmp_path):
    _synthetic_run(tmp_path)
    (tmp_path / "eval").mkdir()
    skills = {"answer<0": {"n": 4, "base": 0.0, "base_stderr": 0.0, "final": 0.5, "final_stderr": 0.289,
                           "final_gain": 0.5, "final_gain_stderr": 0.289},
              "answer>=0": {"n": 12, "base": 0.25, "base_stderr": 0.131, "final": 0.75, "final_stderr": 0.131,
                            "final_gain": 0.5, "final_gain_stderr": 0.151}}
    (tmp_path / "eval" / "heldout.json").write_text(json.dumps(
        {"heldout_base": 0.1875, "heldout_final": 0.6875, "heldout_gain": 0.5, "heldout_gain_stderr": 0.1,
         "heldout_n": 16, "heldout_skill": "answer<0", "heldout_skills": skills, "heldout_format_ceiling": 0.75,
         **{f"heldout_skill_{key}": value for key, value in skills["answer<0"].items()}}))
    summary = build_summary(SaoConfig(), tmp_path, duration_s=1.0)
    assert summary["heldout_skill"] == "answer<0" and summary["heldout_skill_final_gain"] == 0.5
    assert summary["heldout_format_ceiling"] == 0.75 and summary["heldout_skills"] == skills
    text = write_report(tmp_path, summary).read_text()
    assert "worst on is `answer<0` (n=4): 0 for the base model, 0.5 for the final version" in text
    assert "Format-only ceiling 0.75" in text
    assert "| answer>=0 | 12 | 0.25 ± 0.131 | 0.75 ± 0.131 | 0.5 ± 0.151 |" in text


def _full_summary(tmp_path) -> dict:
    """build_summary of the synthetic run with every held-out figure there: held-out, kept, skill, second try."""
    _synthetic_run(tmp_path)
    (tmp_path / "eval").mkdir()
    skill = {"n": 4, "base": 0.0, "base_stderr": 0.0, "final": 0.5, "final_stderr": 0.289, "final_gain": 0.5,
             "final_gain_stderr": 0.289}
    (tmp_path / "eval" / "heldout.json").write_text(json.dumps(
        {"heldout_base": 0.1875, "heldout_final": 0.6875, "heldout_gain": 0.5, "heldout_gain_stderr": 0.1,
         "heldout_n": 16, "kept_version": 4, "heldout_kept": 0.625, "heldout_kept_gain": 0.4375,
         "heldout_kept_gain_stderr": 0.11, "heldout_second_try_base": 0.1, "heldout_second_try_base_n": 13,
         "heldout_second_try_final": 0.4, "heldout_second_try_n": 5, "heldout_skill": "answer<0",
         "heldout_skills": {"answer<0": skill}, "heldout_format_ceiling": 0.75,
         **{f"heldout_skill_{key}": value for key, value in skill.items()}}))
    return build_summary(SaoConfig(), tmp_path, duration_s=42.0)


def test_the_printed_summary_fits_one_screen_and_leads_with_what_a_user_decides_on(tmp_path):
    from rich.console import Console

    summary = _full_summary(tmp_path)
    console = Console(width=160, record=True, file=open(tmp_path / "screen.txt", "w"))
    console.print(summary_table(summary, tmp_path))
    screen = console.export_text()
    assert len(screen.splitlines()) <= 25 + 5, screen  # at most 25 rows, and the table's frame
    rows = dict(decision_rows(summary))
    assert rows["held-out first-try success, base v0 -> final v6"] == "0.1875 -> 0.6875 (gain +0.5 ± 0.1, n=16)"
    assert rows["kept by shadow validation: v4"].startswith("0.625 (gain +0.4375 ± 0.11")
    assert rows["skill answer<0, base -> final"] == "0 -> 0.5 (gain +0.5 ± 0.289, n=4)"
    assert rows["format-only ceiling"] == "0.75"
    assert rows["trajectories trained / produced"].startswith("24 / 24")
    assert rows["throughput"] == f"{24 / 42:.4g} trajectories/s"
    assert dict(decision_rows({**summary, "cpu_utilisation": 0.876, "cores": 2}))["CPU busy"] == "88% of 2 cores"
    assert str(tmp_path) in screen and "docs/summary.md" in screen
    assert "trajectories_from_reloaded_policy" not in screen  # the rest stays in summary.json and report.md
    kept_is_final = dict(decision_rows({**summary, "kept_version": summary["policy_version"]}))
    assert not any(name.startswith("kept by") for name in kept_is_final)  # the final row says it already
    bare = dict(decision_rows({"trajectories_trained": 0}))
    assert bare["held-out evaluation"].startswith("none")


def test_docs_summary_md_explains_every_key_of_summary_json_and_no_other(tmp_path):
    from pathlib import Path

    legend = (Path(__file__).resolve().parent.parent / "docs" / "summary.md").read_text()
    explained = re.findall(r"^\| `(\w+)` \|", legend, flags=re.M)
    assert len(explained) == len(set(explained))
    assert sorted(explained) == sorted(_full_summary(tmp_path))


def test_tasks_fed_is_what_the_feeder_sent_not_what_was_asked(tmp_path):
    _synthetic_run(tmp_path)
    assert build_summary(SaoConfig(), tmp_path, duration_s=1.0)["tasks_fed"] == SaoConfig().run.num_tasks  # no file
    write_status(tmp_path / "status" / "feeder.json", {"mode": "async", "fed": 40})  # a budget ended it early
    assert build_summary(SaoConfig(), tmp_path, duration_s=1.0)["tasks_fed"] == 40
