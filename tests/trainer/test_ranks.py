"""ZeRO-3 across 2 CPU ranks (torchrun, gloo) follows the same loss curve as 1 rank, with half the memory."""

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
    result = subprocess.run(command, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((run_dir / "status" / "trainer.json").read_text())


@pytest.mark.slow
def test_two_ranks_match_one_rank(kafka_bootstrap, unique_topic_prefix, tmp_path):
    # One partition: both runs read the same trajectories in the same order.
    produce_trajectories(kafka_bootstrap, unique_topic_prefix, partitions=1)
    status = {}
    for ranks in (1, 2):
        config = tmp_path / f"r{ranks}.toml"
        write_config(config, unique_topic_prefix, batch_size=4, checkpoint_every=100)
        # a consumer group per run, so the second run reads the topic from the start too
        config.write_text(config.read_text().replace(f'"{unique_topic_prefix}-trainer"',
                                                     f'"{unique_topic_prefix}-trainer-{ranks}"'))
        status[ranks] = train(ranks, config, kafka_bootstrap, tmp_path / f"run{ranks}")
    one, two = status[1], status[2]
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert len(one["history"]["loss"]) == len(two["history"]["loss"]) == 5  # 18 trajectories / 4, last one partial
    assert one["history"]["loss"] == pytest.approx(two["history"]["loss"], rel=1e-4, abs=1e-4)
    assert one["history"]["grad_norm"] == pytest.approx(two["history"]["grad_norm"], rel=1e-4)
    # ZeRO-3: each rank holds about half the parameters and optimizer state.
    for key in ("param_bytes", "optimizer_state_bytes"):
        assert two["memory"][key] < 0.6 * one["memory"][key], key
