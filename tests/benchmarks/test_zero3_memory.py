"""`benchmarks/zero3_memory.py` on the tiny model: the house headline, 1/N sharding, and an offload arm that computes the same."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "zero3_memory.py"


@pytest.mark.slow
def test_two_ranks_hold_half_and_offload_changes_where_not_what(tmp_path):
    out = tmp_path / "zero3.json"
    subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--ranks", "2", "--steps", "2", "--json", str(out)],
                   check=True, timeout=1800)
    result = json.loads(out.read_text())

    headline = result["headline"]
    assert set(headline) == {"metric", "value", "baseline", "ratio", "unit"} and headline["unit"] == "bytes"
    assert all(math.isfinite(headline[key]) and headline[key] > 0 for key in ("value", "baseline", "ratio"))
    assert headline["ratio"] == pytest.approx(headline["value"] / headline["baseline"])
    one, two, offloaded = result["arms"]
    assert (one["ranks"], two["ranks"], offloaded["ranks"]) == (1, 2, 2)
    assert not one["offload_optimizer"] and not two["offload_optimizer"] and offloaded["offload_optimizer"]
    assert (one["offload_active"], two["offload_active"], offloaded["offload_active"]) == (False, False, True)
    assert headline["baseline"] == one["param_bytes"] + one["optimizer_state_bytes"]
    assert headline["value"] == two["param_bytes"] + two["optimizer_state_bytes"]
    # ZeRO-3 gives each of 2 ranks half of the parameters, AdamW state and fp32 masters (up to padding).
    for key in ("param_bytes", "optimizer_state_bytes", "master_weight_bytes"):
        assert 0.5 <= two[key] / one[key] < 0.501, key
        assert offloaded[key] == two[key], key  # offload moves the same bytes, it does not shrink them
    # AdamW keeps two fp32 moments per parameter of the rank's partition, and a step count (a scalar tensor).
    assert 0 < one["optimizer_state_bytes"] - 2 * one["master_weight_bytes"] <= 64
    # The same steps on the same rows: offload changes where the optimizer runs, not what it computes.
    assert len(offloaded["losses"]) == len(two["losses"]) == 2
    assert result["offload"]["loss_max_abs_diff"] < 1e-6
    assert two["losses"][1] != two["losses"][0]  # the first step did change the weights
    for arm in result["arms"]:
        assert math.isfinite(arm["step_s"]) and arm["step_s"] > 0
        assert all(len(rank["step_s"]) == 2 for rank in arm["per_rank"])
    assert result["offload"]["step_s_ratio"] == pytest.approx(offloaded["step_s"] / two["step_s"])
    # Where the bytes live: all on the CPU here; on a GPU offload moves the optimizer state off the accelerator.
    if offloaded["devices"]["param_bytes"] == "cpu":
        assert offloaded["accelerator_bytes"] == two["accelerator_bytes"] == 0
    else:
        assert offloaded["devices"]["optimizer_state_bytes"] == "cpu"
        assert offloaded["accelerator_bytes"] < two["accelerator_bytes"]
