"""Tiny-model ZeRO-3 engines in a fresh interpreter: DeepSpeed's process group must not live in pytest's.

`TINY_ENGINE` is the start of such a script: a seeded tiny policy config (learning rate 1e-3, unfused
AdamW, one thread) named `config`/`cfg`; `run_script` runs a script built on it and returns the JSON
object its last line prints.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # so that the script can import `support`

TINY_ENGINE = """
import json
import numpy as np
import torch
from sao.config import load_config
from sao.policy.weights import build_policy
from sao.trainer.baselines import RewardBaseline
from sao.trainer.engine import batch_layout, build_engine, shutdown
from sao.trainer.training_step import train_step
from support.trainer_runs import synthetic_trajectory

torch.manual_seed(0)
torch.set_num_threads(1)
config = load_config(overrides=['policy.model="tiny"', "trainer.learning_rate=1e-3", "trainer.fused_adamw=false"],
                     environ={})
cfg = config.trainer
"""


def run_script(script: str, *args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
