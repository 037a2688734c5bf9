"""Recorded episodes as text, and the files and topic they are read from for training and inspection.

An `Episode` is what the compressor needs of a trajectory: each step's observation and action
text and its reward. Its step text, `observation + "\\n" + action`, is exactly what the sampler
hands `OnlineCompressor.finish_turn` (turn 0's observation is the task prompt).

Two file formats are read, told apart by their first byte:
- JSONL (`sao compression record` writes it): one episode per line,
  `{"format": "sao-episode-v1", "env", "task_id", "agent", "steps": [{"observation", "action",
  "reward", "done", "label"}]}` (`label` is optional, e.g. the scripted expert's action).
- Trajectory records: sao `trajectory` messages (docs/wire-format.md), each preceded by its
  length as a 4-byte little-endian unsigned integer. Their token ids are decoded back to text
  with the policy's tokenizer (`episode_from_trajectory`).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sao.envs.recall import RecallEnv
from sao.envs.recall import build_episode as build_recall_episode
from sao.envs.textworld import TextWorldEnv
from sao.envs.textworld_agents import Agent, expert_action
from sao.policy.chat import turn_text, user_turn_text
from sao.schema import Memory, SchemaError, Step, Trajectory, decode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from sao.compression.bottleneck import Bottleneck
    from sao.compression.semantic import SemanticEncoder
    from sao.compression.temporal import Decision, TemporalFilter
    from sao.config import EnvConfig

logger = logging.getLogger(__name__)

EPISODE_FORMAT = "sao-episode-v1"
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class EpisodeStep:
    observation: str  # shown before the action; step 0's is the task prompt
    action: str
    reward: float
    done: bool
    label: str | None = None  # optional per-step annotation, e.g. the expert's action here


@dataclass(frozen=True)
class Episode:
    env: str
    task_id: str
    steps: list[EpisodeStep]
    agent: str = ""
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.steps)

    def texts(self) -> list[str]:
        """Each step's text as the sampler encodes it: observation, newline, action."""
        return [turn_text(step.observation, step.action) for step in self.steps]

    def rewards(self) -> list[float]:
        return [step.reward for step in self.steps]

    def compressed_steps(self) -> int:
        """How many steps the sampler feeds the compressor: all but a final `done` step."""
        return len(self.steps) - 1 if self.steps and self.steps[-1].done else len(self.steps)

    def truncated(self, length: int) -> Episode:
        return Episode(self.env, self.task_id, self.steps[:length], self.agent, dict(self.meta))

    def to_json(self) -> str:
        steps = [{k: v for k, v in asdict(s).items() if v is not None} for s in self.steps]
        return json.dumps({"format": EPISODE_FORMAT, "env": self.env, "task_id": self.task_id,
                           "agent": self.agent, "meta": self.meta, "steps": steps})

    @classmethod
    def from_json(cls, line: str) -> Episode:
        obj = json.loads(line)
        if obj.get("format") != EPISODE_FORMAT:
            raise ValueError(f"expected an episode of format {EPISODE_FORMAT!r}, got {obj.get('format')!r}")
        steps = [EpisodeStep(s["observation"], s["action"], float(s["reward"]), bool(s["done"]), s.get("label"))
                 for s in obj["steps"]]
        return cls(obj["env"], obj["task_id"], steps, obj.get("agent", ""), obj.get("meta", {}))


def write_episodes(path: str | Path, episodes: Iterable[Episode]) -> int:
    """Write episodes as JSONL; returns how many."""
    lines = [episode.to_json() + "\n" for episode in episodes]
    Path(path).write_text("".join(lines), encoding="utf-8")
    return len(lines)


