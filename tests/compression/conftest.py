"""Shared fixtures for compression tests: one real encoder per session, small seeded filters."""

from __future__ import annotations

import os

# Set before sentence-transformers is imported anywhere: nothing may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest
import torch

from sao.compression.semantic import SemanticEncoder, load_encoder
from sao.compression.temporal import NextEmbeddingLSTM, TemporalFilter, sequence_errors

torch.set_num_threads(1)  # the machine is shared; one thread was also the fastest measured

# One tutoring dialogue in the sampler's step format: observation + "\n" + action.
DIALOGUE = [
    "Calculate 7 + 5.\n13",
    "Incorrect. Try again.\n13",
    "Incorrect. Try again.\n13",
    "Incorrect. Try again.\n13",
    "Incorrect. Try again.\nThe answer is 11.",
    "Incorrect. Try again.\nThe answer is 11.",
    "Incorrect. Try again.\nThe answer is 11.",
    "Incorrect. Try again.\n12",
    "Correct.\n12",
    "Correct.\n12",
    "Correct.\nThanks!",
    "Calculate -4 * 3.\n-12",
    "Correct.\n-12",
    "Correct.\n-12",
]
DIALOGUE_REWARDS = [0.0, 0.0, 0.0, 0.0, 0.0, -0.25, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0]


@pytest.fixture(scope="session")
def encoder() -> SemanticEncoder:
    return load_encoder("default")


@pytest.fixture(scope="session")
def dialogue() -> tuple[list[str], list[float]]:
    return list(DIALOGUE), list(DIALOGUE_REWARDS)


@pytest.fixture(scope="session")
def dialogue_embeddings(encoder: SemanticEncoder) -> np.ndarray:
    return encoder.encode(DIALOGUE)


def seeded_model(dim: int = 384, hidden: int = 32, seed: int = 0) -> NextEmbeddingLSTM:
    """An untrained LSTM whose head is not zero, so predictions really depend on the LSTM."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = NextEmbeddingLSTM(dim, hidden=hidden)
        torch.nn.init.normal_(model.head.weight, std=0.05)
    return model


@pytest.fixture
def make_filter():
    """Builds a TemporalFilter on a seeded untrained LSTM with the given threshold."""

    def make(threshold: float, dim: int = 384, seed: int = 0) -> TemporalFilter:
        return TemporalFilter(seeded_model(dim, seed=seed), threshold, {"encoder": "all-MiniLM-L6-v2"})

    return make


@pytest.fixture
def median_filter(make_filter, dialogue_embeddings: np.ndarray) -> TemporalFilter:
    """A filter whose threshold lies between the two middle errors on the dialogue.

    About half the non-first steps are surprising, and no error sits on the threshold, so
    float rounding differences between the online and batch paths cannot flip a decision.
    """
    errors = np.sort(sequence_errors(seeded_model(), dialogue_embeddings))
    middle = len(errors) // 2
    return make_filter(float((errors[middle - 1] + errors[middle]) / 2))
