"""RunDir.drop_weights: what benchmarks delete after reading a run's figures, and what they keep."""

import json

from sao.run_dir import RunDir


def test_dropping_weights_keeps_the_figures_and_counts_the_bytes(tmp_path):
    run = RunDir(tmp_path / "run")
    heavy = {run.weights(3): 300, run.weights_delta(4): 40, run.checkpoints / "step-4" / "rank0.pt": 1000,
             run.shadow_snapshots / "rank0" / "v000003.safetensors": 200}
    for path, size in heavy.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"w" * size)
    run.best_weights.symlink_to(run.weights(3).name)  # a link: freed space counts its target once
    figures = [run.summary, run.status("trainer"), run.heldout, run.shadow_board, run.shadow_result(3), run.log("trainer")]
    for path in figures:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kept": True}))

    assert run.drop_weights() == sum(heavy.values())
    assert not run.checkpoints.exists() and not run.policy_dir.exists() and not run.shadow_snapshots.exists()
    assert all(json.loads(path.read_text()) == {"kept": True} for path in figures)
    assert run.drop_weights() == 0  # nothing left to drop: no error


def test_a_linked_weights_folder_loses_its_link_not_its_files(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "policy-v000001.safetensors").write_bytes(b"w" * 100)
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.policy_dir.symlink_to(elsewhere)

    assert run.drop_weights() == 0  # nothing of this run's own was freed
    assert not run.policy_dir.exists() and not run.policy_dir.is_symlink()
    assert (elsewhere / "policy-v000001.safetensors").read_bytes() == b"w" * 100
