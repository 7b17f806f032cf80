#!/usr/bin/env bash
# Create .venv and install dpflow into it; a no-op when pyproject.toml is unchanged.
# torch is installed first and pinned to 2.13.0: on these machines that takes the
# CPU wheel already on disk, where an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DPFLOW_VENV:-.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  echo "dpflow setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
stamp="$VENV/.dpflow-installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "dpflow setup: installing (a few minutes the first time)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  fi
  "$VENV/bin/python" -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
