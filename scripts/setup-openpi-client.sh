#!/usr/bin/env bash
# Create .venv-openpi-client, the robot-computer side of `dpflow serve`: the unmodified
# openpi-client package from PyPI, in a virtual environment of its own because it requires
# numpy<2 (the project runs numpy 2) and imports typing_extensions without declaring it.
# tests/core/serving/test_serve.py connects with it; examples/robot_client.py runs in it. A no-op when this
# file is unchanged since the environment was made.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
venv=.venv-openpi-client
want="$(sha256sum scripts/setup-openpi-client.sh | cut -c1-16)"
stamp="$venv/.dpflow-openpi-client-installed"
[ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && exit 0
echo "dpflow setup: creating $venv (openpi-client 0.1.2)" >&2
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q "openpi-client==0.1.2" "typing_extensions>=4"
echo "$want" > "$stamp"
