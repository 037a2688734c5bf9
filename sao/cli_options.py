"""What every `sao` command shares: the `--config` / `--set` options, the logging set-up and the config they make.

Its own module so that `sao.cli` and the offline tools' commands (`sao compression …`) define them once.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.logging import RichHandler

from sao.config import ConfigError, SaoConfig, load_config, toml_value

console = Console(stderr=True)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override any knob: section.knob=value.")]


def fail(message: str, code: int = 2) -> NoReturn:
    """End the command with exit code `code` after `message` (rich markup) on stderr, one line: greppable in logs."""
    console.print(message, soft_wrap=True)
    raise typer.Exit(code)


def setup_logging() -> None:
    handler: logging.Handler = RichHandler(console=console, show_path=False) if sys.stderr.isatty() else logging.StreamHandler()
    if not isinstance(handler, RichHandler):
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level="INFO", handlers=[handler], force=True)
    for noisy in ("httpx", "sentence_transformers", "transformers", "DeepSpeed", "deepspeed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def config_or_exit(path: Path | None, sets: list[str] | None, **flags: Any) -> SaoConfig:
    """Effective config: file < env < --set < dedicated flags (those not None); a bad one exits 2 naming it."""
    overrides = list(sets or [])
    overrides += [f"{key}={toml_value(value)}" for key, value in flags.items() if value is not None]
    try:
        return load_config(path, overrides)
    except ConfigError as err:
        fail(f"[red]config error:[/] {err}")
