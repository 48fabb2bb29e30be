#!/usr/bin/env bash
# The main command of the README: install what is needed, then run the demo workload on the embedded
# default stack (tansu broker + redis-server + kvmanager + scheduler + 2 workers + intake, all loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec "${PYTHON:-python3}" -m kvmesh.cli demo --embedded "$@"
