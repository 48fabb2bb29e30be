"""The inference engine: prefill and decode with continuous batching over the paged KV cache.

One ``step()`` is one iteration of the batch::

    admit     waiting requests, FIFO, while the batch has room: reference the cached prefix
              (KvCacheManager.acquire_prefix, promoting lower-tier blocks) and allocate the rest;
              a request whose peer blocks are still being pulled keeps its place and is passed over
              until ``kv_arrived`` (vLLM's WAITING_FOR_REMOTE_KVS)
    prefill   up to ``prefill_chunk`` prompt tokens across prefilling requests (chunked prefill);
              the request whose prompt completes samples its first token
    decode    ONE token for every request past prefill, all in one batched forward

A request's KV lives in its list of GPU blocks; block i holds tokens [i*bs, (i+1)*bs). The leading
blocks that came from the cache are shared and read-only; the rest are the request's own. Whenever one
of its own blocks fills up it is named by its chained hash (prompt blocks by the request's hashes,
generated blocks by continuing the chain) and committed to the cache, so the next turn of the
conversation, whose prompt is this prompt plus the answer, finds it. Attention gathers a request's
blocks into one contiguous K/V (simple and exact) and runs ``scaled_dot_product_attention``.

The engine is driven by one thread; a lock makes add_request/abort/load safe from another one.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from kvmesh_core.costmodel import PerfProfile, prefill_ctx
from kvmesh_core.kv_room import kv_release
from kvmesh_core.reuse import reusable_blocks
from kvmesh_core.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from schemas.blocks import ROOT_HASH, block_hashes
from schemas.messages import BASE_FEATURES, KvEvent, TokenLogprob
from services.worker.batch_slots import DecodeStepMeter, OutputLengths
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
from services.worker.kv_layout import BlockLayout
from services.worker.model import LlamaModel, build_model
from services.worker.model_configs import get_config
from services.worker.sampling import History, allowed_mask, sample
from services.worker.weights import load_checkpoint

log = logging.getLogger(__name__)

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "RequestRejected",
    "RequestStats",
    "StepOutput",
]


@dataclass
class EngineConfig:
    model: str = "tiny"
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
    worker_id: str = "worker-0"


@dataclass
class _Seq:
    """A running request: its tokens, block table and progress."""

    req: EngineRequest
    tokens: list[int]
    prompt_len: int
    max_tokens: int
    hashes: list[int]
    gen: torch.Generator
    block_ids: list[int] = field(default_factory=list)
    committed: int = 0  # leading blocks already named in the cache (or shared from it)
    n_computed: int = 0  # tokens whose KV is written in block_ids
    reused_blocks: int = 0
    promoted: int = 0
    fallback: str | None = None
    started: float = 0.0
    output: list[int] = field(default_factory=list)
    hist: History | None = None  # only when the request has penalties
    kv_pending: bool = False  # its pull is on the link: admission passes it over

    @property
    def prefilling(self) -> bool:
        return self.n_computed < self.prompt_len

    def banned(self) -> list[int]:
        """End tokens may not be chosen before ``min_tokens`` tokens (vLLM's rule)."""
        if len(self.output) < self.req.sampling.min_tokens:
            return list(self.req.stop_token_ids)
        return []


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _resolve_dtype(name: str, device: torch.device) -> str:
    if name == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    if name not in ("float32", "float16", "bfloat16"):
        raise ModelConfigError(f"unsupported dtype {name!r}")
    return name


class Engine:
    """Owns the model, the tokenizer, the KV cache manager and the queue of requests of one worker.

    The built-in implementation of :class:`~services.worker.engine_api.WorkerEngine`: its KV cache
    manager is the data plane's block source and sink, with DRAM and disk tiers below the GPU pool.
    """

    kind = "builtin"

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.device = _resolve_device(cfg.device)
        dtype_name = _resolve_dtype(cfg.dtype, self.device)
        dtype = getattr(torch, dtype_name)
        if cfg.checkpoint:
            self.model: LlamaModel = load_checkpoint(cfg.checkpoint, self.device, dtype)
        else:
            self.model = build_model(get_config(cfg.model), cfg.seed, self.device, dtype)
        mc = self.model.cfg
        self.model_cfg = mc
        tok_file = Path(cfg.checkpoint) / "tokenizer.json" if cfg.checkpoint else None
        self.tokenizer: Tokenizer = (
            HFTokenizer(tok_file) if tok_file and tok_file.is_file() else ByteTokenizer()
        )
        if self.tokenizer.vocab_size > mc.vocab_size:
            raise ModelConfigError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens, model only {mc.vocab_size}"
            )
        self.max_context = cfg.max_context or mc.max_context
        self.layout = BlockLayout(mc.n_layers, mc.n_kv_heads, cfg.block_size, mc.head_dim, dtype_name)
        self.kv = KvCacheManager(
            self.layout,
            gpu_blocks=cfg.gpu_blocks,
            dram_blocks=cfg.dram_blocks,
            disk_blocks=cfg.disk_blocks,
            disk_dir=cfg.disk_dir,
            device=self.device,
            worker_id=cfg.worker_id,
        )
        self._mask = allowed_mask(self.tokenizer.generation_vocab(), mc.vocab_size)
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._pending: list[StepOutput] = []
        self._outputs = OutputLengths()  # how long answers run here, for the wait for a batch place
        self._step_meter = DecodeStepMeter()  # what a decode step of the batch takes now
        self._lock = threading.RLock()

    # ---- the WorkerEngine surface beyond requests and steps ------------------------------------
    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def vocab_size(self) -> int:
        return self.model_cfg.vocab_size

    @property
    def model_name(self) -> str:
        return self.model_cfg.name

    @property
    def dtype(self) -> str:
        return self.layout.dtype

    @property
    def block_bytes(self) -> int:
        return self.layout.nbytes

    @property
    def prefill_chunk_tokens(self) -> int:
        return self.cfg.prefill_chunk

    @property
    def features(self) -> tuple[str, ...]:
        # No grammar-constrained decoding: structured output and tool calls are vLLM's.
        return BASE_FEATURES

    def describe(self) -> str:
        return f"builtin engine, model {self.model_cfg.name}, layout {self.layout.describe()}"

    def block_source(self) -> KvCacheManager:
        return self.kv

    def block_sink(self) -> KvCacheManager:
        return self.kv

    def set_fleet_copies(self, fn: Callable[[int], int] | None) -> None:
        self.kv.set_fleet_copies(fn)

    def retain(self, block_hashes: list[int], until_ms: int) -> None:
        self.kv.retain(block_hashes, until_ms)

    def expire_retains(self, now_ms: int) -> None:
        self.kv.expire_retains(now_ms)

    def holdings_events(self, max_blocks_per_event: int) -> list[KvEvent]:
        return self.kv.holdings_events(max_blocks_per_event)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; raises RequestRejected when it can never run here."""
        bs = self.layout.block_size
        n = len(req.token_ids)
        ids = check_request(req, bs, self.max_context, self.model_cfg.vocab_size, self.features)
        if -(-(n + 1) // bs) > self.kv.pool.num_blocks:
            raise RequestRejected(
                f"request {req.request_id}: prompt needs more KV blocks than the GPU tier has "
                f"({self.kv.pool.num_blocks})"
            )
        # The hashes name the blocks this request will store for everyone: they must be the hashes
        # of its tokens, or a wrong request could poison the cache.
        expect = block_hashes(ids, bs, req.namespace, req.public_prefix_tokens)
        if list(req.block_hashes) != expect:
            raise RequestRejected(
                f"request {req.request_id}: block_hashes do not match token_ids "
                f"(block size {bs}, {len(req.block_hashes)} hashes for {len(expect)} full blocks)"
            )
        seed = req.sampling.seed
        if seed is None:
            seed = (self.cfg.seed << 32) ^ zlib.crc32(req.request_id.encode())
        seq = _Seq(
            req=req,
            tokens=list(req.token_ids),
            prompt_len=n,
            max_tokens=min(req.max_tokens, self.max_context - n),
            hashes=list(expect),
            gen=torch.Generator().manual_seed(seed),
            hist=History(ids.tolist(), self.model_cfg.vocab_size) if req.sampling.penalized else None,
            kv_pending=req.kv_pending,
        )
        with self._lock:
            if any(s.req.request_id == req.request_id for s in self._waiting + self._running):
                raise RequestRejected(f"request {req.request_id} is already queued")
            self._waiting.append(seq)
            # the prefix it finds here stays until it is admitted (KvCacheManager.hold): the prompts
            # queued ahead of it would otherwise evict it before it runs
            self.kv.hold(req.request_id, seq.hashes)

    def abort(self, request_id: str) -> bool:
        """Stop a request; the next ``step()`` reports it finished with reason "cancelled"."""
        with self._lock:
            for lst in (self._waiting, self._running):
                for s in lst:
                    if s.req.request_id == request_id:
                        lst.remove(s)
                        self.kv.unhold(request_id)
                        if s.block_ids:
                            self.kv.release(s.block_ids)
                            s.block_ids = []
                        self._pending.append(StepOutput(request_id, [], True, "cancelled"))
                        return True
            return False

    def kv_arrived(self, request_id: str, expected_reuse_blocks: int) -> None:
        with self._lock:
            for s in self._waiting:
                if s.req.request_id == request_id:
                    s.kv_pending = False
                    s.req.expected_reuse_blocks = expected_reuse_blocks
                    self.kv.hold(request_id, s.hashes)  # what it pulled extends the prefix it holds

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._running or self._pending or any(not s.kv_pending for s in self._waiting))

    # ---- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        with self._lock:
            out, self._pending = self._pending, []
            self._admit(out)
            decoding = [s for s in self._running if not s.prefilling]
            self._prefill(out)
            if decoding:
                t0 = time.perf_counter()
                self._decode(decoding, out)
                self._step_meter.add((time.perf_counter() - t0) * 1e3)
            return out

    def _admit(self, out: list[StepOutput]) -> None:
        bs = self.layout.block_size
        i = 0  # the first waiting request not passed over (those before it still wait for their pull)
        while i < len(self._waiting) and len(self._running) < self.cfg.max_batch:
            s = self._waiting[i]
            if s.kv_pending:
                i += 1
                continue
            s.started = time.perf_counter()
            # The last prompt token is always recomputed: its logits give the first output token,
            # and shared blocks are never written.
            usable = min(len(s.hashes), reusable_blocks(s.prompt_len, bs))
            hit = self.kv.acquire_prefix(s.hashes, max_blocks=usable)
            need = -(-s.prompt_len // bs) - len(hit.block_ids)
            own = self.kv.allocate(need)
            if own is None:
                self.kv.release(hit.block_ids)
                if self._running:
                    return  # wait for running requests to free blocks; FIFO order is kept
                self._waiting.pop(i)
                out.append(self._fail(s, "out of KV cache blocks"))
                continue
            self._waiting.pop(i)
            self.kv.unhold(s.req.request_id)  # its prefix is referenced now
            s.block_ids = hit.block_ids + own
            s.reused_blocks = s.committed = len(hit.block_ids)
            s.n_computed = s.reused_blocks * bs
            s.promoted = hit.promoted
            expected = min(s.req.expected_reuse_blocks, usable)
            if len(hit.block_ids) < expected:
                s.fallback = f"expected {expected} cached blocks, found {len(hit.block_ids)}; recomputed"
            self._running.append(s)

    def _prefill(self, out: list[StepOutput]) -> None:
        budget = self.cfg.prefill_chunk
        for s in [s for s in self._running if s.prefilling]:
            if budget <= 0:
                break
            t = min(s.prompt_len - s.n_computed, budget)
            budget -= t
            try:
                logits = self._forward_one(s, t)
            except Exception as e:  # a failed forward ends this request, not the worker
                log.exception("prefill of %s failed", s.req.request_id)
                self._running.remove(s)
                out.append(self._fail(s, f"prefill failed: {e}"))
                continue
            if s.prefilling:
                continue
            tok, lp = sample(logits, s.req.sampling, s.gen, self._mask, s.hist, s.banned())
            stats = RequestStats(
                prompt_tokens=s.prompt_len,
                reused_tokens=s.reused_blocks * self.layout.block_size,
                recomputed_tokens=s.prompt_len - s.reused_blocks * self.layout.block_size,
                prefill_ms=(time.perf_counter() - s.started) * 1e3,
                promoted_blocks=s.promoted,
                fallback=s.fallback,
            )
            out.append(self._emit_token(s, tok, lp, first=True, stats=stats))

    def _forward_one(self, s: _Seq, t: int) -> Tensor:
        """Run ``t`` prompt tokens of ``s`` after its computed ones; logits of the last one [V]."""
        start = s.n_computed
        toks = torch.tensor(s.tokens[start : start + t], dtype=torch.long, device=self.device)[None]
        pos = torch.arange(start, start + t, device=self.device)[None]
        past = self.kv.pool.gather(s.block_ids, start)[:, :, None] if start else None
        logits, new_kv = self.model(toks, pos, past=past, last_only=True)
        self.kv.pool.write(s.block_ids, start, new_kv[:, :, 0])
        s.n_computed += t
        self._commit_full_blocks(s)
        last: Tensor = logits[0, -1]
        return last

    def _decode(self, seqs: list[_Seq], out: list[StepOutput]) -> None:
        bs = self.layout.block_size
        batch: list[_Seq] = []
        for s in seqs:
            if s.n_computed // bs >= len(s.block_ids):
                got = self.kv.allocate(1)
                if got is None:
                    self._running.remove(s)
                    out.append(self._fail(s, "out of KV cache blocks during decode"))
                    continue
                s.block_ids += got
            batch.append(s)
        if not batch:
            return
        try:
            logits = self._forward_batch(batch)
        except Exception as e:
            log.exception("decode step failed")
            for s in batch:
                self._running.remove(s)
                out.append(self._fail(s, f"decode failed: {e}"))
            return
        for i, s in enumerate(batch):
            tok, lp = sample(logits[i], s.req.sampling, s.gen, self._mask, s.hist, s.banned())
            out.append(self._emit_token(s, tok, lp, first=False, stats=None))

    def _forward_batch(self, batch: list[_Seq]) -> Tensor:
        """Feed each sequence's last token in one forward; logits [B, V]."""
        pool = self.kv.pool
        lens = [s.n_computed for s in batch]
        p_max = max(lens)
        toks = torch.tensor([[s.tokens[-1]] for s in batch], dtype=torch.long, device=self.device)
        pos = torch.tensor([[n] for n in lens], dtype=torch.long, device=self.device)
        past = torch.zeros(
            (*self.layout.shape[:3], len(batch), p_max, self.layout.head_dim),
            dtype=pool.tensor.dtype,
            device=self.device,
        )
        # past is [L, 2, Hkv, B, P, D] while filling, permuted to the model's [L, 2, B, Hkv, P, D].
        mask = torch.zeros((len(batch), p_max), dtype=torch.bool, device=self.device)
        for i, s in enumerate(batch):
            past[:, :, :, i, : lens[i]] = pool.gather(s.block_ids, lens[i])
            mask[i, : lens[i]] = True
        past = past.permute(0, 1, 3, 2, 4, 5)
        logits, new_kv = self.model(toks, pos, past=past, past_mask=mask if len(batch) > 1 else None)
        for i, s in enumerate(batch):
            pool.write(s.block_ids, lens[i], new_kv[:, :, i])
            s.n_computed += 1
            self._commit_full_blocks(s)
        firsts: Tensor = logits[:, 0]
        return firsts

    def _commit_full_blocks(self, s: _Seq) -> None:
        bs = self.layout.block_size
        full = s.n_computed // bs
        while len(s.hashes) < full:
            # Generated tokens continue the prompt's hash chain (same namespace rules).
            k = len(s.hashes)
            parent = s.hashes[-1] if s.hashes else ROOT_HASH
            s.hashes += block_hashes(
                s.tokens[k * bs : (k + 1) * bs],
                bs,
                s.req.namespace,
                s.req.public_prefix_tokens,
                parent=parent,
                start_token=k * bs,
            )
        for i in range(s.committed, full):
            parent = s.hashes[i - 1] if i else ROOT_HASH
            self.kv.commit_computed(s.block_ids[i], s.hashes[i], parent, s.req.namespace, s.req.session_id)
        s.committed = max(s.committed, full)

    def _emit_token(
        self, s: _Seq, tok: int, lp: TokenLogprob | None, first: bool, stats: RequestStats | None
    ) -> StepOutput:
        s.tokens.append(tok)
        s.output.append(tok)
        if s.hist is not None:
            s.hist.add(tok)
        reason = None
        if tok in s.req.stop_token_ids and not s.req.sampling.ignore_eos:
            reason = "stop"
        elif len(s.output) >= s.max_tokens or len(s.tokens) >= self.max_context:
            reason = "length"
        if reason is not None:
            self._outputs.add(len(s.output))
            self._finish(s)
        return StepOutput(
            s.req.request_id, [tok], reason is not None, reason, first, stats, logprobs=[lp] if lp else None
        )

    def _finish(self, s: _Seq) -> None:
        self._commit_full_blocks(s)
        if s in self._running:
            self._running.remove(s)
        self.kv.release(s.block_ids)
        s.block_ids = []

    def _fail(self, s: _Seq, message: str) -> StepOutput:
        self.kv.unhold(s.req.request_id)
        if s.block_ids:
            self.kv.release(s.block_ids)
            s.block_ids = []
        return StepOutput(s.req.request_id, [], True, "error", error=message)

    # ---- cache and load ----------------------------------------------------------------------
    def lookup_prefix(self, block_hashes: list[int]) -> int:
        return self.kv.lookup_prefix(block_hashes)

    def drain_kv_events(self) -> list[KvEvent]:
        return self.kv.drain_kv_events()

    def load(self) -> EngineLoad:
        with self._lock:
            active = list(self._running)
            # a waiting request's reuse is known only when it starts: until then, what the scheduler
            # expected (new tokens, cached context), as the simulator's workers report
            waiting = [
                (n, s.prompt_len - n) for s in self._waiting for n in [waiting_prefill(s.req, s.prompt_len)]
            ]
            tiers = self.kv.tier_usage()
            bs = self.layout.block_size
            # room for the next prompt: the GPU blocks no running request references, less what the
            # queued prompts take first; and when running requests are expected to free theirs
            free = tiers[0].free_blocks - sum(-(-s.prompt_len // bs) for s in self._waiting)
            release = kv_release(
                (self._outputs.steps_left(len(s.output), s.max_tokens), self.kv.sole_blocks(s.block_ids))
                for s in active
            )
            return EngineLoad(
                queue_depth=len(self._waiting),
                active_requests=len(active),
                active_tokens=sum(len(s.tokens) for s in active),
                queued_prefill_tokens=sum(n for n, _ in waiting)
                + sum(s.prompt_len - s.n_computed for s in active if s.prefilling),
                queued_prefill_ctx_tokens=sum(prefill_ctx(n, c) for n, c in waiting)
                + sum(prefill_ctx(s.prompt_len - s.n_computed, s.n_computed) for s in active if s.prefilling),
                tiers=tiers,
                slot_wait_steps=self._outputs.slot_wait(
                    [(len(s.output), s.max_tokens) for s in active], len(self._waiting), self.cfg.max_batch
                ),
                recent_decode_ms_per_step=self._step_meter.ms or 0.0,
                kv_free_blocks=free,
                kv_release=release,
            )

    def release_all(self) -> list[KvEvent]:
        """Graceful shutdown: forget every request and every block; the events to publish."""
        with self._lock:
            self._waiting.clear()
            self._running.clear()
            self._pending.clear()
            events = self.kv.clear()
            self.kv.close()
            return events

    # ---- calibration -------------------------------------------------------------------------
    @torch.inference_mode()
    def calibrate(self, short: int = 256, long: int = 2048, decode_ctx: int = 256) -> PerfProfile:
        """Measure this machine (services.worker.builtin_calibration)."""
        from services.worker.builtin_calibration import calibrate

        profile = calibrate(self, short, long, decode_ctx)
        self._outputs = OutputLengths()  # its one-token answers say nothing of how long real ones run
        return profile

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
