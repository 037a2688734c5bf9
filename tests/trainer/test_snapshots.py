"""A rollback returns ZeRO-3 training to a published version exactly: restore a snapshot taken at
version v after two more steps, and the weights equal v's, and the next step from there equals the
step first taken from v (same batch): the AdamW moments came back too, not only the weights.

The snapshot is written in the background while the next steps run; here its write is slowed so
that two optimizer updates come first, and nothing waits for it: only the copy `take` made keeps
those updates out of the file.
"""

import pytest

from support.engine_scripts import TINY_ENGINE, run_script

STEPS = TINY_ENGINE + """
from sao.trainer.batch import plan_batch
from sao.trainer.engine import gather_full_state
import threading
import sao.trainer.snapshots as snapshot_module
from sao.trainer.snapshots import OptimizerSnapshots

write_file = snapshot_module.save_file
two_updates_later = threading.Event()
write_waited_out = []
def slow_write(*args, **kwargs):  # writes only once two more optimizer updates are done
    write_waited_out.append(not two_updates_later.wait(60))  # True: a step waited for this write
    write_file(*args, **kwargs)
snapshot_module.save_file = slow_write

engine = build_engine(build_policy(config.policy, 384), cfg)
rng = np.random.default_rng(0)
batches = [[synthetic_trajectory(8 * b + i, rng) for i in range(cfg.batch_size)] for b in range(3)]

def step(batch):
    plan = plan_batch(batch, RewardBaseline(), cfg, 0)
    train_step(engine, plan, lambda kept: plan_batch(kept, RewardBaseline(), cfg, 0), cfg, 384,
               batch_layout(cfg, 1)[1])

def max_difference(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)

import sys, pathlib
snapshots = OptimizerSnapshots(pathlib.Path(sys.argv[1]))
step(batches[0])
snapshots.take(engine, 1)
at_v1 = gather_full_state(engine)
step(batches[1])
after_v1 = gather_full_state(engine)
step(batches[2])
two_updates_later.set()
moved = max_difference(gather_full_state(engine), at_v1)
snapshots.restore(engine, 1)
restored = max_difference(gather_full_state(engine), at_v1)
step(batches[1])
replayed = max_difference(gather_full_state(engine), after_v1)
snapshots.relabel(1, 5)
relabelled = snapshots.versions()
snapshots.keep_only(set())
print(json.dumps({"steps_waited_for_the_write": write_waited_out,
                  "moved": moved, "restored": restored, "replayed": replayed, "relabelled": relabelled,
                  "kept": snapshots.versions(), "files": sorted(p.name for p in pathlib.Path(sys.argv[1]).iterdir())}))
shutdown()
"""


@pytest.mark.slow
def test_restoring_a_snapshot_returns_weights_and_optimizer_state_to_that_version(tmp_path):
    found = run_script(STEPS, str(tmp_path))
    assert found["steps_waited_for_the_write"] == [False]  # the two updates came while the write was pending
    assert found["moved"] > 1e-4  # two more steps changed the weights: a restore has something to undo
    assert found["restored"] == 0.0  # the weights are v1's, bit for bit
    # The step after the restore equals the step first taken from v1 on the same batch: with AdamW's
    # moments reset instead, the update would differ.
    assert found["replayed"] < 1e-6
    assert found["relabelled"] == [5]
    assert found["kept"] == [] and found["files"] == []  # a dropped snapshot leaves no file behind


def test_a_snapshot_that_cannot_be_written_costs_its_version_not_the_step(tmp_path, monkeypatch, caplog):
    """A full disk while a snapshot is written in the background: the step waiting for it goes on, and that
    version is no longer one a rollback can return to (nothing half-written is left either)."""
    import torch

    import sao.trainer.snapshots as snapshot_module

    def disk_full(tensors, filename):
        open(filename, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_module, "save_file", disk_full)
    weights = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([weights])
    weights.grad = torch.ones(4)
    optimizer.step()

    class Engine:
        def zero_optimization(self) -> bool:  # as under ZeRO: the optimizer's state is the whole state
            return True

    engine = Engine()
    engine.optimizer = optimizer
    snapshots = snapshot_module.OptimizerSnapshots(tmp_path)
    snapshots.take(engine, 3)
    snapshots.settle()  # what a restore or a drop does first: it must not raise
    assert 3 not in snapshots and snapshots.versions() == []
    assert list(tmp_path.iterdir()) == []
    assert "could not be written" in caplog.text
    snapshots.close()


def test_later_snapshots_reuse_the_host_buffers_and_leave_earlier_files_whole(tmp_path):
    """The second snapshot copies into the buffers the first one was written from (no fresh allocation of the
    optimizer's size), and only once that write is done: both files hold their own version's moments."""
    import torch
    from safetensors.torch import load_file

    from sao.trainer.snapshots import OptimizerSnapshots

    weights = torch.nn.Parameter(torch.ones(64))
    optimizer = torch.optim.AdamW([weights])

    class Engine:
        def zero_optimization(self) -> bool:  # as under ZeRO: the optimizer's state is the whole state
            return True

    engine = Engine()
    engine.optimizer = optimizer
    snapshots = OptimizerSnapshots(tmp_path)
    moments = {}
    buffers = []
    for version, gradient in ((1, 1.0), (2, -3.0)):
        weights.grad = torch.full((64,), gradient)
        optimizer.step()
        snapshots.take(engine, version)
        moments[version] = optimizer.state[weights]["exp_avg"].clone()
        buffers.append({path: tensor.data_ptr() for path, tensor in snapshots._buffers.items()})
    snapshots.settle()
    assert buffers[0] == buffers[1] and buffers[0]  # same host memory both times
    for version in (1, 2):
        [exp_avg] = [t for name, t in load_file(str(tmp_path / f"v{version:06d}.safetensors")).items()
                     if name.endswith("/exp_avg")]
        assert torch.equal(exp_avg, moments[version])
    assert not torch.equal(moments[1], moments[2])
    snapshots.close()
