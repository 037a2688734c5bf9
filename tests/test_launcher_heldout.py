"""What `sao run` prints after its held-out comparison (the comparison itself is faked here)."""

import io

from rich.console import Console

from sao import launcher
from sao.config import SaoConfig
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


def test_penalised_retries_print_even_when_the_final_version_had_no_second_attempt(tmp_path, monkeypatch):
    # The final version got every first answer right: its share is None, and the line must not crash on it.
    text = _printed(tmp_path, monkeypatch, heldout_second_try_penalised_base=5 / 6,
                    heldout_second_try_penalised_final=None)
    assert "no new answer (penalised): v0 0.833 (n=6) -> v3 - (n=0)" in text


def test_no_penalised_line_when_the_env_penalised_nothing(tmp_path, monkeypatch):
    text = _printed(tmp_path, monkeypatch, heldout_second_try_penalised_base=0.0,
                    heldout_second_try_penalised_final=None)
    assert "second-try success" in text and "no new answer" not in text


def test_the_skill_line_names_the_skill_its_gain_and_the_format_ceiling(tmp_path, monkeypatch):
    text = _printed(tmp_path, monkeypatch, heldout_second_try_penalised_base=0.0, heldout_second_try_penalised_final=None,
                    heldout_skill="answer<0", heldout_skill_n=5, heldout_skill_base=0.0, heldout_skill_base_stderr=0.0,
                    heldout_skill_final=0.4, heldout_skill_final_gain=0.4, heldout_skill_final_gain_stderr=0.245,
                    heldout_format_ceiling=0.5)
    assert ("held-out on skill answer<0: v0 0.000 ± 0.000 (n=5) -> v3 0.400, gain +0.400 ± 0.245; "
            "format-only ceiling 0.500") in text
