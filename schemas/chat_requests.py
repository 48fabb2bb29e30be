"""The one way to build a ChatRequest from prompt tokens: the SDK (and so intake), the workloads, the
benches and the tests' factories all call it, so a request always carries the block hashes intake
would compute (chained, salted with the tenant's namespace past the public prefix)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from schemas.blocks import block_hashes, tenant_namespace
from schemas.messages import ChatRequest
from schemas.token_ids import TokenIds


def chat_request(
    tokens: Sequence[int] | np.ndarray,
    *,
    request_id: str,
    session_id: str,
    tenant: str,
    block_size: int,
    max_tokens: int,
    arrival_ms: int,
    public_prefix_tokens: int = 0,
    **fields: Any,
) -> ChatRequest:
    """A request for ``tokens`` of ``tenant``; ``fields``: the rest of ChatRequest's (sampling,
    deadline_ms, model, reply_topic, stop_token_ids)."""
    # an array is packed and hashed as it is: a list of it costs a Python int per token, twice
    ids: Sequence[int]
    hashed: Sequence[int] | np.ndarray
    if isinstance(tokens, np.ndarray):
        ids, hashed = TokenIds(tokens), tokens
    else:
        ids = hashed = list(tokens)
    namespace = tenant_namespace(tenant)
    return ChatRequest(
        request_id=request_id,
        session_id=session_id,
        tenant=tenant,
        token_ids=ids,
        block_hashes=block_hashes(hashed, block_size, namespace, public_prefix_tokens),
        block_size=block_size,
        max_tokens=max_tokens,
        arrival_ms=arrival_ms,
        namespace=namespace,
        public_prefix_tokens=public_prefix_tokens,
        **fields,
    )
