"""Pulling the blocks an assignment's transfer plan names, before the engine prefills the request.

A block is useful only if every block before it is held (the chain), so each planned run is fetched
only from where the local prefix ends, and a gap stops the plan::

    prompt blocks   0 1 2 3 4 5 6 7
    held locally    ■ ■ ■
    plan            peer A: blocks 2..6      → fetch 3..6 (2 is here), verified blocks enter the sink
    gap case        peer A: blocks 5..6      → nothing fetched: 3 and 4 are missing; recompute

Every fault (peer gone, corrupt or truncated bytes, another tenant's block) ends in fewer received
blocks, never an exception: the rest is recomputed and the request says so in ``fallback``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh_core.fetching import Step, chain_parents, plan_step
from schemas.messages import Assignment, ReplicateCommand
from schemas.token_ids import int_list

if TYPE_CHECKING:
    from services.worker.kv_layout import BlockSink
    from services.worker.reports import RunningRequest
    from services.worker.transfer import BlockClient

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FetchOutcome:
    fetched_blocks: int = 0
    failures: int = 0
    declined: int = 0  # runs the worker's own cost check turned down


#: ``worth_fetching(n_blocks, cached_tokens)``: the worker's own check of a plan against the cost model.
WorthFetching = Callable[[int, int], bool]


async def fetch_planned(
    a: Assignment,
    entry: RunningRequest,
    client: BlockClient,
    sink: BlockSink,
    lookup_prefix: Callable[[list[int]], int],
    peer_id: str,
    worth_fetching: WorthFetching | None = None,
) -> FetchOutcome:
    """Fetch the plan's blocks that extend the local prefix; updates ``entry`` (fetched, fallback).

    ``worth_fetching`` re-checks each run with this worker's own measured figures (the scheduler
    priced it with what it last heard): a run that no longer beats recomputing it is not pulled."""
    req = a.request
    hashes = int_list(req.block_hashes)
    outcome = FetchOutcome()
    for plan in sorted(a.fetch, key=lambda p: p.first_block):
        step, start = plan_step(plan.first_block, len(plan.block_hashes), lookup_prefix(hashes))
        if step is Step.HELD:
            continue  # someone (a replication, an earlier turn) already brought them
        if step is Step.GAP:
            entry.fallback = "gap before fetched blocks; recomputing"
            break
        want = list(plan.block_hashes[start - plan.first_block :])
        if worth_fetching is not None and not worth_fetching(len(want), start * req.block_size):
            outcome.declined += 1
            entry.fallback = (
                f"fetch of {len(want)} blocks from {plan.peer_worker} costs more than recomputing"
            )
            break
        result = await client.fetch(
            plan.peer_address,
            want,
            chain_parents(hashes, start, len(want)),
            req.namespace,
            sink,
            peer_id=peer_id,
        )
        got = len(result.received)
        entry.fetched_blocks += got
        entry.expected_blocks = max(entry.expected_blocks, start + got)
        outcome.fetched_blocks += got
        if got < len(want):
            outcome.failures += 1
            entry.fallback = f"fetch from {plan.peer_worker} incomplete ({got}/{len(want)}): recomputing rest"
            log.warning("request %s: %s", req.request_id, entry.fallback)
            break
    return outcome


async def replicate(
    cmd: ReplicateCommand,
    client: BlockClient,
    sink: BlockSink,
    lookup_prefix: Callable[[list[int]], int],
    peer_id: str,
) -> int | None:
    """Pull a hot prefix from ``cmd``'s source; how many blocks arrived (None: all already here)."""
    hashes = list(cmd.block_hashes)
    have = lookup_prefix(hashes)
    if have >= len(hashes):
        return None
    want = hashes[have:]
    result = await client.fetch(
        cmd.source_address, want, chain_parents(hashes, have, len(want)), cmd.namespace, sink, peer_id=peer_id
    )
    log.info(
        "replication %s: %d/%d blocks from %s",
        cmd.command_id,
        len(result.received),
        len(want),
        cmd.source_worker,
    )
    return len(result.received)
