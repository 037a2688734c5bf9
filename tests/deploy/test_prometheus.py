"""Prometheus: scrape configs and alert rules; `promtool` checks them when it is installed."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from sao.config import MetricsConfig

REQUIRED_ALERTS = {"SaoTrainerStalled", "SaoConsumerLagGrowing", "SaoDeadLettersGrowing", "SaoStalenessOverBudget"}


def _rules(deploy_dir):
    groups = yaml.safe_load((deploy_dir / "prometheus" / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_cover_the_failure_modes_and_name_real_metrics(deploy_dir, metric_names_in, allowed_metric_names):
    rules = _rules(deploy_dir)
    assert REQUIRED_ALERTS <= {rule["alert"] for rule in rules}
    for rule in rules:
        unknown = metric_names_in(rule["expr"]) - allowed_metric_names
        assert not unknown, f"alert {rule['alert']} names undefined metrics {unknown}"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def _targets(config_path):
    config = yaml.safe_load(config_path.read_text())
    jobs = {}
    for job in config["scrape_configs"]:
        targets = [t for static in job.get("static_configs", []) for t in static["targets"]]
        targets += [f"{name}:{dns['port']}" for dns in job.get("dns_sd_configs", []) for name in dns["names"]]
        jobs[job["job_name"]] = targets
    assert config["rule_files"] == ["alerts.yml"]
    return jobs


def test_compose_scrape_targets_are_the_ports_the_services_serve(deploy_dir):
    jobs = _targets(deploy_dir / "prometheus" / "prometheus.yml")
    services = yaml.safe_load((deploy_dir / "docker-compose.yml").read_text())["services"]
    for job, service in (("sao-trainer", "trainer"), ("sao-sampler", "sampler")):
        command = services[service]["command"]
        command = " ".join(command) if isinstance(command, list) else command
        [target] = jobs[job]
        host, port = target.split(":")
        assert host == service and f"--metrics-port {port}" in command, (job, command)


def test_small_run_config_scrapes_the_stack_jobs_faster(deploy_dir):
    assert _targets(deploy_dir / "prometheus" / "prometheus-small.yml") == _targets(deploy_dir / "prometheus" / "prometheus.yml")
    small = yaml.safe_load((deploy_dir / "prometheus" / "prometheus-small.yml").read_text())
    assert small["global"]["scrape_interval"] == "1s"


def test_local_scrape_targets_are_the_default_ports(deploy_dir):
    defaults = MetricsConfig()
    jobs = _targets(deploy_dir / "prometheus" / "prometheus-local.yml")
    assert jobs["sao-launcher"] == [f"127.0.0.1:{defaults.launcher_port}"]
    assert jobs["sao-trainer"] == [f"127.0.0.1:{defaults.trainer_port}"]
    assert jobs["sao-sampler"][0] == f"127.0.0.1:{defaults.sampler_port}"


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian/Ubuntu: apt-get install prometheus)")
@pytest.mark.parametrize("args", [
    ["check", "config", "prometheus.yml"],
    ["check", "config", "prometheus-local.yml"],
    ["check", "config", "prometheus-small.yml"],
    ["check", "rules", "alerts.yml"],
    ["test", "rules", "alerts.test.yml"],
], ids=lambda args: " ".join(args))
def test_promtool(deploy_dir, args):
    result = subprocess.run([PROMTOOL, *args], cwd=deploy_dir / "prometheus", capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian/Ubuntu: apt-get install prometheus)")
def test_promtool_parses_every_dashboard_query(deploy_dir, tmp_path):
    # promtool has no PromQL checker of its own; as recording rules, the queries get its parser.
    import json

    exprs = []
    for path in sorted((deploy_dir / "grafana" / "dashboards").glob("*.json")):
        panels = json.loads(path.read_text())["panels"]
        for panel in [*panels, *(inner for p in panels for inner in p.get("panels", []))]:
            exprs += [t["expr"].replace("$__rate_interval", "1m") for t in panel.get("targets", [])]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"sao:dashboard_query:{i}", "expr": expr}
                                                         for i, expr in enumerate(exprs)]}]}
    (tmp_path / "dashboard_queries.yml").write_text(yaml.safe_dump(rules))
    result = subprocess.run([PROMTOOL, "check", "rules", "dashboard_queries.yml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(exprs)} rules found" in result.stdout
