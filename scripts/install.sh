#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv: CPU torch first, then the project
# with its test extras. Safe to run again; prints what it does.
set -euo pipefail  # pipefail: a failed pip fails the script even through the warning filter
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "install: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    # torch first, pinned: a plain 'torch' requirement would pull a multi-GB CUDA build
    echo "install: torch==2.13.0 (CPU wheel)"
    "${PIP[@]}" install "torch==2.13.0" 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
echo "install: p2p-diloco and its dependencies"
"${PIP[@]}" install -e ".[test]" 2>&1 | { grep -v "^WARNING: Location" || true; }
.venv/bin/python -c "import torch, hivemind, multiaddr, msgpack, uvloop, p2p_diloco; print('install: ok (torch', torch.__version__ + ', hivemind', hivemind.__version__ + ')')"
