#!/usr/bin/env bash
# The main job on the embedded default: set up, then `dpflow demo` (arguments are passed on).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/dpflow demo "$@"
