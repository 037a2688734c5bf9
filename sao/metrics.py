"""The Prometheus metric definitions, one place.

Metrics live in the default registry; whoever wants them scraped starts the HTTP server
(nothing here does), so importing this module has no side effects beyond registration.
"""

from __future__ import annotations

from prometheus_client import Counter

DLQ_MESSAGES = Counter(
    "sao_dlq_messages_total",
    "Messages sent to a dead-letter topic instead of being processed, by reason code.",
    ["reason"],
)
