"""Where the broker is and what its topics are called."""

from __future__ import annotations

from pydantic import Field

from sao.config.section import Section


class BrokerConfig(Section):
    bootstrap_servers: str | None = Field(
        None, description="Kafka bootstrap servers (host:port,...). Unset: `sao run` starts the embedded broker.")
    embedded_port: int = Field(0, ge=0, le=65535, description="Port of the embedded broker; 0 picks a free one.")
    connect_timeout_s: float = Field(
        15.0, gt=0, description="How long a command that talks to a given broker (sao feed, topics, inspect, audit, "
                                "sampler, trainer; sao run with broker.bootstrap_servers set) waits at start for it "
                                "to answer before it exits (code 2) with one line naming the address. Default 15 s.")
    loss_timeout_s: float = Field(
        60.0, gt=0, description="How long a sampler or the trainer keeps retrying an unreachable broker before it "
                                "exits (code 3) naming what it held; a broker that comes back as another cluster "
                                "(a restarted in-memory one) stops them at once. See docs/reliability.md.")
    fetch_wait_ms: int = Field(
        20, ge=1, le=10_000,
        description="How long the broker may hold a consumer's fetch that has nothing new: the pipeline's latency "
                    "floor with Tansu. Raise it to 100 or more with `--storage s3` (docs/reliability.md).")


class TopicsConfig(Section):
    tasks: str = Field("sao.tasks", description="Feeder -> samplers.")
    trajectories: str = Field("sao.trajectories", description="Samplers -> trainer.")
    policy: str = Field("sao.policy", description="Trainer -> samplers: policy version announcements.")
    weights: str = Field(
        "sao.weights", description="Trainer -> samplers with policy.transport = 'kafka': the published files in "
                                   "chunks (one partition). The trainer creates it at its first publish with a "
                                   "retention sized from the snapshot (docs/design.md, 'Where weights travel').")
    dlq: str = Field("sao.dlq", description="Dead letters: malformed, incompatible or rejected messages.")
    sampler_group: str = Field("sao-samplers", description="Consumer group of the samplers on the tasks topic.")
    trainer_group: str = Field("sao-trainer", description="Consumer group of the trainer on the trajectories topic.")
    task_partitions: int = Field(4, ge=1, description="Partitions of the tasks topic; caps useful samplers.")
    trajectory_partitions: int = Field(4, ge=1, description="Partitions of the trajectories topic.")
