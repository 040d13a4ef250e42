# Sourced by tools/serve and tools/test: make .venv once, then reuse it.
# A stamp holding the hash of setup.cfg + the extra decides whether to reinstall,
# so a second run with nothing changed starts in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
EXTRA="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.ferroxmp-installed"
WANT="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-$EXTRA"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build,
    # while 2.13.0 (CPU) is on this disk. A user's own torch is kept.
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        "$VENV/bin/pip" install -q "torch==2.13.0"
    fi
    if [ -n "$EXTRA" ]; then
        "$VENV/bin/pip" install -q -e "$ROOT[$EXTRA]"
    else
        "$VENV/bin/pip" install -q -e "$ROOT"
    fi
    echo "$WANT" > "$STAMP"
fi
