"""Memory-projector weights on disk: aligned projectors ship per (model, encoder) pair and load at start.

A projector maps one encoder's sentence embeddings into one LM's input-embedding space, so a
file is only meaningful for the pair it was aligned on (`sao compression align`). Its JSON
sidecar names that pair; loading it for another pair is refused with an error that says what to
do, never silently. Without a matching file the projector stays at zero (memory adds nothing).
Files read the encoder's full width; where memory travels narrowed (compression.bottleneck), the
loaded projector is composed with the bottleneck's basis (`compose`), which is exact.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from sao.compression.bottleneck import Bottleneck
from sao.compression.semantic import encoder_name, file_slug
from sao.compression.temporal import sidecar_path

logger = logging.getLogger(__name__)

PROJECTOR_FORMAT = "sao-projector-v1"
SHIPPED_DIR = Path(__file__).resolve().parent / "projectors"


class ProjectorMismatch(ValueError):
    """Projector weights aligned for another model or encoder, or not a projector file at all."""


def shipped_projector_path(model: str, encoder: str) -> Path:
    """Where the aligned projector for (model, encoder identity) ships (it may not exist)."""
    return SHIPPED_DIR / f"{file_slug(model)}--{file_slug(encoder)}.safetensors"


def save_projector(projector: nn.Linear, path: Path | str, meta: dict) -> None:
    """Write the projector (safetensors) and its sidecar; `meta` must name `model` and `encoder`."""
    missing = {"model", "encoder"} - set(meta)
    if missing:
        raise ValueError(f"projector metadata must name {sorted(missing)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"weight": projector.weight.detach().to("cpu", torch.float32).contiguous(),
             "bias": projector.bias.detach().to("cpu", torch.float32).contiguous()}
    save_file(state, str(path))
    full = {"format": PROJECTOR_FORMAT, "memory_width": projector.in_features,
            "hidden_size": projector.out_features, **meta}
    sidecar_path(path).write_text(json.dumps(full, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_projector(projector: nn.Linear, path: Path | str, model: str, encoder: str) -> dict:
    """Copy aligned weights into `projector` after checking they were aligned for `model` + `encoder`.

    `encoder` is the encoder's name (`sao.compression.semantic.encoder_name`). Returns the sidecar metadata.
    """
    side = sidecar_path(path)
    if not side.is_file():
        raise ProjectorMismatch(f"{path}: its sidecar {side.name} is missing, so the model and encoder it was "
                                "aligned for are unknown; re-run `sao compression align`")
    meta = json.loads(side.read_text(encoding="utf-8"))
    if meta.get("format") != PROJECTOR_FORMAT:
        raise ProjectorMismatch(f"{side}: format {meta.get('format')!r}, expected {PROJECTOR_FORMAT!r}")
    if (meta.get("model"), meta.get("encoder")) != (model, encoder):
        raise ProjectorMismatch(
            f"{path} was aligned for model {meta.get('model')!r} + encoder {meta.get('encoder')!r}, but this run "
            f"uses model {model!r} + encoder {encoder!r}: a projector only fits the pair it was aligned on. Align "
            f"one with `sao compression align`, or set policy.projector = \"zero\"")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ProjectorMismatch(f"{path}: not a readable safetensors file ({err})") from err
    expected = {name: tuple(tensor.shape) for name, tensor in projector.state_dict().items()}
    found = {name: tuple(tensor.shape) for name, tensor in state.items()}
    if found != expected:
        raise ProjectorMismatch(f"{path}: holds {found}, the projector needs {expected}")
    if not all(bool(torch.isfinite(tensor).all()) for tensor in state.values()):
        raise ProjectorMismatch(f"{path}: holds NaN or infinity")
    projector.load_state_dict(state)
    return meta


def compose(aligned: nn.Linear, bottleneck: Bottleneck, projector: nn.Linear) -> None:
    """Set `projector` (reading the bottleneck's coordinates c) to what `aligned` (reading the encoder's
    vectors) gives for the vector they stand for: W (centre + U c) + b = (W U) c + (W centre + b)."""
    basis = torch.from_numpy(bottleneck.basis).to(torch.float64)
    centre = torch.from_numpy(bottleneck.centre).to(torch.float64)
    weight, bias = aligned.weight.detach().to(torch.float64), aligned.bias.detach().to(torch.float64)
    with torch.no_grad():
        projector.weight.copy_(weight @ basis)
        projector.bias.copy_(weight @ centre + bias)


def apply_projector_setting(projector: nn.Linear, setting: str, model: str, encoder_setting: str,
                            bottleneck: Bottleneck | None = None) -> str:
    """Load what `policy.projector` asks for; return a line saying which projector the run uses.

    `auto`: the shipped aligned weights of this (model, encoder) pair if they exist, else zero;
    `zero`: zero init; anything else: a weights file, which must match the pair. Projector files read
    the encoder's full width; with a `bottleneck` they are composed with its basis (`compose`).
    """
    encoder = encoder_name(encoder_setting)
    if setting == "zero":
        return "memory projector: zero init (policy.projector = \"zero\"): memory adds nothing until trained"
    path = shipped_projector_path(model, encoder) if setting == "auto" else Path(setting).expanduser()
    if setting == "auto" and not path.is_file():
        return (f"memory projector: zero init (no aligned projector ships for model {model!r} + encoder "
                f"{encoder!r}): memory adds nothing until trained")
    if not path.is_file():
        raise ProjectorMismatch(f"policy.projector {setting!r}: no such file")
    if bottleneck is None:
        meta = load_projector(projector, path, model, encoder)
    else:
        aligned = nn.Linear(bottleneck.dim, projector.out_features)
        meta = load_projector(aligned, path, model, encoder)
        compose(aligned, bottleneck, projector)
    result = meta.get("result", {})
    measured = {"kl_zero", "kl_aligned"} <= set(result)
    kl = f"; held-out KL {result['kl_zero']:.3f} -> {result['kl_aligned']:.3f}" if measured else ""
    through = f", composed with basis {bottleneck.identity}" if bottleneck is not None else ""
    return f"memory projector: aligned, {path.name}{through} ({meta.get('corpus', 'corpus unknown')}{kl})"
