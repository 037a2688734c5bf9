"""Shared by the deploy tests: where deploy/ is, and which metric names PromQL may use."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

# Prometheus' own series that sao's dashboards and rules may name besides sao's metrics.
PROMETHEUS_BUILTIN = {"up"}

_FUNCTIONS = {
    # aggregations
    "sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    # functions
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "delta", "deriv",
    "exp", "floor", "histogram_quantile", "idelta", "increase", "irate", "label_join", "label_replace", "ln",
    "log2", "log10", "predict_linear", "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt",
    "time", "timestamp", "vector", "avg_over_time", "min_over_time", "max_over_time", "sum_over_time",
    "count_over_time", "quantile_over_time", "stddev_over_time", "last_over_time", "present_over_time",
}
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects; raises on a function this parser does not know."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries, with Grafana's $__rate_interval
    text = _GROUPING.sub(" ", text)
    names: set[str] = set()
    for match in _IDENTIFIER.finditer(text):
        word = match.group()
        if re.match(r"\s*\(", text[match.end():]):
            assert word in _FUNCTIONS, f"unknown PromQL function {word!r} in {expr!r}"
        elif word not in _KEYWORDS and word not in {"by", "without"}:
            names.add(word)
    return names


def _exposed_names() -> set[str]:
    """Every series name a sao process exposes, suffixes included (_total, _bucket, _sum, _count)."""
    from prometheus_client import REGISTRY

    import sao.metrics  # noqa: F401  (registers the metrics)

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count", "")}
    names: set[str] = set()
    for family in REGISTRY.collect():
        if family.name.startswith("sao_"):
            names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


@pytest.fixture(scope="session")
def metric_names_in() -> Callable[[str], set[str]]:
    return promql_metric_names


@pytest.fixture(scope="session")
def exposed_metric_names() -> set[str]:
    return _exposed_names()


@pytest.fixture(scope="session")
def allowed_metric_names(exposed_metric_names: set[str]) -> set[str]:
    return exposed_metric_names | PROMETHEUS_BUILTIN


@pytest.fixture(scope="session")
def deploy_dir() -> Path:
    return DEPLOY
