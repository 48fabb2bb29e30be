"""kvmesh: a global KV-cache layer for LLM inference fleets.

This package holds the tools on top of the services: the command line, the dev runner, the demo,
benchmarks, the simulator and replay. What the services and the tools share (errors, cost model,
tokenizer, service shell) lives in ``kvmesh_core``, below every other layer.
"""

__version__ = "0.1.0"
