"""From a request's Completion to the HTTP error the client sees.

The reply routing itself (request id → handle, order, dedup) lives once, in the producer SDK
(:mod:`kvmesh_client`); tokens become text in :mod:`kvmesh_core.text_stream`, the rule the worker shares.
"""

from __future__ import annotations

from schemas.messages import Completion
from services.intake.errors import IntakeError, UpstreamFailed, UpstreamRejected


def completion_error(c: Completion) -> IntakeError | None:
    """The HTTP error a failed Completion stands for, or None when it succeeded."""
    if c.finish_reason in ("stop", "length"):
        return None
    # Worker error strings may quote internals; the client gets the class of failure and the id.
    if c.finish_reason == "rejected":
        return UpstreamRejected(f"The fleet rejected request {c.request_id}: {c.error or 'no capacity'}.")
    if c.finish_reason == "cancelled":
        return UpstreamFailed(f"Request {c.request_id} was cancelled by the fleet.", code="cancelled")
    return UpstreamFailed(f"The worker failed while serving request {c.request_id}.")
