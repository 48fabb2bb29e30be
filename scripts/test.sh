#!/usr/bin/env bash
# The test command of the README (and of CI): install what is needed, lint, then the whole suite
# against a real embedded broker (tansu) and real redis-server processes started by the fixtures.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
PY="${PYTHON:-python3}"
"$PY" -m ruff check .
"$PY" -m mypy --no-error-summary
# the layers import downward only (pyproject [tool.importlinter])
"$PY" -c "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c(['--no-cache']))"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
