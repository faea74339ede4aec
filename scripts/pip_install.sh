#!/usr/bin/env bash
# pip_install.sh PYTHON ARGS...: `pip install -q ARGS` into the environment of PYTHON, with
# the uv that scripts/setup.sh puts in .venv where it is there (it unpacks torch and its CUDA
# libraries in parallel and links them from its cache: ~35 s cold for what pip takes 2-2.5
# min over, about a second for a second environment with the same torch), else with that
# environment's pip. The one installer choice of setup.sh, install_verl.sh and
# check_install.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY=$1
shift
if [ -x "$ROOT/.venv/bin/uv" ]; then
  exec "$ROOT/.venv/bin/uv" pip install -q --python "$PY" "$@"
fi
exec "$PY" -m pip install -q "$@"
