"""What sao's processes really expose, against what the dashboards assume they expose."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest


def test_every_histogram_exports_its_sum_as_the_dashboards_assume():
    # A histogram whose first bucket is below 0 loses its `_sum` in prometheus_client, and with it
    # every mean a dashboard computes as rate(_sum) / rate(_count) (the Reward panel once did).
    import sao.metrics  # noqa: F401  (registers the metrics)

    exposed = {line.split("{")[0].split(" ")[0] for line in generate_latest(REGISTRY).decode().splitlines()
               if line and not line.startswith("#")}
    histograms = [family.name for family in REGISTRY.collect()
                  if family.name.startswith("sao_") and family.type == "histogram" and family.samples]
    assert {"sao_sampler_reward", "sao_trainer_reward"} <= set(histograms)
    missing = [name for name in histograms if f"{name}_sum" not in exposed or f"{name}_count" not in exposed]
    assert not missing, f"histograms without _sum or _count: {missing}"
