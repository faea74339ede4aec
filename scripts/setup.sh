#!/usr/bin/env bash
# Sets up everything for working on the project on a fresh machine: a virtual environment
# in .venv with torch 2.14.1 (a CUDA 13.0 build that also runs on the CPU; it matches the
# nvcc 13.0 of the build machines so the CUDA kernels compile and link), the test and demo
# dependencies, and the extension built in place. Safe to run again: it rebuilds only after
# csrc/ or the build files changed. (Installing into an environment of your own needs none
# of this: README, "Install into your own environment".)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
# The build needs no environment variable: setup.py finds the toolkit, the arch list and
# MAX_JOBS itself (docs/DESIGN.md, build notes). The editable build below is the one a
# developer works with; ninja keeps its objects in build/, so a rebuild compiles only what
# changed, and it runs only when the kernel sources or the build files changed.
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
# DeepSpeed for the ZeRO-3 tests of the LM head (tests/test_lm_head.py): a source package
# whose build imports torch, hence --no-build-isolation; its ops compile at first use
# (DS_BUILD_OPS=0), none of which the CPU tests use
if ! .venv/bin/python -c "import deepspeed" > /dev/null 2>&1; then
  DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-build-isolation deepspeed==0.19.8
fi
