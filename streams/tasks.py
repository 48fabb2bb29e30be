"""Stopping background tasks so that a ``stop()`` always returns.

``task.cancel(); await task`` waits forever when the task absorbs the cancel: a library that catches
``CancelledError`` and loops on, or (on Python 3.11) ``asyncio.wait_for`` returning the result of an
inner call that finished just as the cancel came. A service loop that polls through such a call then
never ends, and neither does its service's ``stop()``. :func:`stop_tasks` cancels again until the
task is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

# long enough for a task's own clean-up (a final flush) to end before it is cancelled again
RECANCEL_S = 5.0


async def stop_tasks(
    tasks: Iterable[asyncio.Task[Any] | None], *, swallow_errors: bool = False, recancel_s: float = RECANCEL_S
) -> None:
    """Cancel every task, then wait for each to end, cancelling again each ``recancel_s`` a task
    goes on. A task that ended with an exception re-raises it here unless ``swallow_errors``."""
    pending = [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    first_error: BaseException | None = None
    for task in pending:
        while not task.done():
            await asyncio.wait({task}, timeout=recancel_s)
            if not task.done():
                log.warning("task %s went on after a cancel; cancelling it again", task.get_name())
                task.cancel()
        if task.cancelled():
            continue
        exc = task.exception()
        if exc is not None and first_error is None:
            first_error = exc
    if first_error is not None and not swallow_errors:
        raise first_error


async def stop_task(
    task: asyncio.Task[Any] | None, *, swallow_errors: bool = False, recancel_s: float = RECANCEL_S
) -> None:
    """:func:`stop_tasks` for one task (or none)."""
    await stop_tasks([task], swallow_errors=swallow_errors, recancel_s=recancel_s)
