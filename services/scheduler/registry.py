"""Every routing policy by name, and the router-side bookkeeping each needs from the view.

kvmesh's own policy and its simple baselines live in :mod:`services.scheduler.policies`; the peers'
routers (Dynamo, llm-d, SGLang) in :mod:`services.scheduler.peer_policies`. ``kvmesh simulate``,
``bench fleet``, ``replay`` and the live scheduler all pick from this one table.
"""

from __future__ import annotations

from collections.abc import Callable

from schemas.messages import ChatRequest
from services.scheduler import peer_policies, policies
from services.scheduler.policies import CandidateScore, ScoringParams
from services.scheduler.view import FleetView

Policy = Callable[[FleetView, ChatRequest, int, list[str], ScoringParams], list[CandidateScore]]

POLICY_FUNCS: dict[str, Policy] = {
    "round_robin": policies.round_robin,
    "least_loaded": policies.least_loaded,
    "session_affinity": policies.session_affinity,
    "prefix_aware": policies.prefix_aware,
    "dynamo": peer_policies.dynamo,
    "llm_d": peer_policies.llm_d,
    "sglang": peer_policies.sglang,
    "kvmesh": policies.kvmesh,
}

POLICIES: tuple[str, ...] = tuple(POLICY_FUNCS)

#: The peers' routers: the baselines a user would run instead of kvmesh.
PEER_POLICIES: tuple[str, ...] = ("dynamo", "llm_d", "sglang")

#: Policies whose choice is the least estimated wait in the fleet, so that "the best worker is over
#: max_queue_ms" means the whole fleet is: they hold requests in the scheduler (late binding).
HOLDING_POLICIES: frozenset[str] = frozenset({"kvmesh"})


def prepare_view(view: FleetView, policy: str) -> None:
    """Make ``view`` keep what ``policy`` reads besides the engines' reports."""
    if policy in ("dynamo", "kvmesh"):
        view.track(active_blocks=True)
    elif policy == "sglang":
        view.track(routed_max_blocks=peer_policies.SGLANG_MAX_TREE_TOKENS // max(view.block_size, 1))
