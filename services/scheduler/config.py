"""Settings of a scheduler replica (env prefix ``KVMESH_SCHEDULER_``, nested with ``__``)."""

from __future__ import annotations

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from kvmesh_core.load_reports import LOAD_INTERVAL_MS
from kvmesh_core.runtime import ShellSettings
from services.scheduler.registry import POLICIES
from services.scheduler.router import RouterSettings
from services.scheduler.view import ViewSettings
from services.scheduler.virtual_clock import AHEAD
from streams.settings import KafkaSettings, RedisSettings


class SchedulerSettings(ShellSettings):
    """Everything a scheduler replica reads from its environment; built once in ``main``."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_SCHEDULER_", env_nested_delimiter="__")

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    scheduler_id: str = "scheduler-0"
    block_size: int = 16

    # Routing (RouterSettings).
    policy: str = "kvmesh"
    max_queue_ms: float = 2.0 * LOAD_INTERVAL_MS  # late binding: hold while every queue is this long
    fetch_min_blocks: int = 1
    tenant_max_inflight: int | None = None
    least_loaded_k: int = 2
    no_worker_hold_ms: int = 2000
    max_hold_ms: int = 600_000  # a safety valve, not a pace: see RouterSettings
    # Fair queueing between tenants: deficit round robin quantum, in prompt tokens.
    quantum_tokens: int = 4096
    # Within a tenant, held requests go by virtual finish time; the share of the held backlog each
    # one waits behind sets how far short prompts pass long ones (services/scheduler/virtual_clock.py:
    # 0 is arrival plus work, 1.0 processor sharing).
    held_ahead: float = Field(default=AHEAD, ge=0.0)

    # Fleet view (ViewSettings).
    # An assignment no report covers yet stops counting this long after its worker could have done it.
    pending_decay_ms: int = 2000
    worker_timeout_ms: int = 10_000
    inflight_timeout_ms: int = 600_000
    # Correct each worker's published prefill speed from its Completions' measured prefill times.
    learn_speed: bool = True
    speed_memory: int = 16
    speed_min_samples: int = 8

    # Cold start: load the KV manager's directory snapshot from Redis, then resume kv-events after it.
    use_snapshot: bool = True
    # Read Completions from the replies topic to free per-tenant in-flight slots.
    track_completions: bool = True
    # Read every replica's Assignments, so that work another replica sent a worker counts as pending
    # load in this replica's queue estimates too.
    share_load: bool = True
    # While requests are held, mark decisions in Redis so that a replica taking over after a crash
    # skips the requests it reads again that were already decided (held_requests.py).
    mark_decided: bool = True
    # The fleet secret (KVMESH_FLEET_SECRET): LoadReports that do not verify under it are dropped
    # (schemas.report_signing). None: dev mode, every report is taken.
    fleet_secret: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("KVMESH_FLEET_SECRET", "fleet_secret")
    )
    create_topics: bool = True
    # How long start() reads state topics up to their end before taking requests.
    catch_up_timeout_s: float = 10.0
    poll_timeout_ms: int = 20
    # Apply the state records fetched while waiting for requests before deciding them (False: the
    # old loop, which decided on a view that could miss them; kept to measure the difference).
    drain_state_before_decide: bool = True

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; choose one of {', '.join(POLICIES)}")
        return v

    @field_validator("block_size")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("block_size must be positive")
        return v

    def router_settings(self) -> RouterSettings:
        return RouterSettings(
            policy=self.policy,
            max_queue_ms=self.max_queue_ms,
            fetch_min_blocks=self.fetch_min_blocks,
            tenant_max_inflight=self.tenant_max_inflight,
            least_loaded_k=self.least_loaded_k,
            no_worker_hold_ms=self.no_worker_hold_ms,
            max_hold_ms=self.max_hold_ms,
        )

    def view_settings(self) -> ViewSettings:
        return ViewSettings(
            pending_decay_ms=self.pending_decay_ms,
            worker_timeout_ms=self.worker_timeout_ms,
            inflight_timeout_ms=self.inflight_timeout_ms,
            learn_speed=self.learn_speed,
            speed_memory=self.speed_memory,
            speed_min_samples=self.speed_min_samples,
        )
