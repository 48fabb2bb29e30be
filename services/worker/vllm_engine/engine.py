"""vLLM behind a kvmesh worker: its v1 engine in process, its KV events bridged to kvmesh hashes.

Why in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor) rather than a child
process: the worker already steps its engine in a thread of its own, so nothing is gained by a second
process, and in process the worker reads vLLM's scheduler state (waiting, running, free KV blocks) for
its LoadReports without an IPC round trip per report, its block pool to re-announce what it really
holds, and its KV tensors, which the kvmesh KV connector needs. The cost: a vLLM crash takes the worker
process with it; the fleet treats that as any lost worker (the KV manager declares it lost and the
scheduler re-decides its requests).

Per request::

    ChatRequest token ids ──TokensPrompt(prompt_token_ids, cache_salt=kvmesh_salt(namespace))──▶ vLLM
      (intake tokenized once; vLLM never tokenizes again)        the salt isolates tenants in vLLM's
                                                                 prefix cache and names the namespace
    vLLM step ──RequestOutput (DELTA)──▶ StepOutput: new token ids, first-token stats with vLLM's
                                         num_cached_tokens as the reused count, finish reason
    vLLM KV events (ZMQ) ──EventSubscriber──▶ HashBridge ──▶ KvEvents under kvmesh hashes

vLLM keeps its KV cache in one pool (the CPU backend's "GPU" tier), reported as the ``gpu`` tier. With
lower tiers configured (``dram_blocks``/``disk_blocks``), the kvmesh KV connector
(``vllm_engine/connector.py``) saves every block vLLM computes into a kvmesh store below it, loads
blocks from there (or fetched there from peers) for new requests, and the store is the data plane's
block source and sink; ``tier_view.py`` merges both kinds of copy into the one stream the fleet sees.
Without lower tiers the engine moves no KV bytes (``block_source()`` is None).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh_core.costmodel import PerfProfile, prefill_ctx
from kvmesh_core.kv_room import kv_release
from kvmesh_core.reuse import reusable_blocks
from kvmesh_core.tokenizer import HFTokenizer
from schemas.messages import (
    BASE_FEATURES,
    OPTIONAL_FEATURES,
    KvEvent,
    StructuredOutput,
    TierUsage,
    TokenLogprob,
)
from services.worker.batch_slots import DecodeStepMeter, OutputLengths
from services.worker.calibration import calibration_lengths, fit_prefill_cost
from services.worker.engine_api import (
    EngineLoad,
    EngineRequest,
    RequestStats,
    StepOutput,
    check_request,
    waiting_prefill,
)
from services.worker.errors import ModelConfigError, RequestRejected
from services.worker.kv_cache_manager import KvCacheManager
from services.worker.vllm_engine.event_subscriber import EventSubscriber
from services.worker.vllm_engine.hash_bridge import HashBridge, external_id, kvmesh_salt
from services.worker.vllm_engine.tier_view import TierView

log = logging.getLogger(__name__)

#: vLLM's CPU attention backend works on blocks of a multiple of this many tokens.
CPU_BLOCK_MULTIPLE = 32

_FINISH = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error"}


#: How often the running requests' sole blocks are recounted at most, between changes of the batch.
SOLE_RECOUNT_S = 0.05


@dataclass
class VllmEngineConfig:
    model_dir: str
    worker_id: str = "worker-0"
    block_size: int = 32
    #: KV blocks of the engine's pool; None lets vLLM size it from ``kv_cache_gib``.
    gpu_blocks: int | None = None
    kv_cache_gib: int = 1
    max_context: int | None = None
    max_batch: int = 8
    prefill_chunk: int = 2048
    dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = True
    event_buffer_steps: int = 10_000
    served_model_name: str | None = None
    #: The kvmesh connector's tiers below vLLM's pool; both 0 turns the connector off.
    dram_blocks: int = 0
    disk_blocks: int = 0
    disk_dir: str | None = None
    #: Load connector blocks in a background thread while vLLM steps other requests, instead of in the
    #: forward. Off by default: on the CPU build the copy is a memcpy that needs the GIL, and vLLM's
    #: stepping thread starves it (measured: 4-8 ms per block instead of 25-40 us in the forward).
    async_load: bool = False


@dataclass
class _Track:
    """What the engine remembers of one running request."""

    req: EngineRequest
    started: float
    prompt_len: int
    first_done: bool = False
    generated: int = 0


def check_block_size(block_size: int, on_cpu: bool) -> None:
    """Refuse a block size vLLM cannot run, with the fix in the message."""
    if block_size <= 0:
        raise ModelConfigError("block size must be positive")
    if on_cpu and block_size % CPU_BLOCK_MULTIPLE:
        raise ModelConfigError(
            f"vLLM's CPU backend needs a block size that is a multiple of {CPU_BLOCK_MULTIPLE}; this "
            f"worker's is {block_size}. The fleet's block size is the engine's: set "
            "KVMESH_WORKER_BLOCK_SIZE, KVMESH_INTAKE_BLOCK_SIZE and KVMESH_SCHEDULER_BLOCK_SIZE "
            "to the same multiple of 32"
        )


class VllmEngine:
    """Owns one in-process vLLM ``LLMEngine``, its KV-event subscriber and the hash bridge.

    Implements :class:`~services.worker.engine_api.WorkerEngine`. ``step()`` runs in one thread;
    ``load()`` answers from a snapshot taken at the end of each step, so the event loop never reads
    vLLM's scheduler while it changes.
    """

    kind = "vllm"

    def __init__(self, cfg: VllmEngineConfig) -> None:
        self.cfg = cfg
        root = Path(cfg.model_dir).expanduser()
        if not root.is_dir():
            raise ModelConfigError(f"model directory {cfg.model_dir!r} does not exist")
        if not (root / "config.json").is_file():
            raise ModelConfigError(f"model directory {cfg.model_dir!r} has no config.json")
        import torch

        on_cpu = not torch.cuda.is_available()
        check_block_size(cfg.block_size, on_cpu)
        # In process: vLLM's engine core runs in this process, stepped by our thread (see the docstring).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
        self._sock_dir = tempfile.mkdtemp(prefix="kvmesh-vllm-")
        # ipc sockets: vLLM's PUB binds them, nothing listens on the network.
        endpoint = f"ipc://{self._sock_dir}/kv-events"
        replay = f"ipc://{self._sock_dir}/kv-replay"
        self._hub: Any = None
        self._hub_id: str | None = None
        if cfg.dram_blocks > 0 or cfg.disk_blocks > 0:
            from services.worker.vllm_engine.connector import ConnectorHub, register_hub

            self._hub = ConnectorHub(None, cfg.block_size, cfg.async_load)  # type: ignore[arg-type]  # store: start()
            self._hub_id = register_hub(self._hub)
        try:
            self._llm = self._build(root, endpoint, replay)
        except ModelConfigError:
            self._release_hub()
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            raise
        except Exception as e:
            self._release_hub()
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            raise ModelConfigError(f"vLLM could not load {cfg.model_dir}: {type(e).__name__}: {e}") from e
        core = self._llm.engine_core.engine_core  # InprocClient → EngineCore
        self._sched: Any = core.scheduler
        vc = core.vllm_config
        self.block_size = int(vc.cache_config.block_size)
        if self.block_size != cfg.block_size:
            raise ModelConfigError(f"vLLM chose block size {self.block_size}, asked {cfg.block_size}")
        mc = vc.model_config
        self.max_context = int(mc.max_model_len)
        layers = mc.get_num_layers(vc.parallel_config)
        kv_heads = mc.get_num_kv_heads(vc.parallel_config)
        itemsize = torch.empty((), dtype=mc.dtype).element_size()
        self.block_bytes = 2 * layers * kv_heads * mc.get_head_size() * self.block_size * itemsize
        self.dtype = str(mc.dtype).removeprefix("torch.")
        self.vocab_size = int(mc.get_vocab_size())
        self._num_blocks = int(vc.cache_config.num_gpu_blocks or 0)
        self.store: KvCacheManager | None = None
        if self._hub is not None:
            from services.worker.vllm_engine.connector import vllm_block_layout

            layout = vllm_block_layout(layers, kv_heads, self.block_size, mc.get_head_size(), self.dtype)
            self.store = KvCacheManager(
                layout,
                gpu_blocks=0,  # vLLM's pool is the GPU tier
                dram_blocks=cfg.dram_blocks,
                disk_blocks=cfg.disk_blocks,
                disk_dir=cfg.disk_dir,
                worker_id=cfg.worker_id,
            )
            self._hub.store = self.store
            self._check_connector_layout(layout.nbytes)
        self.tiers = TierView(cfg.worker_id)
        self.tokenizer = HFTokenizer(root)
        self.model_name = root.name
        self._events = EventSubscriber(endpoint, replay)
        self.bridge = HashBridge(self.block_size)
        self._tracks: dict[str, _Track] = {}
        self._outputs = OutputLengths()  # how long answers run here, for the wait for a batch place
        self._step_meter = DecodeStepMeter()  # what a decode step of the batch takes now
        self._sole: dict[str, int] = {}  # per running request, its sole blocks (_sole_blocks)
        self._sole_at = -math.inf
        self._pending: list[StepOutput] = []
        self._reannounce = False
        self._lock = threading.Lock()  # guards the load snapshot only
        self._step_lock = threading.Lock()
        self._load = self._snapshot_load()
        self._events_lock = threading.Lock()  # drain and holdings may be asked from two tasks
        log.info("vLLM engine up: %s", self.describe())

    def _release_hub(self) -> None:
        if self._hub_id is not None:
            from services.worker.vllm_engine.connector import unregister_hub

            unregister_hub(self._hub_id)
            self._hub_id = None

    def _check_connector_layout(self, nbytes: int) -> None:
        """The connector moves each layer's block slab as is: their sum must be one kvmesh block."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            raise ModelConfigError("vLLM did not start the kvmesh KV connector")
        got = getattr(get_kv_transfer_group(), "block_bytes", 0)
        if got != nbytes:
            raise ModelConfigError(f"vLLM KV blocks are {got} bytes, the connector's layout {nbytes}")

    def _build(self, root: Path, endpoint: str, replay: str) -> Any:
        from vllm import EngineArgs
        from vllm.config import KVEventsConfig, KVTransferConfig, StructuredOutputsConfig
        from vllm.v1.engine.llm_engine import LLMEngine

        cfg = self.cfg
        kv_transfer = None
        if self._hub_id is not None:
            kv_transfer = KVTransferConfig(
                kv_connector="KvmeshConnector",
                kv_connector_module_path="services.worker.vllm_engine.connector",
                kv_role="kv_both",
                kv_connector_extra_config={"kvmesh_hub": self._hub_id},
                # A block the connector could not load is recomputed. vLLM's default ("fail") ends the
                # request with an error instead, so a store block gone or a copy that raised lost it.
                kv_load_failure_policy="recompute",
            )
        args = EngineArgs(
            model=str(root),
            served_model_name=cfg.served_model_name,
            dtype=cfg.dtype,  # type: ignore[arg-type]  # vLLM checks the name itself
            seed=cfg.seed,
            block_size=cfg.block_size,
            enable_prefix_caching=True,
            enforce_eager=cfg.enforce_eager,
            distributed_executor_backend="uni",
            max_model_len=cfg.max_context,  # type: ignore[arg-type]  # None: the model's own
            max_num_seqs=cfg.max_batch,
            max_num_batched_tokens=max(cfg.prefill_chunk, cfg.block_size),
            num_gpu_blocks_override=cfg.gpu_blocks,
            kv_transfer_config=kv_transfer,
            # Compact JSON only under response_format: with "any whitespace" allowed, a weak model can
            # spend its whole budget on whitespace between tokens and never close the object. The
            # output is still any valid JSON value of the schema, without optional whitespace.
            structured_outputs_config=StructuredOutputsConfig(
                backend="xgrammar", disable_any_whitespace=True
            ),
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=endpoint,
                replay_endpoint=replay,
                buffer_steps=cfg.event_buffer_steps,
                topic="kv-events",
            ),
        )
        return LLMEngine.from_engine_args(args)

    # ---- WorkerEngine: description and the data plane -------------------------------------------
    @property
    def _batch_places(self) -> int:
        """How many requests vLLM admits into its running batch (``max_num_seqs`` unless configured)."""
        return int(self._sched.max_num_active_reqs)

    @property
    def prefill_chunk_tokens(self) -> int:
        # vLLM's token budget per step, after its own adjustments; decoding requests take one each
        return int(self._sched.max_num_scheduled_tokens)

    @property
    def features(self) -> tuple[str, ...]:
        # vLLM's structured output decoding gives response_format and forced tool calls.
        return BASE_FEATURES + OPTIONAL_FEATURES

    def describe(self) -> str:
        lower = (
            f", connector tiers dram {self.cfg.dram_blocks} / disk {self.cfg.disk_blocks} blocks"
            if self.store is not None
            else ", no connector"
        )
        return (
            f"vllm engine, model {self.model_name}, block size {self.block_size}, {self._num_blocks} KV "
            f"blocks of {self.block_bytes} B, context {self.max_context}, dtype {self.dtype}{lower}"
        )

    def block_source(self) -> KvCacheManager | None:
        return self.store

    def block_sink(self) -> KvCacheManager | None:
        return self.store

    @property
    def connector_stats(self) -> Any:
        return self._hub.stats if self._hub is not None else None

    # vLLM evicts its own pool (LRU); fleet-aware eviction and retain hints apply to the store below it.
    def set_fleet_copies(self, fn: Callable[[int], int] | None) -> None:
        if self.store is not None:
            self.store.set_fleet_copies(fn)

    def retain(self, block_hashes: list[int], until_ms: int) -> None:
        if self.store is not None:
            self.store.retain(block_hashes, until_ms)

    def expire_retains(self, now_ms: int) -> None:
        if self.store is not None:
            self.store.expire_retains(now_ms)

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        rid = req.request_id
        n = len(req.token_ids)
        ids = check_request(req, self.block_size, self.max_context, self.vocab_size, self.features)
        if rid in self._tracks:
            raise RequestRejected(f"request {rid} is already queued")
        s = req.sampling
        seed = s.seed
        if seed is None and s.temperature > 0:
            # Repeatable per request id, as the built-in engine: a replayed request samples alike.
            seed = (self.cfg.seed << 32) ^ zlib.crc32(rid.encode())
        # Stop strings are not vLLM's to match: the worker service runs the one rule every engine
        # shares (kvmesh_core.text_stream) and aborts the request when it matches. The request's end tokens
        # are its stop_token_ids, which ignore_eos turns off like vLLM's own EOS.
        params = SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=seed,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            min_tokens=s.min_tokens,
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs,
            max_tokens=min(req.max_tokens, self.max_context - n),
            stop_token_ids=None if s.ignore_eos else (list(req.stop_token_ids) or None),
            structured_outputs=_structured(s.structured),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )
        prompt = TokensPrompt(
            prompt_token_ids=ids.tolist(), cache_salt=kvmesh_salt(req.namespace, req.public_prefix_tokens)
        )
        # Before vLLM sees it: its first scheduling pass must already find it waiting for its pull.
        self._set_awaiting(rid, req.kv_pending)
        try:
            self._llm.add_request(rid, prompt, params)
        except Exception as e:  # vLLM's own validation: a clear error for this request only
            self._set_awaiting(rid, False)
            raise RequestRejected(f"request {rid}: vLLM refused it: {e}") from e
        self._tracks[rid] = _Track(req, time.perf_counter(), n)
        if self.store is not None:
            # its prefix in the store stays until vLLM has loaded it (KvCacheManager.hold): the
            # prompts queued ahead of it would otherwise evict it before it runs
            self.store.hold(rid, list(req.block_hashes))
        self._refresh_load()

    def _set_awaiting(self, request_id: str, pulling: bool) -> None:
        if self._hub is None:
            return  # no connector: no peer blocks, so nothing is ever pulled for a request
        with self._hub.lock:
            if pulling:
                self._hub.awaiting_pull.add(request_id)
            else:
                self._hub.awaiting_pull.discard(request_id)

    def _awaiting(self) -> int:
        """Tracked requests still waiting for their pull (an id that ended meanwhile is not counted)."""
        if self._hub is None:
            return 0
        with self._hub.lock:
            return sum(1 for rid in self._hub.awaiting_pull if rid in self._tracks)

    def kv_arrived(self, request_id: str, expected_reuse_blocks: int) -> None:
        t = self._tracks.get(request_id)
        if t is not None:
            t.req.expected_reuse_blocks = expected_reuse_blocks
            if self.store is not None:  # what it pulled extends the prefix it holds
                self.store.hold(request_id, list(t.req.block_hashes))
        self._set_awaiting(request_id, False)

    def abort(self, request_id: str) -> bool:
        self._set_awaiting(request_id, False)
        self._unhold(request_id)
        if self._tracks.pop(request_id, None) is None:
            return False
        self._llm.abort_request([request_id])
        self._pending.append(StepOutput(request_id, [], True, "cancelled"))
        self._refresh_load()
        return True

    def has_work(self) -> bool:
        # Requests waiting for their pull are passed over by vLLM: stepping for them alone would spin.
        return (
            bool(self._pending)
            or len(self._tracks) > self._awaiting()
            or (not self._tracks and self._llm.has_unfinished_requests())
        )

    def step(self) -> list[StepOutput]:
        # Held for the whole step: shutdown (release_all, from the event loop) waits for a step that
        # is still running in the engine thread rather than stopping vLLM under it.
        with self._step_lock:
            return self._step()

    def _step(self) -> list[StepOutput]:
        out, self._pending = self._pending, []
        if not self._llm.has_unfinished_requests():
            # Nothing left in vLLM: a request we still track would otherwise wait (and spin the
            # engine loop) forever, so it ends with an error rather than silently.
            for rid in list(self._tracks):
                self._tracks.pop(rid)
                self._unhold(rid)
                out.append(StepOutput(rid, [], True, "error", error="vLLM dropped the request"))
            self._refresh_load()
            return out
        # A step of running requests that have all been prefilled only decodes when none waits, or when
        # the batch is full (a place a request frees in this step is filled at the next): the overloaded
        # case, where the step's price matters most.
        sched = self._sched
        full = len(sched.running) >= self._batch_places
        decoding = bool(sched.running) and (not sched.waiting or full)
        decoding = decoding and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
        t0 = time.perf_counter()
        try:
            results = self._llm.step()
            if decoding:
                self._step_meter.add((time.perf_counter() - t0) * 1e3)
        except Exception as e:  # a failed step ends the requests in it, not the worker
            log.exception("vLLM step failed")
            for rid in list(self._tracks):
                with contextlib.suppress(Exception):
                    self._llm.abort_request([rid])
                self._tracks.pop(rid, None)
                self._unhold(rid)
                out.append(StepOutput(rid, [], True, "error", error=f"vLLM step failed: {e}"))
            self._refresh_load()
            return out
        for r in results:
            t = self._tracks.get(r.request_id)
            if t is None or not r.outputs:
                if r.finished:
                    self._unhold(r.request_id)
                continue
            c = r.outputs[0]
            new = list(c.token_ids)
            stats = None
            first = False
            if new and not t.first_done:
                t.first_done = first = True
                reused = min(int(r.num_cached_tokens or 0), t.prompt_len)
                stats = RequestStats(
                    prompt_tokens=t.prompt_len,
                    reused_tokens=reused,
                    recomputed_tokens=t.prompt_len - reused,
                    prefill_ms=(time.perf_counter() - t.started) * 1e3,
                    # blocks the connector loaded from the tiers below (saved there, or fetched)
                    promoted_blocks=self._hub.take_loaded(r.request_id) if self._hub is not None else 0,
                    fallback=self._fallback(t, reused),
                )
            finished = bool(r.finished)
            if first or finished:
                self._unhold(r.request_id)  # vLLM has loaded its prefix: it computed a token
            reason = _FINISH.get(c.finish_reason or "stop", "stop") if finished else None
            t.generated += len(new)
            if finished:
                self._tracks.pop(r.request_id, None)
                if reason in ("stop", "length"):
                    self._outputs.add(t.generated)
            lps = _logprobs(new, c.logprobs, t.req.sampling.logprobs)
            out.append(StepOutput(r.request_id, new, finished, reason, first, stats, logprobs=lps))
        self._refresh_load()
        return out

    def _unhold(self, request_id: str) -> None:
        if self.store is not None:
            self.store.unhold(request_id)

    def _fallback(self, t: _Track, reused: int) -> str | None:
        bs = self.block_size
        expected = min(t.req.expected_reuse_blocks, reusable_blocks(t.prompt_len, bs))
        found = reused // bs
        if found < expected:
            return f"expected {expected} cached blocks, vLLM found {found}; recomputed"
        return None

    # ---- load ------------------------------------------------------------------------------------
    def _snapshot_load(self) -> EngineLoad:
        sched = self._sched
        waiting = list(sched.waiting)
        running = list(sched.running)
        # a waiting request's reuse is known only when vLLM schedules it: until then, what the
        # scheduler expected (new tokens, cached context), as the simulator's workers report
        news = [(self._waiting_prefill(r), r.num_prompt_tokens) for r in waiting]
        queued = sum(n for n, _ in news) + sum(
            max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in running
        )
        ctx = sum(prefill_ctx(n, p - n) for n, p in news) + sum(
            prefill_ctx(max(r.num_prompt_tokens - r.num_computed_tokens, 0), r.num_computed_tokens)
            for r in running
        )
        manager = sched.kv_cache_manager
        free = int(manager.block_pool.get_num_free_blocks())
        # Free-queue blocks may still hold cached prefixes (evictable): vLLM counts them free, as we do.
        # Room for the next prompt: those, less what vLLM's queue takes first; and when the running
        # requests are expected to end, each freeing the blocks no other request references.
        bs = self.block_size
        room = free - sum(-(-r.num_prompt_tokens // bs) for r in waiting)
        sole = self._sole_blocks(manager, running)
        release = kv_release(
            (self._outputs.steps_left(r.num_output_tokens, r.max_tokens), sole[r.request_id]) for r in running
        )
        return EngineLoad(
            queue_depth=len(waiting),
            active_requests=len(running),
            active_tokens=sum(r.num_tokens for r in running),
            queued_prefill_tokens=queued,
            queued_prefill_ctx_tokens=ctx,
            tiers=[
                TierUsage(tier="gpu", free_blocks=free, total_blocks=self._num_blocks),
                *(t for t in (self.store.tier_usage() if self.store is not None else []) if t.tier != "gpu"),
            ],
            slot_wait_steps=self._outputs.slot_wait(
                [(r.num_output_tokens, r.max_tokens) for r in running], len(waiting), self._batch_places
            ),
            recent_decode_ms_per_step=self._step_meter.ms or 0.0,
            kv_free_blocks=room,
            kv_release=release,
        )

    def _sole_blocks(self, manager: Any, running: list[Any]) -> dict[str, int]:
        """Per running request, the blocks no other request references (what its end frees). Counting
        them walks every block of the batch, milliseconds on a large one, and the load is taken after
        every step: the counts are redone when the running set changes or ``SOLE_RECOUNT_S`` has
        passed, and reused in between (a request's growth meanwhile is a block or two)."""
        now = time.perf_counter()
        if (
            now - self._sole_at >= SOLE_RECOUNT_S
            or len(running) != len(self._sole)
            or any(r.request_id not in self._sole for r in running)
        ):
            self._sole = {
                r.request_id: sum(1 for b in manager.get_blocks(r.request_id).blocks[0] if b.ref_cnt == 1)
                for r in running
            }
            self._sole_at = now
        return self._sole

    def _waiting_prefill(self, r: Any) -> int:
        t = self._tracks.get(external_id(r.request_id))  # vLLM's scheduler knows it by its own id
        return r.num_prompt_tokens if t is None else waiting_prefill(t.req, r.num_prompt_tokens)

    def _refresh_load(self) -> None:
        snap = self._snapshot_load()
        with self._lock:
            self._load = snap

    def load(self) -> EngineLoad:
        with self._lock:
            return self._load

    # ---- KV events -------------------------------------------------------------------------------
    def lookup_prefix(self, block_hashes: list[int]) -> int:
        return self.tiers.prefix_length(block_hashes)

    def drain_kv_events(self) -> list[KvEvent]:
        """vLLM's events since the last call, as kvmesh KvEvents (a re-announce after a lost gap)."""
        with self._events_lock:
            drained = self._events.drain()
            # The store's events first: saves and loads happen inside vLLM's step, so they describe the
            # store as it is, while vLLM's own events arrive over ZMQ a little later. In this order a
            # block vLLM drops but the store keeps is "moved" down, never briefly "removed".
            if self.store is not None:
                for kv in self.store.drain_kv_events():
                    self.tiers.lower_event(kv)
            for batch in drained.batches:
                for ev in batch[1]:
                    self._apply_vllm_event(ev)
            out = self.tiers.drain()
            if drained.lost or self._reannounce:
                self._reannounce = False
                out += self._resync()
            return _merge(out)

    def _apply_vllm_event(self, ev: Any) -> None:
        """One raw vLLM event: renamed by the bridge, then applied to the tier view (which emits)."""
        kind, fields = _event_fields(ev)
        try:
            if kind == "BlockStored":
                parent = fields.get("parent_block_hash")
                stored = self.bridge.stored(
                    [int(h) for h in fields["block_hashes"]],
                    None if parent is None else int(parent),
                    fields["token_ids"],
                    int(fields["block_size"]),
                    fields.get("extra_keys"),
                )
                if stored:
                    self.tiers.gpu_stored([b.block_hash for b in stored], [b.parent for b in stored])
            elif kind == "BlockRemoved":
                self.tiers.gpu_removed(self.bridge.removed(int(h) for h in fields["block_hashes"]))
            elif kind == "AllBlocksCleared":
                self.bridge.cleared()
                self.tiers.gpu_cleared()
        except (KeyError, TypeError, ValueError) as e:
            log.warning("malformed vLLM %s event skipped: %s", kind or "KV", e)

    def _resync(self) -> list[KvEvent]:
        """After events were lost: keep only what vLLM really holds, then re-announce all of it."""
        gone = self.bridge.retain_only(self._vllm_held())
        log.warning(
            "vLLM KV events were lost: re-announcing %d blocks (%d no longer held)",
            len(self.bridge),
            len(gone),
        )
        self.tiers.reset()
        held = self.bridge.held()
        self.tiers.gpu_stored([b.block_hash for b in held], [b.parent for b in held])
        if self.store is not None:
            for ev in self.store.holdings_events(4096):
                if ev.tier != "gpu":
                    self.tiers.lower_event(ev)
        self.tiers.drain()  # the re-announce below says it all
        wid = self.cfg.worker_id
        cleared = KvEvent(worker_id=wid, kind="cleared", tier="gpu", block_hashes=[])
        return [cleared, *self.holdings_events(4096)]

    def _vllm_held(self) -> set[int]:
        """vLLM's external hashes of every cached block in its pool right now."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

        cache = self._sched.kv_cache_manager.block_pool.cached_block_hash_to_block._cache
        for _ in range(5):
            try:
                keys = list(cache)  # one C-level copy under the GIL; retried if a step resized it
                break
            except RuntimeError:
                continue
        else:
            keys = []
        out = set()
        for k in keys:
            h = maybe_convert_block_hash(get_block_hash(k))
            out.add(h if isinstance(h, int) else int.from_bytes(h, "big") & ((1 << 64) - 1))
        return out

    def holdings_events(self, max_blocks_per_event: int) -> list[KvEvent]:
        wid = self.cfg.worker_id
        step = max(1, max_blocks_per_event)
        by_tier: dict[str, list[tuple[int, int]]] = {}
        for h, parent, tier in self.tiers.held():
            by_tier.setdefault(tier, []).append((h, parent))
        out = []
        for tier in ("gpu", "dram", "disk"):
            blocks = by_tier.get(tier, [])
            for i in range(0, len(blocks), step):
                chunk = blocks[i : i + step]
                out.append(
                    KvEvent(
                        worker_id=wid,
                        kind="stored",
                        tier=tier,
                        block_hashes=[h for h, _ in chunk],
                        parent_hashes=[p for _, p in chunk],
                    )
                )
        return out

    # ---- calibration -------------------------------------------------------------------------------
    def calibrate(self, short: int = 256, long: int = 2048, decode_ctx: int = 256) -> PerfProfile:
        """Prefill cost per token and per context token, and the decode step, timed through vLLM."""
        bs = self.block_size
        long = max(min(long, self.max_context - 64, (self._num_blocks - 2) * bs), 2 * bs)
        short = max(min(short, long // 2), bs)
        rng = np.random.default_rng(self.cfg.seed)
        vocab = min(self.vocab_size, 256)
        runs = [0]

        def run(n: int, max_tokens: int) -> list[float]:
            """Step times of one request: [first token, then each decode step]."""
            runs[0] += 1
            req = EngineRequest(
                request_id=f"calibration-{runs[0]}",
                session_id="calibration",
                token_ids=rng.integers(0, vocab, n).tolist(),
                block_hashes=[],
                # its own namespace: never a prefix-cache hit
                namespace=b"kvmesh-calibration:%d" % runs[0],
                max_tokens=max_tokens,
            )
            times = []
            t0 = time.perf_counter()
            self.add_request(req)
            while self.has_work():
                outs = self.step()
                if any(o.new_token_ids for o in outs):
                    now = time.perf_counter()
                    times.append((now - t0) * 1e3)
                    t0 = now
            return times

        run(bs * 2, 1)  # warm-up
        samples = [(n, min(run(n, 1)[0] for _ in range(3))) for n in calibration_lengths(short, long)]
        a, b = fit_prefill_cost(samples)
        steps = run(min(decode_ctx, self.max_context - 40), 17)[1:]
        decode = sorted(steps)[len(steps) // 2] if steps else 5.0
        # Calibration prompts are nobody's cache: on an idle engine (at start) forget them everywhere,
        # vLLM's pool, the connector's store and the bridge, before the fleet hears of them.
        if not self._tracks:
            self.reset_cache()
        self._outputs = OutputLengths()  # its short answers say nothing of how long real ones run
        return PerfProfile(
            prefill_ms_per_token=a,
            prefill_ms_per_token_per_ctx=b,
            decode_ms_per_step=decode,
            link_gbps=1.0,
            link_latency_ms=1.0,
            block_bytes=self.block_bytes,
            block_size=bs,
            dram_gbps=self._measured_dram_gbps(),
            gpu_blocks=self._num_blocks,
            dram_blocks=self.cfg.dram_blocks if self.store is not None else 0,
            disk_blocks=self.cfg.disk_blocks if self.store is not None else 0,
        )

    def reset_cache(self) -> list[KvEvent]:
        """Forget every cached block, vLLM's and the store's (benchmarks and tests between cases); only
        while no request runs. The events tell the fleet."""
        if self._tracks:
            raise RuntimeError("reset_cache while requests run")
        self._llm.reset_prefix_cache()
        time.sleep(0.05)  # vLLM's publisher thread sends AllBlocksCleared and what came before it
        with self._events_lock:
            self._events.drain()  # all of it is void now
            self.bridge.cleared()
            self.tiers.reset()
            if self.store is not None:
                self.store.clear()
        return [KvEvent(worker_id=self.cfg.worker_id, kind="cleared", tier="gpu", block_hashes=[])]

    def _measured_dram_gbps(self) -> float:
        """How fast the connector moves a block between vLLM's pool and its DRAM tier, from the saves the
        calibration prompts just made (the cost model prices promotions and fetches with it)."""
        st = self.connector_stats
        if st is None or st.saved_blocks == 0 or st.save_s <= 0:
            return 20.0  # no connector: nothing moves, the figure is never used
        return max(float(self.block_bytes * st.saved_blocks / st.save_s / 1e9), 0.1)

    # ---- shutdown -------------------------------------------------------------------------------
    def release_all(self) -> list[KvEvent]:
        """Abort everything, stop vLLM; the fleet is told every block of this worker is gone."""
        got = self._step_lock.acquire(timeout=30.0)  # a step still running finishes first
        try:
            return self._release_all()
        finally:
            if got:
                self._step_lock.release()

    def _release_all(self) -> list[KvEvent]:
        for rid in list(self._tracks):
            with contextlib.suppress(Exception):
                self._llm.abort_request([rid])
        self._tracks.clear()
        self._pending.clear()
        self.close()
        self.bridge.cleared()
        self.tiers.reset()
        if self.store is not None:
            self.store.clear()
            self.store.close()
        return [KvEvent(worker_id=self.cfg.worker_id, kind="cleared", tier="gpu", block_hashes=[])]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._events.close()
        with contextlib.suppress(Exception):
            self._llm.engine_core.shutdown()
        self._release_hub()
        shutil.rmtree(self._sock_dir, ignore_errors=True)


def _structured(so: StructuredOutput | None) -> Any:
    """vLLM's structured-output parameters for a request's constraint (None: unconstrained)."""
    if so is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    # json_object is the schema of any object: vLLM's own json_object grammar ignores the engine's
    # whitespace setting (see _build).
    if so.kind == "json_object":
        return StructuredOutputsParams(json={"type": "object"})
    return StructuredOutputsParams(json=so.schema)


def _logprobs(new: list[int], sample: Any, k: int | None) -> list[TokenLogprob] | None:
    """kvmesh logprobs of the ``new`` tokens from vLLM's per-token ``{token id: Logprob}`` maps."""
    if k is None:
        return None
    if sample is None or len(sample) < len(new):
        raise RuntimeError("vLLM returned fewer logprobs than tokens")
    out = []
    for tok, entry in zip(new, list(sample)[-len(new) :] if new else [], strict=True):
        ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None))
        top = [(tid, v) for rank, tid, v in ranked if rank <= k][:k]
        out.append(
            TokenLogprob(
                token_id=tok,
                logprob=float(entry[tok].logprob),
                top_ids=[tid for tid, _ in top],
                top_logprobs=[float(v) for _, v in top],
            )
        )
    return out


