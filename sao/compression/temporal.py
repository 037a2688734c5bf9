"""Stage 2 of compression: an LSTM that predicts the next step embedding, and the keep/merge rule.

A step is redundant when the LSTM, having read the earlier steps, predicted its embedding well
and it carries no reward; redundant steps are merged into the previous kept step. Everything
here is causal, so the sampler runs it online, one step at a time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

DEFAULT_WEIGHTS_PATH = Path(__file__).parent / "weights" / "temporal-minilm-l6.safetensors"
DEFAULT_WEIGHTS_COMMAND = "python -m sao.offline.default_weights --seed 0"
WEIGHTS_FORMAT = "sao-temporal-lstm-v1"

KEEP_BOUNDARY = "boundary"
KEEP_REWARD = "reward"
KEEP_SURPRISE = "surprise"
MERGE_REDUNDANT = "redundant"


class NextEmbeddingLSTM(torch.nn.Module):
    """Reads embeddings [B, T, dim]; output at t is the predicted (unit) embedding of step t+1.

    The prediction is a learned correction added to the current embedding, and the correction
    starts at zero, so an untrained model is exactly the "next step looks like this one"
    baseline and training can only have to improve on it.
    """

    def __init__(self, dim: int, hidden: int = 256, layers: int = 1):
        super().__init__()
        self.dim, self.hidden, self.layers = dim, hidden, layers
        self.lstm = torch.nn.LSTM(dim, hidden, num_layers=layers, batch_first=True)
        self.head = torch.nn.Linear(hidden, dim)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        """Predict step t+1 from steps 0..t, for every t at once: [B, T, dim] -> [B, T, dim]."""
        hidden_states, _ = self.lstm(seq)
        return F.normalize(seq + self.head(hidden_states), dim=-1)

    def step(self, embedding: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
        """Advance one step online: ([dim], state or None) -> (prediction [dim], new state)."""
        x = embedding.reshape(1, 1, self.dim)
        hidden_states, state = self.lstm(x, state)
        return F.normalize(x + self.head(hidden_states), dim=-1).reshape(self.dim), state


@dataclass(frozen=True)
class Decision:
    """What the filter decided for one step, and why."""

    keep: bool
    reason: str  # "boundary" | "reward" | "surprise" | "redundant"
    error: float  # 1 - cos(prediction, actual); 0.0 for the first step, which has no prediction


def prediction_errors(predictions: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Row-wise 1 - cosine similarity, computed in float64 so both paths round alike."""
    p = np.asarray(predictions, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    norms = np.maximum(np.linalg.norm(p, axis=-1) * np.linalg.norm(a, axis=-1), 1e-12)
    return 1.0 - (p * a).sum(axis=-1) / norms


def _decide(first: bool, reward: float, error: float, threshold: float) -> Decision:
    if first:
        return Decision(True, KEEP_BOUNDARY, error)
    if reward != 0.0:
        return Decision(True, KEEP_REWARD, error)
    if error > threshold:
        return Decision(True, KEEP_SURPRISE, error)
    return Decision(False, MERGE_REDUNDANT, error)


def sequence_errors(model: NextEmbeddingLSTM, embeddings: np.ndarray) -> np.ndarray:
    """Prediction error of steps 1..T-1 of one episode (float64 [T-1]); step 0 has none."""
    embeddings = np.asarray(embeddings, dtype=np.float32)
    if len(embeddings) < 2:
        return np.zeros(0)
    with torch.no_grad():
        predictions = model(torch.from_numpy(embeddings)[None])[0].numpy()
    return prediction_errors(predictions[:-1], embeddings[1:])


class TemporalFilter:
    """Keeps a step if it starts the episode, carries reward, or its error exceeds `threshold`.

    One instance holds the online state of one trajectory at a time: call `start()` before each.
    """

    def __init__(self, model: NextEmbeddingLSTM, threshold: float, meta: dict | None = None):
        self.model = model.eval()
        self.threshold = float(threshold)
        self.meta = dict(meta or {})  # provenance: encoder name, training seed/command, stats
        self.start()

    def fork(self) -> TemporalFilter:
        """A filter with the same weights and threshold but its own online state (one per live episode)."""
        return TemporalFilter(self.model, self.threshold, self.meta)

    @property
    def dim(self) -> int:
        return self.model.dim

    def start(self) -> None:
        """Forget the previous trajectory; the next observed step is a boundary."""
        self._state: Any = None
        self._prediction: np.ndarray | None = None

    def observe(self, embedding: np.ndarray, reward: float) -> Decision:
        """Decide for the next step of the current trajectory, then update the LSTM state."""
        x = np.asarray(embedding, dtype=np.float32).reshape(-1)
        if x.shape[0] != self.dim:
            raise ValueError(f"embedding has {x.shape[0]} dims, the filter expects {self.dim}")
        first = self._prediction is None
        error = 0.0 if first else float(prediction_errors(self._prediction, x))
        decision = _decide(first, reward, error, self.threshold)
        with torch.no_grad():
            prediction, self._state = self.model.step(torch.from_numpy(x), self._state)
        self._prediction = prediction.numpy()
        return decision

    def filter_batch(self, embeddings: np.ndarray, rewards: Sequence[float]) -> list[Decision]:
        """Decide for a whole episode in one forward pass; same decisions as `observe` per step."""
        embeddings = np.asarray(embeddings, dtype=np.float32)
        if len(embeddings) != len(rewards):
            raise ValueError(f"{len(embeddings)} embeddings but {len(rewards)} rewards")
        if len(embeddings) == 0:
            return []
        if embeddings.ndim != 2 or embeddings.shape[1] != self.dim:
            raise ValueError(f"expected embeddings [n, {self.dim}], got {embeddings.shape}")
        errors = np.concatenate([[0.0], sequence_errors(self.model, embeddings)])
        return [_decide(t == 0, float(rewards[t]), float(errors[t]), self.threshold) for t in range(len(embeddings))]


def calibrate_threshold(filter_model: NextEmbeddingLSTM | TemporalFilter, sequences: Sequence[np.ndarray],
                        target_keep_ratio: float) -> float:
    """Threshold that keeps about `target_keep_ratio` of all steps of `sequences`.

    The ratio counts the always-kept first steps; rewards are not known here, so with rewards
    the kept share is at least this. If the first steps alone exceed the target, the threshold
    keeps nothing else.
    """
    if not 0.0 < target_keep_ratio <= 1.0:
        raise ValueError(f"target_keep_ratio must be in (0, 1], got {target_keep_ratio}")
    model = filter_model.model if isinstance(filter_model, TemporalFilter) else filter_model
    errors = np.concatenate([sequence_errors(model, s) for s in sequences] + [np.zeros(0)])
    if errors.size == 0:
        raise ValueError("calibration needs at least one sequence of two or more steps")
    total_steps = sum(len(s) for s in sequences)
    first_steps = sum(1 for s in sequences if len(s) > 0)
    share_of_rest = (target_keep_ratio * total_steps - first_steps) / errors.size
    if share_of_rest <= 0.0:
        return float(errors.max())
    if share_of_rest >= 1.0:
        return float(np.nextafter(errors.min(), -np.inf))
    return float(np.quantile(errors, 1.0 - share_of_rest))


def measure_keep_ratio(temporal_filter: TemporalFilter, sequences: Sequence[np.ndarray]) -> float:
    """Share of all steps the filter keeps on `sequences` with zero rewards."""
    kept = total = 0
    for sequence in sequences:
        decisions = temporal_filter.filter_batch(sequence, [0.0] * len(sequence))
        kept += sum(d.keep for d in decisions)
        total += len(decisions)
    return kept / total if total else 0.0


def sidecar_path(path: str | Path) -> Path:
    """The JSON that describes a weights file: same name, `.json` suffix."""
    return Path(path).with_suffix(".json")


def save_temporal_weights(model: NextEmbeddingLSTM, path: str | Path, meta: dict) -> None:
    """Write the LSTM as safetensors plus a JSON sidecar (shape, threshold, provenance)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": WEIGHTS_FORMAT})
    record = {**meta, "format": WEIGHTS_FORMAT, "dim": model.dim, "hidden": model.hidden, "layers": model.layers}
    sidecar_path(path).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    logger.info("saved temporal filter weights to %s", path)


def load_temporal_filter(path: str | Path | None = None, threshold: float | None = None) -> TemporalFilter:
    """Load a TemporalFilter; `path=None` is the default shipped with sao.

    `threshold` overrides the one recorded in the sidecar JSON.
    """
    if path is None:
        path = DEFAULT_WEIGHTS_PATH
        if not path.exists():
            raise FileNotFoundError(f"default temporal filter weights {path} do not exist yet; "
                                    f"create them with `{DEFAULT_WEIGHTS_COMMAND}`")
    path = Path(path)
    meta_path = sidecar_path(path)
    for needed in (path, meta_path):
        if not needed.exists():
            raise FileNotFoundError(f"temporal filter file {needed} is missing; weights and their .json sidecar are "
                                    "written together by save_temporal_weights")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != WEIGHTS_FORMAT:
        raise ValueError(f"{meta_path} has format {meta.get('format')!r}, expected {WEIGHTS_FORMAT!r}")
    model = NextEmbeddingLSTM(meta["dim"], hidden=meta["hidden"], layers=meta.get("layers", 1))
    model.load_state_dict(load_file(str(path)))
    if threshold is None:
        if "threshold" not in meta:
            raise ValueError(f"{meta_path} records no threshold; pass threshold= explicitly")
        threshold = meta["threshold"]
    return TemporalFilter(model, threshold, meta)
