"""The trainer's algorithm and objective: tagged tables, each holding only its own knobs."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from sao.config.section import Section, tagged_table


class SaoAlgorithm(Section):
    """sao: one trajectory per task, each turn against its running baseline."""

    type: Literal["sao"] = Field("sao", description="sao: one trajectory per task, each turn against its running baseline.")
    copies_per_task: ClassVar[int] = 1
    group_baseline: ClassVar[bool] = False
    batches_in_flight: ClassVar[int] = 3  # the feeder's default lead: see feeder.in_flight_cap

    def label(self) -> str:
        return "sao"


class GrpoAlgorithm(Section):
    """grpo, the comparison baseline: each task sampled group_size times, group-mean advantages, one batch at a time."""

    type: Literal["grpo"] = Field("grpo", description="grpo: each task group_size times, group-mean advantages.")
    group_size: int = Field(4, ge=2, description="Copies per task; must divide trainer.batch_size.")
    batches_in_flight: ClassVar[int] = 1  # synchronous: the next batch is sampled only with the new policy
    group_baseline: ClassVar[bool] = True  # advantages against the group's mean, whole groups a step

    @property
    def copies_per_task(self) -> int:
        return self.group_size

    def label(self) -> str:
        return f"grpo (group {self.group_size})"


class TisObjective(Section):
    """tis: truncated importance sampling, -min(rho, clip).detach() * A * log pi."""

    type: Literal["tis"] = Field("tis", description="tis: every token weighted by its importance ratio, truncated at clip.")
    clip: float = Field(2.0, gt=0, description="Largest importance weight a token gets.")


class PpoObjective(Section):
    """ppo: decoupled PPO, -min(rho A, clip(rho, 1 - clip, 1 + clip_high) A), rho against the behaviour policy."""

    type: Literal["ppo"] = Field("ppo", description="ppo: the clipped surrogate against the behaviour policy.")
    clip: float = Field(0.2, gt=0, lt=1, description="Lower clip epsilon (rho >= 1 - clip).")
    clip_high: float | None = Field(None, gt=0, description="Upper clip epsilon; unset = clip.")
    dual_clip: float | None = Field(3.0, gt=1, description="For A < 0 the loss is bounded by dual_clip * |A|; "
                                                           "unset = off.")


class MaskedObjective(Section):
    """masked: tis with the tokens whose rho leaves [low, high] dropped, not truncated."""

    type: Literal["masked"] = Field("masked", description="masked: tokens whose ratio leaves [low, high] dropped.")
    low: float = Field(0.5, gt=0, description="Tokens with rho below this are dropped.")
    high: float = Field(2.0, gt=1, description="Tokens with rho above this are dropped.")


Algorithm = Annotated[SaoAlgorithm | GrpoAlgorithm, Field(discriminator="type"), tagged_table("sao")]
Objective = Annotated[TisObjective | PpoObjective | MaskedObjective, Field(discriminator="type"), tagged_table("tis")]
