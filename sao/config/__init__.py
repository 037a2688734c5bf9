"""Typed configuration: one pydantic tree, loaded from TOML + env vars + CLI overrides.

Every knob is defined once, with its description, in the module of its component (transport,
env, policy, sampler, trainer with its algorithm and objective, run); this module joins them,
and loads, validates and renders the tree (`sao config show` prints the effective one).
Precedence (last wins): defaults < TOML file < `SAO__SECTION__KNOB` env vars < `--set
section.knob=value` flags < dedicated CLI flags. A wrong value fails at start naming its field.
"""

from __future__ import annotations

import os
import textwrap
import typing
from pathlib import Path
from typing import Any

import tomllib
from pydantic import BaseModel, ValidationError, model_validator

from sao.config.algorithms import (
    GrpoAlgorithm,
    MaskedObjective,
    PpoObjective,
    SaoAlgorithm,
    TisObjective,
)
from sao.config.env import DATASET_DEFAULT_OPTIONS, DEFAULT_DATASET, EnvConfig, SandboxConfig
from sao.config.policy import MAX_RECALL_TURNS, CompressionConfig, FolderTransport, KafkaTransport, PolicyConfig
from sao.config.run import MetricsConfig, RunConfig
from sao.config.sampler import SamplerConfig
from sao.config.section import TAGGED_TABLES, Section, available_cpu_ids, machine_cpu_ids
from sao.config.trainer import LORA_ALL_LINEAR, LoraConfig, TrainerConfig
from sao.config.transport import BrokerConfig, TopicsConfig

__all__ = ["DATASET_DEFAULT_OPTIONS", "DEFAULT_DATASET", "LORA_ALL_LINEAR", "MAX_RECALL_TURNS", "BrokerConfig",
           "CompressionConfig", "ConfigError", "EnvConfig", "FolderTransport", "GrpoAlgorithm", "KafkaTransport",
           "LoraConfig", "MaskedObjective", "MetricsConfig", "PolicyConfig", "PpoObjective", "RunConfig",
           "SamplerConfig", "SandboxConfig", "SaoAlgorithm", "SaoConfig", "Section", "TisObjective", "TopicsConfig",
           "TrainerConfig", "available_cpu_ids", "load_config", "machine_cpu_ids",
           "to_described_toml", "to_toml", "toml_value"]


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
    """Set one knob; a name where a table stands (`trainer.algorithm = "grpo"`) is that table's `type`."""
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        if key in TAGGED_TABLES and isinstance(node.get(key), str):
            node[key] = {"type": node[key]}
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {key} is not a section")
    if keys[-1] in TAGGED_TABLES and isinstance(value, str) and isinstance(node.get(keys[-1]), dict):
        node[keys[-1]]["type"] = value
    else:
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
    try:
        return SaoConfig.model_validate(tree)
    except ValidationError as err:
        first = err.errors()[0]
        # A tagged table's errors name its type as a step (trainer.algorithm.grpo.group_size): the user never wrote it.
        loc = tuple(part for index, part in enumerate(first["loc"])
                    if not (index and first["loc"][index - 1] in TAGGED_TABLES))
        field = ".".join(str(part) for part in loc)
        hint = _nearest_knobs(loc) if first["type"] == "extra_forbidden" else ""
        raise ConfigError(f"config field `{field}`: {first['msg']} (got {first.get('input')!r}){hint}") from err


def _nearest_knobs(loc: tuple[Any, ...]) -> str:
    """' (did you mean a, b?)': the valid names nearest an unknown one at `loc`, from its section's fields."""
    import difflib

    model: type[BaseModel] = SaoConfig
    for part in loc[:-1]:
        inner = model.model_fields.get(str(part))
        kinds = typing.get_args(inner.annotation) if inner is not None else ()
        if part in TAGGED_TABLES and kinds:  # a knob of another type than the one chosen
            owners = [kind.model_fields["type"].default for kind in kinds if loc[-1] in kind.model_fields]
            return f" ({loc[-1]} belongs to type {' or '.join(map(repr, owners))})" if owners else ""
        if inner is None or not (isinstance(inner.annotation, type) and issubclass(inner.annotation, BaseModel)):
            return ""
        model = inner.annotation
    prefix = "".join(f"{part}." for part in loc[:-1])
    near = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(prefix + name for name in near)}?)" if near else ""


def to_toml(config: SaoConfig) -> str:
    """The effective config as TOML, inner tables inline: what runs record (`sao config show`: to_described_toml)."""
    return "\n".join(f"[{section}]\n" + "".join(f"{key} = {toml_value(value)}\n" for key, value in values.items())
                     for section, values in config.model_dump(exclude_none=True).items())


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
        lines.append(f"# {name} = (unset)" if value is None else f"{name} = {toml_value(value)}")
    text = (f"[{table}]\n" if table and lines else "") + "".join(f"{line}\n" for line in lines)
    for name, section in sections:
        text += ("\n" if text else "") + to_described_toml(section, describe, name)
    return text


def toml_value(value: Any) -> str:
    """`value` as a TOML literal: how runs record the config, and how CLI flags become `--set` overrides."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")
