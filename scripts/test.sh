#!/usr/bin/env bash
# The whole test suite: system packages and .venv set up, then pytest in 2 worker processes
# (pytest-xdist, one test module per worker at a time, the longest modules first: tests/conftest.py
# SLOW_MODULES_FIRST); arguments are passed on (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/system-packages.sh
scripts/setup.sh
scripts/setup-lerobot.sh
scripts/setup-openpi-client.sh
exec .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
