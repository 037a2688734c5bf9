"""Context size accounting: naive, stored once, sao's message, and each stage's per-step contexts."""

import numpy as np

from sao.compression.accounting import context_costs, naive_context_tokens, trajectory_bytes, trajectory_context_costs
from sao.schema import Memory, Step, Trajectory, encode


def _trajectory(recent_window=1):
    # 4 steps of 3 + 2 tokens; slots created at steps 0 and 2; step t sees slots created <= t - 2.
    steps = [Step(np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32), np.zeros(2, np.float32), 0.0,
                  t == 3, visible) for t, visible in enumerate([0, 0, 1, 1])]
    memory = Memory(np.ones((2, 8), np.int8), np.ones(2, np.float32), np.array([[0, 1], [2, 3]], np.int32),
                    np.zeros(2, np.float32))
    return Trajectory("t#0", "t", "textworld", "s", 0, np.arange(10, dtype=np.int32), steps, memory, 1.0, "enc",
                      recent_window)


def test_stage_costs_by_hand():
    costs = context_costs(10, [5, 5, 5, 5], [0, 0, 1, 1], dim=8, recent_window=1)
    # naive: every step sees the prompt and all earlier steps in full.
    assert costs["naive"].positions == (10 + 5) + (10 + 10) + (10 + 15) + (10 + 20)
    assert costs["naive"].bytes == 4 * costs["naive"].positions
    # After the semantic stage, steps older than the window are one vector each: 0, 0, 1, 2 of them.
    text = (10 + 5) + (10 + 10) + (10 + 10) + (10 + 10)
    assert costs["semantic"].positions == text + 3
    assert costs["semantic"].bytes == 4 * text + 3 * 8 * 4
    assert costs["temporal"].positions == costs["int8"].positions == text + 2
    assert costs["temporal"].bytes == 4 * text + 2 * 8 * 4
    assert costs["int8"].bytes == 4 * text + 2 * (8 + 4)


def test_a_bottleneck_narrows_only_the_int8_stage():
    """Slots coded in 8 coordinates of 32-d embeddings: the stages before it still hold 32-d float32 vectors."""
    costs = trajectory_context_costs(_trajectory(), encoder_dim=32)
    text = (10 + 5) + (10 + 10) + (10 + 10) + (10 + 10)
    assert costs["semantic"].bytes == 4 * text + 3 * 32 * 4 and costs["temporal"].bytes == 4 * text + 2 * 32 * 4
    assert costs["int8"].bytes == 4 * text + 2 * (8 + 4)
    assert trajectory_context_costs(_trajectory())["temporal"].bytes == 4 * text + 2 * 8 * 4  # no bottleneck


def test_trajectory_bytes_agree_with_the_trainer_and_the_wire():
    trajectory = _trajectory()
    sizes = trajectory_bytes(trajectory)
    assert sizes["naive"] == 4 * naive_context_tokens(10, trajectory.steps)
    assert sizes["naive"] == trajectory_context_costs(trajectory)["naive"].bytes
    assert sizes["stored_once"] == 4 * (10 + 4 * 5)
    assert sizes["memory"] == 2 * 8 + 2 * 4 + 2 * 8 + 2 * 4
    assert sizes["slot_refs"] == 4 * 4  # one int32 count per step
    assert sizes["sao"] == sizes["stored_once"] + sizes["memory"] + sizes["slot_refs"]
    assert sizes["message"] == len(encode(trajectory))


def test_recalled_turns_count_as_text_in_every_stage_after_the_naive_one():
    """Step 3 recalls step 0 (5 tokens): 5 more positions and 20 more bytes in each compressed stage."""
    import dataclasses

    plain = _trajectory()
    recalled = dataclasses.replace(plain, steps=[*plain.steps[:3], dataclasses.replace(plain.steps[3], recalled=(0,))])
    before, after = trajectory_context_costs(plain), trajectory_context_costs(recalled)
    assert after["naive"] == before["naive"]
    for stage in ("semantic", "temporal", "int8"):
        assert after[stage].positions == before[stage].positions + 5
        assert after[stage].bytes == before[stage].bytes + 4 * 5
