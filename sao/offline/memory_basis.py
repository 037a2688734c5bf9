"""Fit the memory bottleneck's basis (sao.compression.bottleneck) on the slots the compressor keeps.

The corpus is the alignment corpus's kind (sao.offline.align: text-labyrinth episodes by the scripted noisy
expert and random agent, multi-turn arithmetic episodes of a stuck learner), generated from the seed and
compressed by the shipped temporal filter; the basis is the top principal directions of the embeddings of
the kept steps, which is what memory slots are. (Every distinct step text of the temporal filter's corpus
was tried first: it kept 0.916 of the held-out slots' variance and 0.79 of their content at 64 dims, against
0.95 here; benchmarks/README.md.) The same seed gives the same bytes. Variance kept is reported per env on
held-out episodes of the next seed. A workload's own episodes (a file or the trajectories topic) can replace
the built-in corpus.
"""

from __future__ import annotations

import random

import numpy as np

from sao.compression.bottleneck import Bottleneck, fit_bottleneck, variance_kept
from sao.compression.pipeline import compress_batch
from sao.offline.align import labyrinth_corpus, tutoring_corpus

CORPUS = {"labyrinth": 40, "tutoring": 100, "max_steps": 400}
HELD_OUT = {"labyrinth": 8, "tutoring": 20, "max_steps": 400}


def kept_embeddings(episodes, encoder, temporal_filter) -> dict[str, np.ndarray]:
    """Per env, the embeddings of the steps the compressor keeps as slots (every step a sampler compresses)."""
    kept: dict[str, list[np.ndarray]] = {}
    for episode in episodes:
        steps = episode.compressed_steps()
        texts = episode.texts()[:steps]
        embeddings = encoder.encode(texts)
        table, _, _ = compress_batch(texts, episode.rewards()[:steps], encoder, temporal_filter.fork(),
                                     embeddings=embeddings)
        kept.setdefault(episode.env, []).append(embeddings[table.created_at_turn])
    return {env: np.concatenate(parts) for env, parts in kept.items()}


def _corpus(seed: int, sizes: dict[str, int]):
    return labyrinth_corpus(seed, sizes["labyrinth"], sizes["max_steps"]) + tutoring_corpus(seed, sizes["tutoring"])


def fit_memory_basis(encoder, temporal_filter, width: int, seed: int, episodes=None,
                     source: str = "") -> tuple[Bottleneck, dict]:
    """The basis and its sidecar record (corpus, counts, variance kept on training and held-out slots).

    Without `episodes`, the built-in corpus of `seed` (held out: the next seed's); with them (a workload's own,
    read from `source`), a fifth of them, drawn with `seed`, is held out and the rest fitted on.
    """
    kept_by = (f"steps kept by the temporal filter ({temporal_filter.meta.get('command', 'unknown filter')}, "
               f"threshold {temporal_filter.threshold:.4f})")
    if episodes is None:
        training_episodes, held_episodes = _corpus(seed, CORPUS), _corpus(seed + 1, HELD_OUT)
        corpus = (f"{kept_by} in {CORPUS['labyrinth']} textworld episodes (noisy expert / random, <= "
                  f"{CORPUS['max_steps']} steps) and {CORPUS['tutoring']} multi-turn arithmetic episodes (stuck "
                  f"learner) of sao.offline.align's corpus, seed {seed}")
        held = f"seed {seed + 1}: {HELD_OUT['labyrinth']} textworld + {HELD_OUT['tutoring']} arithmetic episodes"
    else:
        shuffled = list(episodes)
        random.Random(seed).shuffle(shuffled)
        cut = max(1, len(shuffled) // 5)
        held_episodes, training_episodes = shuffled[:cut], shuffled[cut:]
        corpus = f"{kept_by} in {len(training_episodes)} episodes from {source}"
        held = f"{cut} episodes of the same source, drawn with seed {seed}"
    training = kept_embeddings(training_episodes, encoder, temporal_filter)
    vectors = np.concatenate([training[env] for env in sorted(training)])
    bottleneck = fit_bottleneck(vectors, width, encoder.name)
    held_out = kept_embeddings(held_episodes, encoder, temporal_filter)
    record = {
        "seed": seed, "corpus": corpus, "held_out": held,
        "vectors": {env: len(rows) for env, rows in sorted(training.items())},
        "variance_kept": {"training": round(variance_kept(bottleneck, vectors), 4),
                          **{f"held_out_{env}": round(variance_kept(bottleneck, rows), 4)
                             for env, rows in sorted(held_out.items())}},
    }
    return bottleneck, record
