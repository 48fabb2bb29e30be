"""The kvmesh KV connector for vLLM: tiers below vLLM's pool, loads from them, blocks for the data plane.

vLLM loads it out of tree (``kv_connector="KvmeshConnector"``, ``kv_connector_module_path`` = this
module, ``kv_role="kv_both"``) and builds two instances, one per role. kvmesh runs vLLM in the worker
process, so both share one :class:`ConnectorHub` (found by the id in ``kv_connector_extra_config``)
with the worker service: the hub's store is a kvmesh :class:`KvCacheManager` with DRAM and disk tiers
and no GPU pool, the same store (and fleet-aware eviction) the built-in engine keeps below its pool,
and the worker's block server serves it to peers.

Per scheduler step::

    scheduler role                                         worker role (same process, same step)
    get_num_new_matched_tokens(req, local_hit)
      kvmesh hashes of the prompt (namespace from the salt)
      blocks past the local hit held in the store → n
    update_state_after_alloc(req, blocks, n)
      pin the n store blocks, pair them with vLLM block ids
    build_connector_meta(output) ──── loads, saves ───────▶ start_load_kv: store bytes → vLLM blocks
      saves = full blocks this step completes                 (before the forward; a block missing
      that the store does not hold yet                         is reported as a load error and vLLM
                                                               recomputes from it)
                                                             forward pass
                                                             wait_for_save: vLLM blocks → store (DRAM)

Peer blocks reach the store before vLLM schedules the request: the worker pulls its transfer plan over
the data plane while vLLM keeps stepping other requests, and until the pull ends the connector answers
``None`` for the request (its place in the queue is kept; ``ConnectorHub.awaiting_pull``). Only verified
blocks enter the store. So every failure of a peer (gone, corrupt or truncated bytes, another tenant) means
fewer blocks in the store, and the connector simply offers fewer: the rest is recomputed, and the output
is the same. Blocks are opaque to kvmesh: one vLLM block is each layer's ``kv_cache[block_id]`` slab,
concatenated over layers (``BlockLayout`` tagged with the engine's arrangement).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvmesh_core.reuse import reusable_blocks
from schemas.blocks import PUBLIC_NAMESPACE, ROOT_HASH, hash_block
from services.worker.kv_cache_manager import KvCacheManager
from services.worker.kv_layout import BlockLayout
from services.worker.vllm_engine.block_copy import BlockCopier
from services.worker.vllm_engine.hash_bridge import external_id, parse_salt

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: The key in ``kv_connector_extra_config`` that names the hub.
HUB_KEY = "kvmesh_hub"


@dataclass
class ConnectorStats:
    """Counters the engine reports (Completion stats, bench figures)."""

    loaded_blocks: int = 0
    saved_blocks: int = 0
    load_errors: int = 0
    load_s: float = 0.0
    save_s: float = 0.0
    #: external request id → blocks loaded from the store for it (taken by the engine per request)
    loaded_by_request: dict[str, int] = field(default_factory=dict)


class ConnectorHub:
    """What the worker service and both connector roles share: the store below vLLM, the counters, and
    the bookkeeping of asynchronous loads.

    Invariant (async loads): a vLLM request id is in ``loading`` from the step its load is handed to the
    worker role until the copy has finished; the blocks of a request that ends meanwhile are freed only
    once the copy is done (``request_finished`` returns True, the copy reports it in ``done_sending``),
    so a copy never writes into blocks another request already got.
    """

    def __init__(self, store: KvCacheManager, block_size: int, async_load: bool = False) -> None:
        self.store = store
        self.block_size = block_size
        self.async_load = async_load
        self.stats = ConnectorStats()
        self.lock = threading.Lock()  # guards stats and the sets below
        self.loading: set[str] = set()
        self.delay_free: set[str] = set()
        self.done_recving: set[str] = set()
        self.done_sending: set[str] = set()
        #: External ids of requests whose peer blocks the worker is still pulling into the store: the
        #: scheduler role answers "not known yet", so vLLM keeps each in its place and steps the rest.
        self.awaiting_pull: set[str] = set()
        #: vLLM request ids with a block that failed to load: vLLM recomputes from it
        #: (``kv_load_failure_policy="recompute"``), and the connector offers them nothing more, or an
        #: asynchronous load that keeps failing would be offered and retried forever.
        self.load_failed: set[str] = set()

    def take_loaded(self, request_id: str) -> int:
        with self.lock:
            return self.stats.loaded_by_request.pop(request_id, 0)


_HUBS: dict[str, ConnectorHub] = {}
_HUB_IDS = itertools.count()


def register_hub(hub: ConnectorHub) -> str:
    hub_id = f"hub-{next(_HUB_IDS)}"
    _HUBS[hub_id] = hub
    return hub_id


def unregister_hub(hub_id: str) -> None:
    _HUBS.pop(hub_id, None)


def vllm_block_layout(layers: int, kv_heads: int, block_size: int, head_dim: int, dtype: str) -> BlockLayout:
    """The data plane's name for a vLLM block of this shape (same bytes, vLLM's arrangement)."""
    return BlockLayout(layers, kv_heads, block_size, head_dim, dtype, tag="vllm")


# ---- metadata: scheduler role → worker role ------------------------------------------------------
@dataclass(slots=True)
class _Load:
    block_hash: int
    block_id: int
    view: memoryview | None  # the pinned store bytes; None: gone before it could be pinned


@dataclass(slots=True)
class _Save:
    block_hash: int
    parent: int
    namespace: bytes
    block_id: int


@dataclass
class KvmeshConnectorMeta(KVConnectorMetadata):
    loads: dict[str, list[_Load]] = field(default_factory=dict)  # vLLM request id → blocks to load
    saves: list[_Save] = field(default_factory=list)


@dataclass
class _ReqState:
    """The scheduler role's view of one request: its kvmesh hashes and its vLLM block table."""

    request: Any
    namespace: bytes
    public_prefix_tokens: int
    hashes: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0  # blocks [0, saved_upto) are in the store or were handed to a save
    match_start: int = 0
    match_blocks: int = 0
    pending_load: list[_Load] | None = None

    def hashes_upto(self, n_blocks: int, block_size: int) -> list[int]:
        """The kvmesh hashes of the first ``n_blocks`` blocks of the request's tokens (computed once)."""
        tokens = self.request.all_token_ids
        n_blocks = min(n_blocks, len(tokens) // block_size)
        while len(self.hashes) < n_blocks:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            ns = PUBLIC_NAMESPACE if (i + 1) * block_size <= self.public_prefix_tokens else self.namespace
            self.hashes.append(hash_block(parent, ns, tokens[i * block_size : (i + 1) * block_size]))
        return self.hashes[:n_blocks]


class KvmeshConnector(KVConnectorBase_V1):
    """kvmesh's lower tiers under vLLM (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        hub_id = self._kv_transfer_config.get_from_extra_config(HUB_KEY, None)
        hub = _HUBS.get(str(hub_id))
        if hub is None:
            raise ValueError(f"no kvmesh connector hub {hub_id!r}: the connector runs inside a kvmesh worker")
        self.hub = hub
        self.bs = vllm_config.cache_config.block_size
        self._reqs: dict[str, _ReqState] = {}
        self._copier: BlockCopier | None = None  # the worker role's, once vLLM registers its KV tensors
        self._load_errors: set[int] = set()
        self._pool: Any = None  # the worker role's copy thread (async loads)

    # ---- scheduler role ----------------------------------------------------------------------------
    def _state(self, request: Request) -> _ReqState | None:
        st = self._reqs.get(request.request_id)
        if st is None:
            found = parse_salt(request.cache_salt)
            if found is None:
                return None  # not a kvmesh request: nothing to name its blocks by
            st = _ReqState(request, found[0], found[1])
            self._reqs[request.request_id] = st
        return st

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        if st is None:
            return 0, False
        with self.hub.lock:
            if external_id(request.request_id) in self.hub.awaiting_pull:
                # vLLM passes it over this step and keeps its place in the queue (None: not known yet)
                return None, False
            if request.request_id in self.hub.load_failed:
                return 0, False
        bs = self.bs
        # The last prompt token is always computed: its logits give the first output token.
        usable = reusable_blocks(request.num_prompt_tokens, bs)
        start = num_computed_tokens // bs
        if start >= usable:
            return 0, False
        hashes = st.hashes_upto(usable, bs)
        n = self.hub.store.lookup_prefix(hashes[start:usable])
        st.match_start, st.match_blocks = start, n
        # Asynchronous: vLLM parks the request (WAITING_FOR_REMOTE_KVS) and keeps stepping the others
        # while the worker role copies; the request runs once get_finished reports its copy done.
        return n * bs, bool(n) and self.hub.async_load

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        ids = blocks.get_block_ids()[0]
        n = num_external_tokens // self.bs
        loads = []
        for i in range(st.match_start, st.match_start + n):
            h = st.hashes[i]
            got = self.hub.store.read_block(h)  # pins it until the worker role has copied it
            loads.append(_Load(h, ids[i], got[1] if got is not None else None))
        st.pending_load = loads

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvmeshConnectorMeta()
        bs = self.bs
        # Loads allocated this step: scheduled now (sync) or parked until their copy is done (async).
        for rid, state in self._reqs.items():
            if state.pending_load:
                meta.loads[rid] = state.pending_load
                state.pending_load = None
        if self.hub.async_load and meta.loads:
            with self.hub.lock:
                self.hub.loading.update(meta.loads)
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids += new_ids[0]
            computed[rid] = cached.num_computed_tokens[i]
        # Save every full block this step completes that the store does not hold yet.
        store = self.hub.store
        for rid, before in computed.items():
            st = self._reqs[rid]
            after = before + scheduler_output.num_scheduled_tokens.get(rid, 0)
            full = min(after, len(st.request.all_token_ids), len(st.block_ids) * bs) // bs
            if full <= st.saved_upto:
                continue
            hashes = st.hashes_upto(full, bs)
            for b in range(st.saved_upto, len(hashes)):
                h = hashes[b]
                if store.tier_of(h) is None:
                    parent = hashes[b - 1] if b else ROOT_HASH
                    ns = PUBLIC_NAMESPACE if (b + 1) * bs <= st.public_prefix_tokens else st.namespace
                    meta.saves.append(_Save(h, parent, ns, st.block_ids[b]))
            st.saved_upto = len(hashes)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        if st is not None and st.pending_load:
            for ld in st.pending_load:  # allocated but never handed out: give the pins back
                if ld.view is not None:
                    self.hub.store.release_read(ld.block_hash)
        with self.hub.lock:
            self.hub.load_failed.discard(rid)
            if rid in self.hub.loading:
                # A copy still writes into this request's blocks: vLLM frees them when it reports done.
                self.hub.delay_free.add(rid)
                return True, None
        return False, None

    # ---- worker role -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # One tensor per attention layer, [num_blocks, ...]: a block is each layer's [block_id] slab.
        self._copier = BlockCopier(list(kv_caches.values()))

    @property
    def block_bytes(self) -> int:
        """One kvmesh block over vLLM's registered KV tensors, in bytes (0 before they are registered)."""
        return 0 if self._copier is None else self._copier.block_bytes

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvmeshConnectorMeta) or not meta.loads:
            return
        if not self.hub.async_load:
            self._copy_in(meta.loads)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmesh-connector-load")
        # Copy in the background; vLLM keeps stepping the requests that are not waiting for these.
        self._pool.submit(self._copy_async, dict(meta.loads))

    def _copy_async(self, loads: dict[str, list[_Load]]) -> None:
        try:
            self._copy_in(loads)
        except Exception:  # every block was already counted as loaded or as an error
            log.exception("asynchronous KV load failed")
        finally:
            hub = self.hub
            with hub.lock:
                for rid in loads:
                    hub.loading.discard(rid)
                    if rid in hub.delay_free:
                        hub.delay_free.discard(rid)
                        hub.load_failed.discard(rid)  # it ended: nothing will ask for it again
                        hub.done_sending.add(rid)  # it ended meanwhile: its blocks may be freed now
                    else:
                        hub.done_recving.add(rid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        hub = self.hub
        with hub.lock:
            sending, hub.done_sending = hub.done_sending, set()
            recving, hub.done_recving = hub.done_recving, set()
        return (sending or None), (recving or None)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _copy_in(self, all_loads: dict[str, list[_Load]]) -> None:
        """Store bytes → vLLM blocks, the whole step's loads in one batch (``block_copy``); a block that
        cannot be copied is a load error (vLLM recomputes it)."""
        t0 = time.perf_counter()
        store = self.hub.store
        errors = 0
        batch: list[tuple[str, _Load]] = []
        items: list[tuple[int, memoryview]] = []
        failed: set[str] = set()
        for rid, loads in all_loads.items():
            for ld in loads:
                if ld.view is None:
                    self._add_error(ld.block_id)
                    errors += 1
                    failed.add(rid)
                else:
                    batch.append((rid, ld))
                    items.append((ld.block_id, ld.view))
        bad: set[int] = set()
        try:
            if self._copier is None:
                raise RuntimeError("no KV tensors registered")
            bad = set(self._copier.copy_in(items))
        except Exception:  # a load that fails is recomputed by vLLM, never a crash of its forward
            log.exception("loading %d blocks failed; vLLM recomputes them", len(batch))
            bad = set(range(len(batch)))
        finally:
            for _, ld in batch:
                store.release_read(ld.block_hash)
        per_request: dict[str, int] = {}
        for i, (rid, ld) in enumerate(batch):
            if i in bad:
                self._add_error(ld.block_id)
                errors += 1
                failed.add(rid)
            else:
                per_request[external_id(rid)] = per_request.get(external_id(rid), 0) + 1
        dt = time.perf_counter() - t0
        with self.hub.lock:
            s = self.hub.stats
            s.loaded_blocks += len(batch) - len(bad)
            s.load_errors += errors
            s.load_s += dt
            self.hub.load_failed |= failed
            for rid, n in per_request.items():
                s.loaded_by_request[rid] = s.loaded_by_request.get(rid, 0) + n

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # sync loads complete in start_load_kv; async ones gate the request, not a layer

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # whole blocks are saved in wait_for_save, once every layer is written

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvmeshConnectorMeta) or not meta.saves or self._copier is None:
            return
        t0 = time.perf_counter()
        saved = 0
        data = self._copier.copy_out([sv.block_id for sv in meta.saves])
        for sv, row in zip(meta.saves, data, strict=True):
            raw = row.data
            saved += self.hub.store.commit_blocks(
                [(sv.block_hash, sv.parent, raw)], sv.namespace, tier="dram"
            )
        dt = time.perf_counter() - t0
        with self.hub.lock:
            self.hub.stats.saved_blocks += saved
            self.hub.stats.save_s += dt

    def _add_error(self, block_id: int) -> None:
        # Recorded before the request is reported done, so vLLM sees it no later than that pass.
        with self.hub.lock:
            self._load_errors.add(block_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self.hub.lock:
            out, self._load_errors = self._load_errors, set()
        return out
