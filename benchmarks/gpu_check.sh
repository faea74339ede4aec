#!/usr/bin/env bash
# (This version is unrun on a GPU: its dry run passes on the CPU. The first GPU run,
# 2026-12-04, used an earlier script.)
# One call on an H100 / H200 machine (no network; python3 with torch, triton, nvcc), in at
# most CHECK_BUDGET_S seconds (default 450: the whole call stays under 8 minutes with the
# machine's start), correctness first, then the timings:
#   build   the extension from source (setup.py build_ext --inplace)
#   correctness:
#     ops_cuda     every op vs the float64 reference (tests/gpu/ops_vs_reference.py)
#     numerics     finfo.min blocks, tiny temperatures, accuracy (tests/gpu/numerics.py)
#     pytest       pytest tests -k "cuda or triton", -n <cores, at most 8> when pytest-xdist
#                  is there, --continue-on-collection-errors
#     ops_triton   ops_cuda on the Triton twins, quick (pinned launch configs, no
#                  autotuning; exit status 2: --budget-s left cases unrun)
#     distill, backward (scale + CUDA graphs), invariance (batch invariance), bigrows (>65,536
#     rows, 64-bit offsets), threshold (the cuda op's re-derived threshold vs the CPU op's,
#     tests/gpu/threshold_select.py), memcheck (compute-sanitizer on the quick ops check),
#     distributed (2 ranks: NCCL with 2 GPUs, else gloo carrying CUDA tensors)
#   timings:
#     bench        benchmarks/gpu_bench.py (copy floor, cuda / triton / torch / eager /
#                  compile / Liger, fwd and fwd+bwd, peak memory)
#     from_hidden  benchmarks/gpu_from_hidden.py (fused vs materialised vs Liger)
#     timings      benchmarks/gpu_timings.py; replay, replay_cuda  benchmarks/replay_bench.py
#                  (the triton and the cuda backend)
# Every stage runs under its own timeout, capped by what is left of the budget (while the
# correctness stages run, TIMINGS_RESERVE_S (default 90, at most a third of what is left) is
# kept for the timings; a stage
# that does not fit is skipped), and prints one line `SUM <stage> <ok|rc=N|TIMEOUT|skipped>
# <seconds>s` when it ends; the summary table repeats them at the end.
#
# Output: at most 8 files under $OUT (./gpu_check_out when unset): gpu_check.log (all of
# the console: stage tails, SUM lines, summary), pytest.log, gpu_bench.json,
# gpu_from_hidden.json, logs.tgz (every stage's full log); packed on exit, also after an
# interrupt or a timeout.
#
#   bash benchmarks/gpu_check.sh             # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run   # CPU smoke: no build (the extension built
#       here), every stage on tiny shapes with the CPU kernels / the Triton interpreter
#       (TRITON_INTERPRET=1), no sanitizer, no distributed run, timeouts doubled and a
#       900 s budget; checks this script's structure, not the kernels (4 minutes on 2 cores)
# env: CHECK_BUDGET_S; BENCH_ARGS="..." extra gpu_bench.py arguments; CUDA_VARIANTS the
#      cuda backend's knob rows (default "default;PPO_CUDA_CLUSTER=1;PPO_CUDA_CLUSTER=2;
#      PPO_CUDA_CLUSTER=1,PPO_CUDA_ROWS_PER_SM=1");
#      SKIP_TESTS=1, SKIP_SANITIZER=1, SKIP_BENCH=1 leave stages out; PYTHON (default python3).
# Liger-Kernel is not in the GPU image and the machine has no network: to compare with it,
# download its wheel first on a machine with PyPI (`echo /.whl/ >> .git/info/exclude;
# python3 -m pip download --no-deps --only-binary=:all: -d .whl liger-kernel`) and carry
# `.whl` with the call; this script installs any wheels found there.
set -u
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUTDIR="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUTDIR"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")  # stage logs, packed into logs.tgz
LOG="$OUTDIR/gpu_check.log"
exec > >(tee "$LOG") 2>&1
PY="${PYTHON:-python3}"
[ $DRY = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET="${CHECK_BUDGET_S:-450}"
declare -a SUMMARY=()
since() { echo $(( $(date +%s) - $1 )); }
left() { echo $(( BUDGET - $(since "$T0") )); }
pack() {
  tar czf "$OUTDIR/logs.tgz" -C "$WORK" . 2> /dev/null
  ls "$OUTDIR" | head -8 | tr '\n' ' '
  echo "($(ls "$OUTDIR" | wc -l) files in $OUTDIR)"
}
trap pack EXIT
stage_line() {
  SUMMARY+=("$(printf '%-12s %-9s %4ss  %s' "$1" "$2" "$3" "${4:-}")")
  echo "SUM $1 $2 $3s ${4:-}"
}
# run_stage NAME TIMEOUT CMD...: CMD under min(TIMEOUT, time left - RESERVE - 10) seconds,
# its output to $WORK/NAME.log (the tail echoed), one SUM line; skipped when under 15 s
# would be left. RESERVE: the seconds kept for the timings while the correctness stages run.
RESERVE=0
SCALE=1  # the dry run: timeouts x2 (the interpreter on 2 shared cores)
run_stage() {
  local name=$1 lim=$(( $2 * SCALE ))
  shift 2
  local r=$RESERVE
  [ "$r" -gt $(( $(left) / 3 )) ] && r=$(( $(left) / 3 ))
  local l=$(( $(left) - r - 10 ))
  if [ "$l" -lt 15 ]; then stage_line "$name" skipped 0 "time budget"; return; fi
  [ "$l" -lt "$lim" ] && lim=$l
  echo "== $name (timeout ${lim}s): $*"
  local t; t=$(date +%s)
  timeout -k 5 "$lim" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  tail -"${TAIL_LINES:-6}" "$WORK/$name.log"
  local st=ok
  [ $rc != 0 ] && st="rc=$rc"
  [ $rc = 124 ] || [ $rc = 137 ] && st=TIMEOUT
  local fails; fails=$(grep -c -E '^(CHECK [^ ]+ FAIL|CHECK FAIL|FAIL )' "$WORK/$name.log")
  stage_line "$name" "$st" "$(since "$t")" "$( [ "$fails" != 0 ] && echo "$fails FAIL lines")"
}

if [ $DRY = 1 ]; then
  export TRITON_INTERPRET=1
  SCALE=2
  BUDGET="${CHECK_BUDGET_S:-900}"
  DEV=(--device cpu)
  SMALL=(--device cpu --small)
  echo "== dry run on the CPU (TRITON_INTERPRET=1, $PY); budget ${BUDGET}s"
  "$PY" -c "import ppo_kernels as pk; print(pk.build_info())" \
    || { stage_line build FAILED 0 "no built extension here"; exit 1; }
  stage_line build skipped 0 "dry run: the extension built here"
else
  DEV=()
  SMALL=()
  export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" TORCH_CUDA_ARCH_LIST="9.0"
  export MAX_JOBS="${MAX_JOBS:-16}" PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  echo "== machine"
  nvidia-smi -L || true
  "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
  nvcc --version | tail -1
  rm -f ppo_kernels/_C*.so ppo_kernels/_cpu_*.so
  TAIL_LINES=3 run_stage build 240 "$PY" setup.py build_ext --inplace
  if [ ! -f "$WORK/build.log" ] || ! compgen -G "ppo_kernels/_C*.so" > /dev/null; then
    tail -40 "$WORK/build.log" 2> /dev/null
    exit 1
  fi
  grep -E "warning|error" "$WORK/build.log" | grep "csrc/cuda" | head -10
  "$PY" -c "import ppo_kernels as pk; print(pk.build_info())"
fi
NCPU=$(nproc 2> /dev/null || echo 2)

# ------------------------------------------------------------------ correctness
[ "${SKIP_BENCH:-0}" != 1 ] && RESERVE="${TIMINGS_RESERVE_S:-90}"
if [ $DRY = 1 ]; then
  run_stage ops_cuda 60 "$PY" tests/gpu/ops_vs_reference.py quick "${DEV[@]}"
else
  run_stage ops_cuda 50 "$PY" tests/gpu/ops_vs_reference.py
fi
TAIL_LINES=14 run_stage numerics 50 "$PY" tests/gpu/numerics.py "${SMALL[@]}" --budget-s 40
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  XD=()
  # pytest-xdist and pytest-timeout are in the GPU image (not in requirements.txt)
  if "$PY" -c "import xdist" 2> /dev/null; then XD=(-n "$(( NCPU < 8 ? NCPU : 8 ))"); fi
  if "$PY" -c "import pytest_timeout" 2> /dev/null; then XD+=(--timeout 90); fi
  if [ $DRY = 1 ]; then
    SEL=(tests/test_loss.py tests/test_loss_bad_inputs.py -k "vocab_one or device_mismatch")
  else
    SEL=(tests -k "cuda or triton")
  fi
  # the log is one of the output files; --maxfail: one call shows every failing family
  run_stage pytest 120 "$PY" -m pytest "${SEL[@]}" -q -rfE --maxfail=40 -p no:cacheprovider \
      --continue-on-collection-errors "${XD[@]}"
  cp "$WORK/pytest.log" "$OUTDIR/pytest.log" 2> /dev/null
fi
if [ $DRY = 1 ]; then
  run_stage ops_triton 90 "$PY" tests/gpu/ops_vs_reference.py quick "${DEV[@]}" \
      --prefix triton_ --budget-s 15
else
  # quick: pinned Triton configs, a line per case; --budget-s: a cold cache still reports
  run_stage ops_triton 80 "$PY" tests/gpu/ops_vs_reference.py quick --prefix triton_ \
      --budget-s 60
fi
run_stage distill 35 "$PY" tests/gpu/distill.py "${SMALL[@]}" --budget-s 28
run_stage backward 35 "$PY" tests/gpu/backward_scale_and_graphs.py "${SMALL[@]}" --budget-s 28
run_stage invariance 35 "$PY" tests/gpu/batch_invariance.py "${SMALL[@]}" --budget-s 28
run_stage bigrows 30 "$PY" tests/gpu/big_rows_64bit.py "${SMALL[@]}" --budget-s 24
run_stage threshold 30 "$PY" tests/gpu/threshold_select.py "${SMALL[@]}" --budget-s 24
if [ $DRY = 1 ]; then
  stage_line memcheck skipped 0 "dry run"
  stage_line distributed skipped 0 "dry run"
else
  if [ "${SKIP_SANITIZER:-0}" != 1 ] && command -v compute-sanitizer > /dev/null; then
    TAIL_LINES=3 run_stage memcheck 50 compute-sanitizer --tool memcheck --leak-check no \
        --error-exitcode 9 "$PY" tests/gpu/ops_vs_reference.py quick
  else
    stage_line memcheck skipped 0 "SKIP_SANITIZER or no compute-sanitizer"
  fi
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2> /dev/null || echo 0)
  BK=gloo
  [ "${NGPU:-0}" -ge 2 ] && BK=nccl
  mkdir -p "$WORK/distributed"
  run_stage distributed 60 "$PY" tests/distributed_cases.py --world 2 --device cuda \
      --backend "$BK" --out "$WORK/distributed"
