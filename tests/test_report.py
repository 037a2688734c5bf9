"""The end-of-run report: report.md and PNG plots from a synthetic run directory."""

import json
import random

from sao.report import PLOTS, write_report
from sao.status import write_status

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _synthetic_run(run_dir, with_hook_fields: bool) -> dict:
    rng = random.Random(0)
    steps, batch = 6, 4
    history = {
        "reward": [rng.random() for _ in range(steps * batch)],
        "staleness": [rng.randint(0, 2) for _ in range(steps * batch)],
        "behaviour_version": [i // batch for i in range(steps * batch)],
        "compression_ratio": [2 + rng.random() for _ in range(steps * batch)],
        "loss": [0.1 * i for i in range(steps)], "grad_norm": [1.0] * (steps - 1) + [float("nan")],
        "ratio_mean": [1.0] * steps, "ratio_abs_dev": [1e-3] * steps, "clip_fraction": [0.0] * steps,
        "kl_k3": [0.0] * steps, "step_s": [2.0] * steps, "trained_at": [1000.0 + 3 * i for i in range(steps)],
    }
    if with_hook_fields:
        history |= {"batch_size": [float(batch)] * steps, "busy_fraction": [0.75] * steps}
    write_status(run_dir / "status" / "trainer.json",
                 {"step": steps, "policy_version": steps, "too_stale": 1, "dlq_reasons": {"too-stale": 1},
                  "history": history})
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
    summary = _synthetic_run(tmp_path, with_hook_fields=True)
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
    _synthetic_run(tmp_path, with_hook_fields=False)
    (tmp_path / "status" / "trainer.json").write_text(json.dumps({"history": {"reward": [1.0]}}))
    text = write_report(tmp_path).read_text()
    assert "0.789" in text
    assert all((tmp_path / "plots" / f"{name}.png").is_file() for name in PLOTS)
