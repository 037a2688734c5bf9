"""`sao export`: a run's published version as a plain Hugging Face model folder, loadable without sao.

What a run publishes is made for samplers: a snapshot and sparse deltas after it, or for a LoRA run
only the adapters. The folder written here is what the policy's language model *is* at that
version: the chain applied and the adapters merged into the weights, saved in the publish dtype
(safetensors), with the base model's tokenizer files, so `AutoModelForCausalLM.from_pretrained`,
vLLM or any HF tool loads it as it would the base model. The rest of the policy (the memory
projector, which maps compressed context into the LM's inputs) goes beside it in
`sao-memory.safetensors`; sao reads it, a plain LM does without it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from sao.config import SaoConfig
from sao.policy.chain import read_version_into
from sao.policy.deltas import PUBLISH_DTYPES
from sao.policy.loading import resolve_model_path
from sao.policy.model import MemoryPolicy
from sao.run_dir import RunDir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json", "chat_template.jinja")
MEMORY_FILE = "sao-memory.safetensors"


def write_model_folder(policy: MemoryPolicy, tokenizer_dir: Path, folder: Path) -> None:
    """The policy's language model, at its current weights and dtype, as an HF model folder (with the tokenizer
    files from `tokenizer_dir`)."""
    policy.lm.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, Path(folder) / name)


def export_version(config: SaoConfig, policy: MemoryPolicy, run_dir: Path, version: int, out: Path) -> dict:
    """Write published `version` of the run (0 = the base model) to `out` (which must not exist yet or be
    empty); `policy` is version 0 as a sampler builds it (a LoRA run's set to merge adapters). Returns what
    was written, as `out/sao-export.json` records it."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: export writes a fresh folder")
    if version:
        read_version_into(policy, RunDir(run_dir), version)  # every file checked against its sidecar
    dtype = PUBLISH_DTYPES[config.trainer.publish_dtype]
    policy = policy.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    write_model_folder(policy, resolve_model_path(config.policy.model, config.policy.cache_dir), out)
    memory = {name: tensor.detach().contiguous() for name, tensor in policy.state_dict().items()
              if not name.startswith("lm.") and not name.startswith("value_head.")}
    save_file(memory, out / MEMORY_FILE, metadata={"memory_width": str(policy.memory_width)})
    facts = {"run_dir": str(Path(run_dir).resolve()), "version": version, "dtype": config.trainer.publish_dtype,
             "base_model": config.policy.model, "lora_merged": policy.adapters is not None and version > 0,
             "memory_file": MEMORY_FILE, "parameters": sum(p.numel() for p in policy.lm.parameters())}
    (out / "sao-export.json").write_text(json.dumps(facts, indent=1) + "\n")
    return facts
