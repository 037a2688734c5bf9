"""Policy weights on disk: safetensors files checked before they are parsed, and the v0 policy.

A file named by an announcement is untrusted input (docs/design.md, "Trust boundaries"). It
must be the run's file for its version, directly inside the policy folder, a regular file of
bounded size whose sha256 matches, holding exactly the model's tensors (a LoRA run's: its adapters),
all finite; each check runs before anything that would need it, so no check reads more than the previous one allowed.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from sao.compression.bottleneck import Bottleneck
from sao.config import PolicyConfig
from sao.config.section import Precision
from sao.policy.loading import load_language_model
from sao.policy.model import MemoryPolicy
from sao.policy.precision import uses_bf16
from sao.policy.projector import apply_projector_setting
from sao.run_dir import RunDir
from sao.schema import PolicyAnnouncement

logger = logging.getLogger(__name__)
_CHUNK_BYTES = 8 << 20
# A published file holds trainer.publish_dtype; any float dtype is accepted because loading casts to the policy's.
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


class WeightsMismatch(RuntimeError):
    """A weights file that must not be loaded: outside the policy folder, not a regular file, too big,
    or not what was announced (partial write, wrong file, tampering). `reason` is a short code."""

    def __init__(self, message: str, reason: str = "mismatch"):
        super().__init__(message)
        self.reason = reason


def sha256_file(path: Path | str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


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


def announced_weights_path(weights_path: str, version: int, policy_dir: Path | str, delta: bool = False) -> Path:
    """The file an announcement of `version` may name: the run's file for it, directly in `policy_dir`.

    Both sides are resolved (symlinks, `..`) before they are compared, so a link from inside the
    folder to elsewhere is refused too; nothing here opens a file. Binding the name to the version
    (and to its kind: a `delta` file or a whole one) stops an announcement from relabelling an older
    file as a much newer version.
    """
    try:
        folder = Path(os.path.realpath(policy_dir))
        resolved = Path(os.path.realpath(Path(policy_dir) / weights_path))  # an absolute path replaces policy_dir
    except (OSError, ValueError) as err:  # a NUL byte, a name too long
        raise WeightsMismatch(f"{weights_path!r} is not a usable path ({err})", "outside-folder") from err
    if resolved.parent != folder:
        raise WeightsMismatch(f"{weights_path!r} resolves outside the policy folder {folder}", "outside-folder")
    run_dir = RunDir(folder.parent)
    expected = (run_dir.weights_delta(version) if delta else run_dir.weights(version)).name
    if resolved.name != expected:
        raise WeightsMismatch(f"{weights_path!r} is not the file of policy v{version} ({expected})", "wrong-name")
    return resolved


def read_weights_into(policy: MemoryPolicy, path: Path | str, sha256: str, *, num_bytes: int | None = None,
                      max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """Load a published version into `policy` after the checks above; tied weights re-tie.

    `num_bytes` is the announced size and `max_bytes` the most to read (None: not known or not
    bounded, as for `sao eval`, which reads its own run's files through their sidecars).
    Returns the file's tensors in their own dtype (the base a delta applies to).
    Raises WeightsMismatch, or OSError when the file cannot be read (FileNotFoundError once pruned).
    """
    with verified_file(path, sha256, num_bytes=num_bytes, max_bytes=max_bytes) as source:
        state = _checked_tensors(policy, source, path)
    load_published(policy, state)
    return state


def check_content(policy: MemoryPolicy, announcement: PolicyAnnouncement) -> None:
    """WeightsMismatch (`content`) unless the announced version holds what `policy` loads: adapters or whole weights."""
    expected = "lora" if policy.adapters is not None else "full"
    if announcement.content != expected:
        raise WeightsMismatch(f"policy v{announcement.policy_version} holds {announcement.content} weights, but this "
                              f"process loads {expected} ones: trainer.lora must be the run's (RUN_DIR/config.toml)",
                              "content")


def load_published(policy: MemoryPolicy, state: dict[str, torch.Tensor]) -> None:
    """Load a checked published state into `policy`: merge a LoRA run's adapters, else the weights themselves."""
    if policy.adapters is not None:
        policy.adapters.load(state)
    else:
        policy.load_state_dict(state, strict=False)  # names and shapes were checked; only the tied alias may be absent


@contextmanager
def verified_file(path: Path | str, sha256: str, *, num_bytes: int | None = None,
                  max_bytes: int | None = None) -> Iterator[str]:
    """A name to parse `path` by once it is a regular file of the announced size (at most `max_bytes`)
    whose bytes hash to `sha256`: the very file hashed, even if the path is swapped meanwhile."""
    limit = max_bytes if max_bytes is not None else float("inf")
    if num_bytes is not None and num_bytes > limit:
        raise WeightsMismatch(f"{path}: announced size {num_bytes} bytes is over sampler.max_weights_bytes = "
                              f"{max_bytes}", "too-large")
    if num_bytes is not None and num_bytes <= 0:
        raise WeightsMismatch(f"{path}: announced size {num_bytes} bytes", "size")
    fd = _open_regular_file(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise WeightsMismatch(f"{path}: {size} bytes is over sampler.max_weights_bytes = {max_bytes}", "too-large")
        if num_bytes is not None and size != num_bytes:
            raise WeightsMismatch(f"{path}: {size} bytes, but {num_bytes} were announced", "size")
        actual = _sha256_of_open_file(fd, size, path)
        if actual != sha256:
            raise WeightsMismatch(f"{path}: sha256 {actual} does not match the announced {sha256}", "sha256")
        # Parse the very file behind `fd` (Linux), so the bytes parsed are the bytes hashed even if the path was
        # swapped since; elsewhere the path itself.
        by_descriptor = f"/proc/self/fd/{fd}"
        yield by_descriptor if os.path.exists(by_descriptor) else str(path)
    finally:
        os.close(fd)


def _open_regular_file(path: Path | str) -> int:
    """A read-only descriptor of `path` if it is a regular file, never following a final symlink.

    lstat comes first because opening a FIFO blocks and a device can be read forever; O_NONBLOCK
    and the fstat after opening cover a swap between the two calls.
    """
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise WeightsMismatch(f"{path}: not a regular file ({_kind(mode)})", "not-a-file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise WeightsMismatch(f"{path}: replaced by something other than a regular file", "not-a-file")
    return fd


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a plain file")


def _sha256_of_open_file(fd: int, size: int, path: Path | str) -> str:
    """Hash exactly `size` bytes; a file that shrinks or grows meanwhile is refused (a partial write)."""
    digest = hashlib.sha256()
    remaining = size
    while remaining > 0:
        chunk = os.read(fd, min(_CHUNK_BYTES, remaining))
        if not chunk:
            raise WeightsMismatch(f"{path}: shrank while being read", "size")
        digest.update(chunk)
        remaining -= len(chunk)
    if os.read(fd, 1):
        raise WeightsMismatch(f"{path}: grew while being read", "size")
    return digest.hexdigest()


def _checked_tensors(policy: MemoryPolicy, source: str, path: Path | str) -> dict[str, torch.Tensor]:
    """The file's tensors, read only after its header names exactly the model's, with its shapes and float dtypes."""
    # What a published version holds: a LoRA run's adapters and projector (sao/policy/lora.py), else the whole state.
    model = policy.adapters.layout() if policy.adapters is not None else policy.state_dict()
    tied = bool(getattr(policy.lm.config, "tie_word_embeddings", False))
    optional = {"lm.lm_head.weight"} if tied else set()  # safetensors stores a tied alias once, under the other name
    try:
        with safe_open(source, framework="pt") as handle:
            names = set(handle.keys())
            problems = [f"missing {name}" for name in sorted(set(model) - optional - names)]
            problems += [f"unexpected {name}" for name in sorted(names - set(model))]
            for name in sorted(names & set(model)):
                piece = model[name]
                header = handle.get_slice(name)
                shape, dtype = tuple(header.get_shape()), header.get_dtype()
                if shape != tuple(piece.shape):
                    problems.append(f"{name} has shape {list(shape)}, the model {list(piece.shape)}")
                if (dtype in _FLOAT_DTYPES) != piece.is_floating_point():
                    problems.append(f"{name} has dtype {dtype}, the model {piece.dtype}")
            if problems:
                raise WeightsMismatch(f"{path}: tensors do not fit the model: {first_few(problems)}", "tensors")
            tensors = {name: handle.get_tensor(name) for name in names}
    except SafetensorError as err:
        raise WeightsMismatch(f"{path}: not a safetensors file ({err})", "format") from err
    # The trainer never publishes a step whose gradient was not finite, so NaN or inf here is a
    # corrupt or forged file; loaded, it would make every later rollout NaN.
    not_finite = sorted(name for name, tensor in tensors.items() if not bool(torch.isfinite(tensor).all()))
    if not_finite:
        raise WeightsMismatch(f"{path}: {', '.join(not_finite[:4])} hold(s) NaN or infinity", "non-finite")
    return tensors


def first_few(problems: list[str], shown: int = 4) -> str:
    """`problems` joined for a message: the first `shown`, then how many more."""
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + (f"; and {more} more" if more > 0 else "")


def build_policy(config: PolicyConfig, memory_width: int, value_head: bool = False,
                 encoder: str | None = None, bottleneck: Bottleneck | None = None) -> MemoryPolicy:
    """Version 0 of the policy, identical in every process: base LM + projector.

    With `encoder` (the compression.encoder setting) the projector is what `policy.projector`
    names (sao/policy/projector.py: the aligned one shipped for this model + encoder, else zero),
    composed with `bottleneck` when memory travels narrowed (then `memory_width` is its width);
    without `encoder`, zero.
    """
    policy = MemoryPolicy(load_language_model(config.model, config.cache_dir, seed=config.seed), memory_width, value_head)
    if encoder is not None:
        logger.info(apply_projector_setting(policy.projector, config.projector, config.model, encoder, bottleneck))
    return policy


def frozen_copy(policy: MemoryPolicy) -> MemoryPolicy:
    """A copy of `policy` that never trains (the base policy a KL is measured against)."""
    frozen = copy.deepcopy(policy).eval()
    frozen.requires_grad_(False)
    return frozen


def place_for_sampling(policy: MemoryPolicy, device: str = "auto", precision: Precision = "auto") -> MemoryPolicy:
    """Move an inference copy of the policy to `device` (auto: a GPU when torch sees one, else the CPU), in
    bf16 or fp32 as `precision` resolves there (sao/policy/precision.py).

    The trainer rescores in its own precision, so the sampler's rounding is one more behaviour/target
    mismatch that rho corrects; the behaviour log-probs are those of the distribution actually sampled.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("sampler.device = 'cuda' but torch sees no GPU; use 'auto' or 'cpu'")
    target = "cpu" if device == "cpu" or (device == "auto" and not torch.cuda.is_available()) else "cuda"
    dtype = torch.bfloat16 if uses_bf16(precision, target) else torch.float32
    return policy.to(device=target, dtype=dtype).eval()
