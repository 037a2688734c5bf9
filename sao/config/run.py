"""One `sao run`: its size, mode, budgets and held-out judge; the metrics endpoints."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from sao.config.section import Section


class RunConfig(Section):
    old_names: ClassVar = {
        "max_tasks_in_flight": "is now run.max_trajectories_in_flight (it counts trajectories: grpo sends a task "
                               "group_size times)"}

    num_tasks: int = Field(192, ge=1, description="Tasks the feeder sends (grpo: each group_size times); the run ends "
                                                 "when all their trajectories are trained on.")
    run_dir: str | None = Field(None, description="Logs, weights, checkpoints, summary.json; unset = runs/<timestamp>.")
    mode: Literal["async", "sync"] = Field(
        "async", description="async: samplers run ahead of the trainer, up to run.max_trajectories_in_flight. sync: "
                             "one batch at a time, sampled with the newest version and trained before the next is "
                             "released (staleness 0).")
    max_trajectories_in_flight: int | None = Field(
        None, ge=1, description="Backpressure: trajectories fed but not yet trained on, at most; unset = the "
                                "algorithm's default (sao three batches, grpo one). run.mode = sync releases one "
                                "batch at a time.")
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
