"""Settings of the intake (env prefix ``KVMESH_INTAKE_``, nested with ``__``; API keys unprefixed).

``KVMESH_API_KEYS="key1:tenantA,key2:tenantB"`` or ``KVMESH_API_KEYS_FILE`` (one ``key:tenant`` per
line) map bearer keys to tenants. JSON-valued settings: ``KVMESH_INTAKE_PUBLIC_PREFIXES`` (name →
system prompt shared across tenants), ``KVMESH_INTAKE_TENANT_MAX_PROMPT_TOKENS`` (tenant → limit).
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from kvmesh_core.runtime import ShellSettings
from schemas.blocks import DEFAULT_BLOCK_SIZE
from streams.settings import KafkaSettings


class IntakeSettings(ShellSettings):
    """Everything one intake needs: HTTP bind, limits, tenancy, and Kafka."""

    model_config = SettingsConfigDict(
        env_prefix="KVMESH_INTAKE_", env_nested_delimiter="__", extra="ignore", populate_by_name=True
    )

    intake_id: str = "intake-0"
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "kvmesh-tiny"
    tokenizer_path: str | None = None
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, gt=0)
    max_context: int = Field(default=4096, gt=0)
    default_max_tokens: int = Field(default=256, gt=0)
    default_temperature: float = 1.0
    max_inflight: int = Field(default=64, gt=0)
    # Larger bodies are refused (413) before they are parsed; the record limit is checked again later.
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    retry_after_s: int = 1
    request_timeout_s: float = Field(default=60.0, gt=0)
    # A publish the broker has not taken by then answers 503 (and marks the intake unready).
    publish_timeout_s: float = Field(default=5.0, gt=0)
    # The fleet secret (KVMESH_FLEET_SECRET): LoadReports that do not verify under it are dropped
    # (schemas.report_signing). None: dev mode, every report is taken.
    fleet_secret: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("KVMESH_FLEET_SECRET", "fleet_secret")
    )
    # Choices per request (``n``) and in all (legacy batches: prompts x n); each is a fleet request.
    max_n: int = Field(default=8, gt=0)
    max_choices: int = Field(default=32, gt=0)
    # A worker whose LoadReport is older than this no longer counts for what the model supports.
    worker_live_s: float = Field(default=10.0, gt=0)
    tenant_max_prompt_tokens: dict[str, int] = Field(default_factory=dict)
    # Explicit and empty by default: blocks are shared across tenants only for prompts named here.
    public_prefixes: dict[str, str] = Field(default_factory=dict)
    # Reply topic of this intake (catalog name); intakes may share the default one.
    reply_topic: str = "kvmesh.replies"
    api_keys: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("api_keys", "KVMESH_API_KEYS")
    )
    api_keys_file: str | None = Field(
        default=None, validation_alias=AliasChoices("api_keys_file", "KVMESH_API_KEYS_FILE")
    )
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)

    @field_validator("host")
    @classmethod
    def _host_not_empty(cls, v: str) -> str:
        if not v:
            raise ValueError("host must not be empty")
        return v
