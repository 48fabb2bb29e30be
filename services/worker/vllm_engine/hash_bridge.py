"""vLLM block hashes → kvmesh block hashes, for the blocks one vLLM engine holds.

vLLM names a block by its own chained hash (its hash function, its seed, the cache salt folded into
the first block). The fleet names blocks by :func:`schemas.blocks.hash_block`. The bridge recomputes
the kvmesh hash of every stored block from what vLLM's ``BlockStored`` event carries: the block's
token ids, its parent (whose kvmesh hash the bridge already knows) and the namespace, which comes from
the cache salt of the chain's first block::

    BlockStored(parent=None, hashes=[v0, v1], tokens=t0..t63, extra_keys=[("kvmesh/0/743a41",), None])
        k0 = H(ROOT, ns, t0..t31)   k1 = H(k0, ns, t32..t63)       ns = bytes.fromhex("743a41") = b"t:A"
    BlockStored(parent=v1, hashes=[v2], tokens=t64..t95)
        k2 = H(k1, ns, t64..t95)                                  (ns, position: inherited from v1)

so the scheduler's index and the Redis directory hold the same hashes intake computed, whatever engine
a worker runs. Blocks that lie wholly inside the request's public prefix take the public namespace, as
:func:`schemas.blocks.block_hashes` says; vLLM itself still keeps one copy per salt, so two vLLM hashes
may name one kvmesh block: the bridge counts them and reports a kvmesh block removed only when its last
vLLM copy goes.

A chain whose first block carries no kvmesh salt (a request that did not come through kvmesh) or whose
parent the bridge never saw (an event lost for good) is skipped: the fleet then under-counts what this
worker holds, which costs a missed reuse, never a wrong one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from schemas.blocks import PUBLIC_NAMESPACE, ROOT_HASH, hash_block

log = logging.getLogger(__name__)

_SALT_PREFIX = "kvmesh/"


def kvmesh_salt(namespace: bytes, public_prefix_tokens: int = 0) -> str:
    """The ``cache_salt`` kvmesh gives vLLM for a request: isolates tenants in vLLM's prefix cache and
    tells the bridge the namespace (and public prefix) to hash the request's blocks with."""
    return f"{_SALT_PREFIX}{max(public_prefix_tokens, 0)}/{namespace.hex()}"


def parse_salt(salt: object) -> tuple[bytes, int] | None:
    """(namespace, public prefix tokens) of a kvmesh salt; None for anything else."""
    if not isinstance(salt, str) or not salt.startswith(_SALT_PREFIX):
        return None
    try:
        ppt, ns_hex = salt[len(_SALT_PREFIX) :].split("/", 1)
        return bytes.fromhex(ns_hex), int(ppt)
    except ValueError:
        return None


def external_id(vllm_request_id: str) -> str:
    """vLLM appends ``-<8 chars>`` to the id it was given; the worker knows the request by the latter."""
    return vllm_request_id.rsplit("-", 1)[0]


@dataclass(slots=True)
class _Mapped:
    """One vLLM block the bridge could name."""

    kvmesh: int
    parent: int  # kvmesh hash of the parent block (ROOT_HASH for a first block)
    namespace: bytes  # the chain's tenant namespace
    public_prefix_tokens: int
    index: int  # position of the block in its prompt (block i holds tokens [i*bs, (i+1)*bs))


@dataclass(frozen=True, slots=True)
class StoredBlock:
    block_hash: int
    parent: int


