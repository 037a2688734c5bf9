"""Serve this process's Prometheus metrics (`sao.metrics`) over HTTP at /metrics.

Every sao process (sampler, trainer, `sao run`'s launcher) calls `start_metrics_server` once
at start. The endpoint binds to `metrics.host`, loopback by default: a scrape endpoint is an
information leak on a shared machine, so containers opt in to 0.0.0.0 explicitly.

Each process serves sao's metrics minus the families that belong to another kind of process:
a sampler exporting the trainer's gauges at 0 would drag every min/avg on the dashboard to 0
and make the stalled-trainer alert fire for it.
"""

from __future__ import annotations

import logging

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.metrics import MetricWrapperBase

import sao.metrics

log = logging.getLogger(__name__)

# Metric families only one kind of process records.
ROLE_PREFIXES = {"sampler": ("sao_sampler_", "sao_compression_"), "trainer": ("sao_trainer_",),
                 "launcher": ("sao_feeder_",)}


def registry_for(role: str) -> CollectorRegistry:
    """sao's metrics a `role` process serves, plus the standard process_* and python_* ones."""
    if role not in ROLE_PREFIXES:
        raise ValueError(f"unknown metrics role {role!r}; expected one of {sorted(ROLE_PREFIXES)}")
    foreign = tuple(prefix for other, prefixes in ROLE_PREFIXES.items() if other != role for prefix in prefixes)
    registry = CollectorRegistry()
    for metric in vars(sao.metrics).values():
        if isinstance(metric, MetricWrapperBase) and not metric.describe()[0].name.startswith(foreign):
            registry.register(metric)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def serve_metrics(host: str, port: int, role: str | None = None) -> int:
    """Serve /metrics on host:port in a daemon thread; port 0 takes a free one. Returns the port.

    `role` (sampler, trainer, launcher) narrows what is served; None serves the whole registry.
    """
    registry = REGISTRY if role is None else registry_for(role)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_address[1])


def start_metrics_server(host: str, port: int, role: str) -> int | None:
    """Serve /metrics for `role` unless `port` is 0 (disabled); returns the port or None.

    A port already in use is logged and training goes on without an endpoint: observability
    must never be the reason a run fails.
    """
    if port == 0:
        return None
    try:
        bound = serve_metrics(host, port, role)
    except OSError as err:
        log.warning("%s: cannot serve metrics on %s:%d (%s); set metrics.%s_port or --metrics-port "
                    "to a free port, or 0 to disable", role, host, port, err, role)
        return None
    log.info("%s metrics at http://%s:%d/metrics", role, host, bound)
    return bound
