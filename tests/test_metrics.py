"""Metrics: the /metrics endpoint on loopback, and what the record_* functions export."""

from __future__ import annotations

import logging
import math
import socket
import urllib.request
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
from prometheus_client import REGISTRY

from sao import metrics
from sao.config import MetricsConfig
from sao.observability import registry_for, serve_metrics, start_metrics_server
from support.records import step_record


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_metrics_endpoint_serves_sao_metrics_on_loopback():
    host = MetricsConfig().host
    assert host == "127.0.0.1"  # the default never exposes a process to the network
    port = serve_metrics(host, 0)
    metrics.record_checkpoint(0.5)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        body = response.read().decode()
    for name in ("sao_dlq_messages_total", "sao_sampler_trajectories_total", "sao_trainer_step_seconds",
                 "sao_transport_consumer_lag", "sao_compression_ratio", "sao_trainer_checkpoint_seconds_count"):
        assert name in body, name
    listening = [c for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert [c.laddr.ip for c in listening] == ["127.0.0.1"]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_each_process_serves_its_own_families_only():
    # A sampler exporting the trainer's gauges at 0 would fire the stalled-trainer alert for it.
    sampler = _scrape(serve_metrics("127.0.0.1", 0, "sampler"))
    trainer = _scrape(serve_metrics("127.0.0.1", 0, "trainer"))
    assert "sao_sampler_trajectories_total" in sampler and "sao_compression_ratio" in sampler
    assert "sao_trainer_" not in sampler and "sao_feeder_" not in sampler
    assert "sao_trainer_last_step_timestamp_seconds" in trainer and "sao_sampler_" not in trainer
    for body in (sampler, trainer):
        assert "sao_transport_consumer_lag" in body and "sao_dlq_messages_total" in body
        assert "process_cpu_seconds_total" in body or "python_gc_objects_collected_total" in body
    with pytest.raises(ValueError, match="unknown metrics role"):
        registry_for("feeder")


def test_a_busy_port_or_port_zero_disables_the_endpoint_without_failing(caplog):
    assert start_metrics_server("127.0.0.1", 0, "sampler") is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with caplog.at_level(logging.WARNING):
            assert start_metrics_server("127.0.0.1", taken.getsockname()[1], "sampler") is None
    assert "cannot serve metrics" in caplog.text


def test_export_trainer_step_exports_every_figure_of_the_record():
    steps = _value("sao_trainer_steps_total")
    stale_8 = _value("sao_trainer_staleness_versions_bucket", le="8.0")
    trajectories = _value("sao_trainer_trajectories_total")
    record = step_record()
    assert record.busy_fraction == 0.75 and record.batch_size == 3
    metrics.export_trainer_step(record)
    assert _value("sao_trainer_steps_total") == steps + 1
    assert _value("sao_trainer_trajectories_total") == trajectories + 3
    assert _value("sao_trainer_busy_fraction") == 0.75
    assert _value("sao_trainer_grad_norm") == 3.5
    assert _value("sao_trainer_importance_ratio", stat="clip_fraction") == 0.1
    assert math.isclose(_value("sao_trainer_advantage", stat="std"), math.sqrt(2 / 3))
    assert _value("sao_trainer_staleness_versions_bucket", le="8.0") == stale_8 + 2  # 9 is over
    assert _value("sao_trainer_phase_seconds_sum", phase="forward_backward") >= 2.0
    metrics.export_trainer_step(step_record(grad_norm=float("nan")))  # no norm: the gauge keeps its last value
    assert _value("sao_trainer_grad_norm") == 3.5
    metrics.record_policy_published(8)
    assert _value("sao_trainer_policy_version") == 8
    metrics.record_trainer_start(max_staleness=8, policy_version=7)
    assert _value("sao_trainer_staleness_budget_versions") == 8
    assert _value("sao_trainer_policy_version") == 7


def test_each_trainer_phase_series_exists_at_zero_from_the_start():
    """rate() needs a sample before the first step's increase: in a fresh process, the phases are exported at 0
    by the start alone (a short run's phase panels were empty when its steps came in one burst)."""
    import subprocess
    import sys

    probe = ("from prometheus_client import REGISTRY\nfrom sao import metrics\n"
             "before = REGISTRY.get_sample_value('sao_trainer_phase_seconds_count', {'phase': 'wait'})\n"
             "metrics.record_trainer_start(max_staleness=8, policy_version=0)\n"
             "print(before, *(REGISTRY.get_sample_value('sao_trainer_phase_seconds_count', {'phase': p})\n"
             "                for p in metrics.TRAINER_PHASES))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["None", "0.0", "0.0", "0.0", "0.0"]


def test_each_policy_file_kind_series_exists_at_zero_once_a_sampler_starts():
    """The same for a sampler's weights series: a short run's versions can all arrive between two scrapes."""
    import subprocess
    import sys

    series = ("sao_sampler_policy_apply_seconds_count", "sao_sampler_weights_fetch_seconds_count",
              "sao_sampler_policy_bytes_total")
    probe = ("from prometheus_client import REGISTRY\nfrom sao import metrics\n"
             f"series = {series!r}\n"
             "before = REGISTRY.get_sample_value(series[0], {'kind': 'delta'})\n"
             "metrics.record_sampler_start()\n"
             "print(before, *(REGISTRY.get_sample_value(name, {'kind': kind})\n"
             "                for name in series for kind in metrics.POLICY_FILE_KINDS))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["None", *["0.0"] * 6]


def test_record_rollout_exports_sampler_and_compression_figures():
    trajectories = _value("sao_sampler_trajectories_total")
    tokens = _value("sao_sampler_tokens_total")
    trajectory = SimpleNamespace(
        steps=[SimpleNamespace(action_ids=np.zeros(5)), SimpleNamespace(action_ids=np.zeros(3))], total_reward=1.0,
        timings={"rollout_s": 2.0, "generate_s": 1.5, "encode_s": 0.01, "filter_s": 0.002, "quantize_s": 0.0001},
        compression={"ratio": 3.0, "memory_ratio": 3.9, "kept_steps": 1.0, "merged_steps": 1.0})
    encode_count = _value("sao_compression_stage_seconds_count", stage="encode")
    metrics.record_rollout(trajectory, produce_s=0.02)
    assert _value("sao_sampler_trajectories_total") == trajectories + 1
    assert _value("sao_sampler_tokens_total") == tokens + 8
    assert _value("sao_compression_stage_seconds_count", stage="encode") == encode_count + 1
    assert _value("sao_compression_ratio_count", kind="memory") >= 1
    metrics.record_policy_reload(4, 0.3)
    assert _value("sao_sampler_policy_version") == 4
