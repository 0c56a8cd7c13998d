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
# The C++ kernels, built once per source content into the cache that every checkout shares
# (leverlab/kernels/cpu_kernels.py), so the first model load does not pay the compile. A build that fails stops
# here with the compiler's error; LEVERLAB_NO_CPP_KERNELS=1 runs on the plain PyTorch paths instead.
KSTAMP="$VENV/.leverlab-kernels"
kwant="$( (cat "$ROOT"/leverlab/kernels/csrc/* "$ROOT/leverlab/kernels/cpu_kernels.py"; echo "$want ${LEVERLAB_CACHE:-}") | sha256sum | cut -d' ' -f1)"
if [ "${LEVERLAB_NO_CPP_KERNELS:-}" != "1" ] && { [ ! -f "$KSTAMP" ] || [ "$(cat "$KSTAMP")" != "$kwant" ]; }; then
    echo "building the C++ kernels (once per source change; 1-3 minutes unless cached)..." >&2
    if ! "$VENV/bin/python" -m leverlab.kernels.cpu_kernels >&2; then
        echo "the C++ kernel build failed (above); fix the compiler, or set LEVERLAB_NO_CPP_KERNELS=1" >&2
        return 1 2>/dev/null || exit 1
    fi
    echo "$kwant" > "$KSTAMP"
fi
