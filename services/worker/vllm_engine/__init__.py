"""The vLLM engine of a kvmesh worker (``KVMESH_WORKER_ENGINE=vllm``; needs ``pip install -e '.[vllm]'``).

``engine.py`` runs vLLM's v1 engine in process behind :class:`~services.worker.engine_api.WorkerEngine`;
``event_subscriber.py`` reads vLLM's ZMQ KV-event stream in order (replay on gaps);
``hash_bridge.py`` renames vLLM's blocks by kvmesh block hashes. Importing this package does not import
vLLM; building a :class:`VllmEngine` does.
"""

from services.worker.vllm_engine.engine import VllmEngine, VllmEngineConfig, check_block_size
from services.worker.vllm_engine.hash_bridge import HashBridge, kvmesh_salt, parse_salt

__all__ = ["HashBridge", "VllmEngine", "VllmEngineConfig", "check_block_size", "kvmesh_salt", "parse_salt"]
