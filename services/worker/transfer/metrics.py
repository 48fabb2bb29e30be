"""Counters of the data plane, one object per server or client (or shared by both on a worker).

Plain in-process integers: the worker copies ``snapshot()`` into its own metrics and logs. Every fault a
fetch can end in is counted under its reason (see ``client.FailReason``), so a fleet that silently
recomputes because transfers fail shows up in numbers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class TransferMetrics:
    """What moved and what failed. Owned by whoever built it; the server and client only add to it."""

    # server side
    connections: int = 0
    requests_served: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    not_found_sent: int = 0
    tenant_refused: int = 0  # blocks held under another namespace, answered not_found
    auth_refused: int = 0
    too_many_blocks: int = 0
    layout_mismatch: int = 0
    bad_frames: int = 0
    connections_refused: int = 0  # over max_connections, closed on accept
    pending_bytes_refused: int = 0  # requests refused while the unauthenticated-bytes budget was full
    sent_by_tier: Counter[str] = field(default_factory=Counter)
    # client side
    fetches: int = 0
    fetches_complete: int = 0
    blocks_received: int = 0
    blocks_committed: int = 0
    bytes_received: int = 0
    fetch_failures: Counter[str] = field(default_factory=Counter)  # reason -> failed fetches

    def snapshot(self) -> dict[str, int]:
        """Flat name -> count view (``fetch_failures.<reason>``, ``sent_by_tier.<tier>``)."""
        out: dict[str, int] = {}
        for name, value in vars(self).items():
            if isinstance(value, Counter):
                for k, v in sorted(value.items()):
                    out[f"{name}.{k}"] = v
            else:
                out[name] = value
        return out
