"""Recorded episodes: JSONL and trajectory-record files, replaying into sampler trajectories."""

import struct

import numpy as np
import pytest

from sao.compression.pipeline import compress_batch
from sao.compression.temporal import load_temporal_filter
from sao.config import EnvConfig
from sao.envs.textworld import TextWorldEnv
from sao.envs.textworld_agents import ExpertAgent
from sao.offline.episodes import (
    Episode,
    EpisodeStep,
    read_episodes,
    read_trajectory_records,
    record_episode,
    replay_episode,
    write_episodes,
)
from sao.schema import encode


@pytest.fixture(scope="module")
def short_episode() -> Episode:
    task = TextWorldEnv.make_tasks(EnvConfig(name="textworld", options={"size": 6, "max_steps": 40}), 1)[0]
    return record_episode(TextWorldEnv(), task.task_id, task.spec, ExpertAgent(noise=0.3, seed=1))


def write_trajectory_records(path, trajectories) -> int:
    """The trajectory-records format read_episodes reads: each message preceded by its length (uint32 LE)."""
    records = [encode(trajectory) for trajectory in trajectories]
    path.write_bytes(b"".join(struct.pack("<I", len(record)) + record for record in records))
    return len(records)


def test_jsonl_round_trip(tmp_path, short_episode):
    extra = Episode("arithmetic", "a/0", [EpisodeStep("What is 2 + 2?", "4", 1.0, True)])
    path = tmp_path / "episodes.jsonl"
    assert write_episodes(path, [short_episode, extra]) == 2
    assert read_episodes(path) == [short_episode, extra]
    assert short_episode.texts()[1] == f"{short_episode.steps[1].observation}\n{short_episode.steps[1].action}"


def test_replayed_trajectory_decodes_back_to_the_step_texts(tmp_path, short_episode, chat, encoder):
    temporal_filter = load_temporal_filter()
    trajectory, decisions = replay_episode(short_episode, chat, encoder, temporal_filter, recent_window=1)
    assert len(trajectory.steps) == len(short_episode) == 40 and len(decisions) == 39  # the final step is not compressed
    assert trajectory.total_reward == sum(short_episode.rewards())
    # The memory is what the sampler's compressor builds, cut to the slots some step saw.
    table, visible, _ = compress_batch(short_episode.texts()[:39], short_episode.rewards()[:39], encoder,
                                       temporal_filter, recent_window=1)
    assert [list(range(s.memory_count)) for s in trajectory.steps[:39]] == visible
    np.testing.assert_array_equal(trajectory.memory.vectors, table.vectors[: len(trajectory.memory.vectors)])
    path = tmp_path / "trajectories.bin"
    assert write_trajectory_records(path, [trajectory, trajectory]) == 2
    assert len(list(read_trajectory_records(path))) == 2
    decoded = read_episodes(path, tokenizer=chat.tokenizer)[0]
    assert decoded.texts() == short_episode.texts()
    assert decoded.rewards() == short_episode.rewards()


def test_truncated_record_file_names_the_offset(tmp_path, short_episode, chat, encoder):
    trajectory, _ = replay_episode(short_episode.truncated(3), chat, encoder, load_temporal_filter())
    path = tmp_path / "trajectories.bin"
    write_trajectory_records(path, [trajectory])
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match="byte 0"):
        list(read_trajectory_records(path))
    with pytest.raises(ValueError, match="tokenizer"):
        read_episodes(path)
