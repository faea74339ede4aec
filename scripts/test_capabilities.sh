#!/usr/bin/env bash
# The tests whose results depend on the CPU's SIMD level, again under the lower
# capabilities this machine can force (ATen and the CPU kernels both follow
# ATEN_CPU_CAPABILITY): what `make test` checks on an AVX2 or a plain x86-64 CPU. A
# capability equal to this processor's own is skipped: `make test` ran the same code.
#
# Not the torch.compile tests: inductor's C++ code generation under a forced lower
# capability is torch's own (torch 2.14 fails its bounds check in a vectorised tail under
# avx2 and does not compile under default), and our kernels are not in it.
#
# The capabilities run side by side, one pytest-xdist worker each (one process per core on
# 2 cores, and half the start-ups of two runs one after the other), each one's log printed
# when it ends. They share one xdist run id, so that the multi-process tests of both take
# turns on the cores (tests/helpers/ranks.py, exclusive_cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TESTS=(tests/test_golden.py tests/test_reference.py tests/test_loss.py
       tests/test_loss_precision.py tests/test_loss_token_logprobs.py tests/test_seed_sheet.py
       tests/test_batch_invariance.py tests/test_distill.py tests/test_distill_tp.py
       tests/test_cpu_stream_stores.py)
native=$("$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())")
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
uid="capabilities-$$"
caps=()
pids=()
for cap in avx2 default; do
  if [ "$cap" = "$native" ]; then
    echo "== ATEN_CPU_CAPABILITY=$cap: this processor's own, run by make test"
    continue
  fi
  ATEN_CPU_CAPABILITY=$cap "$PY" -m pytest -q -n 1 --dist loadgroup --testrunuid "$uid" \
    -p no:cacheprovider -k "not triton and not compile" "${TESTS[@]}" > "$logs/$cap.log" 2>&1 &
  caps+=("$cap")
  pids+=("$!")
done
failed=()
for i in "${!caps[@]}"; do
  wait "${pids[$i]}" || failed+=("${caps[$i]}")
  echo "== ATEN_CPU_CAPABILITY=${caps[$i]}"
  cat "$logs/${caps[$i]}.log"
done
[ ${#failed[@]} = 0 ] || { echo "== failed under: ${failed[*]}" >&2; exit 1; }
