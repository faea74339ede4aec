#!/usr/bin/env bash
# Sets up everything on a fresh machine: a virtual environment in .venv with torch 2.14.1
# (a CUDA 13.0 build that also runs on the CPU; it matches the nvcc 13.0 of the build
# machines so the CUDA kernels compile and link), the test and demo dependencies, and the
# extension built in place. Safe to run again: it only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
# Build notes (DESIGN.md): auto-detection picks /usr/local and fails to link cudart, and a
# GPU-less build needs an explicit arch list.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-2}
.venv/bin/python -m pip install -q --no-build-isolation -e .
.venv/bin/python -c "import ppo_kernels as pk; print('ppo_kernels built:', pk.build_info())"
