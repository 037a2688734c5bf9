"""Grafana: dashboards and provisioning. Every PromQL expression names metrics sao defines."""

from __future__ import annotations

import json

import yaml

SECTIONS = {"Pipeline overview", "Samplers", "Compression", "Kafka", "Trainer", "Off-policy health"}


def _dashboards(deploy_dir):
    paths = sorted((deploy_dir / "grafana" / "dashboards").glob("*.json"))
    assert paths, "no dashboard JSON under deploy/grafana/dashboards"
    return {path.name: json.loads(path.read_text()) for path in paths}


def _panels(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # panels inside collapsed rows


def test_every_panel_queries_metrics_that_exist(deploy_dir, metric_names_in, allowed_metric_names):
    for name, dashboard in _dashboards(deploy_dir).items():
        for panel in _panels(dashboard):
            if panel["type"] == "row":
                continue
            assert panel.get("targets"), f"{name}: panel {panel['title']!r} has no query"
            for target in panel["targets"]:
                used = metric_names_in(target["expr"])
                assert used, f"{panel['title']!r}: no metric found in {target['expr']!r}"
                unknown = used - allowed_metric_names
                assert not unknown, f"{name}: panel {panel['title']!r} names undefined metrics {unknown}"
        for variable in dashboard.get("templating", {}).get("list", []):
            query = variable.get("query")
            if isinstance(query, dict):
                query = query.get("query", "")
            if variable.get("type") == "query" and query:
                assert not metric_names_in(query) - allowed_metric_names


def test_every_sao_metric_has_a_panel(deploy_dir, metric_names_in, exposed_metric_names):
    used = {n for d in _dashboards(deploy_dir).values() for p in _panels(d) for t in p.get("targets", [])
            for n in metric_names_in(t["expr"])}
    families = {n.removesuffix("_total").removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                for n in exposed_metric_names}
    shown = {n.removesuffix("_total").removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
             for n in used}
    assert not families - shown, f"metrics no panel shows: {sorted(families - shown)}"


def test_dashboard_has_the_sections_and_uses_the_provisioned_datasource(deploy_dir):
    datasources = yaml.safe_load((deploy_dir / "grafana/provisioning/datasources/prometheus.yml").read_text())
    [datasource] = datasources["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    for dashboard in _dashboards(deploy_dir).values():
        assert dashboard["uid"] and dashboard["title"]
        rows = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
        assert SECTIONS <= rows, SECTIONS - rows
        ids = [p["id"] for p in _panels(dashboard)]
        assert len(ids) == len(set(ids)), "panel ids must be unique"
        for panel in _panels(dashboard):
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
                assert panel.get("description"), f"panel {panel['title']!r} should say what it shows"


def test_dashboard_provider_reads_the_folder_compose_mounts(deploy_dir):
    providers = yaml.safe_load((deploy_dir / "grafana/provisioning/dashboards/sao.yml").read_text())["providers"]
    compose = yaml.safe_load((deploy_dir / "docker-compose.yml").read_text())
    mounts = dict(volume.split(":")[:2][::-1] for volume in compose["services"]["grafana"]["volumes"])
    assert mounts[providers[0]["options"]["path"]] == "./grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"


def test_the_metric_check_catches_wrong_names(metric_names_in, allowed_metric_names):
    # A counter is exposed with _total; a histogram only through _bucket/_sum/_count.
    assert "sao_sampler_trajectories" not in allowed_metric_names
    assert "sao_sampler_trajectories_total" in allowed_metric_names
    assert "sao_trainer_step_seconds" not in allowed_metric_names
    expr = 'sum by (le) (rate(sao_trainer_step_seconds_bucket{job="x"}[$__rate_interval])) / sao_typo_total'
    assert metric_names_in(expr) - allowed_metric_names == {"sao_typo_total"}