def read_trajectory_records(path: str | Path) -> Iterator[Trajectory]:
    """Trajectories from a file of length-prefixed messages; a malformed record stops with its offset."""
    data = Path(path).read_bytes()
    offset = 0
    while offset < len(data):
        if offset + _LENGTH.size > len(data):
            raise ValueError(f"{path}: truncated length prefix at byte {offset}")
        (length,) = _LENGTH.unpack_from(data, offset)
        start = offset + _LENGTH.size
        if start + length > len(data):
            raise ValueError(f"{path}: record at byte {offset} claims {length} bytes, file ends first")
        try:
            yield decode(data[start:start + length], Trajectory)
        except SchemaError as err:
            raise ValueError(f"{path}: record at byte {offset} is not a valid trajectory ({err})") from err
        offset = start + length


def episode_from_trajectory(trajectory: Trajectory, tokenizer: PreTrainedTokenizerBase) -> Episode:
    """Recover the sampler's step texts from token ids: the user turn before each action, and the action."""
    steps = []
    for index, step in enumerate(trajectory.steps):
        observation = user_turn_text(tokenizer, trajectory.prompt_ids if index == 0 else step.observation_ids)
        action = tokenizer.decode(list(map(int, step.action_ids)), skip_special_tokens=True)
        steps.append(EpisodeStep(observation, action, float(step.reward), bool(step.done)))
    return Episode(trajectory.env, trajectory.task_id, steps, agent=f"policy v{trajectory.behaviour_version}")


def holds_trajectory_records(path: str | Path) -> bool:
    """Whether a file holds trajectory records rather than JSONL episodes (which start with `{`)."""
    with open(path, "rb") as probe:
        return probe.read(1) not in (b"{", b"")


