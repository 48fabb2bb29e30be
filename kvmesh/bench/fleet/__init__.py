"""``kvmesh bench fleet``: one workload against the live pipeline under every routing policy.

    kvmesh bench fleet [--workload multiturn|shared-prefix|trace] [--trace FILE --token-scale 1/32]
        [--policies round_robin,...,dynamo,llm_d,sglang,kvmesh (every policy)] [--workers 2]
        [--users 4 --rounds 3 ...] [--time-scale X] [--max-requests K] [--plot DIR] [--json]
    kvmesh bench fleet --bootstrap HOST:PORT | --url http://HOST:PORT   (an existing stack: one policy)

For each policy a fresh embedded stack (``DevStack``: broker, Redis, kvmanager, scheduler, N workers,
intake) is started, so no run inherits another's caches; the workload is driven through the producer
SDK (``kvmesh_client.KvmeshClient``, token ids straight in) or, with ``--url``, through intake's
streaming HTTP API. Users run concurrently, each user's turns strictly one after another, and every
next turn's prompt is the previous prompt + the real answer + the new question
(:mod:`kvmesh.workloads`: the same generators the simulator plays).

Per policy it reports the simulator's summary (:func:`kvmesh.sim.metrics.summarize`, same field
names, so ``kvmesh simulate`` and this bench can be set side by side):

* TTFT -- client side: submit -> first TokenChunk (HTTP: first SSE event, sent with the first token).
* end-to-end -- submit -> Completion; throughput over the run's makespan.
* reused / fetched / recomputed prompt tokens -- from the Completions.
* busy fraction per worker -- the union of the intervals during which the worker held a request
  (its own ``e2e_ms`` measured back from when the Completion arrived) over the makespan; spread =
  max - min in percentage points.

With ``--json`` the last stdout line is one JSON object ``{"policies": {name: summary}, ...}``; each
summary also holds ``errors``, ``worker_ids``, ``wall_s`` and the ``profile`` the workers calibrated
(a :class:`~kvmesh_core.costmodel.PerfProfile` as a dict: what to feed the simulator for the same fleet).
"""

from kvmesh.bench.fleet.cli import main, workload_from_args
from kvmesh.bench.fleet.errors import FleetBenchError
from kvmesh.bench.fleet.output import build_output, format_table
from kvmesh.bench.fleet.records import TurnRecord, summarize_live, to_sim_result, union_length
from kvmesh.bench.fleet.run import (
    PolicyRun,
    StackOptions,
    drive,
    read_profiles,
    run_existing,
    run_fleet,
    run_policy,
)

__all__ = [
    "FleetBenchError",
    "PolicyRun",
    "StackOptions",
    "TurnRecord",
    "build_output",
    "drive",
    "format_table",
    "main",
    "read_profiles",
    "run_existing",
    "run_fleet",
    "run_policy",
    "summarize_live",
    "to_sim_result",
    "union_length",
    "workload_from_args",
]
