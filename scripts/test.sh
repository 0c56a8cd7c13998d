#!/usr/bin/env bash
# The whole test suite (and the linter), in .venv at the repo root. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ruff check .
python -m pytest "$@"
