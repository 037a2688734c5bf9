"""The end-of-run report: report.md and PNG plots from a synthetic run directory."""

import json
import random
from dataclasses import asdict

from sao.config import SaoConfig
from sao.report import PLOTS, build_summary, write_report
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
    summary = {"trajectories_trained": steps * batch, "trainer_steps": steps, "reward_first_window": 0.123,
               "reward_last_window": 0.789, "reward_window_size": 4, "compression_ratio": 2.5,
               "staleness_mean": 1.0, "duration_s": 42.0, "model": "tiny", "tasks_fed": 24}
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
