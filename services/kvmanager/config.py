"""Settings of the KV manager (env prefix ``KVMESH_KVMANAGER_``, nested with ``__``)."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from kvmesh_core.runtime import ShellSettings
from streams.settings import KafkaSettings, RedisSettings


class KvManagerSettings(ShellSettings):
    """Everything the KV manager reads from its environment; built once in ``main`` and passed down."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_KVMANAGER_", env_nested_delimiter="__")

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    manager_id: str = "kvmanager-0"
    # The fleet secret (KVMESH_FLEET_SECRET): LoadReports that do not verify under it are dropped
    # (schemas.report_signing). None: dev mode, every report is taken.
    fleet_secret: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("KVMESH_FLEET_SECRET", "fleet_secret")
    )
    # The fleet's block size: a worker announcing another one is refused (never indexed). None accepts
    # every size (a directory shared by fleets of several block sizes).
    block_size: int | None = Field(default=None, gt=0)

    # KV-manager replicas. Off: this manager is the directory's one writer (every partition of every
    # input topic). On: the replicas sharing ``group_id`` split the kv-events partitions (each owns a
    # shard slice of the directory); all read load and requests; the holder of the Redis lease
    # (``lease_ms``) also runs liveness, placement and the fleet slice. ``manager_id`` must differ
    # per replica (the pod name).
    sharded: bool = False
    group_id: str = "kvmesh-kvmanager"
    lease_ms: int = Field(default=3000, gt=0)
    # How often the leader refreshes the holders of hot blocks held in shards it does not own.
    placement_view_ms: int = Field(default=250, gt=0)

    # Liveness: a worker whose last LoadReport is older than this is declared lost.
    liveness_timeout_ms: int = 5000
    # "wall": the manager's clock ticks liveness even when no message arrives (live use);
    # "event": only the largest event time seen counts (replays, fully deterministic runs).
    liveness_clock: Literal["wall", "event"] = "wall"

    # Hot prefixes: leading blocks requested by at least ``hot_min_sessions`` distinct sessions
    # within the last ``hot_window_ms`` (event time, from ChatRequest.arrival_ms).
    hot_window_ms: int = 10_000
    hot_min_sessions: int = 4
    hot_min_blocks: int = 1
    max_replicas: int = 3
    replicate_bytes_per_s: float = 200e6
    replicate_burst_bytes: float = 64e6
    replicate_tier: str = "dram"
    # A command not yet visible in the directory counts as a replica for this long.
    replicate_pending_ms: int = 10_000
    # Workers are only replication targets when their free DRAM blocks cover the run.
    replicate_min_free_blocks: int = 1

    # Retain hints for multi-turn sessions.
    retain_min_turns: int = 2
    retain_ms: int = 300_000
    session_ttl_ms: int = 600_000

    # Consume/flush loop.
    batch_max_records: int = 5000
    poll_timeout_ms: int = 20
    # While Redis is down the manager buffers changes in memory up to this many dirty entries,
    # then stops consuming (Kafka keeps the rest; offsets in Redis say where to resume).
    buffer_max_dirty: int = 2_000_000
    redis_retry_ms: int = 500
