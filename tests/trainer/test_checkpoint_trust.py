"""Checkpoints are trusted input only from sao itself (issue 12, item 7).

DeepSpeed loads its checkpoint files with `torch.load(weights_only=False)`: a planted
`*model_states.pt` ran code on `--resume`. Now every file of the checkpoint must match the sha256
sao recorded when it wrote it, checked before anything is unpickled.
"""

import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from sao.trainer.checkpoint import (
    TrainerState,
    UntrustedCheckpoint,
    has_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from support.trainer_runs import produce_trajectories, trainer_command, write_config

MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"


class FakeEngine:
    """Writes two files per tag like DeepSpeed; records whether it was asked to load (to unpickle)."""

    def __init__(self) -> None:
        self.loaded: str | None = None

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        assert not save_latest  # sao writes `latest` itself, once the hashes are recorded
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MODEL_STATES).write_bytes(b"weights")
        (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"moments")

    def load_checkpoint(self, load_dir: str, tag: str, **_) -> tuple[str, dict]:
        self.loaded = tag
        return str(Path(load_dir) / tag), {}


def saved(tmp_path: Path, step: int = 3) -> Path:
    directory = tmp_path / "checkpoints"
    save_checkpoint(FakeEngine(), directory, TrainerState(step=step, policy_version=2, offsets={0: 7}))
    return directory


def test_a_checkpoint_sao_wrote_loads(tmp_path):
    directory = saved(tmp_path)
    assert (directory / "latest").read_text() == "step-00000003"
    recorded = json.loads((directory / "step-00000003" / "sao_state.json").read_text())["files"]
    assert set(recorded) == {MODEL_STATES, "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    engine = FakeEngine()
    state = load_checkpoint(engine, directory)
    assert engine.loaded == "step-00000003"
    assert (state.step, state.policy_version, state.offsets) == (3, 2, {0: 7})


def _plant(tag: Path) -> None:
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").write_bytes(b"planted")


def _modify(tag: Path) -> None:
    (tag / MODEL_STATES).write_bytes(b"weights, changed")


def _remove(tag: Path) -> None:
    (tag / MODEL_STATES).unlink()


def _link(tag: Path) -> None:  # the same bytes, but through a link sao did not write
    target = tag.parent / "elsewhere.pt"
    target.write_bytes((tag / MODEL_STATES).read_bytes())
    (tag / MODEL_STATES).unlink()
    (tag / MODEL_STATES).symlink_to(target)


def _latest_outside(tag: Path) -> None:
    outside = tag.parent.parent / "evil"
    outside.mkdir()
    (tag.parent / "latest").write_text("../evil")


def _latest_to_unrecorded(tag: Path) -> None:  # a DeepSpeed checkpoint sao never wrote (or an older sao's)
    other = tag.parent / "step-00000009"
    other.mkdir()
    (other / MODEL_STATES).write_bytes(b"weights")
    (tag.parent / "latest").write_text("step-00000009")


@pytest.mark.parametrize(("tamper", "named"), [
    (_plant, "zero_pp_rank_1_mp_rank_00_model_states.pt was not written by sao"),
    (_modify, f"{MODEL_STATES} changed since sao wrote it"),
    (_remove, f"{MODEL_STATES} is missing"),
    (_link, f"{MODEL_STATES} is not a regular file"),
    (_latest_outside, "names '../evil'"),
    (_latest_to_unrecorded, "holds no record of the files sao wrote"),
])
@pytest.mark.parametrize("in_background", [False, True], ids=["inline", "in_background"])
def test_anything_sao_did_not_write_refuses_the_resume_before_loading(tmp_path, tamper, named, in_background):
    directory = saved(tmp_path)
    tamper(directory / "step-00000003")
    engine = FakeEngine()
    # The trainer verifies on a thread while it builds the engine: the refusal comes out of the load all the same.
    verified = ThreadPoolExecutor(max_workers=1).submit(verify_checkpoint, directory) if in_background else None
    with pytest.raises(UntrustedCheckpoint, match="refusing to resume") as refused:
        load_checkpoint(engine, directory, verified)
    assert named in str(refused.value) and "fresh run directory" in str(refused.value)
    assert engine.loaded is None  # nothing reached DeepSpeed, so nothing was unpickled


def test_a_verification_under_way_is_awaited_and_used_not_repeated(tmp_path):
    directory = saved(tmp_path)
    assert has_checkpoint(directory) and not has_checkpoint(tmp_path / "nothing-here")
    tag, recorded = verify_checkpoint(directory)
    verified: Future = Future()
    verified.set_result((tag, {**recorded, "step": 99}))  # stands out from the files' step 3
    engine = FakeEngine()
    assert load_checkpoint(engine, directory, verified).step == 99 and engine.loaded == tag


def test_a_half_written_tag_of_a_crashed_life_is_replaced_not_blessed(tmp_path):
    directory = tmp_path / "checkpoints"
    leftover = directory / "step-00000004"
    leftover.mkdir(parents=True)
    (leftover / "zero_pp_rank_1_mp_rank_00_model_states.pt").write_bytes(b"planted before the save")
    save_checkpoint(FakeEngine(), directory, TrainerState(step=4))
    assert not (leftover / "zero_pp_rank_1_mp_rank_00_model_states.pt").exists()
    assert load_checkpoint(FakeEngine(), directory).step == 4


class _Payload:
    """Unpickling this creates the marker file: what a planted checkpoint could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.slow
def test_a_planted_pickle_never_runs_on_resume(kafka_bootstrap, unique_topic_prefix, tmp_path):
    import torch

    produce_trajectories(kafka_bootstrap, unique_topic_prefix)
    config, run_dir = tmp_path / "sao.toml", tmp_path / "run"
    write_config(config, unique_topic_prefix, checkpoint_every=100)
    first = subprocess.run(trainer_command(config, kafka_bootstrap, run_dir), capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    tag = checkpoints / (checkpoints / "latest").read_text().strip()
    targets = sorted(tag.glob("*model_states.pt"))
    assert targets, sorted(p.name for p in tag.iterdir())
    marker = tmp_path / "code-ran"
    for target in targets:
        torch.save({"module": _Payload(marker)}, target)
    # The payload works: loading it the way DeepSpeed does runs it.
    probe = subprocess.run([sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1], weights_only=False)",
                            str(targets[0])], capture_output=True, text=True, timeout=120)
    assert marker.exists(), probe.stderr[-2000:]
    marker.unlink()

    resumed = subprocess.run(trainer_command(config, kafka_bootstrap, run_dir, "--resume"), capture_output=True,
                             text=True, timeout=300)
    assert not marker.exists(), "the planted pickle ran"
    assert resumed.returncode != 0
    assert "refusing to resume" in resumed.stderr and targets[0].name in resumed.stderr, resumed.stderr[-3000:]
