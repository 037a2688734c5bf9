"""What validation misses must not stop the trainer nor reach the weights (issue 12, items 2 and 3).

A trajectory that raises while scored is dead-lettered (`scoring-error`) and the rest of its batch
trains; a batch whose loss or gradient norm is not finite is skipped (`non-finite-loss`), leaving
weights, optimizer state and baselines exactly as they were.
"""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sao.transport.topics import ensure_topics
from support.trainer_runs import (
    dead_letters,
    latest_weights_are_finite,
    produce,
    synthetic_trajectory,
    trained_ids,
    trainer_command,
    write_config,
)

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.mark.slow
@pytest.mark.parametrize("deepspeed", [
    "{}", '{ gradient_accumulation_steps = 2, zero_optimization = { offload_optimizer = { device = "cpu" } } }'],
    ids=["plain", "accumulation+offload"])
def test_what_cannot_be_trained_leaves_no_trace_in_the_engine(deepspeed):
    """Two engines (plain: one rank without ZeRO; offload: ZeRO-3): one meets a trajectory that raises and a
    batch with a NaN loss, one never does."""
    result = subprocess.run([sys.executable, str(SUPPORT / "training_step_checks.py"), deepspeed],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    findings = json.loads(result.stdout.split("FINDINGS ", 1)[1])
    assert findings["dead_lettered_unscorable"] == [["bad#0", "scoring-error"]]
    assert "IndexError" in findings["unscorable_detail"]
    assert findings["applied_without_it"] == ["task-0#0", "task-1#0"]
    assert findings["same_as_clean_after_unscorable"]  # the failed pass left nothing behind
    assert findings["skipped_reason"] == "non-finite-loss"
    assert findings["dead_lettered_poisoned"] == [["poison#0", "non-finite-loss"], ["task-2#0", "non-finite-loss"],
                                                  ["task-3#0", "non-finite-loss"]]
    assert findings["weights_unchanged_by_skip"] and findings["moments_unchanged_by_skip"]  # bit for bit
    assert findings["same_as_clean_after_skip"] and findings["moved_since_skip"] and findings["final_finite"]
    # A stop (SIGTERM) waits for one pass at most: the step is abandoned and leaves no trace.
    assert findings["passes"] > 1 and findings["interrupted"] and findings["passes_before_stop"] == 1
    assert findings["weights_unchanged_by_stop"] and findings["same_as_clean_after_stop"]


@pytest.mark.slow
def test_trainer_survives_what_validation_would_have_dead_lettered(kafka_bootstrap, unique_topic_prefix, tmp_path):
    prefix = unique_topic_prefix
    ensure_topics(kafka_bootstrap, {f"{prefix}.traj": 1, f"{prefix}.policy": 1, f"{prefix}.dlq": 1})
    rng = np.random.default_rng(3)
    good = [replace(synthetic_trajectory(i, rng), created_at=1000.0 + i) for i in range(8)]
    unscorable = replace(good[0], trajectory_id="bad#0", task_id="bad", created_at=1000.5,
                         prompt_ids=np.array([10**6, 7], np.int32))
    poisoned = replace(good[2], trajectory_id="poison#0", task_id="poison", created_at=1002.5,
                       steps=[replace(s, reward=1e39) for s in good[2].steps])
    # Batches of 3, oldest first: [g0 bad g1] -> g0 g1 trained; [g2 poison g3] -> skipped; [g4 g5 g6]
    batches = [good[0], unscorable, good[1], good[2], poisoned, good[3], good[4], good[5], good[6]]
    produce(kafka_bootstrap, f"{prefix}.traj", batches)
    config, run_dir = tmp_path / "sao.toml", tmp_path / "run"
    write_config(config, prefix, checkpoint_every=100)
    entry = [str(SUPPORT / "unvalidated_trainer.py")]
    first = subprocess.run(trainer_command(config, kafka_bootstrap, run_dir, expect=len(batches), entry=entry),
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]

    letters = dead_letters(kafka_bootstrap, f"{prefix}.dlq")
    assert {key: letter["reason"] for key, letter in letters.items()} == {
        "bad": "scoring-error", "poison": "non-finite-loss", good[2].task_id: "non-finite-loss",
        good[3].task_id: "non-finite-loss"}
    assert "IndexError" in letters["bad"]["detail"]
    trained = trained_ids(run_dir)
    assert trained == [t.trajectory_id for t in (good[0], good[1], good[4], good[5], good[6])]
    status = json.loads((run_dir / "status" / "trainer.json").read_text())
    assert status["skipped_steps"] == {"non-finite-loss": 1} and status["step"] == 2
    assert latest_weights_are_finite(run_dir)
    # The skipped batch's rewards never reached the running baseline: it holds the trained ones only.
    # (a running mean's first 1 / (1 - momentum) = 10 rewards are averaged plainly; arithmetic credits
    # each turn with its own reward, so the turn-0 key holds first answers' rewards)
    trained_rewards = [t.steps[0].reward for t in (good[0], good[1], good[4], good[5], good[6])]
    expected = sum(trained_rewards) / len(trained_rewards)
    checkpoints = run_dir / "checkpoints"
    state = json.loads((checkpoints / (checkpoints / "latest").read_text() / "sao_state.json").read_text())
    assert state["baseline"]["values"]["env:arithmetic"] == pytest.approx(expected, abs=1e-12)

    produce(kafka_bootstrap, f"{prefix}.traj", [good[7]])
    second = subprocess.run(trainer_command(config, kafka_bootstrap, run_dir, "--resume", expect=len(batches) + 1,
                                            entry=entry), capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert dead_letters(kafka_bootstrap, f"{prefix}.dlq").keys() == letters.keys()  # none of them met again
    assert trained_ids(run_dir) == trained + [good[7].trajectory_id]


@pytest.mark.slow
def test_two_ranks_skip_together_when_one_rank_meets_a_non_finite_loss(kafka_bootstrap, unique_topic_prefix, tmp_path):
    """The poisoned trajectory is scored by rank 1 only; DeepSpeed's all-reduced check stops both ranks' step."""
    from sao.transport.broker import free_port

    prefix = unique_topic_prefix
    ensure_topics(kafka_bootstrap, {f"{prefix}.traj": 1, f"{prefix}.policy": 1, f"{prefix}.dlq": 1})
    rng = np.random.default_rng(3)
    good = [replace(synthetic_trajectory(i, rng), created_at=1000.0 + i) for i in range(8)]
    poisoned = replace(good[3], trajectory_id="poison#0", task_id="poison", created_at=1003.5,
                       steps=[replace(s, reward=1e39) for s in good[3].steps])
    # Batches of 3: [g0 g1 g2]; [g3 poison g4] (rank 0 scores g3 and g4, rank 1 the poison); [g5 g6 g7]
    messages = [*good[:4], poisoned, *good[4:]]
    produce(kafka_bootstrap, f"{prefix}.traj", messages)
    config, run_dir = tmp_path / "sao.toml", tmp_path / "run"
    write_config(config, prefix, checkpoint_every=100)
    command = trainer_command(config, kafka_bootstrap, run_dir, expect=len(messages),
                              entry=[str(SUPPORT / "unvalidated_trainer.py")])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), *command[1:]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {key: letter["reason"] for key, letter in dead_letters(kafka_bootstrap, f"{prefix}.dlq").items()} == {
        "poison": "non-finite-loss", good[3].task_id: "non-finite-loss", good[4].task_id: "non-finite-loss"}
    assert trained_ids(run_dir) == [t.trajectory_id for t in (*good[:3], *good[5:])]
    for name in ("trainer", "trainer-rank1"):
        status = json.loads((run_dir / "status" / f"{name}.json").read_text())
        assert status["skipped_steps"] == {"non-finite-loss": 1} and status["step"] == 2, name
    assert latest_weights_are_finite(run_dir)
