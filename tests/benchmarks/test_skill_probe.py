"""`benchmarks/skill_probe.py` on the tiny model: probabilities of the right reply in every context, and the
headline is the first try's right reply against the greedy one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "skill_probe.py"


def test_right_reply_keeps_the_policy_s_form():
    sys.path.insert(0, str(SCRIPT.parent))
    from skill_probe import right_reply

    assert right_reply("3 - 9 = 6", "-6") == "3 - 9 = -6"
    assert right_reply("The answer is 4.", "-4") == "The answer is -4."
    assert right_reply("no idea", "-1") == "-1"


@pytest.mark.slow
def test_every_context_is_probed_on_every_negative_question(tmp_path):
    out = tmp_path / "probe.json"
    subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--every", "11", "--threads", "1",
                    "--json", str(out)], check=True, timeout=600)
    result = json.loads(out.read_text())
    figures, headline = result["figures"], result["headline"]
    assert len(figures) == 5 and {f["n"] for f in figures.values()} == {len(result["examples"])} and result["examples"]
    assert all(0 <= f["mean"] <= 1 and 0 <= f["median"] <= 1 for f in figures.values())
    assert headline["value"] == figures["first try, right reply"]["mean"]
    assert headline["ratio"] == pytest.approx(headline["value"] / headline["baseline"])
    assert all(e["right"] != e["greedy"] for e in result["examples"])  # a random model never answers right
