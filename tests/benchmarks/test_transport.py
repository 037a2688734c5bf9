"""`benchmarks/transport.py` in a tiny configuration: its JSON has the house headline, and every arm got every message."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "transport.py"


@pytest.mark.slow
def test_every_arm_delivers_every_message_and_the_headline_is_consistent(tmp_path):
    out = tmp_path / "transport.json"
    subprocess.run([sys.executable, str(SCRIPT), "--sizes", "1KB,8KB", "--messages", "12", "--latency-messages", "4",
                    "--latency-interval-ms", "20", "--repeats", "1", "--timeout-s", "60", "--json", str(out)],
                   check=True, timeout=600)
    result = json.loads(out.read_text())

    headline = result["headline"]
    assert {"metric", "value", "baseline", "ratio", "unit"} <= headline.keys()
    assert headline["unit"] == "messages/s" and headline["size_bytes"] == 8 * 1024  # upper middle of two sizes
    for key in ("value", "baseline", "ratio", "ratio_geomean"):
        assert math.isfinite(headline[key]) and headline[key] > 0
    assert headline["ratio"] == pytest.approx(headline["value"] / headline["baseline"])

    assert set(result["sizes"]) == {"1024", "8192"}
    for size, arms in result["sizes"].items():
        assert set(arms) == {"bare", "sao", "sao-blocking"}
        for arm, row in arms.items():
            # 12 timed messages + 4 paced ones, each received once, none refused by the trainer's checks.
            assert row["sent"] == row["received"] == 16, (size, arm)
            assert row["duplicates"] == 0 and row["dead_lettered"] == 0, (size, arm)
            assert row["latency_n"] == 4
            assert 0.9 * int(size) <= row["message_bytes"] <= 1.1 * int(size)  # trajectories of the asked size
            assert row["latency_p50_ms"] <= row["latency_p99_ms"]
            assert math.isfinite(row["messages_per_s"]) and row["mb_per_s"] > 0
            assert row["producer_cpu_us_per_msg"] > 0 and row["consumer_cpu_us_per_msg"] > 0
            assert math.isfinite(row["broker_cpu_us_per_msg"]) and row["broker_cpu_us_per_msg"] >= 0  # 10 ms ticks
        assert arms["sao"]["ratio_to_bare"] == pytest.approx(arms["sao"]["messages_per_s"]
                                                             / arms["bare"]["messages_per_s"])
    assert {"fetch.wait.max.ms", "session.timeout.ms"} <= result["settings"]["sao_consumer"].keys()
    assert result["settings"]["sao_producer"]["acks"] == "all"
