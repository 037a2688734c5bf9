"""What `sao run` says after its held-out comparison (faked here), and the summary rows that carry its figures."""

import io

from rich.console import Console

from sao import launcher
from sao.config import SaoConfig
from sao.report import decision_rows
from sao.run_dir import RunDir
from sao.status import write_status


def _printed(tmp_path, monkeypatch, **figures) -> str:
    import sao.sampler.evaluation as evaluation

    result = {"heldout_base": 0.4, "heldout_final": 1.0, "heldout_n": 10, "base_cached": True, "base_seconds": 1.0,
              "final_seconds": 1.0, "heldout_second_try_base": 0.1, "heldout_second_try_base_stderr": 0.1,
              "heldout_second_try_base_n": 6, "heldout_second_try_final": None, "heldout_second_try_final_stderr": None,
              "heldout_second_try_n": 0, **figures}
    monkeypatch.setattr(evaluation, "compare", lambda *args, **kwargs: result)
    run_dir = RunDir(tmp_path)
    write_status(run_dir.status("trainer"), {"policy_version": 3})
    out = io.StringIO()
    launcher._compare_on_heldout(SaoConfig(), run_dir, Console(file=out, width=200))
    return out.getvalue()


def test_the_comparison_says_what_it_judged_and_leaves_the_figures_to_the_summary(tmp_path, monkeypatch):
    text = _printed(tmp_path, monkeypatch, heldout_second_try_penalised_base=5 / 6,
                    heldout_second_try_penalised_final=None)
    assert "held-out evaluation done: 10 tasks in 2 s, the base's scores from the cache" in text
    assert "0.400" not in text and "0.4 " not in text  # each figure is said once, by the summary


def test_penalised_retries_show_even_when_the_final_version_had_no_second_attempt():
    # The final version got every first answer right: its share is None, and the row must not crash on it.
    rows = dict(decision_rows({"heldout_n": 10, "heldout_second_try_base_n": 6, "heldout_second_try_n": 0,
                               "heldout_second_try_penalised_base": 5 / 6, "heldout_second_try_penalised_final": None}))
    assert rows["second tries with no new answer (penalised), base -> final"] == "0.8333 -> -"


def test_no_penalised_row_when_the_env_penalised_nothing():
    rows = dict(decision_rows({"heldout_n": 10, "heldout_second_try_base_n": 6, "heldout_second_try_n": 0,
                               "heldout_second_try_penalised_base": 0.0, "heldout_second_try_penalised_final": None}))
    assert any(name.startswith("second-try success") for name in rows)
    assert not any("penalised" in name for name in rows)


def test_the_skill_row_names_the_skill_its_gain_the_kept_version_and_the_format_ceiling():
    rows = dict(decision_rows({"heldout_n": 10, "heldout_skill": "answer<0", "heldout_skill_n": 5,
                               "heldout_skill_base": 0.0, "heldout_skill_final": 0.4, "heldout_skill_final_gain": 0.4,
                               "heldout_skill_final_gain_stderr": 0.245, "heldout_skill_kept": 0.6,
                               "heldout_format_ceiling": 0.5}))
    assert rows["skill answer<0, base -> final"] == "0 -> 0.4 (gain +0.4 ± 0.245, n=5); kept 0.6"
    assert rows["format-only ceiling"] == "0.5"
