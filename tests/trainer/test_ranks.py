"""ZeRO-3 across 2 CPU ranks (torchrun, gloo), gradient accumulation and CPU offload: one loss curve."""

import json
import subprocess
import sys

import pytest

from sao.transport.broker import free_port
from support.trainer_runs import produce_trajectories, trainer_command, write_config


def train(ranks: int, config, bootstrap: str, run_dir) -> dict:
    command = trainer_command(config, bootstrap, run_dir)
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                   "--master_port", str(free_port()), "-m", *command[2:]]
    # A hang guard, not a speed check: alone one run takes ~70 s, beside other training runs 2-3x that.
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((run_dir / "status" / "trainer.json").read_text())


VARIANTS = {  # name: (ranks, extra [trainer] TOML)
    "one_rank": (1, ""),
    "two_ranks": (2, ""),
    "accumulation": (1, "deepspeed = { gradient_accumulation_steps = 2 }"),
    "cpu_offload": (1, 'deepspeed = { zero_optimization = { offload_optimizer = { device = "cpu" } } }'),
    # Passes of at most 64 positions: several per step, a different number on each rank.
    "token_passes": (2, "micro_batch_tokens = 64"),
}


@pytest.mark.slow
def test_ranks_accumulation_and_offload_follow_one_loss_curve(kafka_bootstrap, unique_topic_prefix, tmp_path):
    """2 ranks, 2 accumulation micro-batches, CPU offload and passes cut by a token budget train exactly like
    1 plain rank; `sao replay` rebuilds the 2-rank run's versions bit for bit. In fp32: bf16 autocast rounds each
    split of the batch its own way, which would hide a wrong split inside its rounding."""
    # One partition: every run reads the same trajectories in the same order.
    produce_trajectories(kafka_bootstrap, unique_topic_prefix, partitions=1)
    status = {}
    for name, (ranks, extra) in VARIANTS.items():
        config = tmp_path / f"{name}.toml"
        # a consumer group per run, so each reads the topic from the start
        write_config(config, unique_topic_prefix, group=f"{unique_topic_prefix}-{name}", trainer_toml=extra,
                     batch_size=4, checkpoint_every=100, precision="fp32")
        status[name] = train(ranks, config, kafka_bootstrap, tmp_path / name)
    one = status["one_rank"]

    def series(run: dict, figure: str) -> list[float]:
        return [record[figure] for record in run["steps"]]

    assert len(series(one, "loss")) == 5  # 18 trajectories / 4, the last batch partial
    for name in ("two_ranks", "accumulation", "cpu_offload", "token_passes"):
        other = status[name]
        assert series(other, "loss") == pytest.approx(series(one, "loss"), rel=1e-4, abs=1e-4), name
        assert series(other, "grad_norm") == pytest.approx(series(one, "grad_norm"), rel=1e-4), name
    assert status["two_ranks"]["world_size"] == 2
    # ZeRO-3: each of 2 ranks holds about half the parameters and optimizer state.
    for key in ("param_bytes", "optimizer_state_bytes"):
        assert status["two_ranks"]["memory"][key] < 0.6 * one["memory"][key], key

    # Each rank scores its own share again, in as many passes as in the run (a different number per rank).
    replayed = subprocess.run([sys.executable, "-m", "sao.cli", "replay", str(tmp_path / "token_passes")],
                              capture_output=True, text=True, timeout=600)
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    assert "5 of 5 versions match" in replayed.stderr, replayed.stderr[-3000:]
