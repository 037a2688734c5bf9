"""`benchmarks/heldout_speed.py` on the tiny model: both arms answer the same questions, and the headline
ratio is the arms' own fastest times."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "heldout_speed.py"


@pytest.mark.slow
def test_the_ratio_is_sao_over_plain_generate_on_the_same_questions(tmp_path):
    out = tmp_path / "speed.json"
    subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--tasks", "6", "--repeats", "2",
                    "--threads", "1", "--json", str(out)], check=True, timeout=600, cwd=tmp_path)
    result = json.loads(out.read_text())
    headline = result["headline"]
    assert result["tasks"] == 6 and len(result["runs"]["sao"]) == len(result["runs"]["plain"]) == 2
    assert headline["value"] == min(seconds for seconds, _ in result["runs"]["sao"])
    assert headline["baseline"] == min(seconds for seconds, _ in result["runs"]["plain"])
    assert headline["ratio"] == pytest.approx(headline["value"] / headline["baseline"])
    # The same greedy policy on the same prompts: both arms right on the same number of questions.
    assert result["runs"]["sao"][-1][1] == result["runs"]["plain"][-1][1]
