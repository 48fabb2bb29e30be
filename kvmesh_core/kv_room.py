"""How long a prefill waits for room in a worker's GPU KV tier, shared by the engines that report it,
the simulated worker, and the scheduler that prices it.

An engine starts a waiting prompt only when its blocks fit in the GPU tier beside those its running
requests hold (the built-in engine's ``_admit``, vLLM's scheduler); until then the prompt, and those
queued behind it, wait for running requests to end. With long prompts this wait, not the queued
prefill, is most of a busy worker's time to first token, and the work queued there does not show it.

A worker reports its room in two figures (``LoadReport.kv_free_blocks`` and ``kv_release``)::

    free now (the tier less the running requests' blocks and the queued prompts')   40 blocks
    releases, soonest first: (decode steps until a running request is expected to end, its blocks)
                             (12, 300)  (50, 120)  (90, 900)
    a prompt of 400 blocks:  40 + 300 + 120 >= 400 after 50 steps     → it waits 50 decode steps

The expected ends are each engine's own (``services.worker.batch_slots.OutputLengths``); the simulated
worker knows them. Blocks shared by several running requests are freed by the last to end, which a
per-request list cannot say: an engine counts each shared block with one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

#: How many releases a report carries; later ones are merged into the last (at its step, so the
#: wait for a prompt that needs them is over-, never under-estimated).
MAX_RELEASES = 16


def kv_release(running: Iterable[tuple[int, int]], limit: int = MAX_RELEASES) -> list[tuple[int, int]]:
    """The report's releases from the running requests' ``(steps left, blocks held)``: soonest first,
    requests ending at the same step merged, at most ``limit`` entries."""
    by_step: dict[int, int] = {}
    for steps, blocks in running:
        if blocks > 0:
            by_step[max(steps, 1)] = by_step.get(max(steps, 1), 0) + blocks
    ends = sorted(by_step.items())
    if len(ends) > limit > 0:
        tail = ends[limit - 1 :]
        ends = [*ends[: limit - 1], (tail[-1][0], sum(b for _, b in tail))]
    return ends


def kv_wait_steps(free: int, release: Sequence[tuple[int, int]], need: int) -> int:
    """Decode steps until a prompt of ``need`` blocks fits: 0 when it fits now. A prompt larger than
    all the running requests free starts after the last of them ends (an engine runs a request alone
    when nothing else runs)."""
    room = free
    if need <= room:
        return 0
    for steps, blocks in release:
        room += blocks
        if need <= room:
            return steps
    return release[-1][0] if release else 0
