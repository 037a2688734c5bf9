"""The env the tasks come from, and the sandbox generated code runs in."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from sao.config.section import Section


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
    old_names: ClassVar = {
        "step_timeout_s": "is now env.turn_timeout_s (it bounds each env call of a turn; a step is an optimizer step)"}

    name: str = Field("arithmetic", description="Built-in env name, or `package.module:Class` of your own "
                      "(see sao/envs/registry.py).")
    dataset: str = Field(DEFAULT_DATASET, description="reasoning-gym dataset the tasks come from (any name "
                                                      "reasoning_gym.create_dataset takes).")
    dataset_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of env.dataset's reasoning-gym config, merged over that dataset's defaults (sao's own for"
                    " basic_arithmetic); an unknown option or a refused value stops the run at start, naming it.")
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
        True, description="arithmetic env: the feedback on a wrong answer states the right one, so a retry can take "
                          "it and trainer.retry_hindsight teaches it to the first try: supervision from the env that a "
                          "reward-only peer does not get (false: reward only); second-try success then measures copying.")
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