def _event_fields(ev: Any) -> tuple[str, dict[str, Any]]:
    """(type, fields) of one raw event: a tagged map (vLLM ≥ 0.10) or a tagged array (older)."""
    if isinstance(ev, dict):
        return str(ev.get("type", "")), ev
    if isinstance(ev, list | tuple) and ev:
        tag = str(ev[0])
        names = {
            "BlockStored": (
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
            ),
            "BlockRemoved": ("block_hashes", "medium"),
        }.get(tag, ())
        return tag, dict(zip(names, ev[1:], strict=False))
    return "", {}


def _merge(events: list[KvEvent]) -> list[KvEvent]:
    """Consecutive events of one kind between the same tiers merged into one record (vLLM reports
    evictions one block at a time)."""
    out: list[KvEvent] = []
    for ev in events:
        prev = out[-1] if out else None
        if (
            prev is not None
            and ev.kind != "cleared"
            and (prev.kind, prev.tier, prev.from_tier) == (ev.kind, ev.tier, ev.from_tier)
        ):
            parents = (
                list(prev.parent_hashes) + list(ev.parent_hashes)
                if prev.parent_hashes and ev.parent_hashes
                else []
            )
            out[-1] = KvEvent(
                worker_id=prev.worker_id,
                kind=prev.kind,
                tier=prev.tier,
                block_hashes=list(prev.block_hashes) + list(ev.block_hashes),
                parent_hashes=parents,
                from_tier=prev.from_tier,
            )
        else:
            out.append(ev)
    return out
