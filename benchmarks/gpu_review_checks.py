"""Device checks of the GPU review (shared/reviews/gpu-review.md), in its priority order,
plus batch invariance and a >65,536-row 64-bit test of the CUDA backend. Called by
benchmarks/gpu_check.sh as three stages (each its own timeout):

    python benchmarks/gpu_review_checks.py review      # C1, C4, C5, C2+C3, C6, S2/S3/S4
    python benchmarks/gpu_review_checks.py invariance  # bitwise: alone / batch / permuted
    python benchmarks/gpu_review_checks.py bigrows     # B=1, T=70000, V=32768 bf16 + grad
    python benchmarks/gpu_review_checks.py all --device cpu --small   # dry run on the CPU

Every check prints one line `CHECK <name> <ok|FAIL|info|skip> <detail>` (gpu_check.sh
collects them for its summary) and never stops the others; the exit status is 1 when any
check FAILs. `--device cpu --small` runs the same code with small shapes on the CPU
backends (cpu, torch, triton under TRITON_INTERPRET=1): a check of this script, not of the
kernels. Time budget: --budget-s (checks past it are skipped, not failed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ppo_kernels as pk  # noqa: E402
from ppo_kernels import reference as R  # noqa: E402

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


def finite(*ts):
    return all(bool(torch.isfinite(t).all()) for t in ts if t is not None)


def maxabs(a, b):
    return float((torch.as_tensor(a).double().cpu() - torch.as_tensor(b).double().cpu()).abs().max())


# ------------------------------------------------------------------ review checks

@check
def c1_finfo_min_block(ctx):
    """C1: a leading half of the vocabulary at finfo.min: loss, H, dlogits finite."""
    V = 4096 if ctx.small else 32768
    dt = torch.bfloat16
    logits, _, mask, old, adv = inputs(ctx, 2, 4, V, dt)
    logits[..., : V // 2] = torch.finfo(dt).min
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(V // 2, V, (2, 4), generator=g).to(ctx.dev)
    out = []
    for be in ctx.kern:
        x = logits.detach().clone().requires_grad_(True)
        loss, _ = pk.ppo_loss(x, tokens, old, adv, mask, entropy_coef=0.01, backend=be)
        loss.backward()
        lp, ent = pk.token_logprobs(logits, tokens, mask, return_entropy=True, backend=be)
        ok = finite(loss, x.grad, lp, ent)
        out.append(f"{be}={'finite' if ok else 'NaN/inf'}")
        report(f"c1_finfo_min[{be}]", "ok" if ok else "FAIL",
               f"loss {float(loss):.6g} H[0,0] {float(ent[0, 0]):.6g}")
    print("   " + ", ".join(out))


@check
def c4_tiny_temperature_backward(ctx):
    """C4: token_logprobs backward on the 5-logit row at T = 1e-3, 1e-10 vs torch."""
    base = torch.tensor([[[1.5410, -0.2934, -2.1788, 0.5684, -1.0845]]])
    for temp in (1e-3, 1e-10):
        for tok in range(5):
            tokens = torch.tensor([[tok]], device=ctx.dev)
            grads = {}
            for be in ["torch"] + ctx.kern:
                x = base.to(ctx.dev).clone().requires_grad_(True)
                lp, ent = pk.token_logprobs(x, tokens, temperature=temp, return_entropy=True,
                                            backend=be)
                (lp.sum() + 0.1 * ent.sum()).backward()
                grads[be] = x.grad.double().cpu()
            for be in ctx.kern:
                g, r = grads[be], grads["torch"]
                err = float(((g - r).abs() / (r.abs() + 1e-30 * (1 / temp))).max()) \
                    if finite(g) else float("inf")
                ok = finite(g) and float((g - r).abs().max()) <= 3e-6 * float(r.abs().max()) + 1e-30
                if not ok or tok == 2:
                    report(f"c4[{be} T={temp:g} tok={tok}]", "ok" if ok else "FAIL",
                           f"max rel err {err:.2e}")


@check
def c5_accuracy_vs_reference(ctx):
    """C5: fp32 [4, 64, 32000] randn*2 + confident rows: logp, H, dlogits vs reference.py."""
    B, T, V = (2, 8, 1000) if ctx.small else (4, 64, 32000)
    logits, tokens, mask, old, adv = inputs(ctx, B, T, V, torch.float32, extra_pos=False)
    logits[:, ::4].scatter_(-1, tokens[:, ::4, None], 22.0)  # confident rows: 1 - p ~ e^-20
    lg = logits.double().cpu()
    rlp, rent = R.token_logprobs(lg, tokens.cpu(), mask.cpu(), 1.0)
    _, _, rdl = R.ppo_loss(lg, tokens.cpu(), old.double().cpu(), adv.double().cpu(),
                           mask.cpu(), entropy_coef=0.01)
    backends = ctx.kern + (["cpu"] if ctx.gpu else [])
    for be in backends:
        x = logits.detach().clone().requires_grad_(True)
        if be == "cpu" and ctx.gpu:
            x = logits.detach().cpu().clone().requires_grad_(True)
            tk, mk, od, ad = tokens.cpu(), mask.cpu(), old.cpu(), adv.cpu()
        else:
            tk, mk, od, ad = tokens, mask, old, adv
        lp, ent = pk.token_logprobs(x.detach(), tk, mk, return_entropy=True, backend=be)
        loss, _ = pk.ppo_loss(x, tk, od, ad, mk, entropy_coef=0.01, backend=be)
        loss.backward()
        e_lp, e_h, e_g = maxabs(lp, rlp), maxabs(ent, rent), maxabs(x.grad, rdl)
        conf = tokens[:, ::4].cpu()
        rel_conf = float(((lp[:, ::4].double().cpu() - torch.as_tensor(rlp)[:, ::4]).abs()
                          / torch.as_tensor(rlp)[:, ::4].abs().clamp(min=1e-30)).max())
        del conf
        # device tolerance (NOTES.md): exp2f 2 ulp, log1pf/expm1f 1 ulp -> ~3e-7 abs on logp/H
        ok = e_lp < 2e-6 and e_h < 2e-5 and e_g < 2e-7 and rel_conf < 2e-5
        report(f"c5[{be}]", "ok" if ok else "FAIL",
               f"max|err| logp {e_lp:.1e} H {e_h:.1e} dlogits {e_g:.1e}; "
               f"confident logp rel {rel_conf:.1e}")
    if ctx.gpu:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests", "-k", "test_vocab_one_with_odd_unit_stride and "
                            "(cuda or triton)"], capture_output=True, text=True, timeout=120)
        last = (r.stdout.strip().splitlines() or ["?"])[-1]
        report("c5_vocab_one_odd_stride", "ok" if r.returncode == 0 else "FAIL", last[:80])


def _peak(ctx, fn):
    if not ctx.gpu:
        fn()
        return float("nan")
    ctx.sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    ctx.sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


@check
def c2_c3_backward_scale_and_graphs(ctx):
    """C2: peak memory / time of loss.backward() vs (loss/3).backward() vs grad_scale=1/3
    (no extra [N, V] allocation); C3: CUDA-graph capture + replay of forward+backward."""
    B, T, V = (2, 16, 1000) if ctx.small else (8, 1024, 151936)
    logits, tokens, mask, old, adv = inputs(ctx, B, T, V, torch.bfloat16)
    nv_mb = logits.numel() * logits.element_size() / 2**20
    x = logits.detach().requires_grad_(True)
    del logits
    variants = [("loss", 1.0, 1.0), ("loss/3", 1.0, 1 / 3), ("gs=1/3,(loss/3)", 1 / 3, 1 / 3)]
    grads = {}
    for name, gs, div in variants:
        def step():
            x.grad = None
            loss, _ = pk.ppo_loss(x, tokens, old, adv, mask, grad_scale=gs, backend=ctx.kern[0])
            (loss * div).backward()
        step()
        t_ms = timed(ctx, step, reps=3, warmup=1)
        x.grad = None
        peak = _peak(ctx, step)
        grads[name] = x.grad[:, :4].float().cpu()
        # fwd+bwd needs the dlogits buffer (one [N, V]); anything above ~1.1x of it is extra
        ok = not ctx.gpu or peak < 1.1 * nv_mb + 64
        report(f"c2[{name}]", "ok" if ok else "FAIL",
               f"{t_ms:.3f} ms, peak +{peak:.0f} MB ([N,V] = {nv_mb:.0f} MB)")
    e = maxabs(grads["loss/3"], grads["loss"] / 3)
    e2 = maxabs(grads["gs=1/3,(loss/3)"], grads["loss"] / 3)
    scale = float(grads["loss"].abs().max()) / 3
    report("c2_scaled_grads", "ok" if max(e, e2) <= 2 ** -7 * scale else "FAIL",
           f"|grad(loss/3) - grad(loss)/3| {e:.1e}, grad_scale {e2:.1e} (bf16 ulp-level)")
    del x, grads
    if not ctx.gpu:
        report("c3_cuda_graph", "skip", "no GPU")
        return
    torch.cuda.empty_cache()
    # C3: capture forward + backward in a CUDA graph, replay, compare with eager
    Bg, Tg, Vg = 2, 64, 32000
    lg, tk, mk, od, ad = inputs(ctx, Bg, Tg, Vg, torch.bfloat16, seed=3)
    xg = lg.detach().requires_grad_(True)

    def fb():
        xg.grad = None
        loss, _ = pk.ppo_loss(xg, tk, od, ad, mk, entropy_coef=0.01, backend="cuda")
        loss.backward()
        return loss
    for be in ctx.kern:
        try:
            def fb_be(be=be):
                xg.grad = None
                loss, _ = pk.ppo_loss(xg, tk, od, ad, mk, entropy_coef=0.01, backend=be)
                (loss / 3).backward()
                return loss
            eager_loss = fb_be().detach().clone()
            eager_grad = xg.grad.detach().clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    fb_be()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            xg.grad = None
            with torch.cuda.graph(g):
                static_loss = fb_be()
            g.replay()
            torch.cuda.synchronize()
            same = bool(torch.equal(static_loss, eager_loss)) and bool(torch.equal(xg.grad, eager_grad))
            report(f"c3_cuda_graph[{be}]", "ok" if same else "FAIL",
                   "capture + replay of fwd+(loss/3).backward() " +
                   ("bitwise equal to eager" if same else
                    f"differs: loss {maxabs(static_loss, eager_loss):.1e} "
                    f"grad {maxabs(xg.grad, eager_grad):.1e}"))
        except Exception as e:
            report(f"c3_cuda_graph[{be}]", "FAIL", f"{type(e).__name__}: {str(e)[:150]}")


@check
def c6_view_vs_raw(ctx):
    """C6: fwd+bwd of full[:, :-1] (odd V: 7/8 rows off the 16-byte phase) vs full vs V+7."""
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
    report("c6_view_vs_raw", "info", "; ".join(rows))


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
def s2_s3_s4_timing(ctx):
    """S2: PPO_CUDA_THREADS 512/256; S3: N in 132/133/200/264 at V=151936; S4: Triton first
    call small then large."""
    if not ctx.gpu:
        ms = _time_loss(ctx, 64, 1000, be=ctx.kern[0], reps=2)
        report("s2_s3_s4", "info", f"dry run: {ms:.1f} ms")
        return
    for V in (32000, 151936):
        parts = []
        for thr in ("", "512", "256"):
            env = {"PPO_CUDA_THREADS": thr} if thr else {}
            ms = _time_loss(ctx, 8192, V, env=env, reps=3)
            parts.append(f"{thr or 'default'} {ms:.3f}")
            torch.cuda.empty_cache()
        report(f"s2_threads[V={V}]", "info", "fwd+bwd ms: " + ", ".join(parts))
    parts = []
    for N in (132, 133, 200, 264):
        parts.append(f"N={N} {_time_loss(ctx, N, 151936, reps=5):.3f}")
    report("s3_wave_quantization", "info", "fwd+bwd ms at V=151936: " + ", ".join(parts))
    # S4: in a fresh process (autotune caches are per process): small first, then large
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
        report(f"s4_triton_first_call[{'->'.join(order)}]", "info" if r.returncode == 0 else "FAIL",
               (r.stdout.strip() or r.stderr.strip().splitlines()[-1:] or ["?"])[-1][:120])


# ------------------------------------------------------------------ batch invariance

@check
def batch_invariance(ctx):
    """A row's logp, H, loss_tok and dlogits: bitwise the same alone (own [1, 2, V] tensor),
    inside a batch of many rows and in a permuted batch; CUDA with the split path forced,
    never and auto; Triton."""
    nrows = 64 if ctx.small else 4096
    cases = [(torch.bfloat16, 32000), (torch.float32, 32000), (torch.bfloat16, 50257)]
    if ctx.small:
        cases = [(torch.bfloat16, 1000), (torch.float32, 257)]
    g = torch.Generator().manual_seed(5)
    for dt, V in cases:
        n = nrows if V % 8 == 0 else nrows // 8
        x = (torch.randn(1, n + 1, V, generator=g) * 2).to(dt).to(ctx.dev)
        tok = torch.randint(0, V, (1, n), generator=g).to(ctx.dev)
        acc = torch.float32
        old = (torch.randn(1, n, generator=g) * 0.1 - 9).to(acc).to(ctx.dev)
        adv = torch.randn(1, n, generator=g).to(acc).to(ctx.dev)
        ref = (torch.randn(1, n, generator=g) * 0.1 - 9).to(acc).to(ctx.dev)
        w = torch.ones(1, n, dtype=acc, device=ctx.dev)  # same normaliser for every layout
        mask = torch.ones(1, n, dtype=torch.bool, device=ctx.dev)
        pick = [0, 1, n // 2, n - 1]
        perm = torch.randperm(n, generator=g).to(ctx.dev)

        def run(be, xx, tk, o, a, r, ww, mm):
            op = ctx.op(be, "ppo_loss_fwd")
            # schema: ..., rollout_is_weights, entropy_weights, clip.., grad_scale,
            # policy_loss, sapo_tau_pos, sapo_tau_neg, kl_bias_correction, compute_grad
            _, ltok, lp, ent, dl = op(xx, tk, mm, o, a, ww, r, None, None, 0.2, 0.28, 3.0, 0.05,
                                      2, 0.01, 0.9, 1.0, 0, 1.0, 1.05, False, True)
            return lp, ent, ltok, dl

        envs = [("auto", None), ("split=1", "1"), ("split=2", "2")] if ctx.gpu else [("", None)]
        for be in ctx.kern:
            for ename, sv in (envs if be in ("cuda",) else [("", None)]):
                if sv is None:
                    os.environ.pop("PPO_CUDA_SPLIT", None)
                else:
                    os.environ["PPO_CUDA_SPLIT"] = sv
                try:
                    full = run(be, x, tok, old, adv, ref, w, mask)
                    inv = torch.argsort(perm)
                    xp = torch.cat([x[:, :n][:, perm], x[:, n:]], 1)
                    permd = run(be, xp, tok[:, perm], old[:, perm], adv[:, perm], ref[:, perm],
                                w, mask)
                    bad = []
                    for k, name in enumerate(("logp", "H", "loss_tok")):
                        if not torch.equal(permd[k][:, inv], full[k]):
                            bad.append(f"permuted {name}")
                    if not torch.equal(permd[3][:, :n][:, inv], full[3][:, :n]):
                        bad.append("permuted dlogits")
                    for i in pick:
                        sl = slice(i, i + 1)
                        alone = run(be, x[:, i:i + 2].clone(), tok[:, sl], old[:, sl], adv[:, sl],
                                    ref[:, sl], w[:, sl], mask[:, sl])
                        for k, name in enumerate(("logp", "H", "loss_tok")):
                            if not torch.equal(alone[k], full[k][:, sl]):
                                bad.append(f"row {i} alone {name}")
                        if not torch.equal(alone[3][:, :1], full[3][:, sl]):
                            bad.append(f"row {i} alone dlogits")
                finally:
                    os.environ.pop("PPO_CUDA_SPLIT", None)
                label = f"invariance[{be}{',' + ename if ename else ''} {str(dt)[6:]} V={V}]"
                report(label, "ok" if not bad else "FAIL",
                       f"{n} rows" + ("" if not bad else ": " + ", ".join(bad[:4])))
        # the CUDA split and fused paths against each other (same bits by design)
        if ctx.gpu:
            res = {}
            for sv in ("1", "2"):
                os.environ["PPO_CUDA_SPLIT"] = sv
                res[sv] = run("cuda", x, tok, old, adv, ref, w, mask)
            os.environ.pop("PPO_CUDA_SPLIT", None)
            same = all(torch.equal(a, b) for a, b in zip(res["1"], res["2"]))
            report(f"invariance[cuda fused==split {str(dt)[6:]} V={V}]", "ok" if same else "FAIL",
                   "" if same else "fused and split paths differ")
        del x


# ------------------------------------------------------------------ 64-bit offsets

@check
def big_rows_64bit(ctx):
    """More than 65,536 rows and > 2^31 elements: B=1, T=70000, V=32768 bf16 with a gradient,
    auto and PPO_CUDA_SPLIT=4; first and last 4 rows vs torch in float64."""
    B, T, V = (1, 300, 256) if ctx.small else (1, 70000, 32768)
    g = torch.Generator(device=ctx.dev).manual_seed(9)
    x = torch.randn(B, T + 1, V, device=ctx.dev, dtype=torch.bfloat16, generator=g)
    tok = torch.randint(0, V, (B, T), device=ctx.dev, generator=g)
    old = torch.full((B, T), -10.0, device=ctx.dev)
    adv = torch.randn(B, T, device=ctx.dev, generator=g)
    w = torch.full((B, T), 1.0 / T, device=ctx.dev)
    mask = torch.ones(B, T, dtype=torch.bool, device=ctx.dev)
    rows = list(range(4)) + list(range(T - 4, T))
    sub = x[:, rows].double().cpu()
    tk = tok[:, rows].cpu()
    rlp, rent = R.token_logprobs(sub, tk, None, 1.0)
    wd = torch.full((1, len(rows)), 1.0 / T, dtype=torch.float64)
    for sv in ("0", "4"):
        os.environ["PPO_CUDA_SPLIT"] = sv
        try:
            op = ctx.op(ctx.kern[0], "ppo_loss_fwd")
            _, ltok, lp, ent, dl = op(x, tok, mask, old, adv, w, None, None, None, 0.2, 0.2, 0.0,
                                      0.0, 2, 0.0, 1.0, 1.0, 0, 1.0, 1.05, False, True)
            e_lp = maxabs(lp[:, rows], rlp)
            e_h = maxabs(ent[:, rows], rent)
            # the reference gradient of those rows (weights 1/T as in the op)
            _, _, rdl = R.ppo_loss(sub, tk, old[:, rows].double().cpu(), adv[:, rows].double().cpu(),
                                   None, clip_eps_low=0.2, clip_eps_high=0.2,
                                   loss_agg_mode="seq-mean-token-sum")
            rdl = torch.as_tensor(rdl) / T
            e_g = maxabs(dl[:, rows].float(), rdl[:, : len(rows)])
            scale = float(rdl.abs().max())
            zero_last = bool((dl[:, T] == 0).all())
            ok = e_lp < 1e-5 and e_h < 1e-4 and e_g <= 1e-2 * scale + 1e-12 and zero_last
            report(f"bigrows[split={sv}]", "ok" if ok else "FAIL",
                   f"{B}x{T}x{V}: logp {e_lp:.1e} H {e_h:.1e} dlogits {e_g:.1e} (max {scale:.1e})"
                   f", row Tl-1 zero: {zero_last}")
            del dl
        finally:
            os.environ.pop("PPO_CUDA_SPLIT", None)
        if ctx.gpu:
            torch.cuda.empty_cache()


STAGES = {
    "review": [c1_finfo_min_block, c4_tiny_temperature_backward, c5_accuracy_vs_reference,
               c2_c3_backward_scale_and_graphs, c6_view_vs_raw, s2_s3_s4_timing],
    "invariance": [batch_invariance],
    "bigrows": [big_rows_64bit],
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=list(STAGES) + ["all"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="small shapes (CPU dry run)")
    ap.add_argument("--budget-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --small for a dry run", file=sys.stderr)
        return 2
    ctx = Ctx(args)
    for st in (list(STAGES) if args.stage == "all" else [args.stage]):
        for fn in STAGES[st]:
            fn(ctx)
    fails = [r for r in RESULTS if r[1] == "FAIL"]
    print(f"{len(RESULTS)} checks, {len(fails)} FAIL", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
