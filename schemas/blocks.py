"""Block identity: the one chained hash used by intake, scheduler, worker, KV manager and simulator.

A prompt of token ids is cut into fixed-size blocks. Only full blocks have an identity; the tail that
does not fill a block is always recomputed (as in vLLM's prefix cache)::

    tokens   | t0 .. t15 | t16 .. t31 | t32 .. t47 | t48 t49 (partial, no hash)
    hash     |    h0     |     h1     |     h2     |
    h0 = H(ROOT, ns0, t0..t15)   h1 = H(h0, ns1, t16..t31)   h2 = H(h1, ns2, t32..t47)

Because each hash covers its parent, equal hashes mean equal *prefixes*, not only equal blocks, so a
lookup for the longest cached prefix is a walk over leading hashes.

``ns`` is the namespace salt of the block. Every block is salted with its tenant's namespace, so the
same tokens sent by two tenants are different blocks (no cross-tenant reuse, no prefix-timing leak).
A deployment may declare leading tokens as a *public* prefix (a product's system prompt): full blocks
that lie entirely inside it are salted with :data:`PUBLIC_NAMESPACE` and shared across tenants. The
first block that reaches past the public prefix, and every block after it, carries the tenant salt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

#: Tokens per KV block unless a deployment sets another size (``KVMESH_BLOCK_SIZE``).
DEFAULT_BLOCK_SIZE = 16

#: Parent hash of the first block of every prompt.
ROOT_HASH = 0

#: Namespace of blocks that a deployment explicitly shares across tenants.
PUBLIC_NAMESPACE = b"public"

_MASK64 = (1 << 64) - 1


def tenant_namespace(tenant: str) -> bytes:
    """The namespace salt of a tenant's private blocks."""
    return b"t:" + tenant.encode("utf-8")


def hash_block(parent: int, namespace: bytes, tokens: Sequence[int] | np.ndarray) -> int:
    """Hash one full block: H(parent hash, namespace, tokens) as an unsigned 64-bit int.

    blake2b keeps collisions as unlikely as a 64-bit digest allows even for adversarial prompts
    (a non-cryptographic hash would let a tenant craft a collision with another's block).
    """
    return _hash_packed(parent, namespace, np.asarray(tokens, dtype="<u4").tobytes())


def _hash_packed(parent: int, namespace: bytes, packed: bytes | memoryview) -> int:
    """hash_block over tokens already packed as little-endian uint32."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent & _MASK64).to_bytes(8, "little"))
    h.update(len(namespace).to_bytes(2, "little"))
    h.update(namespace)
    h.update(packed)
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int = DEFAULT_BLOCK_SIZE,
    namespace: bytes = PUBLIC_NAMESPACE,
    public_prefix_tokens: int = 0,
    parent: int = ROOT_HASH,
    start_token: int = 0,
) -> list[int]:
    """Chained hashes of every full block of ``tokens``.

    ``parent`` and ``start_token`` continue a chain: to extend the hashes of a prompt by its generated
    tokens, pass the last hash as ``parent`` and the number of tokens already hashed as ``start_token``
    (``tokens`` then holds only the new tokens, and ``start_token`` must be a multiple of the block size).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if start_token % block_size:
        raise ValueError("start_token must be a multiple of block_size")
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in 32 bits")
    out: list[int] = []
    n_full = arr.size // block_size
    # packed once, then hashed a block's bytes at a time (a conversion per block was most of the cost)
    packed = memoryview(arr[: n_full * block_size].astype("<u4").tobytes())
    width = 4 * block_size
    for i in range(n_full):
        block_end = start_token + (i + 1) * block_size
        ns = PUBLIC_NAMESPACE if block_end <= public_prefix_tokens else namespace
        parent = _hash_packed(parent, ns, packed[i * width : (i + 1) * width])
        out.append(parent)
    return out


def num_full_blocks(n_tokens: int, block_size: int) -> int:
    """How many full blocks ``n_tokens`` tokens fill."""
    return n_tokens // block_size
