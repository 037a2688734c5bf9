"""The trainer: optimisation, advantages, publishing, shadow validation, DeepSpeed and LoRA."""

from __future__ import annotations

import os
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from sao.config.algorithms import Algorithm, Objective, SaoAlgorithm, TisObjective
from sao.config.section import Precision, Section, available_cpu_ids

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
    moved_knobs: ClassVar = {
        "group_size": ("algorithm", "group_size", "grpo"), "tis_clip": ("objective", "clip", "tis"),
        "ppo_clip": ("objective", "clip", "ppo"), "ppo_clip_high": ("objective", "clip_high", "ppo"),
        "dual_clip": ("objective", "dual_clip", "ppo"), "mask_low": ("objective", "low", "masked"),
        "mask_high": ("objective", "high", "masked")}
    old_names: ClassVar = {
        "eval_every": "is retired: shadow validation replaces it (trainer.shadow_every)",
        "eval_tasks": "is retired: shadow validation replaces it (trainer.shadow_tasks)",
        "whiten_advantages": "is now trainer.scale_advantages (it scales; trainer.center_advantages centres)"}

    algorithm: Algorithm = Field(
        default_factory=SaoAlgorithm, description="What the trainer optimises: sao (the default) or grpo (the "
                                                  "comparison baseline), with that algorithm's own knobs.")
    batch_size: int = Field(8, ge=1, description="Trajectories per optimizer step; DeepSpeed's train_batch_size "
                                                 "in trainer.deepspeed overrides it.")
    max_reuse: int = Field(1, ge=1, description="Times a buffered trajectory may be trained on (1 = exactly once).")
    priority_exponent: float = Field(
        0.0, ge=0, description="Replay priority (freshness_decay**staleness * |advantage|)**exponent; 0 = oldest first.")
    learning_rate: float = Field(1.5e-5, gt=0, description="AdamW learning rate.")
    warmup_steps: int = Field(
        0, ge=0, description="Raise the learning rate linearly over the first this many optimizer steps, so Adam's "
                             "moment estimates fill before full-size updates; 0 = the full rate from the first step.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global L2 gradient norm to this.")
    objective: Objective = Field(
        default_factory=TisObjective, description="The policy-gradient loss with its off-policy correction: tis, ppo "
                                                  "or masked, with that objective's own knobs.")
    importance_level: Literal["token", "sequence"] = Field(
        "token", description="tis/masked: one rho per token, or one per trajectory (product over its tokens).")
    baseline_key: Literal["env", "task_id", "prompt", "leave_one_out"] = Field(
        "prompt", description="What a sao advantage subtracts from a turn's return: a running mean per prompt (else "
                              "per env), per env, per task id (else env), or the mean of the batch's other "
                              "trajectories. Trade-offs: docs/design.md.")
    baseline_momentum: float = Field(
        0.9, ge=0, lt=1, description="EMA momentum of the running-mean baselines; a key's first 1/(1-momentum) "
                                     "rewards are averaged plainly, so one early reward does not dominate.")
    turn_credit: Literal["auto", "reward_to_go", "own_reward"] = Field(
        "auto", description="What a turn's tokens are credited with: reward_to_go (the rewards to the episode's end),"
                            " own_reward (its own, so a wrong first answer does not share its retry's), auto "
                            "(own_reward in retry envs).")
    retry_hindsight: bool = Field(
        True, description="sao with own_reward credit: a retry that earned more than the first try is also trained as "
                          "the first try's answer: the env's feedback teaches the question (trainer.hindsight_reply).")
    hindsight_reply: Literal["retry", "corrected"] = Field(
        "corrected", description="What that row answers with: the first reply with its answer put right by the "
                                 "retry's, judged as a first try (envs that say where a reply's answer stands; others: "
                                 "as retry), or the retry's own reply at the retry's advantage.")
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
        "bf16", description="Dtype of published weights: bf16 halves a file and changes fewer values between versions"
                            " (smaller deltas), and the importance ratio corrects a CPU sampler's rounding; fp32 "
                            "publishes exactly.")
    publish_deltas: bool = Field(
        True, description="Publish each version as a sparse delta on the one before (unless over half a whole file); "
                          "a sampler holding another base re-syncs from the newest snapshot (docs/design.md).")
    snapshot_every: int = Field(
        10, ge=1, le=100, description="With publish_deltas: publish a whole snapshot every this many versions (and the "
                                      "first version a trainer publishes), so a sampler that joins or loses the chain "
                                      "re-syncs from at most this many files (a sampler remembers the last 256 "
                                      "announcements it read, so a chain fits in them).")
    shadow_every: int = Field(
        2, ge=0, description="Score a published version at most every this many versions on a fixed validation slice,"
                             " greedily, in a background process training never waits for; the best is kept as "
                             "RUN_DIR/policy/best. 0 = off.")
    shadow_tasks: int = Field(
        48, ge=1, description="Distinct validation tasks each shadow score uses at most: the held-out tasks that "
                              "follow the run.heldout_cap the final comparison uses. An eval split too small for "
                              "both is shared: validation takes at most its last half.")
    shadow_margin: float = Field(
        2.0, gt=0, description="A scored version whose success is below the top score's by more than this many "
                               "standard errors of their paired difference has dropped: an alert, and with rollback "
                               "a restore.")
    rollback: bool = Field(
        True, description="On a drop (see shadow_margin), restore the best version's (the newest that did not drop) "
                          "weights and optimizer state and go on from there, publishing them as a new version.")
    fused_adamw: bool = Field(
        True, description="torch AdamW's fused kernel: one pass over the weights per step instead of several, "
                          "for the same update (measured: benchmarks/README.md).")
    micro_batch_tokens: int = Field(
        4096, ge=64, description="Positions (rows x the longest row, padding included) one forward and backward pass "
                                 "computes at most: it bounds the trainer's peak memory. A longer row is "
                                 "dead-lettered (too-large).")
    length_buckets: int = Field(
        2, ge=1, description="At most this many forward passes per micro-batch: rows sorted by length and split where"
                             " that cuts the padding most (same loss); 1 = one padded pass. With several ranks it is "
                             "1.")
    precision: Precision = Field(
        "auto", description="Dtype the trainer computes in: auto = bf16 on a GPU (DeepSpeed's bf16) or on a CPU with "
                            "native bf16 matmuls (the decoder under bf16 autocast; weights, optimizer and log-probs' "
                            "logits in fp32), else fp32.")
    torch_threads: int | Literal["auto"] = Field(
        "auto", description="torch threads of the trainer process; auto = the CPUs in the process's affinity mask "
                            "(after trainer.cpu_affinity is applied) shared among the ranks on this machine, so the "
                            "trainer also runs on what the samplers leave idle (measured: benchmarks/README.md).")
    cpu_affinity: list[int] | None = Field(
        None, description="CPU ids the trainer process is pinned to (os.sched_setaffinity at start, before torch sets "
                          "its threads); unset = wherever the OS schedules it. See sampler.cpu_affinity.")
    offload_optimizer: bool = Field(
        False, description="ZeRO-3 optimizer offload: fp32 master weights and AdamW state in CPU memory, the "
                           "optimizer step run there; it frees accelerator memory for a slower step "
                           "(benchmarks/zero3_memory.py).")
    deepspeed_config: str | None = Field(
        None, description="A DeepSpeed JSON config file, merged over sao's derived config (ZeRO stage, clipping, batch).")
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
        return self.importance_level == "sequence" and self.objective.type != "ppo"

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
        if self.batch_size % self.algorithm.copies_per_task:
            raise ValueError(f"trainer.algorithm.group_size {self.algorithm.copies_per_task} must divide "
                             f"trainer.batch_size {self.batch_size}")
        return self
