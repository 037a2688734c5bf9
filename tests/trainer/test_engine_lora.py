"""LoRA under the real ZeRO-3 engine: a step moves the adapters at the scaled rate and leaves every base weight
bit-identical, only the adapters and projector are gathered for publishing, and a checkpoint or an optimizer
snapshot (a shadow-validation rollback) restores them."""

import pytest

from support.engine_scripts import TINY_ENGINE, run_script

LORA_STEP = TINY_ENGINE + """
import tempfile
from pathlib import Path
from sao.policy.lora import add_lora
from sao.trainer.batch import plan_batch
from sao.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from sao.trainer.engine import gather_adapter_state, gather_full_state
from sao.trainer.snapshots import OptimizerSnapshots

cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 4}), "value_head": True})
policy = build_policy(config.policy, 384, value_head=True)
add_lora(policy, cfg.lora)
trainable = sorted(name for name, parameter in policy.named_parameters() if parameter.requires_grad)
start = {name: tensor.detach().clone() for name, tensor in policy.state_dict().items()}
engine = build_engine(policy, cfg)
rng = np.random.default_rng(0)
batch = [synthetic_trajectory(i, rng) for i in range(cfg.batch_size)]
plan = plan_batch(batch, RewardBaseline(), cfg, 0)


def step():
    train_step(engine, plan, lambda kept: plan_batch(kept, RewardBaseline(), cfg, 0), cfg, 384,
               batch_layout(cfg, 1)[1])


step()
after_one = gather_full_state(engine)
published = gather_adapter_state(engine)
checkpoints = Path(tempfile.mkdtemp())
save_checkpoint(engine, checkpoints, TrainerState(step=1))
snapshots = OptimizerSnapshots(checkpoints / "shadow")
snapshots.take(engine, 1)
step()
moved_again = any(not torch.equal(tensor, after_one[name]) for name, tensor in gather_adapter_state(engine).items())
load_checkpoint(engine, checkpoints)
restored = gather_full_state(engine)
step()
snapshots.restore(engine, 1)  # a shadow-validation rollback
rolled_back = gather_full_state(engine)
base = [name for name in after_one if "lora_" not in name and not name.startswith(("projector.", "value_head."))]
print(json.dumps({
    "trainable": trainable,
    "published": sorted(published),
    "base_unchanged": all(torch.equal(after_one[name], start[name]) for name in base),
    "base_count": len(base),
    "b_moved": sum(not torch.equal(after_one[name], start[name]) for name in after_one if "lora_B" in name),
    "b_count": sum("lora_B" in name for name in after_one),
    "rate": engine.optimizer.param_groups[0]["lr"],
    "moved_again": moved_again,
    "restored": all(torch.equal(restored[name], after_one[name]) for name in after_one),
    "rolled_back": all(torch.equal(rolled_back[name], after_one[name]) for name in after_one),
}))
shutdown()
"""


@pytest.mark.slow
def test_a_zero3_lora_step_trains_the_adapters_only_and_a_checkpoint_restores_them():
    found = run_script(LORA_STEP)
    assert found["base_count"] > 0 and found["base_unchanged"]  # frozen base weights: bit for bit
    assert found["b_moved"] == found["b_count"] > 0  # B starts at zero; every adapter learned
    assert found["rate"] == pytest.approx(1e-3 * 10)  # trainer.learning_rate * trainer.lora.lr_scale
    # The publisher gathers what is trained, but the value head (the trainer's own).
    assert found["published"] == [name for name in found["trainable"] if not name.startswith("value_head.")]
    assert any(name.startswith("value_head.") for name in found["trainable"])
    assert found["moved_again"] and found["restored"] and found["rolled_back"]
