"""What every layer above shares: the product's errors, the cost model that prices fetch, recompute
and waiting, the tokenizer, the text stream rules and the service shell.

The bottom layer: it imports nothing of kvmesh's (schemas, streams, services and the tools all import
it); ``lint-imports`` (pyproject ``[tool.importlinter]``) keeps it that way.
"""
