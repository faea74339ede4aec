#!/usr/bin/env bash
# One call on an H200 machine (no network; python3 with torch 2.11+cu130, triton 3.6, nvcc
# 13.0): build the extension from source, check the CUDA kernels against the float64
# reference on small odd shapes (also under compute-sanitizer memcheck and racecheck), run
# the CUDA and Triton tests, then benchmarks/gpu_bench.py. Aimed at under 8 minutes; every
# stage has its own timeout so a hang cannot eat the lease. Logs and JSON go to $OUT when
# set (else ./out). The short table comes last.
#
#   device run:  bash benchmarks/gpu_check.sh
#   env: BENCH_ARGS="..." extra gpu_bench.py arguments; SKIP_TESTS=1, SKIP_SANITIZER=1,
#        SKIP_BENCH=1 to leave a stage out.
#   Liger-Kernel is not in the H200 image and the machine has no network: to compare with
#   it, download its wheel first on a machine with PyPI (`echo /.whl/ >> .git/info/exclude;
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl liger-kernel`) and carry
#   `.whl` with the call; this script installs any wheels found there.
set -u
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-$PWD/out}"
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
exec > >(tee "$LOG") 2>&1
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export TORCH_CUDA_ARCH_LIST="9.0"
export MAX_JOBS="${MAX_JOBS:-16}"
export PATH="$CUDA_HOME/bin:$PATH"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
T0=$(date +%s)
declare -a SUMMARY
stage() { SUMMARY+=("$(printf '%-28s %-8s %5ss  %s' "$1" "$2" "$3" "${4:-}")"); }
since() { echo $(( $(date +%s) - $1 )); }

echo "== machine"
nvidia-smi -L || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,memory.total --format=csv || true
"$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvcc --version | tail -1

echo "== build (setup.py build_ext --inplace, MAX_JOBS=$MAX_JOBS)"
t=$(date +%s)
rm -f ppo_kernels/_C*.so ppo_kernels/_cpu_*.so
if timeout 420 "$PY" setup.py build_ext --inplace > "$OUTDIR/build.log" 2>&1; then
  stage build ok "$(since $t)"
else
  stage build FAILED "$(since $t)" "see build.log"
  tail -40 "$OUTDIR/build.log"
  printf '%s\n' "${SUMMARY[@]}"
  exit 1
fi
grep -E "warning|error" "$OUTDIR/build.log" | grep "csrc/cuda" | head -20
"$PY" -c "import ppo_kernels as pk; print(pk.build_info())"

# -------------------------------------------------------------- small reference check
cat > /tmp/ppo_cuda_smoke.py <<'EOF'
"""Every CUDA op on small odd shapes vs ppo_kernels/reference.py: strided rows with an odd
row stride (misaligned 16-byte packs), Tl = T + 1, masked positions holding out-of-range
token ids, -inf logits, all four dtypes, fused and split-vocabulary paths."""
import os
import sys

import numpy as np
import torch

import ppo_kernels  # noqa: F401  (loads the ops)
from ppo_kernels import reference as R

ops = torch.ops.ppo_kernels
dev = os.environ.get("SMOKE_DEVICE", "cuda")  # "cpu": check this script on the CPU kernels
fails = []


def close(name, got, want, tol, floor=0.1):
    got = np.asarray(got.detach().double().cpu() if torch.is_tensor(got) else got, np.float64)
    want = np.asarray(want, np.float64)
    scale = max(np.abs(want).max() if want.size else 0.0, floor)  # floor: all-zero refs
    err = np.abs(got - want).max() / scale if want.size else 0.0
    if not np.isfinite(got).all() or not err <= tol:
        fails.append(f"{name}: rel err {err:.2e} (tol {tol:.0e}), finite={np.isfinite(got).all()}")


quick = len(sys.argv) > 1 and sys.argv[1] == "quick"
g = torch.Generator().manual_seed(0)
dtypes = [torch.float32, torch.bfloat16] if quick else [torch.float32, torch.bfloat16,
                                                        torch.float16, torch.float64]
splits = ["0", "1", "3"]
Vs = [7, 1003] if quick else [1, 7, 1003, 20011]
for split in splits:
    os.environ["PPO_CUDA_SPLIT"] = split
    for dt in dtypes:
        acc = torch.float64 if dt == torch.float64 else torch.float32
        tl = {torch.float32: 2e-5, torch.float64: 1e-10}.get(dt, 2e-5)
        tg = {torch.float32: 2e-5, torch.float64: 1e-10}.get(dt, 1.5e-2)
        for V in Vs:
            B, T = 3, 5
            base = torch.randn(B, T + 2, V + 1, generator=g, dtype=torch.float64) * 3
            if V > 2:
                base[0, 1, 2] = -float("inf")
            logits = base.to(dt).to(dev)[:, : T + 1, :V]  # Tl = T + 1, odd row stride
            tokens = torch.randint(0, V, (B, T), generator=g)
            mask = torch.rand(B, T, generator=g) > 0.3
            mask[1] = False  # an empty sequence
            tokens[~mask] = V + 5  # out of range where masked: must never be read
            if V > 2:
                tokens[0, 1] = 3
            tok_d, mask_d = tokens.to(dev), mask.to(dev)
            lg64 = logits.double().cpu()
            tag = f"split={split} {str(dt)[6:]} V={V}"
            # old / ref logprobs near the true ones (as in training): far-off ones make the
            # k3 gradient 1 - exp(-delta) huge, beyond float16's range
            true_lp = torch.tensor(R.token_logprobs(lg64, tokens, mask, 0.9)[0])
            old = (true_lp + 0.3 * torch.randn(B, T, generator=g)).to(acc)
            adv = torch.randn(B, T, generator=g).to(acc)
            refl = (true_lp + 0.3 * torch.randn(B, T, generator=g)).to(acc)
            isw = (torch.rand(B, T, generator=g) + 0.5).to(acc)
            # token_logprobs
            lp, ent, lse = ops.token_logprobs_fwd(logits, tok_d, mask_d, 0.7, True)
            rlp, rent = R.token_logprobs(lg64, tokens, mask, 0.7)
            close(f"logprobs {tag}", lp, rlp, tl)
            close(f"entropy {tag}", ent, rent, tl * 10)
            glp = torch.randn(B, T, generator=g).to(acc)
            gent = torch.randn(B, T, generator=g).to(acc)
            d = ops.token_logprobs_bwd(glp.to(dev), gent.to(dev), logits, tok_d, mask_d, lse,
                                       ent, 0.7)
            close(f"token_logprobs_bwd {tag}", d,
                  R.token_logprobs_grad(lg64, tokens, mask, 0.7, glp, gent), tg)
            # ppo_loss (dual clip, k3 KL, entropy bonus, IS weights), out of place and in place
            w = torch.tensor(R.agg_weights(mask, "token-mean")).to(acc)
            args = (old.to(dev), adv.to(dev), w.to(dev), refl.to(dev), isw.to(dev), 0.2, 0.28,
                    3.0, 0.1, 2, 0.01, 0.9)
            loss, ltok, lp2, ent2, dl = ops.ppo_loss_fwd(logits, tok_d, mask_d, *args, True)
            rloss, _, rdl = R.ppo_loss(lg64, tokens, old, adv, mask, refl, clip_eps_low=0.2,
                                       clip_eps_high=0.28, dual_clip_c=3.0, kl_coef=0.1,
                                       kl_estimator="k3", entropy_coef=0.01, temperature=0.9,
                                       rollout_is_weights=isw)
            close(f"ppo loss {tag}", loss, rloss, tl * 10)
            close(f"ppo dlogits {tag}", dl, rdl, tg, 1e-3)
            buf = base.to(dt).to(dev)
            view = buf[:, : T + 1, :V]
            loss_i, *_ = ops.ppo_loss_fwd_inplace(view, tok_d, mask_d, *args)
            close(f"ppo inplace loss {tag}", loss_i, rloss, tl * 10)
            close(f"ppo inplace dlogits {tag}", view, rdl, tg, 1e-3)
            close(f"ppo inplace untouched {tag}", buf[:, T + 1:], base.to(dt)[:, T + 1:].double(), 0)
            # score_rollout (no whitening in the op); float32 by the project's contract
            if dt == torch.float64:
                continue
            vals = torch.randn(B, T, generator=g).to(acc)
            sc = torch.randn(B, generator=g).to(acc)
            out = ops.score_rollout(logits, tok_d, mask_d, refl.to(dev), vals.to(dev), sc.to(dev),
                                    0.05, 0, 0.99, 0.95, 0.7)
            rs = R.score_rollout(lg64, tokens, refl, vals, sc, mask, kl_coef=0.05,
                                 kl_estimator="k1", gamma=0.99, lam=0.95, temperature=0.7,
                                 whiten_advantages=False)
            for k, got in zip(("logprobs", "kl", "rewards", "advantages", "returns"), out):
                close(f"score_rollout {k} {tag}", got, rs[k], tl * 10)
# GAE, long and short, with gaps and bootstrap values
for B, T in ((3, 1), (4, 37), (2, 9000)):
    for acc in (torch.float32, torch.float64):
        r = torch.randn(B, T, generator=g).to(acc)
        v = torch.randn(B, T, generator=g).to(acc)
        m = torch.rand(B, T, generator=g) > 0.2
        bs = torch.randn(B, generator=g).to(acc)
        a, ret = ops.gae(r.to(dev), v.to(dev), m.to(dev), bs.to(dev), 0.99, 0.95)
        ra, rr = R.gae(r, v, m, gamma=0.99, lam=0.95, bootstrap_values=bs)
        tol = 1e-4 if acc == torch.float32 else 1e-10
        close(f"gae adv {B}x{T} {acc}", a, ra, tol)
        close(f"gae returns {B}x{T} {acc}", ret, rr, tol)
if dev == "cuda":
    torch.cuda.synchronize()
print("\n".join(fails) if fails else "smoke: all checks passed")
sys.exit(1 if fails else 0)
EOF

echo "== small reference check of every CUDA op"
t=$(date +%s)
if timeout 120 "$PY" /tmp/ppo_cuda_smoke.py; then stage "cuda ops vs reference" ok "$(since $t)"
else stage "cuda ops vs reference" FAILED "$(since $t)"; fi

if [ "${SKIP_SANITIZER:-0}" != 1 ] && command -v compute-sanitizer > /dev/null; then
  echo "== compute-sanitizer memcheck (quick shapes)"
  t=$(date +%s)
  timeout 150 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 \
      "$PY" /tmp/ppo_cuda_smoke.py quick > "$OUTDIR/memcheck.log" 2>&1
  rc=$?
  tail -5 "$OUTDIR/memcheck.log"
  stage "memcheck" "$([ $rc = 0 ] && echo ok || echo "rc=$rc")" "$(since $t)" "memcheck.log"
  echo "== compute-sanitizer racecheck (quick shapes)"
  t=$(date +%s)
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 \
      "$PY" /tmp/ppo_cuda_smoke.py quick > "$OUTDIR/racecheck.log" 2>&1
  rc=$?
  tail -5 "$OUTDIR/racecheck.log"
  stage "racecheck" "$([ $rc = 0 ] && echo ok || echo "rc=$rc")" "$(since $t)" "racecheck.log"
else
  stage "sanitizer" skipped 0
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== pytest -k 'cuda or triton'"
  t=$(date +%s)
  IGN=()
  if ! "$PY" -c "import hypothesis" 2> /dev/null; then
    # hypothesis missing offline: leave out the files that import it
    for f in $(grep -l "hypothesis" tests/*.py); do IGN+=("--ignore=$f"); done
    echo "hypothesis not importable: ${IGN[*]}"
  fi
  # --maxfail instead of -x: one device call should show every failing family
  timeout 240 "$PY" -m pytest tests -k "cuda or triton" -q --maxfail=15 -p no:cacheprovider \
      "${IGN[@]}" > "$OUTDIR/pytest.log" 2>&1
  rc=$?
  tail -25 "$OUTDIR/pytest.log"
  stage "pytest cuda|triton" "$([ $rc = 0 ] && echo ok || echo "rc=$rc")" "$(since $t)" \
      "$(tail -1 "$OUTDIR/pytest.log" | cut -c1-60)"
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== benchmark"
  t=$(date +%s)
  left=$(( 460 - $(since $T0) ))
  [ $left -lt 60 ] && left=60
  timeout $(( left + 30 )) "$PY" benchmarks/gpu_bench.py --budget-s "$left" \
      --json "$OUTDIR/gpu_bench.json" ${BENCH_ARGS:-} > "$OUTDIR/bench.log" 2>&1
  rc=$?
  stage "benchmark" "$([ $rc = 0 ] && echo ok || echo "rc=$rc")" "$(since $t)" "bench.log, gpu_bench.json"
fi

echo
echo "== summary (total $(since $T0) s; logs in $OUTDIR)"
printf '%s\n' "${SUMMARY[@]}"
if [ -f "$OUTDIR/bench.log" ]; then
  echo
  sed -n '/^ *N  *V backend/,$p' "$OUTDIR/bench.log"
fi
