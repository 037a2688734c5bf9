"""`sao compression record / train / inspect`, from a file, from the env's agents and from Kafka."""

import json

import pytest
from typer.testing import CliRunner

from sao.cli import app
from sao.compression.temporal import load_temporal_filter
from sao.offline.episodes import read_episodes, replay_episode
from sao.schema import encode
from sao.transport.kafka import deliver_and_wait, make_producer
from sao.transport.topics import ensure_topics

SMALL_WORLDS = ["--set", "env.options.size=6", "--set", "env.options.max_steps=30"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("episodes") / "episodes.jsonl"
    result = CliRunner().invoke(app, ["compression", "record", "--out", str(path), "--episodes", "3",
                                      "--agent", "noisy", "--noise", "0.3", *SMALL_WORLDS])
    assert result.exit_code == 0, result.output
    return path


def test_record_writes_labelled_episodes(recorded):
    episodes = read_episodes(recorded)
    assert [len(e) for e in episodes] == [30, 30, 30]
    assert all(step.label for e in episodes for step in e.steps)
    assert [e.task_id for e in episodes] == ["textworld/0/0", "textworld/0/1", "textworld/0/2"]


def test_train_then_inspect_from_a_file(recorded, tmp_path, encoder):
    out = tmp_path / "filter.safetensors"
    result = CliRunner().invoke(app, ["compression", "train", "--input", str(recorded), "--out", str(out),
                                      "--hidden", "8", "--epochs", "2", "--target-keep-ratio", "0.4", "--seed", "3"])
    assert result.exit_code == 0, result.output
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["seed"] == 3 and meta["episodes"] == 3 and meta["keep_ratio"] == pytest.approx(0.4, abs=0.1)
    assert meta["command"].startswith("sao compression train --input") and "--seed 3" in meta["command"]
    result = CliRunner().invoke(app, ["compression", "inspect", "--input", str(recorded), "--index", "1",
                                      "--temporal-weights", str(out), "--width", "30"])
    assert result.exit_code == 0, result.output
    for expected in ("boundary", "keep", "merge", "redundant", "final step", "29 compressed into"):
        assert expected in result.output


def test_inspect_plays_the_env_and_train_needs_one_source(recorded):
    result = CliRunner().invoke(app, ["compression", "inspect", "--from-env", "textworld", "--limit", "4",
                                      "--kept-only", *SMALL_WORLDS])
    assert result.exit_code == 0, result.output
    assert "textworld/0/0" in result.output and "boundary" in result.output
    result = CliRunner().invoke(app, ["compression", "train", "--input", str(recorded), "--from-env", "textworld",
                                      "--out", "unused.safetensors"])
    assert result.exit_code == 2 and "exactly one" in result.output
    result = CliRunner().invoke(app, ["compression", "record", "--env", "arithmetic", "--out", "unused.jsonl"])
    assert result.exit_code == 2 and "textworld and recall" in result.output


def test_record_plays_recall_episodes_with_the_replies_its_rules_ask_for(tmp_path):
    from sao.envs.recall import build_episode

    path = tmp_path / "recall.jsonl"
    result = CliRunner().invoke(app, ["compression", "record", "--env", "recall", "--episodes", "2", "--out", str(path),
                                      "--set", "env.options.turns=6", "--set", "env.options.facts=2"])
    assert result.exit_code == 0, result.output
    episodes = read_episodes(path)
    assert [e.task_id for e in episodes] == ["train/recall/0/0", "train/recall/0/1"] and "2 solved" in result.output
    for episode in episodes:
        turns = build_episode(episode.meta["spec"]).turns
        assert [s.observation for s in episode.steps] == [t.text for t in turns]  # each turn shown, then replied to
        assert [s.action for s in episode.steps] == [t.reply for t in turns]
        assert [s.reward for s in episode.steps] == [1.0 if t.fact else 0.0 for t in turns]  # the env scored them
        assert [s.done for s in episode.steps] == [False] * (len(turns) - 1) + [True]


def test_train_from_the_trajectories_topic(recorded, tmp_path, kafka_bootstrap, unique_topic_prefix, chat, encoder):
    topic = f"{unique_topic_prefix}.trajectories"
    ensure_topics(kafka_bootstrap, {topic: 1})
    producer = make_producer(kafka_bootstrap)
    for episode in read_episodes(recorded):
        trajectory, _ = replay_episode(episode, chat, encoder, load_temporal_filter())
        deliver_and_wait(producer, topic, encode(trajectory), key=trajectory.task_id)
    deliver_and_wait(producer, topic, b"not msgpack", key="bad")  # skipped with a warning, not fatal
    out = tmp_path / "from-kafka.safetensors"
    result = CliRunner().invoke(app, ["compression", "train", "--bootstrap-servers", kafka_bootstrap,
                                      "--set", f'topics.trajectories="{topic}"', "--out", str(out),
                                      "--hidden", "8", "--epochs", "1"])
    assert result.exit_code == 0, result.output
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["episodes"] == 3 and meta["steps"] == 90 and topic in meta["corpus"]


def test_align_writes_a_projector_whose_sidecar_holds_its_recipe_and_content_check(tmp_path, encoder):
    out = tmp_path / "projector.safetensors"
    result = CliRunner().invoke(app, ["compression", "align", "--labyrinth-episodes", "1", "--tutoring-episodes", "1",
                                      "--max-steps", "12", "--updates", "2", "--reconstruct-updates", "2",
                                      "--reconstruct-weight", "0.5", "--reconstruct-batch", "4",
                                      "--validation-steps", "4", "--out", str(out), "--set", 'policy.model="tiny"'])
    assert result.exit_code == 0, result.output
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["model"] == "tiny" and "--reconstruct-updates 2" in meta["command"]
    assert "--reconstruct-weight 0.5" in meta["command"]
    content = meta["result"]["content"]
    assert content["n"] > 0 and content["other_minus_own"] == pytest.approx(content["other"] - content["own"])
    assert "under its own slot" in result.output


@pytest.mark.slow
def test_the_shipped_memory_basis_is_rebuilt_by_the_command_in_its_sidecar(tmp_path):
    """`sao compression bottleneck --width 64 --seed 0` gives the shipped file's numbers."""
    import shlex

    from sao.compression.bottleneck import shipped_bottleneck_path

    shipped = shipped_bottleneck_path("all-MiniLM-L6-v2")
    meta = json.loads(shipped.with_suffix(".json").read_text())
    command = shlex.split(meta["command"])
    assert command[:3] == ["sao", "compression", "bottleneck"] and "--out" not in command
    out = tmp_path / "basis.safetensors"
    result = CliRunner().invoke(app, [*command[1:], "--out", str(out)])
    assert result.exit_code == 0, result.output
    # The same numbers up to float rounding: the fit's reductions (encoder, PCA) may round differently under
    # other torch/numpy builds, so the bytes, and the identity hashed from them, are compared only up to that.
    from safetensors.numpy import load_file

    rebuilt_arrays, shipped_arrays = load_file(str(out)), load_file(str(shipped))
    assert sorted(rebuilt_arrays) == sorted(shipped_arrays)
    for name, array in shipped_arrays.items():
        assert rebuilt_arrays[name].shape == array.shape
        assert abs(rebuilt_arrays[name] - array).max() < 1e-4, name
    rebuilt = json.loads(out.with_suffix(".json").read_text())
    assert rebuilt["vectors"] == meta["vectors"]  # the same corpus, kept step for kept step
    for split, kept in meta["variance_kept"].items():
        assert rebuilt["variance_kept"][split] == pytest.approx(kept, abs=1e-3)
    assert meta["variance_kept"]["held_out_textworld"] > 0.85  # the labyrinth, where memory is used


def test_the_bottleneck_command_refuses_a_width_beyond_the_encoder():
    result = CliRunner().invoke(app, ["compression", "bottleneck", "--width", "385", "--out", "/nonexistent/x"])
    assert result.exit_code == 2 and "--width" in result.output and "384" in result.output


def test_a_basis_fits_on_a_workload_s_own_episodes_and_names_them(recorded, tmp_path):
    from sao.compression.bottleneck import load_bottleneck

    out = tmp_path / "basis.safetensors"
    result = CliRunner().invoke(app, ["compression", "bottleneck", "--input", str(recorded), "--width", "8",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    basis, meta = load_bottleneck(out, "all-MiniLM-L6-v2")
    assert basis.width == 8 and f"2 episodes from file {recorded}" in meta["corpus"]
    assert meta["command"].endswith(f"--input {recorded}") and 0 < meta["variance_kept"]["held_out_textworld"] < 1
    too_wide = CliRunner().invoke(app, ["compression", "bottleneck", "--input", str(recorded), "--width", "300",
                                        "--out", str(out)])
    assert too_wide.exit_code == 1 and "--width 300" in too_wide.output
