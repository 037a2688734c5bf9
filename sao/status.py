"""Progress files: each process of a run writes its counters as JSON; `sao run` reads them.

Files keep the processes independent of the launcher (a sampler started by hand on another
machine works the same) and survive a crash for the post-mortem. Writes are atomic.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def write_status(path: Path, fields: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**fields, "updated_at": time.time()}, indent=1, default=float))
    os.replace(tmp, path)


def read_status(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def read_all_status(directory: Path, prefix: str) -> dict[str, dict[str, Any]]:
    return {p.stem: read_status(p) for p in sorted(directory.glob(f"{prefix}*.json"))}
