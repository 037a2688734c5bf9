"""Policy weights on disk: safetensors files checked against their sha256, and the v0 policy."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sao.config import PolicyConfig
from sao.policy.loading import load_language_model
from sao.policy.model import MemoryPolicy


class WeightsMismatch(RuntimeError):
    """A weights file does not match its announced sha256 (partial write, wrong file, tampering)."""


def sha256_file(path: Path | str, chunk_bytes: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def unique_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop aliases of tied weights (safetensors stores each storage once); fp32 CPU copies."""
    seen: dict[tuple[int, int], str] = {}
    out = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tensor.numel())
        if key in seen:
            continue
        seen[key] = name
        out[name] = tensor.detach().to("cpu", torch.float32, copy=True).contiguous()
    return out


def write_weights(state: dict[str, torch.Tensor], path: Path) -> str:
    """Write atomically (tmp + rename, so readers never see half a file); return the sha256.

    `state` must hold no aliased tensors: pass it through `unique_state_dict` first.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp))
    digest = sha256_file(tmp)
    os.replace(tmp, path)
    return digest


def read_weights_into(policy: MemoryPolicy, path: Path | str, sha256: str) -> None:
    """Load a published version into `policy` after checking its hash; tied weights re-tie."""
    actual = sha256_file(path)
    if actual != sha256:
        raise WeightsMismatch(f"{path}: sha256 {actual} does not match the announced {sha256}")
    state = load_file(str(path))
    missing, unexpected = policy.load_state_dict(state, strict=False)
    tied = {name for name in missing if _is_tied_alias(policy, name)}
    if set(missing) - tied or unexpected:
        raise WeightsMismatch(f"{path}: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")


def _is_tied_alias(policy: MemoryPolicy, name: str) -> bool:
    return name == "lm.lm_head.weight" and bool(getattr(policy.lm.config, "tie_word_embeddings", False))


def build_policy(config: PolicyConfig, memory_dim: int, value_head: bool = False) -> MemoryPolicy:
    """Version 0 of the policy: base LM + zero projector, identical in every process."""
    return MemoryPolicy(load_language_model(config.model, config.cache_dir, seed=config.seed), memory_dim, value_head)


def place_for_sampling(policy: MemoryPolicy, device: str = "auto") -> MemoryPolicy:
    """Move an inference copy of the policy: a GPU samples in bf16, the CPU in fp32.

    The trainer still rescores in its own precision (fp32 on CPU, DeepSpeed's bf16 on GPU), so
    the bf16 rounding of the sampler is one more behaviour/target mismatch that rho corrects.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("sampler.device = 'cuda' but torch sees no GPU; use 'auto' or 'cpu'")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return policy.to(device="cpu", dtype=torch.float32).eval()
    return policy.to(device="cuda", dtype=torch.bfloat16).eval()