fi

# ------------------------------------------------------------------ timings
RESERVE=0
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  if [ $DRY = 1 ]; then
    TAIL_LINES=8 run_stage bench 120 "$PY" benchmarks/gpu_bench.py --dry-run --no-gae \
        --backends torch,cpu,eager --json "$OUTDIR/gpu_bench.json" ${BENCH_ARGS:-}
    TAIL_LINES=8 run_stage from_hidden 60 "$PY" benchmarks/gpu_from_hidden.py --device cpu \
        --quick --json "$OUTDIR/gpu_from_hidden.json"
    run_stage timings 60 "$PY" benchmarks/gpu_timings.py "${SMALL[@]}" --budget-s 40
    stage_line replay skipped 0 "dry run"
  else
    # --budget-s: no new measurement past it, so the JSON and the table get written
    # the CUDA kernel's launch knobs beside its default (the cluster path where a row is
    # too large for the fused path's re-read to hit L2): the fused path (CLUSTER=1), two
    # blocks a row instead of four, the fused path with its rows in flight capped at one
    # per SM: a few ms a row, no result bit changes (gpu_bench.py --cuda-variants)
    TAIL_LINES=30 run_stage bench 80 "$PY" benchmarks/gpu_bench.py --budget-s 60 \
        --cuda-variants "${CUDA_VARIANTS:-default;PPO_CUDA_CLUSTER=1;PPO_CUDA_CLUSTER=2;PPO_CUDA_CLUSTER=1,PPO_CUDA_ROWS_PER_SM=1}" \
        --json "$OUTDIR/gpu_bench.json" ${BENCH_ARGS:-}
    TAIL_LINES=12 run_stage from_hidden 60 "$PY" benchmarks/gpu_from_hidden.py \
        --json "$OUTDIR/gpu_from_hidden.json"
    TAIL_LINES=10 run_stage timings 45 "$PY" benchmarks/gpu_timings.py --budget-s 35
    # replay at the loss's target shape: a given mask of 8 and a re-derived top-p against
    # the plain fused op, N 8192, V 151936, bf16
    TAIL_LINES=16 run_stage replay 40 "$PY" benchmarks/replay_bench.py --device cuda \
        --backend triton --n 8192 --v 151936 --dtype bfloat16 --reps 3 \
        --skip "plain composite,F.cross_entropy,cross-entropy loss,eager composite"
    # the cuda backend: its own threshold (the shared-memory histogram select)
    TAIL_LINES=16 run_stage replay_cuda 40 "$PY" benchmarks/replay_bench.py --device cuda \
        --backend cuda --n 8192 --v 151936 --dtype bfloat16 --reps 3 \
        --skip "plain composite,F.cross_entropy,cross-entropy loss,eager composite"
  fi
fi

echo
echo "== summary (total $(since "$T0") s of a ${BUDGET} s budget)"
printf '%s\n' "${SUMMARY[@]}"
echo
echo "-- device checks that FAILed"
cat "$WORK"/*.log 2> /dev/null | grep -E '^(CHECK [^ ]+ FAIL|CHECK FAIL|FAIL )' | cut -c1-160 \
  | head -40
grep -h "ERROR SUMMARY" "$WORK/memcheck.log" 2> /dev/null | head -1
grep -E "passed|failed" "$WORK/pytest.log" 2> /dev/null | tail -1
if [ -f "$WORK/bench.log" ]; then
  echo
  sed -n '/^ *N  *V backend/,$p' "$WORK/bench.log"
fi
