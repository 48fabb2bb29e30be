"""How long a request queued now waits for a place in the engine's running batch.

An engine runs at most so many requests at once (the built-in engine's ``max_batch``, vLLM's
``max_num_seqs``). While the batch is full a new request waits in the engine's queue until running
requests finish, however short the queued prefill is: on a busy worker that wait, counted in decode
steps, is most of its time to first token, and nothing else in a LoadReport says it. Each engine
reports it as ``LoadReport.slot_wait_steps`` and the scheduler prices it with the worker's decode step.

A running request is expected to end after as many tokens as the worker's requests have produced on
average (:class:`OutputLengths`), and never after its own ``max_tokens``::

    batch of 4, 2 queued, typical output 100 tokens
    steps left per running request   10  35  60  100   → the queued two take the first two places;
    a request queued now needs the third:  60 steps
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: How much one finished request moves the typical output length (an exponential mean over about
#: this many requests): fast enough to follow a change of workload, slow enough to ignore one outlier.
OUTPUT_MEMORY = 32


@dataclass(slots=True)
class OutputLengths:
    """The typical number of tokens a request produces here, from the requests that finished."""

    mean: float | None = None

    def add(self, tokens: int) -> None:
        if self.mean is None:
            self.mean = float(tokens)
        else:
            self.mean += (tokens - self.mean) / OUTPUT_MEMORY

    def steps_left(self, generated: int, max_tokens: int) -> int:
        """Decode steps a running request that has produced ``generated`` tokens is expected to run
        still: to the typical length (its own ``max_tokens`` before any request finished), never past
        ``max_tokens``, at least one."""
        typical = max_tokens if self.mean is None else min(round(self.mean), max_tokens)
        return max(typical - generated, 1) if generated < max_tokens else 1

    def slot_wait(self, running: Sequence[tuple[int, int]], queued: int, slots: int) -> int:
        """:func:`slot_wait_steps` of a batch whose running requests have each produced so many tokens
        of their ``max_tokens`` (``(generated, max_tokens)`` pairs): what an engine reports."""
        typical = self.steps_left(0, max((m for _, m in running), default=1))
        return slot_wait_steps((self.steps_left(g, m) for g, m in running), queued, slots, typical)


def slot_wait_steps(steps_left: Iterable[int], queued: int, slots: int, typical: int) -> int:
    """Decode steps until a request queued now behind ``queued`` others gets a place in a batch of
    ``slots`` whose running requests have ``steps_left`` each. 0 when the batch has room (or no limit,
    ``slots`` <= 0). A place that frees up goes to the queued requests in order; past one turnover of
    the batch, each later place comes ``typical`` steps after the one it follows."""
    ends = sorted(steps_left)
    need = len(ends) + queued + 1 - slots  # places that must free up before this request's
    if slots <= 0 or need <= 0 or not ends:
        return 0
    rounds, k = divmod(need - 1, len(ends))
    return ends[k] + rounds * max(typical, 1)


#: How many decode steps the measured step time averages over (an exponential mean).
STEP_MEMORY = 32


@dataclass(slots=True)
class DecodeStepMeter:
    """The time of this engine's decode steps as they run now, for LoadReports.

    Calibration times one step of a one-request batch on an idle engine. A step of a full batch on a
    busy machine can take many times that (a CPU computes every request's token; a GPU reads every
    running request's KV), and every wait a LoadReport implies (the step in flight, the steps a prefill
    carries, the wait for a place in the batch) is counted in steps. So each engine times its steps
    that only decode and reports their recent mean; None until it has run one.
    """

    ms: float | None = None

    def add(self, ms: float) -> None:
        self.ms = ms if self.ms is None else self.ms + (ms - self.ms) / STEP_MEMORY
