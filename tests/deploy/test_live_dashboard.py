"""A real Prometheus scrapes a real `sao run`; every dashboard query then has data.

The static checks (test_dashboards.py) only know which names sao defines, not which series its
processes really export: a histogram with a negative bucket, for one, exports no `_sum`, and the
Reward panel stayed empty. Skipped without the `prometheus` binary (Debian: apt-get install
prometheus; .ci/run installs it where it can).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml

from support.dashboard import panels_without_data, prometheus_get
from support.shadow_env import shadow_on

PROMETHEUS = shutil.which("prometheus")
# The end-of-run held-out comparison, off in this run (run.heldout_eval = false) to keep it short.
HELDOUT_COMPARISON = {"sao_heldout_skill_success", "sao_heldout_format_ceiling"}


def _free_ports(count: int, consecutive: int = 1) -> list[int]:
    """`count` free loopback ports; the last `consecutive` of them in a row (sampler i gets base + i)."""
    ports: list[int] = []
    while len(ports) < count - consecutive:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    for base in range(20000, 30000, 7):
        sockets = []
        try:
            for port in range(base, base + consecutive):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for probe in sockets:
                probe.close()
        if base not in ports:
            return [*ports, *range(base, base + consecutive)]
    raise RuntimeError("no free loopback ports")


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (Debian/Ubuntu: apt-get install prometheus)")
def test_every_dashboard_query_has_data_from_a_live_run(deploy_dir, metric_names_in, tmp_path):
    launcher_port, trainer_port, web_port, sampler_port, _ = _free_ports(5, consecutive=2)
    jobs = {"sao-launcher": [launcher_port], "sao-trainer": [trainer_port], "sao-sampler": [sampler_port, sampler_port + 1]}
    config = {"global": {"scrape_interval": "1s"},
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}
                                 for job, ports in jobs.items()]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    api = f"http://127.0.0.1:{web_port}/api/v1"
    prometheus_log = open(tmp_path / "prometheus.log", "wb")
    prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web_port}"],
                                  stdout=subprocess.DEVNULL, stderr=prometheus_log)
    try:
        started = time.time()
        command = [sys.executable, "-m", "sao.cli", "run", "--model", "tiny", "--num-tasks", "16", "--samplers", "2",
                   "--run-dir", str(tmp_path / "run"), "--set", "trainer.batch_size=4", "--set", "policy.max_new_tokens=8",
                   "--set", "trainer.checkpoint_every=1", "--set", "run.heldout_eval=false",
                   "--set", "trainer.shadow_every=1", "--set", "trainer.shadow_tasks=2", "--set", "run.timeout_s=400",
                   # Weights through the weights topic: the Kafka panel has data too (the folder path has none of
                   # its own), and a small step keeps versions sparse deltas.
                   "--set", "policy.transport=\"kafka\"", "--set", "trainer.learning_rate=2e-6",
                   "--set", f"metrics.launcher_port={launcher_port}", "--set", f"metrics.trainer_port={trainer_port}",
                   "--set", f"metrics.sampler_port={sampler_port}"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=500, env=shadow_on())
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        ended = time.time()
        targets = prometheus_get(f"{api}/targets")["data"]["activeTargets"]
        assert {t["labels"]["job"] for t in targets} == set(jobs), targets

        empty = panels_without_data(api, started, ended, rate_interval="10s", step=1, metric_names_in=metric_names_in,
                                    may_be_empty=HELDOUT_COMPARISON)
        assert not empty, f"panels with no data from a clean run: {empty}"
    finally:
        prometheus.terminate()
        prometheus.wait(30)
        prometheus_log.close()
