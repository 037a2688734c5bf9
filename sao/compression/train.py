"""Self-supervised training of the temporal filter's LSTM on recorded episode embeddings."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from sao.compression.temporal import (
    NextEmbeddingLSTM,
    TemporalFilter,
    calibrate_threshold,
    measure_keep_ratio,
)

if TYPE_CHECKING:
    from sao.compression.semantic import SemanticEncoder

logger = logging.getLogger(__name__)


def _pad(sequences: list[np.ndarray], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack episodes into [N, T_max, dim] plus a mask of valid (t, t+1) pairs [N, T_max-1]."""
    longest = max(len(s) for s in sequences)
    batch = torch.zeros(len(sequences), longest, dim)
    pair_mask = torch.zeros(len(sequences), longest - 1, dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        batch[row, : len(sequence)] = torch.from_numpy(sequence)
        pair_mask[row, : len(sequence) - 1] = True
    return batch, pair_mask


def _pair_losses(predictions: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """1 - cos(prediction at t, embedding at t+1) for every t: [N, T-1]."""
    return 1.0 - F.cosine_similarity(predictions[:, :-1], batch[:, 1:], dim=-1)


def train_temporal_model(sequences: Sequence[np.ndarray], dim: int, hidden: int = 256, epochs: int = 30,
                         lr: float = 1e-3, seed: int = 0, batch_size: int = 32, val_fraction: float = 0.1,
                         chunk_length: int = 128) -> tuple[NextEmbeddingLSTM, dict]:
    """Train a NextEmbeddingLSTM to predict each next embedding; deterministic given `seed`.

    Loss is 1 - cos(prediction at t, embedding at t+1), averaged over all step pairs. A share
    `val_fraction` of the episodes is held out; the weights of the epoch with the lowest
    validation loss are returned. Stats include the loss of the trivial "the next step looks
    like this one" predictor on the same data, which the model has to beat to be worth using.
    Episodes longer than `chunk_length` are trained on as consecutive chunks (truncated
    backpropagation through time): a batch pads to its longest member, so one 1,000-step
    episode would otherwise make every batch it joins cost 1,000 LSTM steps.
    """
    if chunk_length < 2:
        raise ValueError(f"chunk_length must be >= 2, got {chunk_length}")
    # Consecutive chunks share one step, so every (t, t+1) pair is trained on exactly once.
    usable = [np.asarray(s, dtype=np.float32)[start:start + chunk_length]
              for s in sequences for start in range(0, max(len(s) - 1, 1), chunk_length - 1)]
    usable = [s for s in usable if len(s) >= 2]
    for sequence in usable:
        if sequence.ndim != 2 or sequence.shape[1] != dim:
            raise ValueError(f"every sequence must be [T, {dim}], got {sequence.shape}")
    if len(usable) < 2:
        raise ValueError("training needs at least two episodes of two or more steps")
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(usable))
    n_val = min(len(usable) - 1, max(1, round(len(usable) * val_fraction)))
    train_set = [usable[i] for i in order[n_val:]]
    val_batch, val_mask = _pad([usable[i] for i in order[:n_val]], dim)
    train_all, train_all_mask = _pad(train_set, dim)

    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = NextEmbeddingLSTM(dim, hidden=hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def evaluate(batch: torch.Tensor, mask: torch.Tensor) -> float:
        model.eval()
        with torch.no_grad():
            return float(_pair_losses(model(batch), batch)[mask].mean())

    best = {"val_loss": evaluate(val_batch, val_mask), "train_loss": evaluate(train_all, train_all_mask),
            "epoch": 0, "state": {k: v.clone() for k, v in model.state_dict().items()}}
    for epoch in range(1, epochs + 1):
        model.train()
        permutation = rng.permutation(len(train_set))
        for start in range(0, len(train_set), batch_size):
            batch, mask = _pad([train_set[i] for i in permutation[start : start + batch_size]], dim)
            loss = _pair_losses(model(batch), batch)[mask].mean()
            optimizer.zero_grad()
            loss.backward()
            # Clipping keeps the recurrent weights stable on long repetitive episodes.
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        val_loss = evaluate(val_batch, val_mask)
        logger.debug("temporal LSTM epoch %d: val loss %.4f", epoch, val_loss)
        if val_loss < best["val_loss"]:
            best = {"val_loss": val_loss, "train_loss": evaluate(train_all, train_all_mask),
                    "epoch": epoch, "state": {k: v.clone() for k, v in model.state_dict().items()}}
    model.load_state_dict(best["state"])
    model.eval()

    stats = {
        "train_loss": best["train_loss"],
        "val_loss": best["val_loss"],
        "baseline_train_loss": float(_pair_losses(train_all, train_all)[train_all_mask].mean()),
        "baseline_val_loss": float(_pair_losses(val_batch, val_batch)[val_mask].mean()),
        "best_epoch": best["epoch"],
        "epochs": epochs,
        "hidden": hidden,
        "lr": lr,
        "seed": seed,
        "train_sequences": len(train_set),  # episodes, or chunks of the longer ones
        "val_sequences": n_val,
        "chunk_length": chunk_length,
    }  # no timings here: they would make the shipped sidecar differ between identical runs
    logger.info("temporal LSTM: val loss %.4f vs previous-embedding baseline %.4f (best epoch %d/%d, %.1f s)",
                stats["val_loss"], stats["baseline_val_loss"], stats["best_epoch"], epochs,
                time.perf_counter() - started)
    return model, stats


def train_from_texts(episodes: Sequence[Sequence[str]], encoder: SemanticEncoder, target_keep_ratio: float = 0.5,
                     **train_kwargs) -> TemporalFilter:
    """Encode episodes of step texts, train the LSTM on them, and calibrate its threshold.

    `train_kwargs` go to `train_temporal_model`; the returned filter's `meta` records the
    encoder, the training stats and the keep ratio reached on these episodes.
    """
    texts = [text for episode in episodes for text in episode]
    started = time.perf_counter()
    flat = encoder.encode(texts)
    logger.info("encoded %d steps in %.1f s", len(texts), time.perf_counter() - started)
    bounds = np.cumsum([0] + [len(episode) for episode in episodes])
    sequences = [flat[a:b] for a, b in itertools.pairwise(bounds)]
    model, stats = train_temporal_model(sequences, encoder.dim, **train_kwargs)
    threshold = calibrate_threshold(model, sequences, target_keep_ratio)
    temporal_filter = TemporalFilter(model, threshold, {"encoder": encoder.name})
    temporal_filter.meta.update(seed=stats["seed"], target_keep_ratio=target_keep_ratio,
                                keep_ratio=measure_keep_ratio(temporal_filter, sequences), episodes=len(episodes),
                                steps=len(texts), training=stats)
    return temporal_filter
