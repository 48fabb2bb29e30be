"""kvmesh: a global KV-cache layer for LLM inference fleets.

This package holds what every service shares beyond the wire contracts: the cost model, the
tokenizer and chat template, the command line, the dev runner, benchmarks, the simulator and replay.
"""

__version__ = "0.1.0"
