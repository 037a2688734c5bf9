"""Shared fixtures: one embedded Kafka broker for the whole test session."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from sao.transport.broker import EmbeddedBroker

# Shadow validation (on by default) starts a scorer process beside every trainer and scores the final
# version before the trainer exits: seconds the many tiny-model trainer tests would each pay for
# nothing (a random policy scores 0). The env var reaches their subprocesses and outranks the config
# file `sao run` hands its trainer; the tests of shadow validation run with `SHADOW_ON` instead.
os.environ.setdefault("SAO__TRAINER__SHADOW_EVERY", "0")


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap address of a Tansu broker on a free loopback port, shared by all tests."""
    log_path = tmp_path_factory.mktemp("broker") / "tansu.log"
    with EmbeddedBroker(log_path=log_path) as broker:
        yield broker.bootstrap_servers


@pytest.fixture
def unique_topic_prefix() -> str:
    """A fresh prefix so that tests sharing the broker never see each other's topics."""
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def tiny_config():
    """Default config with the tiny random policy: what unit tests of the loop run on."""
    from sao.config import load_config

    return load_config(overrides=["policy.model=\"tiny\""], environ={})


@pytest.fixture(scope="session")
def encoder():
    from sao.compression.semantic import load_encoder

    return load_encoder("default")


@pytest.fixture(scope="session")
def chat(tiny_config):
    from sao.envs.registry import generation_settings
    from sao.policy.chat import ChatFormat
    from sao.policy.loading import load_tokenizer

    settings = generation_settings(tiny_config)
    return ChatFormat(load_tokenizer("tiny", tiny_config.policy.cache_dir), settings.system_prompt, settings.stop)
