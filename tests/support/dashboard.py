"""Dashboard queries against a live Prometheus: which panels a run left without data."""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

DASHBOARDS = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards"

# Series that exist only once something went wrong: a clean run leaves their panels empty.
ONLY_AFTER_AN_ERROR = {
    "sao_dlq_messages_total",  # dead letters (too-stale ones included)
    "sao_transport_duplicates_total",  # redelivered tasks
    "sao_trainer_skipped_steps_total",  # non-finite loss or gradient
    "sao_transport_announcements_refused_total",  # bad policy announcements
}

def prometheus_get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard, rows' inner panels included."""
    dashboard = json.loads((DASHBOARDS / "sao-pipeline.json").read_text())
    panels = [*dashboard["panels"], *(inner for p in dashboard["panels"] for inner in p.get("panels", []))]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]


def panels_without_data(api: str, start: float, end: float, rate_interval: str, step: float,
                        metric_names_in: Callable[[str], set[str]],
                        may_be_empty: set[str] = frozenset()) -> list[tuple[str, str]]:
    """Dashboard queries with no finite value over [start, end] from the Prometheus at `api`, except
    those naming a metric of ONLY_AFTER_AN_ERROR or `may_be_empty`."""
    empty = []
    for title, expr in panel_queries():
        if metric_names_in(expr) & (ONLY_AFTER_AN_ERROR | set(may_be_empty)):
            continue
        query = urllib.parse.urlencode({"query": expr.replace("$__rate_interval", rate_interval), "start": start,
                                        "end": end, "step": step})
        series = prometheus_get(f"{api}/query_range?{query}")["data"]["result"]
        if not any(math.isfinite(float(value)) for s in series for _, value in s["values"]):
            empty.append((title, expr))
    return empty