def read_episodes(path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> list[Episode]:
    """Episodes from a JSONL file or a file of trajectory records (the latter needs `tokenizer`)."""
    path = Path(path)
    if not holds_trajectory_records(path):
        lines = path.read_text(encoding="utf-8").splitlines()
        return [Episode.from_json(line) for line in lines if line.strip()]
    if tokenizer is None:
        raise ValueError(f"{path} holds trajectory records: decoding their tokens needs the policy's tokenizer")
    return [episode_from_trajectory(t, tokenizer) for t in read_trajectory_records(path)]


def read_episodes_from_topic(bootstrap: str, topic: str, tokenizer: PreTrainedTokenizerBase,
                             max_messages: int | None = None, timeout: float = 30.0) -> list[Episode]:
    """Episodes from the trajectories topic, read from the beginning; invalid messages are counted and skipped."""
    from sao.transport.kafka import read_all

    episodes, invalid = [], 0
    for message in read_all(bootstrap, topic, timeout=timeout, max_messages=max_messages):
        try:
            episodes.append(episode_from_trajectory(decode(message.value(), Trajectory), tokenizer))
        except SchemaError as err:
            invalid += 1
            logger.warning("skipping %s[%d]@%d: %s", topic, message.partition(), message.offset(), err)
    if invalid:
        logger.warning("%d invalid message(s) on %s were skipped (the trainer sends such messages to the DLQ)",
                       invalid, topic)
    return episodes


def replay_episode(episode: Episode, chat, encoder: SemanticEncoder, temporal_filter: TemporalFilter,
                   recent_window: int = 1, sampler_id: str = "replay", embeddings: np.ndarray | None = None,
                   bottleneck: Bottleneck | None = None, recall_turns: int = 0) -> tuple[Trajectory, list[Decision]]:
    """The trajectory a sampler would send had its policy taken the recorded actions.

    `chat` is the sampler's `sao.policy.chat.ChatFormat` (token ids are built exactly as
    in a rollout; each action ends with the end-of-turn token). Behaviour log-probs are 0: no
    policy sampled these actions. Memory is built by `compress_batch`, which equals the
    sampler's online path, over every step but a final `done` one, as the sampler does.
    `embeddings` may hold `encoder.encode(episode.texts())` (or its first rows) computed earlier. With a
    `bottleneck` the memory travels as its coordinates, as a sampler's with compression.bottleneck set.
    With `recall_turns` each step recalls earlier turns as the sampler's `OnlineCompressor.recall` does.
    Returns the trajectory and the filter's decision for each compressed step.
    """
    from sao.compression import pipeline
    from sao.compression.bottleneck import basis_name
    from sao.compression.pipeline import compress_batch, visible_slots_at
    from sao.compression.quantize import dequantize_int8

    compressed = episode.compressed_steps()
    table, _, decisions = compress_batch(
        episode.texts()[:compressed], episode.rewards()[:compressed], encoder, temporal_filter,
        recent_window=recent_window, embeddings=None if embeddings is None else embeddings[:compressed],
        bottleneck=bottleneck)
    vectors = dequantize_int8(table.vectors, table.scales) if len(table) else table.vectors.astype(np.float32)
    queries = None
    if recall_turns > 0 and len(table):  # the sampler's query: the observation, in the slots' coordinates
        queries = encoder.encode([step.observation for step in episode.steps])
        queries = queries if bottleneck is None else bottleneck.encode(queries)
    steps = []
    for index, step in enumerate(episode.steps):
        observation_ids = (chat.first_observation(step.observation) if index == 0
                           else chat.feedback_observation(step.observation, steps[-1].action_ids))
        action_ids = chat.action_ids(step.action)
        visible = len(visible_slots_at(table.created_at_turn, index, recent_window))
        recalled = () if queries is None or not visible else tuple(pipeline.recall_turns(
            vectors[:visible], table.spans[:visible], queries[index], recall_turns, before=index - recent_window))
        steps.append(Step(observation_ids, action_ids, np.zeros(len(action_ids), np.float32), step.reward,
                          step.done, visible, recalled))
    used = max((step.memory_count for step in steps), default=0)  # as the sampler: unseen slots are not sent
    memory = Memory(table.vectors[:used], table.scales[:used], table.spans[:used], table.reward_sums[:used])
    prompt_text = episode.steps[0].observation if episode.steps else ""
    trajectory = Trajectory(
        trajectory_id=Trajectory.make_id(episode.task_id, 0), task_id=episode.task_id, env=episode.env,
        sampler_id=sampler_id, behaviour_version=0, prompt_ids=chat.prompt(prompt_text), steps=steps,
        memory=memory, temperature=1.0, encoder=encoder.name, recent_window=recent_window,
        memory_basis=basis_name(bottleneck))
    return trajectory, decisions


def record_episode(env: TextWorldEnv, task_id: str, spec: dict, agent: Agent) -> Episode:
    """Play one labyrinth episode with a scripted agent; each step is labelled with the expert's command."""
    observation = env.reset(spec)
    steps = []
    while True:
        label = expert_action(env)
        action = agent.act(env)
        feedback = env.step(action)
        steps.append(EpisodeStep(observation, action, feedback.reward, feedback.done, label))
        if feedback.done:
            break
        observation = feedback.observation
    return Episode(env.name, task_id, steps, agent.name,
                   {"solved": feedback.info["solved"], "delivered": feedback.info["delivered"], "spec": dict(spec)})


def recall_episodes(env_config: EnvConfig, count: int, start_index: int = 0, split: str = "train") -> list[Episode]:
    """`count` recall episodes played with the replies the rules ask for (each message repeated back, a
    question answered with its fact's statement), scored by the env itself."""
    env = RecallEnv()
    episodes = []
    for task in RecallEnv.make_tasks(env_config, count, start_index, split):
        observation, steps, turns = env.reset(task.spec), [], build_recall_episode(task.spec).turns
        for turn in turns:
            feedback = env.step(turn.reply)
            steps.append(EpisodeStep(observation, turn.reply, feedback.reward, feedback.done))
            observation = feedback.observation
        solved = all(step.reward > 0 for step, turn in zip(steps, turns) if turn.fact is not None)
        episodes.append(Episode(RecallEnv.name, task.task_id, steps, "rules", {"spec": dict(task.spec),
                                                                              "solved": solved}))
    return episodes
