"""Stage 3a of compression: a narrower memory, so a slot costs less on the wire than the text it stands for.

Each kept embedding travels as INT8 coordinates in the `width` top principal directions of embeddings from
training episodes (a basis fitted once and shipped per encoder, like the temporal filter's weights), so a
slot costs `width` + 4 bytes instead of the encoder's width + 4 (64 dims: 68 B against 388 B). Measured on
the LM (benchmarks/README.md, "Bytes that earn their keep"): at 64 dims the labyrinth's gap recovered and
what the LM can read back from a slot are unchanged.

The memory projector stays aligned in the encoder's space; the policy composes it with the basis at load
(`compose`): W (centre + U c) + b = (W U) c + (W centre + b), so coordinates c give exactly the soft token
the full vector would. Every trajectory names the basis it was coded in (`Bottleneck.identity`), and the
trainer dead-letters memory coded in another one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from sao.compression.quantize import dequantize_int8, quantize_int8
from sao.compression.semantic import file_slug
from sao.compression.temporal import sidecar_path

BASIS_FORMAT = "sao-memory-basis-v1"
SHIPPED_DIR = Path(__file__).resolve().parent / "weights"
SHIPPED_COMMAND = "sao compression bottleneck --width 64 --seed 0"


class BottleneckMismatch(ValueError):
    """A basis file that is unreadable, malformed, or fitted on another encoder's embeddings."""


@dataclass(frozen=True, eq=False)
class Bottleneck:
    """An orthonormal basis [dim, width] and the centre [dim] it is taken around, for one encoder."""

    centre: np.ndarray  # float32 [dim]
    basis: np.ndarray  # float32 [dim, width], orthonormal columns
    encoder: str  # the encoder whose embeddings it was fitted on (SemanticEncoder.name)

    @property
    def width(self) -> int:
        return int(self.basis.shape[1])

    @property
    def dim(self) -> int:
        return int(self.basis.shape[0])

    @cached_property
    def identity(self) -> str:
        """Names this exact basis: trajectories carry it, and the trainer compares it with its own."""
        digest = hashlib.sha256(self.centre.tobytes() + self.basis.tobytes()).hexdigest()[:12]
        return f"{self.encoder}/pca{self.width}/{digest}"

    def encode(self, embeddings: np.ndarray) -> np.ndarray:
        """float32 [n, dim] embeddings -> float32 [n, width] coordinates."""
        return (np.asarray(embeddings, np.float32) - self.centre) @ self.basis

    def decode(self, coordinates: np.ndarray) -> np.ndarray:
        """float32 [n, width] coordinates -> float32 [n, dim]: the embedding's part that the basis spans."""
        return self.centre + np.asarray(coordinates, np.float32) @ self.basis.T

    def squeeze(self, embeddings: np.ndarray) -> np.ndarray:
        """Embeddings as they come back from the wire: encoded, INT8-quantized, decoded (benchmarks compare)."""
        if not len(embeddings):
            return np.asarray(embeddings, np.float32)
        return self.decode(dequantize_int8(*quantize_int8(self.encode(embeddings))))


def fit_bottleneck(vectors: np.ndarray, width: int, encoder: str) -> Bottleneck:
    """The top `width` principal directions of training embeddings `vectors` [n, dim].

    Each direction's sign is fixed (its largest component positive), so the same vectors give the same bytes.
    """
    vectors = np.asarray(vectors, np.float64)
    if not 1 <= width <= min(vectors.shape):
        raise ValueError(f"a bottleneck width must be between 1 and min(vectors, dims) = {min(vectors.shape)} "
                         f"(got {width})")
    centre = vectors.mean(0)
    directions = np.linalg.svd(vectors - centre, full_matrices=False)[2][:width]  # [width, dim]
    signs = np.sign(directions[np.arange(width), np.abs(directions).argmax(1)])
    return Bottleneck(centre.astype(np.float32), (directions * signs[:, None]).T.astype(np.float32).copy(), encoder)


def variance_kept(bottleneck: Bottleneck, vectors: np.ndarray) -> float:
    """Share of the variance of `vectors` [n, dim] (around their own mean) that survives the round trip."""
    vectors = np.asarray(vectors, np.float64)
    spread = ((vectors - vectors.mean(0)) ** 2).sum()
    lost = ((vectors - bottleneck.squeeze(vectors.astype(np.float32))) ** 2).sum()
    return float(1 - lost / spread) if spread else 1.0


