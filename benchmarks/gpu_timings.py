"""GPU timings of the fused loss (info lines, not correctness checks; the checks are in
tests/gpu/), run by benchmarks/gpu_check.sh as one stage:

- kernel_launches: the kernels one small call launches on the device, per backend and
  option set (the fixed cost of a small call);
- view_vs_raw: forward + backward of logits[:, :-1] (odd V: most rows off the 16-byte
  phase) against the raw [B, T + 1, V] tensor and against V + 7;
- launch_timings: threads per block, wave quantization over the row count, and Triton's
  first call (autotuning) in a fresh process.

    python benchmarks/gpu_timings.py [--device cpu --small] [--budget-s S]

Lines `CHECK <name> <info|FAIL|skip> <detail>` (the harness of tests/gpu/_harness.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "gpu"))
from _harness import check, inputs, main, report, timed  # noqa: E402

import ppo_kernels as pk  # noqa: E402  (after _harness: the repository root on sys.path)


@check
def kernel_launches(ctx):
    """Kernels (and memsets / copies) one ppo_loss forward and its backward launch on the
    device, after a warm-up call (torch.profiler's CUDA events), B 2, T 8, V 64, per kernel
    backend and option set; the metrics are not read (they launch when first read). The
    goal: 8 forward and 3 backward (GSPO 20 in all); tests/test_launch_counts.py counts the
    same path on the CPU under the Triton interpreter (6 and 3, GSPO 13 and 3). The dry run
    counts the CPU profiler's aten events instead (a smoke test of this check)."""
    from torch.profiler import ProfilerActivity, profile

    full, tokens, mask, old, adv = inputs(ctx, 2, 8, 64, torch.float32)
    opts = {"default": {}, "kl-k3": dict(ref_logprobs=old + 0.05, kl_coef=0.1),
            "entropy": dict(entropy_coef=0.01),
            "tis": dict(rollout_logprobs=old + 0.05, rollout_correction="tis"),
            "gspo": dict(policy_loss="gspo")}
    act = [ProfilerActivity.CUDA] if ctx.gpu else [ProfilerActivity.CPU]

    def launches(fn):
        with profile(activities=act) as p:
            fn()
            ctx.sync()
        if ctx.gpu:
            return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in p.events())
        return sum(e.name.startswith("aten::") for e in p.events())

    for be in ctx.kern:
        parts = []
        for name, kw in opts.items():
            x = full.detach().requires_grad_()
            loss, _ = pk.ppo_loss(x, tokens, old, adv, mask, backend=be, **kw)
            loss.backward()  # (warm-up: autotuning, caches)
            x.grad = None
            out = []
            n_fwd = launches(lambda: out.append(
                pk.ppo_loss(x, tokens, old, adv, mask, backend=be, **kw)[0]))
            n_bwd = launches(lambda: out[0].backward())
            parts.append(f"{name} {n_fwd} + {n_bwd}")
        report(f"kernel_launches[{be}]", "info",
               ("fwd + bwd: " if ctx.gpu else "dry run, CPU aten events: ") + ", ".join(parts))


@check
def view_vs_raw(ctx):
    """fwd+bwd time of full[:, :-1] (odd V: 7/8 rows off the 16-byte phase) vs full vs V+7."""
    B, T = (2, 32) if ctx.small else (8, 1024)
    rows = []
    for V, view in ((50257, True), (50257, False), (50264, False)):
        if ctx.small:
            V = V // 50
        full, tokens, mask, old, adv = inputs(ctx, B, T, V, torch.bfloat16)
        x = (full[:, :-1] if view else full).detach()
        for be in ctx.kern[:1]:
            xx = x.requires_grad_(True) if not view else full.detach().requires_grad_(True)

            def step(xx=xx):
                xx.grad = None
                inp = xx[:, :-1] if view else xx
                loss, _ = pk.ppo_loss(inp, tokens, old, adv, mask, backend=be)
                loss.backward()
            ms = timed(ctx, step, reps=5)
            rows.append(f"V={V}{' view' if view else ' raw'} {ms:.3f} ms")
        del full, x
    report("view_vs_raw", "info", "; ".join(rows))


def _time_loss(ctx, N, V, be="cuda", env=None, grad=True, reps=5):
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        T = min(N, 1024)
        B = max(1, N // T)
        logits, tokens, mask, old, adv = inputs(ctx, B, T, V, torch.bfloat16)
        x = logits.detach().requires_grad_(grad)

        def step():
            x.grad = None
            loss, _ = pk.ppo_loss(x, tokens, old, adv, mask, backend=be)
            if grad:
                loss.backward()
        with torch.set_grad_enabled(grad):
            return timed(ctx, step, reps=reps)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@check
def launch_timings(ctx):
    """Threads per block (PPO_CUDA_THREADS default / 512 / 256, at V = 32000 and 151936);
    wave quantization (N in 132, 133, 200, 264 at V = 151936); Triton's first call
    (autotuning) small then large, in a fresh process."""
    if not ctx.gpu:
        ms = _time_loss(ctx, 64, 1000, be=ctx.kern[0], reps=2)
        report("launch_timings", "info", f"dry run: {ms:.1f} ms")
        return
    for V in (32000, 151936):
        parts = []
        for thr in ("", "512", "256"):
            env = {"PPO_CUDA_THREADS": thr} if thr else {}
            ms = _time_loss(ctx, 8192, V, env=env, reps=3)
            parts.append(f"{thr or 'default'} {ms:.3f}")
            torch.cuda.empty_cache()
        report(f"threads_per_block[V={V}]", "info", "fwd+bwd ms: " + ", ".join(parts))
    parts = []
    for N in (132, 133, 200, 264):
        parts.append(f"N={N} {_time_loss(ctx, N, 151936, reps=5):.3f}")
    report("wave_quantization", "info", "fwd+bwd ms at V=151936: " + ", ".join(parts))
    # Triton's first call in a fresh process (autotune caches are per process): small
    # first, then large
    code = ("import sys, time, torch; sys.path.insert(0, '.'); import ppo_kernels as pk\n"
            "def run(N):\n"
            "    T = min(N, 1024); B = max(1, N // T)\n"
            "    x = torch.randn(B, T + 1, 32000, device='cuda', dtype=torch.bfloat16)\n"
            "    tk = torch.randint(0, 32000, (B, T), device='cuda')\n"
            "    o = torch.zeros(B, T, device='cuda'); a = torch.randn(B, T, device='cuda')\n"
            "    f = lambda: pk.ppo_loss(x, tk, o, a, backend='triton')[0]\n"
            "    f(); torch.cuda.synchronize(); t = time.perf_counter()\n"
            "    for _ in range(5): f()\n"
            "    torch.cuda.synchronize(); return (time.perf_counter() - t) / 5 * 1e3\n"
            "order = [int(s) for s in sys.argv[1:]]\n"
            "print(' '.join(f'N={n}:{run(n):.3f}ms' for n in order))\n")
    for order in (["8", "16384"], ["16384"]):
        r = subprocess.run([sys.executable, "-c", code, *order], capture_output=True, text=True,
                           timeout=150)
        report(f"triton_first_call[{'->'.join(order)}]", "info" if r.returncode == 0 else "FAIL",
               (r.stdout.strip() or r.stderr.strip().splitlines()[-1:] or ["?"])[-1][:120])


CHECKS = [kernel_launches, view_vs_raw, launch_timings]

if __name__ == "__main__":
    sys.exit(main(CHECKS, __doc__))
