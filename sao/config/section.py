"""What every config table shares: extra keys refused, assignments validated; CPU-list checks."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator

log = logging.getLogger(__name__)
# Tables tagged by `type` (pydantic discriminated unions): the knob names whose value is one.
TAGGED_TABLES = ("algorithm", "objective", "transport", "engine")


# What `sampler.precision` and `trainer.precision` accept (sao/policy/precision.py resolves auto).
Precision = Literal["auto", "fp32", "bf16"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # Knobs of earlier releases, by their old name: flat ones still read, moved into a tagged table (-> that table,
    # knob, and the type or types it belongs to; see move_flat_knobs), and old names refused (-> what to use instead).
    moved_knobs: ClassVar[dict[str, tuple[str, str, str | tuple[str, ...]]]] = {}
    old_names: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _earlier_knobs(cls, data: Any) -> Any:
        section = cls.__name__.removesuffix("Config").lower()  # TrainerConfig is the table `trainer`
        data = move_flat_knobs(data, section, cls.moved_knobs, cls)
        for old, instead in cls.old_names.items():
            if isinstance(data, dict) and old in data:
                raise ValueError(f"{section}.{old} {instead}")
        return data


def move_flat_knobs(data: Any, section: str, moved: dict[str, tuple[str, str, str | tuple[str, ...]]],
                    model: type[BaseModel]) -> Any:
    """`model`'s raw data with the flat knobs of earlier releases (`moved`: old name -> table, knob, the type or
    types it belongs to) moved into that table, each with a warning naming its new place; dropped when the table
    holds another type (unset, the table's default)."""
    if not isinstance(data, dict) or not set(data) & set(moved):
        return data
    data = dict(data)
    for old, (table, knob, kinds) in moved.items():
        if old not in data:
            continue
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        value = data.pop(old)
        log.warning("config: %s.%s is now %s.%s.%s (with %s.%s.type = %s)", section, old, section, table, knob,
                    section, table, " or ".join(map(repr, kinds)))
        chosen = data.get(table, model.model_fields[table].get_default(call_default_factory=True).type)
        chosen_type = chosen.get("type") if isinstance(chosen, dict) else chosen
        if chosen_type in kinds:
            data[table] = {**(chosen if isinstance(chosen, dict) else {}), "type": chosen_type, knob: value}
    return data


def tagged_table(default: str) -> BeforeValidator:
    """Reads a table tagged by `type`: a bare name stands for `{type = name}`, a table without a type is the
    default type's (so a knob of another type is refused naming the type it belongs to)."""
    def read(value: Any) -> Any:
        if isinstance(value, str):
            return {"type": value}
        return {"type": default, **value} if isinstance(value, dict) and "type" not in value else value
    return BeforeValidator(read)


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
