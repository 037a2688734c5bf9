"""The trajectory compressor: slot semantics, exact returns, and online == batch."""

import numpy as np
import pytest

from sao.compression.pipeline import OnlineCompressor, compress_batch
from sao.compression.quantize import dequantize_int8
from sao.compression.temporal import Decision


class ScriptedFilter:
    """Stands in for TemporalFilter with fixed keep/merge decisions, to test slot bookkeeping alone."""

    def __init__(self, keeps: list[bool], dim: int = 384):
        self.keeps, self.dim, self.meta = keeps, dim, {}
        self.start()

    def start(self) -> None:
        self.step = 0

    def observe(self, embedding, reward) -> Decision:
        self.step += 1
        return Decision(self.keeps[self.step - 1], "scripted", 0.0)


def run_online(encoder, temporal_filter, texts, rewards, recent_window):
    compressor = OnlineCompressor(encoder, temporal_filter, recent_window=recent_window)
    visible, decisions = [], []
    for text, reward in zip(texts, rewards):
        visible.append(compressor.visible_slots())
        decisions.append(compressor.finish_turn(text, reward))
    return compressor, visible, decisions


@pytest.mark.parametrize("recent_window", [0, 1, 2])
def test_batch_equals_online(encoder, median_filter, dialogue, recent_window):
    texts, rewards = dialogue
    compressor, visible, decisions = run_online(encoder, median_filter, texts, rewards, recent_window)
    table, batch_visible, batch_decisions = compress_batch(
        texts, rewards, encoder, median_filter, recent_window=recent_window)
    online = compressor.memory()
    for field in ("vectors", "scales", "spans", "reward_sums", "created_at_turn"):
        np.testing.assert_array_equal(getattr(table, field), getattr(online, field), err_msg=field)
    assert batch_visible == visible
    assert [(d.keep, d.reason) for d in batch_decisions] == [(d.keep, d.reason) for d in decisions]
    assert 1 < len(table) < len(texts)  # some steps were merged, some kept


def test_table_dtypes_and_shapes(encoder, median_filter, dialogue):
    texts, rewards = dialogue
    table, _, _ = compress_batch(texts, rewards, encoder, median_filter)
    k = len(table)
    assert table.vectors.dtype == np.int8 and table.vectors.shape == (k, 384)
    assert table.scales.dtype == np.float32 and table.scales.shape == (k,)
    assert table.spans.dtype == np.int32 and table.spans.shape == (k, 2)
    assert table.reward_sums.dtype == np.float32 and table.created_at_turn.dtype == np.int32
    # Spans tile the trajectory: each starts where the previous ended, and starts at its step.
    np.testing.assert_array_equal(table.spans[:, 0], table.created_at_turn)
    np.testing.assert_array_equal(table.spans[1:, 0], table.spans[:-1, 1] + 1)
    assert table.spans[0, 0] == 0 and table.spans[-1, 1] == len(texts) - 1


