"""Build the engine a worker's settings name: the built-in torch engine or vLLM.

The one place that knows both engines; the worker service sees only
:class:`~services.worker.engine_api.WorkerEngine`.
"""

from __future__ import annotations

import dataclasses

from services.worker.config import WorkerSettings
from services.worker.engine_api import WorkerEngine
from services.worker.errors import ModelConfigError


def build_engine(settings: WorkerSettings) -> WorkerEngine:
    """The engine of ``settings.engine`` loaded with ``settings.model`` (a size or a local directory).

    Raises ModelConfigError with what to fix: a model directory that does not exist, a block size the
    engine cannot run, vLLM not installed."""
    model_dir = settings.model_dir()
    if settings.engine == "vllm":
        if model_dir is None:
            raise ModelConfigError(
                "the vLLM engine needs a local model directory: KVMESH_WORKER_MODEL=DIR "
                "(`kvmesh model init DIR` writes a small one)"
            )
        try:
            from services.worker.vllm_engine import VllmEngine, VllmEngineConfig
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ModelConfigError(f"the vLLM engine needs vLLM: pip install -e '.[vllm]' ({e})") from e
        return VllmEngine(
            VllmEngineConfig(
                model_dir=str(model_dir),
                worker_id=settings.worker_id,
                block_size=settings.block_size,
                gpu_blocks=settings.gpu_blocks,
                kv_cache_gib=settings.vllm_kv_cache_gib,
                max_context=settings.max_context,
                max_batch=settings.max_batch,
                prefill_chunk=max(settings.prefill_chunk, 2048),
                dtype=settings.dtype,
                seed=settings.seed,
                enforce_eager=settings.vllm_enforce_eager,
                event_buffer_steps=settings.vllm_event_buffer_steps,
                served_model_name=settings.served_model,
                dram_blocks=settings.dram_blocks if settings.vllm_connector else 0,
                disk_blocks=settings.disk_blocks if settings.vllm_connector else 0,
                disk_dir=settings.disk_dir,
                async_load=settings.vllm_async_load,
            )
        )
    from services.worker.engine import Engine, EngineConfig

    cfg = EngineConfig(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(EngineConfig)})
    if model_dir is not None:
        cfg.checkpoint = str(model_dir)
    return Engine(cfg)
