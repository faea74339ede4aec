#!/usr/bin/env bash
# Installs verl 0.9.1 for ppo_kernels.integrations.verl and tests/test_integrations_verl.py
# without verl's heavy dependency tree (vllm, wandb, datasets, peft, ...): verl itself with
# --no-deps, plus only what verl.trainer.ppo.core_algos, verl.workers.utils.losses and the
# fused-kernel modules import (ray: verl/__init__.py imports verl.protocol, which imports
# it; tensordict; omegaconf / hydra-core; codetiming). torch stays at the project's
# 2.14.1 (a constraint), nothing is built. tensordict's dependency pyvers pins
# packaging < 26. Safe to run again.
#
# Usage: scripts/install_verl.sh [all|install|check] (default all: install, then check that
# ppo_kernels' loss modes register with verl; setup.sh installs while the extension
# compiles and checks after it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WHAT=${1:-all}
case "$WHAT" in all|install|check) ;; *) echo "usage: $0 [all|install|check]" >&2; exit 2 ;; esac
if [ "$WHAT" != check ]; then
  constraint=$(mktemp)
  trap 'rm -f "$constraint"' EXIT
  echo "torch==2.14.1" > "$constraint"
  INSTALL=(bash scripts/pip_install.sh "$PY")  # (uv if setup.sh put it in .venv, else pip)
  "${INSTALL[@]}" --no-deps "verl==0.9.1"
  "${INSTALL[@]}" -c "$constraint" "ray>=2.41.0" "tensordict>=0.8.0,<=0.10.0,!=0.9.0" \
    omegaconf hydra-core codetiming
fi
[ "$WHAT" = install ] && exit 0
"$PY" - <<'PYEOF'
import torch
assert torch.__version__.split("+")[0] == "2.14.1", f"torch changed: {torch.__version__}"
import ppo_kernels.integrations.verl as pv
from verl.trainer.ppo.core_algos import get_policy_loss_fn
get_policy_loss_fn("ppo_kernels")
print("verl integration ready:", ", ".join(pv.REGISTERED_LOSS_MODES))
PYEOF
