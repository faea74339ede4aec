#!/usr/bin/env bash
# Sets up everything on a fresh machine: a virtual environment in .venv with torch 2.14.1
# (a CUDA 13.0 build that also runs on the CPU; it matches the nvcc 13.0 of the build
# machines so the CUDA kernels compile and link), the test and demo dependencies, and the
# extension built in place. Safe to run again: it rebuilds only after csrc/ or the build
# files changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
# Build notes (docs/DESIGN.md): auto-detection picks /usr/local and fails to link cudart, and a
# GPU-less build needs an explicit arch list.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-2}
# pip's editable build compiles everything from scratch each time (a few minutes here), so
# it runs only when the kernel sources or the build files changed since the last build.
stamp=.venv/.ppo_kernels_build
sources=$(find csrc -type f | LC_ALL=C sort | xargs cat setup.py pyproject.toml | sha256sum)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sources" ] && ls ppo_kernels/_C*.so > /dev/null 2>&1; then
  echo "ppo_kernels extension up to date"
else
  .venv/bin/python -m pip install -q --no-build-isolation -e .
  echo "$sources" > "$stamp"
fi
.venv/bin/python -c "import ppo_kernels as pk; print('ppo_kernels built:', pk.build_info())"
# verl for its integration tests, without its dependency tree (scripts/install_verl.sh);
# only once: it is slow to re-resolve
if ! .venv/bin/python -c "import verl" > /dev/null 2>&1; then
  bash scripts/install_verl.sh
fi
