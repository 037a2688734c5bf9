"""Bind a run directory to the Kafka cluster it first started on, so a resume elsewhere is refused.

A checkpoint records its cluster, but a run can lose its broker before its first checkpoint: the
run directory records the cluster id at the trainer's first start (RUN_DIR/cluster-id), and a
`--resume` against another cluster (a restarted in-memory broker, another address) stops at once,
with or without a checkpoint, instead of waiting on topics that will never hold the run's log.
"""

from __future__ import annotations

import logging

from sao.run_dir import RunDir
from sao.status import write_atomically
from sao.transport.health import BrokerWatch

log = logging.getLogger(__name__)


def bind_run_to_cluster(run_dir: RunDir, watch: BrokerWatch, resume: bool) -> None:
    """Resuming: refuse (BrokerReplaced) a cluster other than the recorded one. Else record this one."""
    recorded = run_dir.recorded_cluster_id()
    if resume and recorded:
        watch.expect_cluster(recorded, f"the run in {run_dir.root} (started there, {run_dir.cluster_id.name})")
        return
    current = watch.cluster_id
    if current is None or current == recorded:
        return  # not answering yet: the checkpoint's cluster still guards a resume
    run_dir.root.mkdir(parents=True, exist_ok=True)
    write_atomically(run_dir.cluster_id, current + "\n")
    if recorded:
        log.warning("run directory %s was started on Kafka cluster %r; a fresh start binds it to %r", run_dir.root,
                    recorded, current)

