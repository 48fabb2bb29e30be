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

Peer blocks reach the store before the request reaches vLLM: the worker pulls its transfer plan over
the data plane (asynchronously, while vLLM keeps stepping other requests), and only verified blocks
enter the store. So every failure of a peer (gone, corrupt or truncated bytes, another tenant) means
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

from schemas.blocks import PUBLIC_NAMESPACE, ROOT_HASH, hash_block
from services.worker.kv_cache_manager import KvCacheManager
from services.worker.kv_layout import BlockLayout
from services.worker.vllm_engine.hash_bridge import parse_salt

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


def external_id(vllm_request_id: str) -> str:
    """vLLM appends ``-<8 chars>`` to the id it was given; the worker knows the request by the latter."""
    return vllm_request_id.rsplit("-", 1)[0]


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
    """What the worker service and both connector roles share: the store below vLLM and the counters."""

    def __init__(self, store: KvCacheManager, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self.stats = ConnectorStats()
        self.lock = threading.Lock()  # guards stats

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
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()

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
        bs = self.bs
        # The last prompt token is always computed: its logits give the first output token.
        usable = (request.num_prompt_tokens - 1) // bs
        start = num_computed_tokens // bs
        if start >= usable:
            return 0, False
        hashes = st.hashes_upto(usable, bs)
        n = self.hub.store.lookup_prefix(hashes[start:usable])
        st.match_start, st.match_blocks = start, n
        return n * bs, False

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
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
            if st.pending_load:
                meta.loads[new.req_id] = st.pending_load
            st.pending_load = None
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
                if st.pending_load:
                    meta.loads[rid] = st.pending_load
                st.pending_load = None
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
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.pending_load:
            for ld in st.pending_load:  # allocated but never scheduled: give the pins back
                if ld.view is not None:
                    self.hub.store.release_read(ld.block_hash)
        return False, None

    # ---- worker role -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # One tensor per attention layer, [num_blocks, ...]: a block is each layer's [block_id] slab.
        self._layers = list(kv_caches.values())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvmeshConnectorMeta) or not meta.loads:
            return
        t0 = time.perf_counter()
        store = self.hub.store
        n_layers = len(self._layers)
        loaded = 0
        per_request: dict[str, int] = {}
        for rid, loads in meta.loads.items():
            for ld in loads:
                if ld.view is None:
                    self._load_errors.add(ld.block_id)
                    continue
                try:
                    first = self._layers[0]
                    src = torch.frombuffer(ld.view, dtype=torch.uint8).view(first.dtype)
                    src = src.view(n_layers, *first.shape[1:])
                    for layer, part in zip(self._layers, src, strict=True):
                        layer[ld.block_id].copy_(part)
                    loaded += 1
                    per_request[external_id(rid)] = per_request.get(external_id(rid), 0) + 1
                except (RuntimeError, ValueError):
                    log.exception("loading block %#x failed; vLLM recomputes it", ld.block_hash)
                    self._load_errors.add(ld.block_id)
                finally:
                    store.release_read(ld.block_hash)
        dt = time.perf_counter() - t0
        with self.hub.lock:
            s = self.hub.stats
            s.loaded_blocks += loaded
            s.load_errors += sum(1 for loads in meta.loads.values() for ld in loads if ld.view is None)
            s.load_s += dt
            for rid, n in per_request.items():
                s.loaded_by_request[rid] = s.loaded_by_request.get(rid, 0) + n

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv, before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # whole blocks are saved in wait_for_save, once every layer is written

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvmeshConnectorMeta) or not meta.saves or not self._layers:
            return
        t0 = time.perf_counter()
        saved = 0
        for sv in meta.saves:
            data = torch.stack([layer[sv.block_id] for layer in self._layers]).contiguous()
            raw = data.view(-1).view(torch.uint8).numpy().data
            saved += self.hub.store.commit_blocks(
                [(sv.block_hash, sv.parent, raw)], sv.namespace, tier="dram"
            )
        dt = time.perf_counter() - t0
        with self.hub.lock:
            self.hub.stats.saved_blocks += saved
            self.hub.stats.save_s += dt

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out
