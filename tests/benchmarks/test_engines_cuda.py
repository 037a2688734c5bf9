"""`benchmarks/gpu/engines_cuda.py` off a GPU: it refuses with a message, and pairs runs by seed when given them."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "engines_cuda.py"


def _module():
    spec = importlib.util.spec_from_file_location("engines_cuda", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_stops_with_a_message_and_runs_nothing(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--seeds", "--json", str(tmp_path / "out.json")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "no CUDA GPU" in result.stderr
    assert not (tmp_path / "out.json").exists()


def test_runs_pair_by_seed_and_only_where_both_engines_ran():
    def run(seed, gain, kept, wall):
        return {"seed": seed, "heldout_gain": gain, "heldout_kept_gain": kept, "wall_s": wall}

    runs = {"hf": {"runs": [run(0, 0.10, 0.12, 300.0), run(1, 0.20, None, 310.0)]},
            "vllm": {"runs": [run(0, 0.25, 0.25, 200.0), run(2, 0.30, 0.30, 210.0)]}}  # seed 1 and 2 ran once
    rows = _module().paired_by_seed(runs)
    assert [row["seed"] for row in rows] == [0]
    assert rows[0]["vllm_minus_hf"] == pytest.approx(0.15)
    assert (rows[0]["hf_wall_s"], rows[0]["vllm_heldout_kept_gain"]) == (300.0, 0.25)
