"""`sao replay`: a run's trajectory log rebuilds every version it published, bit for bit, and names where one differs."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest

from sao.run_dir import RunDir
from sao.schema import Trajectory, decode, encode
from sao.trainer.archive import MAGIC, ArchiveError, TrajectoryArchive, read_records
from sao.trainer.replay import CannotReplay, Replay, replay_config
from support.fault_runs import fault_seed
from support.shadow_env import shadow_on
from support.trainer_runs import (
    TOTAL,
    kill_9_after_step_2_and_resume,
    produce_trajectories,
    trainer_command,
    write_config,
)


def replay(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sao.cli", "replay", str(run_dir), *extra], capture_output=True,
                          text=True, timeout=300)


def rewrite_log(source: Path, target: Path, change) -> None:
    """Copy a trajectory log, each record passed through `change` (which returns it, changed or not)."""
    with open(target, "wb") as out:
        out.write(MAGIC)
        for record in read_records(source):
            payload = msgpack.packb(change(record), use_bin_type=True)
            out.write(len(payload).to_bytes(4, "little") + payload)


def trained_run(bootstrap: str, prefix: str, tmp_path: Path, entry: list[str] | None = None, env=None,
                **knobs) -> Path:
    """A tiny trainer run over `produce_trajectories`' messages with these [trainer] knobs; its run folder."""
    produce_trajectories(bootstrap, prefix)
    config, run_dir = tmp_path / "sao.toml", tmp_path / "run"
    write_config(config, prefix, **knobs)
    trained = subprocess.run(trainer_command(config, bootstrap, run_dir, entry=entry), capture_output=True, text=True,
                             timeout=300, env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    return run_dir


def test_replay_rebuilds_every_published_version_and_names_the_first_difference(kafka_bootstrap, unique_topic_prefix,
                                                                                 tmp_path):
    run_dir = trained_run(kafka_bootstrap, unique_topic_prefix, tmp_path, keep_versions=100)

    records = list(read_records(run_dir / "trajectory-log.bin"))
    kinds = [record["kind"] for record in records]
    # Every message read (the redelivery or the malformed one too, as the trainer met them before it stopped), each
    # once; a step per batch, a version per step.
    positions = [(r["partition"], r["offset"]) for r in records if r["kind"] == "trajectory"]
    assert len(set(positions)) == len(positions) >= TOTAL + 1 and kinds.count("life") == 1
    # A replay recomputes in the precision `auto` resolved to on the run's machine, whatever it resolves to on its own.
    life = records[kinds.index("life")]
    assert life["precision"] in ("bf16", "fp32")
    assert replay_config({**life, "precision": "fp32"}, []).trainer.precision == "fp32"
    steps = [record for record in records if record["kind"] == "step"]
    published = [record for record in records if record["kind"] == "published"]
    assert [s["step"] for s in steps] == list(range(1, TOTAL // 3 + 1)) and len(published) == len(steps)
    ledger = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    messages = {(r["partition"], r["offset"]): r["value"] for r in records if r["kind"] == "trajectory"}
    assert [[decode(messages[tuple(p)], Trajectory).trajectory_id for p in s["trained"]] for s in steps] == \
        [entry["trajectory_ids"] for entry in ledger]
    status = json.loads((run_dir / "status" / "trainer.json").read_text())
    assert status["trajectory_log"]["bytes"] == (run_dir / "trajectory-log.bin").stat().st_size

    result = replay(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{len(published)} of {len(published)} versions match" in result.stderr

    # One reward changed in a trajectory that step 3 trained on: steps 1-2 still match, step 3 does not.
    tampered_at = tuple(steps[2]["trained"][0])

    def tamper(record):
        if record["kind"] == "trajectory" and (record["partition"], record["offset"]) == tampered_at:
            trajectory = decode(record["value"], Trajectory)
            first = replace(trajectory.steps[0], reward=1.0 - trajectory.steps[0].reward)
            record["value"] = encode(replace(trajectory, steps=[first, *trajectory.steps[1:]]))
        return record

    rewrite_log(run_dir / "trajectory-log.bin", tmp_path / "tampered.bin", tamper)
    (tmp_path / "tampered.bin").replace(run_dir / "trajectory-log.bin")
    result = replay(run_dir)
    assert result.returncode == 1 and "replay mismatch" in result.stderr, result.stderr[-3000:]
    assert "step 3, v3" in result.stderr and "max abs difference" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_replay_with_another_knob_differs_from_step_one_and_writes_its_own_versions(kafka_bootstrap,
                                                                                   unique_topic_prefix, tmp_path):
    run_dir = trained_run(kafka_bootstrap, unique_topic_prefix, tmp_path, max_steps=2)

    result = replay(run_dir, "--set", "trainer.learning_rate=1e-3")
    assert result.returncode == 1 and "replay mismatch: step 1" in result.stderr, result.stderr[-3000:]
    out = tmp_path / "other"
    result = replay(run_dir, "--set", "trainer.learning_rate=1e-3", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 versions rebuilt (not checked" in result.stderr
    assert sorted(p.name for p in (out / "policy").glob("policy-v*.safetensors")) == \
        ["policy-v000001.safetensors", "policy-v000002.safetensors"]
    bad = replay(run_dir, "--set", "trainer.learning_rate=-1")
    assert bad.returncode == 2 and "trainer.learning_rate" in bad.stderr


@pytest.mark.slow
def test_replay_rebuilds_a_lora_run(kafka_bootstrap, unique_topic_prefix, tmp_path):
    """LoRA draws its adapters at start (seeded by policy.seed): replay draws the same ones."""
    run_dir = trained_run(kafka_bootstrap, unique_topic_prefix, tmp_path, trainer_toml="lora = { rank = 4 }",
                          max_steps=3)
    result = replay(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "3 of 3 versions match" in result.stderr


@pytest.mark.slow
def test_replay_after_a_kill_9_and_resume_rebuilds_the_surviving_lineage(kafka_bootstrap, unique_topic_prefix,
                                                                        tmp_path):
    produce_trajectories(kafka_bootstrap, unique_topic_prefix)
    config, run_dir = tmp_path / "sao.toml", tmp_path / "run"
    write_config(config, unique_topic_prefix, keep_versions=100)
    # Killed within 0.1 s of step 2, so the resumed life has steps left to replay (the whole run takes seconds).
    delay, second = kill_9_after_step_2_and_resume(config, kafka_bootstrap, run_dir, tmp_path / "first.log", 300,
                                                   max_delay=0.1)
    assert second.returncode == 0, second.stderr[-3000:]

    records = list(read_records(run_dir / "trajectory-log.bin"))
    lives = [record for record in records if record["kind"] == "life"]
    assert len(lives) == 2 and lives[1]["resumed"], f"SAO_FAULT_SEED={fault_seed()}"
    positions = [(r["partition"], r["offset"]) for r in records if r["kind"] == "trajectory"]
    assert len(positions) == len(set(positions)), "a message re-read after the resume was logged twice"
    steps = [record["step"] for record in records if record["kind"] == "step"]
    assert steps == list(range(1, len(steps) + 1)) and lives[1]["step"] < len(steps), \
        f"killed {delay:.2f} s after step 2, past the last step (SAO_FAULT_SEED={fault_seed()})"

    result = replay(run_dir)
    published = sum(record["kind"] == "published" for record in records)
    assert result.returncode == 0, f"killed {delay:.2f} s after step 2 (SAO_FAULT_SEED={fault_seed()}): " + \
        result.stderr[-3000:]
    assert f"{published} of {published} versions match" in result.stderr


@pytest.mark.slow
def test_replay_follows_a_rollback_where_the_log_puts_it(kafka_bootstrap, unique_topic_prefix, tmp_path):
    entry = [str(Path(__file__).parents[1] / "support" / "rollback_trainer.py")]
    run_dir = trained_run(kafka_bootstrap, unique_topic_prefix, tmp_path, entry, shadow_on(), keep_versions=100,
                          shadow_every=1)
    records = list(read_records(run_dir / "trajectory-log.bin"))
    [rollback] = [record for record in records if record["kind"] == "rollback"]
    assert rollback["step"] == 3 and rollback["to_version"] == 1 and rollback["published_as"] == 4
    hashes = {r["version"]: r["state_sha256"] for r in records if r["kind"] == "published"}
    assert hashes[4] == hashes[1] != hashes[3]  # v4 republished v1's weights

    result = replay(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{len(hashes)} of {len(hashes)} versions match" in result.stderr


@pytest.mark.parametrize(("step", "ranks", "refusal"), [(3, 1, "starts at step 3"), (0, 2, "trained on 2 ranks"),
                                                    (0, 10**6, "not a rank count"), (0, "2", "not a rank count")])
def test_a_log_replay_cannot_rebuild_from_is_refused_before_any_model_loads(tmp_path, step, ranks, refusal):
    archive = TrajectoryArchive(RunDir(tmp_path).trajectory_log)
    archive.life(step, 0, step > 0, ranks, "")
    archive.close()
    with pytest.raises((CannotReplay, ArchiveError), match=refusal):
        Replay(tmp_path)
