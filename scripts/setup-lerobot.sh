#!/usr/bin/env bash
# Create the two lerobot reader environments the consumer tests run in, a no-op when this file
# is unchanged:
#   .venv-lerobot-0.4  lerobot 0.4.4 (reads LeRobot v3.0; the newest lerobot for Python 3.11)
#   .venv-lerobot-0.3  lerobot 0.3.3 (reads LeRobot v2.1; what openpi's pinned lerobot reads)
# lerobot's full dependency sets pin other torch / torchvision / torchcodec builds (several GB,
# CUDA); each environment gets lerobot with --no-deps, our CPU torch 2.13.0 wheel, and only the
# packages that lerobot.datasets imports. torchvision is not among them: PyPI's build does not
# import beside the CPU torch wheel (docs/formats.md, "Proven by lerobot").
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
want="$(sha256sum scripts/setup-lerobot.sh | cut -c1-16)"

make_env() {
  local venv="$1" lerobot="$2"; shift 2
  local stamp="$venv/.dpflow-lerobot-installed"
  [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return 0
  echo "dpflow setup: creating $venv (lerobot $lerobot)" >&2
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q "$@"
  "$venv/bin/python" -m pip install -q --no-deps "lerobot==$lerobot"
  echo "$want" > "$stamp"
}

make_env .venv-lerobot-0.4 0.4.4 "datasets>=4,<5" "huggingface-hub>=0.34.2,<0.36" "accelerate>=1.10,<2" \
  "av>=15,<16" "jsonlines>=4" "packaging>=24.2,<26" pandas pillow fsspec "draccus==0.10.0" "deepdiff>=7,<9" "termcolor>=2.4"
make_env .venv-lerobot-0.3 0.3.3 "datasets>=2.19,<=3.6.0" "huggingface-hub>=0.34.2,<0.36" "accelerate>=1.10,<2" \
  "av>=14.2,<16" "jsonlines>=4" "packaging>=24.2,<26" pandas pillow fsspec "draccus==0.10.0" "deepdiff>=7,<9" "termcolor>=2.4"
