"""The shipped compressor on long text-labyrinth episodes: online == batch, turning points, exact return."""

import numpy as np
import pytest

from sao.compression.pipeline import OnlineCompressor, compress_batch
from sao.compression.temporal import load_temporal_filter
from sao.config import EnvConfig
from sao.envs.textworld import TextWorldEnv
from sao.envs.textworld_agents import ExpertAgent
from sao.offline.episodes import record_episode


@pytest.fixture(scope="module")
def labyrinth_episode():
    """150 steps of the noisy expert in a 10 x 10 labyrinth; one of two gems is delivered on the way."""
    config = EnvConfig(name="textworld", seed=5, options={"size": 10, "gems": 2, "locked_doors": 1, "max_steps": 150})
    task = TextWorldEnv.make_tasks(config, 1)[0]
    episode = record_episode(TextWorldEnv(), task.task_id, task.spec, ExpertAgent(noise=0.2, seed=0))
    assert len(episode) == 150
    return episode


@pytest.fixture(scope="module")
def labyrinth_embeddings(encoder, labyrinth_episode):
    return encoder.encode(labyrinth_episode.texts())


def test_online_equals_batch_with_the_shipped_filter(encoder, labyrinth_episode, labyrinth_embeddings):
    texts, rewards = labyrinth_episode.texts(), labyrinth_episode.rewards()
    compressor = OnlineCompressor(encoder, load_temporal_filter(), recent_window=1)
    visible, decisions = [], []
    for text, reward in zip(texts, rewards):
        visible.append(compressor.visible_slots())
        decisions.append(compressor.finish_turn(text, reward))
    table, batch_visible, batch_decisions = compress_batch(texts, rewards, encoder, load_temporal_filter(),
                                                           recent_window=1, embeddings=labyrinth_embeddings)
    online = compressor.memory()
    for field in ("vectors", "scales", "spans", "reward_sums", "created_at_turn"):
        np.testing.assert_array_equal(getattr(table, field), getattr(online, field), err_msg=field)
    assert batch_visible == visible
    assert [(d.keep, d.reason) for d in batch_decisions] == [(d.keep, d.reason) for d in decisions]
    np.testing.assert_allclose([d.error for d in batch_decisions], [d.error for d in decisions], atol=1e-6)


def test_shipped_filter_merges_corridors_and_keeps_turning_points(encoder, labyrinth_episode, labyrinth_embeddings):
    texts, rewards = labyrinth_episode.texts(), labyrinth_episode.rewards()
    table, _, decisions = compress_batch(texts, rewards, encoder, load_temporal_filter(), embeddings=labyrinth_embeddings)
    assert 0.2 < len(table) / len(texts) < 0.8
    assert decisions[0].reason == "boundary"
    assert all(d.keep and d.reason == "reward" for d, r in zip(decisions, rewards) if r)
    assert sum(rewards) > 0 and float(table.reward_sums.sum()) == sum(rewards)  # rewards of 1/2: exact
    corridor = [d for d, text in zip(decisions, texts) if "A long corridor" in text and "You go" in text]
    assert len(corridor) > 20 and np.mean([d.keep for d in corridor]) < 0.4
    repeated = [decisions[t] for t in range(1, len(texts)) if texts[t] == texts[t - 1]]
    assert repeated and not any(d.keep for d in repeated)