def shipped_bottleneck_path(encoder: str) -> Path:
    """Where the basis shipped for `encoder` (its SemanticEncoder.name) lives; it may not exist."""
    return SHIPPED_DIR / f"memory-basis--{file_slug(encoder)}.safetensors"


def save_bottleneck(bottleneck: Bottleneck, path: Path | str, meta: dict) -> None:
    """Write the basis (safetensors) and a JSON sidecar naming its encoder, width, identity and provenance."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"centre": bottleneck.centre, "basis": bottleneck.basis}, str(path))
    record = {**meta, "format": BASIS_FORMAT, "encoder": bottleneck.encoder, "dim": bottleneck.dim,
              "width": bottleneck.width, "identity": bottleneck.identity}
    sidecar_path(path).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_bottleneck(path: Path | str, encoder: str) -> tuple[Bottleneck, dict]:
    """Read a basis and its sidecar; refuse one fitted on another encoder, or not a basis at all."""
    path, side = Path(path), sidecar_path(path)
    if not side.is_file():
        raise BottleneckMismatch(f"{path}: its sidecar {side.name} is missing, so the encoder it was fitted on "
                                 f"is unknown; re-run `{SHIPPED_COMMAND}`")
    meta = json.loads(side.read_text(encoding="utf-8"))
    if meta.get("format") != BASIS_FORMAT:
        raise BottleneckMismatch(f"{side}: format {meta.get('format')!r}, expected {BASIS_FORMAT!r}")
    if meta.get("encoder") != encoder:
        raise BottleneckMismatch(f"{path} was fitted on {meta.get('encoder')!r} embeddings, but this run's encoder "
                                 f"is {encoder!r}; fit one with `sao compression bottleneck`, or set "
                                 "compression.bottleneck = \"none\"")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise BottleneckMismatch(f"{path}: not a readable safetensors file ({err})") from err
    centre, basis = tensors.get("centre"), tensors.get("basis")
    if centre is None or basis is None or centre.ndim != 1 or basis.ndim != 2 or basis.shape[0] != len(centre) \
            or not 1 <= basis.shape[1] <= len(centre):
        raise BottleneckMismatch(f"{path}: expected centre [dim] and basis [dim, width <= dim], found "
                                 f"{ {name: list(t.shape) for name, t in tensors.items()} }")
    if not (np.isfinite(centre).all() and np.isfinite(basis).all()):
        raise BottleneckMismatch(f"{path}: holds NaN or infinity")
    bottleneck = Bottleneck(centre.astype(np.float32), basis.astype(np.float32), encoder)
    if meta.get("identity") not in (None, bottleneck.identity):
        raise BottleneckMismatch(f"{path}: its bytes are not the basis its sidecar names ({meta['identity']})")
    return bottleneck, meta


def resolve_bottleneck(setting: str, encoder: str) -> Bottleneck | None:
    """What `compression.bottleneck` asks for: `auto` = the basis shipped for `encoder` if one ships, else
    none; `none` = the encoder's full width; anything else is a basis file, which must fit `encoder`."""
    if setting == "none":
        return None
    path = shipped_bottleneck_path(encoder) if setting == "auto" else Path(setting).expanduser()
    if setting == "auto" and not path.is_file():
        return None
    if not path.is_file():
        raise BottleneckMismatch(f"compression.bottleneck {setting!r}: no such file")
    return load_bottleneck(path, encoder)[0]


def basis_name(bottleneck: Bottleneck | None) -> str:
    """What a trajectory's `memory_basis` says: the bottleneck's identity, or "" for the encoder's full width."""
    return bottleneck.identity if bottleneck is not None else ""


def memory_width(bottleneck: Bottleneck | None, encoder_dim: int) -> int:
    """How many numbers a memory slot holds: the bottleneck's width, else the encoder's."""
    return bottleneck.width if bottleneck is not None else encoder_dim


def describe(bottleneck: Bottleneck | None, encoder_dim: int) -> str:
    """One line for the run log: how wide memory is on the wire."""
    if bottleneck is None:
        return f"memory slots: the encoder's full {encoder_dim} dims ({encoder_dim + 4} B a slot)"
    return (f"memory slots: {bottleneck.width} INT8 coordinates in basis {bottleneck.identity} "
            f"({bottleneck.width + 4} B a slot instead of {bottleneck.dim + 4})")
