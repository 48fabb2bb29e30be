"""Discrete-event fleet simulator that drives the live scheduler code (FleetView + Router).

Modules: ``events`` (the time-ordered queue), ``cache`` (a worker's tiered LRU of block hashes),
``worker`` (one simulated worker: FCFS prefill queue, batched decode), ``engine`` (the fleet, the
lagged message flow into the view, the router calls), ``metrics`` (per-request records and the summary),
``plots`` (PNG figures), ``__main__`` (``kvmesh simulate``).
"""
