"""What every config table shares: extra keys refused, assignments validated; CPU-list checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict


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
