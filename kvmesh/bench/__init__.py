"""Benchmarks: one module per ``kvmesh bench <name>``, each with ``main(argv) -> int``.

Contract of every benchmark: a progress bar on stderr while it runs, a human summary, and with
``--json`` the last line printed on stdout is one JSON object of the results.
"""