class HashBridge:
    """Owns the vLLM-hash → kvmesh-hash map of one engine and the count of vLLM copies per kvmesh block.

    Invariant: a kvmesh hash is reported stored when its first vLLM copy appears and removed when its
    last one goes; ``held`` is exactly the set of kvmesh hashes with at least one copy.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_vllm: dict[int, _Mapped] = {}
        self._copies: dict[int, int] = {}  # kvmesh hash → number of vLLM blocks naming it
        self._parent: dict[int, int] = {}  # kvmesh hash → its parent's kvmesh hash
        self.skipped_blocks = 0
        self.size_mismatches = 0

    def __len__(self) -> int:
        return len(self._copies)

    def holds(self, kvmesh_hash: int) -> bool:
        return kvmesh_hash in self._copies

    def prefix_length(self, kvmesh_hashes: Sequence[int]) -> int:
        """How many leading hashes are held."""
        n = 0
        for h in kvmesh_hashes:
            if h not in self._copies:
                break
            n += 1
        return n

    def stored(
        self,
        vllm_hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: Sequence[object] | None = None,
    ) -> list[StoredBlock]:
        """Apply one ``BlockStored``; the kvmesh blocks that became held (in chain order)."""
        bs = self.block_size
        if block_size != bs:
            # Never index blocks cut at another size: every hash would be wrong for the fleet.
            self.size_mismatches += 1
            self.skipped_blocks += len(vllm_hashes)
            log.error("vLLM stored blocks of %d tokens; the fleet's block size is %d", block_size, bs)
            return []
        if len(token_ids) < len(vllm_hashes) * bs:
            self.skipped_blocks += len(vllm_hashes)
            log.warning("BlockStored with %d tokens for %d blocks: skipped", len(token_ids), len(vllm_hashes))
            return []
        if parent is None:
            first_keys = extra_keys[0] if extra_keys else None
            found = _salt_in(first_keys)
            if found is None:
                self.skipped_blocks += len(vllm_hashes)
                return []
            namespace, ppt = found
            parent_k, index = ROOT_HASH, 0
        else:
            prev = self._by_vllm.get(parent)
            if prev is None:
                self.skipped_blocks += len(vllm_hashes)
                return []
            namespace, ppt = prev.namespace, prev.public_prefix_tokens
            parent_k, index = prev.kvmesh, prev.index + 1
        out: list[StoredBlock] = []
        for i, v in enumerate(vllm_hashes):
            idx = index + i
            ns = PUBLIC_NAMESPACE if (idx + 1) * bs <= ppt else namespace
            k = hash_block(parent_k, ns, token_ids[i * bs : (i + 1) * bs])
            known = self._by_vllm.get(v)
            if known is None:
                self._by_vllm[v] = _Mapped(k, parent_k, namespace, ppt, idx)
                n = self._copies.get(k, 0)
                self._copies[k] = n + 1
                if n == 0:
                    self._parent[k] = parent_k
                    out.append(StoredBlock(k, parent_k))
            parent_k = k
        return out

    def removed(self, vllm_hashes: Iterable[int]) -> list[int]:
        """Apply one ``BlockRemoved``; the kvmesh hashes no longer held (unknown vLLM hashes are ignored:
        blocks the bridge could not name, or partial-block entries vLLM also removes)."""
        out = []
        for v in vllm_hashes:
            m = self._by_vllm.pop(v, None)
            if m is None:
                continue
            n = self._copies[m.kvmesh] - 1
            if n:
                self._copies[m.kvmesh] = n
            else:
                del self._copies[m.kvmesh]
                self._parent.pop(m.kvmesh, None)
                out.append(m.kvmesh)
        return out

    def cleared(self) -> None:
        self._by_vllm.clear()
        self._copies.clear()
        self._parent.clear()

    def retain_only(self, vllm_hashes: set[int]) -> list[int]:
        """Forget every vLLM block not in ``vllm_hashes`` (what the engine really holds after events were
        lost); the kvmesh hashes that are no longer held."""
        return self.removed([v for v in list(self._by_vllm) if v not in vllm_hashes])

    def held(self) -> list[StoredBlock]:
        """Every held kvmesh block with its parent, parents before children where both are held."""
        return [StoredBlock(k, self._parent[k]) for k in self._copies]


def _salt_in(keys: object) -> tuple[bytes, int] | None:
    # vLLM publishes a block's extra keys untagged: LoRA name, (mm id, offset) pairs, the cache salt.
    if keys is None:
        return None
    if isinstance(keys, str):
        return parse_salt(keys)
    if isinstance(keys, list | tuple):
        for k in keys:
            found = parse_salt(k)
            if found is not None:
                return found
    return None
