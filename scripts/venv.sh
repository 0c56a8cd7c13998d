# Sourced by the quick-start scripts: makes .venv at the repo root and installs LeverLab into it.
# Idempotent: it reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.leverlab-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    echo "setting up $VENV (one time)..." >&2
    # torch first and pinned: it comes from the machine's local CPU wheel, never a CUDA build.
    "$VENV/bin/pip" install -q "torch==2.13.0"
    "$VENV/bin/pip" install -q -e "$ROOT[dev]"
    echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
