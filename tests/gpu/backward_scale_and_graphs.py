"""GPU device check of the fused loss's backward (ppo_kernels/_autograd.py): the peak memory
and time of loss.backward(), (loss / 3).backward() and grad_scale = 1/3 with (loss /
3).backward() on [8, 1024, 151936] bf16 logits (no [N, V] allocation beyond the dlogits
buffer; the scaled gradients agree to bf16 rounding), and a CUDA-graph capture and replay
of forward + (loss / 3).backward(), bitwise equal to eager, for each kernel backend.

    python tests/gpu/backward_scale_and_graphs.py [--device cpu --small] [--budget-s S]

(tests/gpu/_harness.py: the CHECK lines, the budget, the CPU dry run.)
"""

from __future__ import annotations

import sys

import torch

from _harness import check, inputs, main, maxabs, report, timed

import ppo_kernels as pk  # noqa: E402  (after _harness: the repository root on sys.path)


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
def backward_scale_and_graphs(ctx):
    """Peak memory / time of loss.backward() vs (loss/3).backward() vs grad_scale=1/3 (no
    extra [N, V] allocation); CUDA-graph capture + replay of forward+backward."""
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
        report(f"backward_scale[{name}]", "ok" if ok else "FAIL",
               f"{t_ms:.3f} ms, peak +{peak:.0f} MB ([N,V] = {nv_mb:.0f} MB)")
    e = maxabs(grads["loss/3"], grads["loss"] / 3)
    e2 = maxabs(grads["gs=1/3,(loss/3)"], grads["loss"] / 3)
    scale = float(grads["loss"].abs().max()) / 3
    report("backward_scale_grads", "ok" if max(e, e2) <= 2 ** -7 * scale else "FAIL",
           f"|grad(loss/3) - grad(loss)/3| {e:.1e}, grad_scale {e2:.1e} (bf16 ulp-level)")
    del x, grads
    if not ctx.gpu:
        report("cuda_graph", "skip", "no GPU")
        return
    torch.cuda.empty_cache()
    # capture forward + backward in a CUDA graph, replay, compare with eager
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
            report(f"cuda_graph[{be}]", "ok" if same else "FAIL",
                   "capture + replay of fwd+(loss/3).backward() " +
                   ("bitwise equal to eager" if same else
                    f"differs: loss {maxabs(static_loss, eager_loss):.1e} "
                    f"grad {maxabs(xg.grad, eager_grad):.1e}"))
        except Exception as e:
            report(f"cuda_graph[{be}]", "FAIL", f"{type(e).__name__}: {str(e)[:150]}")


CHECKS = [backward_scale_and_graphs]

if __name__ == "__main__":
    sys.exit(main(CHECKS, __doc__))