def test_return_is_exact_and_each_slot_sums_its_span(encoder, make_filter, dialogue):
    texts, _ = dialogue
    rewards = [0.5, 0.0, 0.0, 1.0, 0.0, 0.0, -0.25, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    table, _, decisions = compress_batch(texts, rewards, encoder, make_filter(10.0))
    assert sum(not d.keep for d in decisions) > 5
    assert float(table.reward_sums.sum()) == sum(rewards)
    for (first, last), reward_sum in zip(table.spans, table.reward_sums):
        assert reward_sum == sum(rewards[first : last + 1])


def test_merged_rewards_accumulate_into_the_previous_slot(encoder, dialogue):
    texts, _ = dialogue
    rewards = [1.0, 0.5, 0.25, 2.0, -1.0]
    compressor = OnlineCompressor(encoder, ScriptedFilter([True, False, False, True, False]))
    for text, reward in zip(texts, rewards):
        compressor.finish_turn(text, reward)
    table = compressor.memory()
    np.testing.assert_array_equal(table.reward_sums, [1.75, 1.0])
    np.testing.assert_array_equal(table.spans, [[0, 2], [3, 4]])
    np.testing.assert_array_equal(table.created_at_turn, [0, 3])


@pytest.mark.parametrize("recent_window", [0, 1, 2])
def test_visible_slots_when_every_step_is_kept(encoder, make_filter, dialogue, recent_window):
    texts, rewards = dialogue
    _, visible, _ = run_online(encoder, make_filter(-1.0), texts[:6], rewards[:6], recent_window)
    # Before step t, steps 0..t-1 are finished; the last `recent_window` of them are full text.
    assert visible == [list(range(max(0, t - recent_window))) for t in range(6)]


@pytest.mark.parametrize("recent_window, expected", [
    (0, [[], [0], [0], [0, 1], [0, 1], [0, 1], [0, 1, 2]]),
    (1, [[], [], [0], [0], [0, 1], [0, 1], [0, 1]]),
    (2, [[], [], [], [0], [0], [0, 1], [0, 1]]),
])
def test_visible_slots_follow_creation_step_with_merges(encoder, dialogue, recent_window, expected):
    texts, _ = dialogue
    keeps = [True, False, True, False, False, True]  # slots created at steps 0, 2 and 5
    compressor = OnlineCompressor(encoder, ScriptedFilter(keeps), recent_window=recent_window)
    visible = []
    for text in texts[:6]:
        visible.append(compressor.visible_slots())
        compressor.finish_turn(text, 0.0)
    visible.append(compressor.visible_slots())  # for the step after the last finished one
    assert visible == expected


def test_slot_vectors_never_change_after_creation(encoder, dialogue):
    texts, _ = dialogue
    compressor = OnlineCompressor(encoder, ScriptedFilter([True, True, False, False, False]))
    for text in texts[:2]:
        compressor.finish_turn(text, 0.0)
    before = compressor.memory()
    for text in texts[2:5]:
        compressor.finish_turn(text, 0.0)
    after = compressor.memory()
    np.testing.assert_array_equal(after.vectors, before.vectors)
    np.testing.assert_array_equal(after.scales, before.scales)
    np.testing.assert_array_equal(before.spans, [[0, 0], [1, 1]])  # the snapshot is a copy
    np.testing.assert_array_equal(after.spans, [[0, 0], [1, 4]])


def test_dequantized_slots_are_the_step_embeddings(encoder, make_filter, dialogue, dialogue_embeddings):
    texts, rewards = dialogue
    compressor, _, _ = run_online(encoder, make_filter(-1.0), texts, rewards, 1)
    restored = compressor.dequantized(np.array([3, 0], dtype=np.int32))  # as the sampler passes them
    assert restored.dtype == np.float32 and restored.shape == (2, 384)
    table = compressor.memory()
    np.testing.assert_array_equal(restored, dequantize_int8(table.vectors[[3, 0]], table.scales[[3, 0]]))
    cosine = (restored * dialogue_embeddings[[3, 0]]).sum(1) / np.linalg.norm(restored, axis=1)
    assert cosine.min() >= 0.999
    assert compressor.dequantized([]).shape == (0, 384)


def test_stats_count_steps_slots_and_bytes(encoder, dialogue):
    texts, _ = dialogue
    compressor = OnlineCompressor(encoder, ScriptedFilter([True, False, True, False, False]))
    assert compressor.stats().steps == 0 and len(compressor.memory()) == 0
    assert compressor.memory().vectors.shape == (0, 384)
    for text in texts[:5]:
        compressor.finish_turn(text, 0.0)
    stats = compressor.stats()
    assert (stats.steps, stats.kept_slots, stats.merged_steps) == (5, 2, 3)
    assert stats.fp32_bytes == 5 * 384 * 4 and stats.int8_bytes == 2 * (384 + 4)
    assert stats.ratio == pytest.approx(stats.fp32_bytes / stats.int8_bytes)
    assert stats.encode_seconds > 0 and stats.filter_seconds > 0 and stats.quantize_seconds > 0


def test_encoder_and_filter_dimensions_must_agree(encoder, make_filter):
    with pytest.raises(ValueError, match="384-d"):
        OnlineCompressor(encoder, make_filter(0.1, dim=16))
    with pytest.raises(ValueError, match="rewards"):
        compress_batch(["a", "b"], [0.0], encoder, make_filter(0.1))


@pytest.mark.parametrize("recent_window", [0, 1])
def test_a_bottleneck_narrows_the_slots_online_and_in_batch_alike(encoder, median_filter, dialogue,
                                                                   dialogue_embeddings, recent_window):
    from sao.compression.bottleneck import fit_bottleneck

    texts, rewards = dialogue
    bottleneck = fit_bottleneck(dialogue_embeddings, 6, encoder.name)
    compressor = OnlineCompressor(encoder, median_filter, recent_window=recent_window, bottleneck=bottleneck)
    for text, reward in zip(texts, rewards):
        compressor.finish_turn(text, reward)
    online = compressor.memory()
    table, _, _ = compress_batch(texts, rewards, encoder, median_filter, recent_window, bottleneck=bottleneck)
    np.testing.assert_array_equal(table.vectors, online.vectors)
    k = len(table)
    assert table.vectors.shape == (k, 6) and compressor.dequantized(range(k)).shape == (k, 6)
    stats = compressor.stats()
    assert stats.int8_bytes == k * (6 + 4) and stats.fp32_bytes == len(texts) * 384 * 4
    # The coordinates decode to the kept steps' embeddings, as far as six directions of the dialogue span them.
    decoded = bottleneck.decode(compressor.dequantized(range(k)))
    kept = dialogue_embeddings[table.created_at_turn]
    cosine = (decoded * kept).sum(1) / np.linalg.norm(decoded, axis=1) / np.linalg.norm(kept, axis=1)
    assert cosine.min() > 0.9


def test_a_bottleneck_for_another_width_of_embeddings_is_refused(encoder, median_filter):
    from sao.compression.bottleneck import fit_bottleneck

    with pytest.raises(ValueError, match="reads 16-d embeddings but the encoder gives 384-d"):
        OnlineCompressor(encoder, median_filter, bottleneck=fit_bottleneck(np.eye(16), 4, encoder.name))
