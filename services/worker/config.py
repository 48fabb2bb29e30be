"""Settings of one worker process (env prefix ``KVMESH_WORKER_``, nested with ``__``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from kvmesh_core.load_reports import LOAD_INTERVAL_MS
from kvmesh_core.runtime import ShellSettings
from services.worker.errors import ModelConfigError
from services.worker.model_configs import MODEL_CONFIGS
from streams.settings import KafkaSettings


def model_dir_of(model: str, must_exist: bool = False) -> Path | None:
    """``model`` as a local directory, or None when it names a built-in size ("tiny", "kvmesh-small")."""
    if model.removeprefix("kvmesh-") in MODEL_CONFIGS and not Path(model).is_dir():
        return None
    p = Path(model).expanduser()
    if must_exist and not p.is_dir():
        raise ModelConfigError(
            f"model {model!r} is neither a built-in size ({', '.join(MODEL_CONFIGS)}) nor an existing "
            "local model directory (config.json + *.safetensors); make one with `kvmesh model init DIR`"
        )
    return p


def served_model_for(model: str) -> str:
    """The OpenAI model name a worker serves ``model`` under unless told otherwise."""
    d = model_dir_of(model)
    name = d.name if d is not None else model
    return name if name.startswith("kvmesh-") else f"kvmesh-{name}"


class WorkerSettings(ShellSettings):
    """Everything a worker needs: engine shape, KV tiers, data plane and Kafka."""

    model_config = SettingsConfigDict(
        env_prefix="KVMESH_WORKER_", env_nested_delimiter="__", extra="ignore", populate_by_name=True
    )

    worker_id: str = "worker-0"
    # Which engine runs the model: the built-in torch engine (the embedded default) or vLLM.
    engine: Literal["builtin", "vllm"] = "builtin"
    # Engine and KV cache. ``model`` is a built-in size ("tiny", "small") or a local model directory
    # (config.json + *.safetensors + tokenizer, e.g. from ``kvmesh model init DIR``).
    model: str = "tiny"
    # The name clients ask for (OpenAI ``model``); defaults to ``kvmesh-<model>`` (the directory's name).
    served_model_name: str | None = None
    checkpoint: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    gpu_blocks: int = 1024
    dram_blocks: int = 4096
    disk_blocks: int = 0
    disk_dir: str | None = None
    max_batch: int = 8
    max_context: int | None = None
    prefill_chunk: int = 512
    seed: int = 0
    # Data plane: the block server binds here and is announced in every LoadReport.
    transfer_host: str = "127.0.0.1"
    transfer_port: int = 0
    # Either name works: the fleet-wide KVMESH_FLEET_SECRET or this worker's own.
    fleet_secret: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("KVMESH_WORKER_FLEET_SECRET", "KVMESH_FLEET_SECRET", "fleet_secret"),
    )
    insecure_dev_transfer: bool = Field(
        default=False,
        validation_alias=AliasChoices(
            "KVMESH_WORKER_INSECURE_DEV_TRANSFER", "KVMESH_INSECURE_DEV_TRANSFER", "insecure_dev_transfer"
        ),
    )
    fetch_timeout_s: float = 5.0
    # How an assignment with a transfer plan meets the engine. "overlap": it joins the engine's queue at
    # once and is passed over until its pull lands (vLLM's WAITING_FOR_REMOTE_KVS), so the requests
    # behind it do not wait for the link (unless the next blocks of their prompt are on it: those wait
    # for that pull and reuse them). "serial": it joins after its pull, and every assignment that
    # arrives meanwhile waits too (the rule before; kept to compare). Pulls go one at a time either way.
    admission: Literal["overlap", "serial"] = "overlap"
    # Fleet-aware eviction: how many (other worker, block) copies the worker tracks from the fleet's
    # kv-events (about 110 bytes each, see services.worker.fleet_view); past it, copies are not counted.
    fleet_view_max_entries: int = 500_000
    # Most blocks the block server sends for one fetch; a larger request is refused as too_many_blocks.
    max_blocks_per_fetch: int = Field(
        default=4096,
        gt=0,
        validation_alias=AliasChoices(
            "KVMESH_WORKER_MAX_BLOCKS_PER_FETCH", "KVMESH_MAX_BLOCKS_PER_FETCH", "max_blocks_per_fetch"
        ),
    )
    # vLLM engine only: the KV cache space vLLM's CPU backend reserves (GiB, VLLM_CPU_KVCACHE_SPACE)
    # when ``gpu_blocks`` does not size it, and how many past event batches its replay endpoint keeps.
    vllm_kv_cache_gib: int = Field(default=1, gt=0)
    vllm_event_buffer_steps: int = Field(default=10_000, gt=0)
    vllm_enforce_eager: bool = True
    # The kvmesh KV connector under vLLM: DRAM/disk tiers (dram_blocks, disk_blocks), loads from them,
    # peer fetch and serving through the data plane. Off: vLLM keeps only its own pool.
    vllm_connector: bool = True
    # Connector loads in a background thread (vLLM's WAITING_FOR_REMOTE_KVS path) rather than in the
    # forward: for hosts where the copy is a DMA; on the CPU build the copy is ~1 ms a 4k prefix either way.
    vllm_async_load: bool = False
    # Reporting
    load_interval_ms: int = LOAD_INTERVAL_MS  # the simulator reports at the same cadence
    calibrate: bool = True
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)

    @model_validator(mode="after")
    def _secret_required(self) -> WorkerSettings:
        # A worker serves what users typed; refuse to run the data plane open unless told so for dev.
        if (self.fleet_secret is None or not self.fleet_secret.get_secret_value()) and not (
            self.insecure_dev_transfer
        ):
            raise ValueError(
                "KVMESH_WORKER_FLEET_SECRET must be set (or KVMESH_WORKER_INSECURE_DEV_TRANSFER=1 for dev)"
            )
        return self

    @property
    def served_model(self) -> str:
        return self.served_model_name or served_model_for(self.model)

    def model_dir(self) -> Path | None:
        """The local model directory ``model`` (or ``checkpoint``) names; None for a built-in size.

        Raises ModelConfigError for a path that is not a directory, so a typo is a clear error at
        start, never a silently different model."""
        return model_dir_of(self.checkpoint or self.model, must_exist=True)

    def secret_bytes(self) -> bytes:
        if self.fleet_secret is not None and self.fleet_secret.get_secret_value():
            return self.fleet_secret.get_secret_value().encode()
        return b"kvmesh-insecure-dev-secret"
