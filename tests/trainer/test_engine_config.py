"""DeepSpeed config: sao derives ZeRO-3 settings (none for one CPU rank); a JSON file and an inline table pass through."""

import json

import pytest

from sao.config import TrainerConfig
from sao.trainer.engine import batch_layout, build_engine, deepspeed_config, learning_rate_at


def test_derived_config_is_zero3_with_clipping():
    config = deepspeed_config(TrainerConfig(batch_size=8, grad_clip=0.5), world_size=2)
    assert config["zero_optimization"]["stage"] == 3 and config["gradient_clipping"] == 0.5
    assert config["train_batch_size"] == 8 and config["train_micro_batch_size_per_gpu"] == 4


def test_one_cpu_rank_runs_without_zero_and_clips_in_its_optimizer_unless_a_stage_is_asked_for():
    alone = deepspeed_config(TrainerConfig(grad_clip=0.5), world_size=1)
    assert alone["zero_optimization"]["stage"] == 0 and alone["gradient_clipping"] == 0.0  # ClippedAdamW clips
    asked = deepspeed_config(TrainerConfig(grad_clip=0.5, deepspeed={"zero_optimization": {"stage": 2}}), 1)
    assert asked["zero_optimization"]["stage"] == 2 and asked["gradient_clipping"] == 0.5


def test_file_then_inline_override_and_batch_settings_come_from_deepspeed(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 12, "gradient_accumulation_steps": 3,
                                "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    trainer = TrainerConfig(batch_size=8, deepspeed_config=str(path),
                            deepspeed={"zero_optimization": {"stage3_max_live_parameters": 10}})
    assert batch_layout(trainer, world_size=2) == (12, 3)
    config = deepspeed_config(trainer, world_size=2)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu"}
    assert zero["stage3_max_live_parameters"] == 10
    assert config["gradient_accumulation_steps"] == 3 and config["train_batch_size"] == 12


def test_unreadable_file_names_the_knob(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"trainer\.deepspeed_config"):
        batch_layout(TrainerConfig(deepspeed_config=str(tmp_path / "bad.json")), 1)


def test_offload_optimizer_puts_the_optimizer_on_the_cpu_and_the_inline_table_still_wins():
    assert "offload_optimizer" not in deepspeed_config(TrainerConfig(), 1)["zero_optimization"]
    zero = deepspeed_config(TrainerConfig(offload_optimizer=True), 1)["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    pinned = TrainerConfig(offload_optimizer=True, deepspeed={"zero_optimization": {"offload_optimizer": {"pin_memory": True}}})
    assert deepspeed_config(pinned, 1)["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


def test_warm_up_raises_the_rate_linearly_and_then_holds_it():
    trainer = TrainerConfig(learning_rate=4e-5, warmup_steps=4)
    assert [learning_rate_at(trainer, step) for step in (1, 2, 3, 4, 5, 100)] == pytest.approx(
        [1e-5, 2e-5, 3e-5, 4e-5, 4e-5, 4e-5])
    assert learning_rate_at(TrainerConfig(learning_rate=4e-5), 1) == 4e-5  # 0 steps: no warm-up


def test_warm_up_and_a_deepspeed_scheduler_are_refused_together():
    trainer = TrainerConfig(warmup_steps=2, deepspeed={"scheduler": {"type": "WarmupLR", "params": {}}})
    with pytest.raises(ValueError, match=r"trainer\.warmup_steps"):
        build_engine(None, trainer)
