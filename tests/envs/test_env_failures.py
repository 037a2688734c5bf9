"""A plugin env that raises or hangs ends its episode with a DLQ reason; the sampler goes on."""

import time

import pytest
import torch

from sao.compression.temporal import load_temporal_filter
from sao.envs.guard import EnvFailure
from sao.envs.registry import make_tasks
from sao.policy.weights import build_policy
from sao.sampler.rollout import Roller


def _roller(tiny_config, encoder, env_name, timeout_s=30.0):
    config = tiny_config.model_copy(deep=True)
    config.env.name, config.env.turn_timeout_s, config.policy.max_new_tokens = env_name, timeout_s, 4
    policy = build_policy(config.policy, encoder.dim).eval()
    return Roller(config, policy, encoder, load_temporal_filter(), "s", seed=0), config


def test_raising_env_becomes_an_env_error(tiny_config, encoder):
    roller, config = _roller(tiny_config, encoder, "support.hostile_envs:RaisingEnv")
    with pytest.raises(EnvFailure) as err:
        roller.rollout(make_tasks(config.env, 1)[0], 0)
    assert err.value.reason == "env-error" and "the grader crashed" in err.value.detail


def test_hanging_env_is_cut_at_the_time_limit(tiny_config, encoder):
    roller, config = _roller(tiny_config, encoder, "support.hostile_envs:HangingEnv", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(EnvFailure) as err:
        roller.rollout(make_tasks(config.env, 1)[0], 0)
    assert err.value.reason == "env-timeout"
    assert time.monotonic() - started < 10
    torch.set_num_threads(1)
