"""The harness of the GPU device checks in tests/gpu/ (numerics.py,
backward_scale_and_graphs.py, batch_invariance.py, big_rows_64bit.py) and of
benchmarks/gpu_timings.py, each a script that benchmarks/gpu_check.sh runs as one stage:

    python tests/gpu/<check>.py [--device cpu --small] [--budget-s S]

Every check prints one line `CHECK <name> <ok|FAIL|info|skip> <detail>` (gpu_check.sh
collects them for its summary) and never stops the others; the exit status is 1 when any
check FAILs. `--device cpu --small` runs the same code with small shapes on the CPU
backends (cpu, torch, triton under TRITON_INTERPRET=1): a check of the scripts, not of the
kernels. Time budget: --budget-s (checks past it are skipped, not failed). Not collected by
pytest (no test_*.py here): the CUDA-parametrised tests of the suite are the pytest side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, ROOT)
from ppo_kernels.spec import FLOAT_SLOTS, INT_SLOTS  # noqa: E402

ops = torch.ops.ppo_kernels
RESULTS = []


def report(name, status, detail=""):
    RESULTS.append((name, status, detail))
    print(f"CHECK {name} {status} {detail}", flush=True)


class Ctx:
    def __init__(self, args):
        self.dev = torch.device(args.device)
        self.small = args.small
        self.gpu = self.dev.type == "cuda"
        self.deadline = time.time() + args.budget_s
        # kernel backends under test: on the CPU dry run the CPU kernels stand in for cuda
        self.kern = ["cuda", "triton"] if self.gpu else ["cpu", "triton"]
        self.prefix = {"cuda": "", "cpu": "", "triton": "triton_"}
        # ctx.op("triton", ...) needs the triton_* ops registered (pk.ppo_loss registers
        # them on its first Triton call; a check may call the ops first)
        try:
            import ppo_kernels.triton_kernels.library  # noqa: F401
        except Exception:  # no triton: the Triton checks FAIL one by one
            pass

    def op(self, backend, name):
        return getattr(ops, self.prefix[backend] + name)

    def sync(self):
        if self.gpu:
            torch.cuda.synchronize()


def check(fn):
    """Runs one check; an exception is a FAIL of that check only; past the budget: skip."""
    def run(ctx):
        if time.time() > ctx.deadline:
            report(fn.__name__, "skip", "time budget")
            return
        t = time.time()
        try:
            fn(ctx)
        except Exception as e:  # report and go on
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            report(fn.__name__, "FAIL", f"{type(e).__name__}: {msg}")
        print(f"   ({fn.__name__}: {time.time() - t:.1f} s)", flush=True)
    run.__name__ = fn.__name__
    return run


def timed(ctx, fn, reps=5, warmup=2):
    """Median ms of fn() (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    ctx.sync()
    ts = []
    for _ in range(reps):
        if ctx.gpu:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def inputs(ctx, B, T, V, dtype, seed=0, scale=2.0, extra_pos=True):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T + (1 if extra_pos else 0), V, generator=g) * scale).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.1
    z = logits[:, :T].double()
    lp = torch.log_softmax(z, -1).gather(-1, tokens[..., None])[..., 0].float()
    old = lp + 0.05 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    d = ctx.dev
    return logits.to(d), tokens.to(d), mask.to(d), old.to(d), adv.to(d)


# The CUDA ops' path knobs (csrc/cuda/row_kernels.cuh, plan_rows).
CUDA_PATH_KNOBS = ("PPO_CUDA_SPLIT", "PPO_CUDA_CLUSTER")


def set_cuda_path(env):
    """Sets the path knobs of `env` ({}: every knob back to auto)."""
    for k in CUDA_PATH_KNOBS:
        if k in env:
            os.environ[k] = env[k]
        else:
            os.environ.pop(k, None)


def finite(*ts):
    return all(bool(torch.isfinite(t).all()) for t in ts if t is not None)


def maxabs(a, b):
    return float((torch.as_tensor(a).double().cpu() - torch.as_tensor(b).double().cpu()).abs().max())


def slot_args(eps_low, eps_high, dual, kl_coef, kl_est, ent_coef, temp, grad_scale,
              policy_loss, tau_pos, tau_neg, kl_bias):
    """(scalars, codes) of the ppo_loss ops by slot name (ppo_kernels/spec.py), from the
    options in this order: clip_eps_low, clip_eps_high, dual_clip_c (0: none), kl_coef,
    kl_estimator (code), entropy_coef, temperature, grad_scale, policy_loss (code),
    sapo_tau_pos, sapo_tau_neg, kl_bias_correction."""
    f = dict(clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip_c=dual, kl_coef=kl_coef,
             entropy_coef=ent_coef, temperature=temp, grad_scale=grad_scale,
             sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
    i = dict(policy_loss=policy_loss, kl_estimator=kl_est, kl_bias_correction=int(kl_bias))
    return [float(f[n]) for n in FLOAT_SLOTS], [int(i[n]) for n in INT_SLOTS]


def main(checks, doc, argv=None):
    """Runs ``checks`` (functions decorated with @check) with the command line's device,
    shapes and time budget; returns the exit status."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="small shapes (CPU dry run)")
    ap.add_argument("--budget-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --small for a dry run", file=sys.stderr)
        return 2
    ctx = Ctx(args)
    for fn in checks:
        fn(ctx)
    fails = [r for r in RESULTS if r[1] == "FAIL"]
    print(f"{len(RESULTS)} checks, {len(fails)} FAIL", flush=True)
    return 1 if fails else 0
