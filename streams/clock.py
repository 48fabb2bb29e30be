"""The one wall-clock read of the streams layer: event times stamped on outgoing envelopes.

Decisions never call this; they read the ``*_ms`` fields of messages. Producers take a ``clock``
argument so tests and replays can inject a fake one.
"""

from __future__ import annotations

import time


def now_ms() -> int:
    """Milliseconds since the Unix epoch, as an int (the unit of every ``*_ms`` field on the wire)."""
    return time.time_ns() // 1_000_000
