#!/usr/bin/env bash
# The whole test suite: set up, then pytest (arguments are passed on).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/setup-lerobot.sh
exec .venv/bin/python -m pytest "$@"
