"""GPU device checks of pk.distill_loss (top-k distillation) on the CUDA and Triton kernels:
loss, metrics and dlogits against the numpy float64 reference at a real vocabulary
(float32 and bf16, tail on and off, sets of every size: empty, 1, k, the whole vocabulary),
the student's mass near 1 (the complement summed without cancellation), and
distill_loss_from_hidden against distill_loss on the materialised logits.

    python tests/gpu/distill.py                      # on the GPU
    TRITON_INTERPRET=1 python tests/gpu/distill.py --device cpu --small   # dry run

(tests/gpu/_harness.py: the CHECK lines, the budget, the CPU dry run.)
"""

from __future__ import annotations

import sys

import torch

from _harness import check, finite, main, maxabs, report

import ppo_kernels as pk  # noqa: E402
from ppo_kernels import reference as R  # noqa: E402


def _teacher(n, v, k, gen):
    ids, lps, off = [], [], [0]
    for i in range(n):
        kk = (0, 1, k, v)[i % 4] if v <= 4096 else (0, 1, k, k)[i % 4]
        lp = torch.log_softmax(torch.randn(v, generator=gen, dtype=torch.float64) * 2, 0)
        top = torch.topk(lp, kk).indices
        ids.append(top)
        lps.append(lp[top])
        off.append(off[-1] + kk)
    return pk.SparseLogprobs(torch.cat(ids), torch.tensor(off), torch.cat(lps).float())


def _on(te, dev):
    return pk.SparseLogprobs(*(x.to(dev) for x in te))


@check
def distill_vs_reference(ctx):
    """Every kernel backend vs the float64 reference: loss, metrics, dlogits."""
    b, t, v, k = (2, 4, 300, 8) if ctx.small else (4, 16, 151936, 64)
    gen = torch.Generator().manual_seed(0)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        logits = (torch.randn(b, t + 1, v, generator=gen) * 2).to(dt)
        te = _teacher(b * t, v, k, gen)
        for tail in (True, False):
            rl, rg, rm = R.distill_loss(logits.double(), te.offsets, te.token_ids,
                                        te.logprobs.double(), tail=tail)
            for be in ctx.kern:
                x = logits.to(ctx.dev).clone().requires_grad_(True)
                loss, m = pk.distill_loss(x, _on(te, ctx.dev), tail=tail, backend=be)
                loss.backward()
                ctx.sync()
                err_l = abs(float(loss) - rl) / max(abs(rl), 1e-30)
                err_g = maxabs(x.grad, rg) / max(float(abs(rg).max()), 1e-30)
                err_m = max(abs(float(m[key]) - val) for key, val in rm.items())
                ok = finite(x.grad) and err_l < tol and err_g < tol * 5 and err_m < tol * 10
                report(f"distill_vs_reference[{be},{dt},tail={tail}]", "ok" if ok else "FAIL",
                       f"loss rel {err_l:.2e}, dlogits rel {err_g:.2e}, metrics {err_m:.2e}")


@check
def distill_student_mass_near_one(ctx):
    """A confident student whose set holds all but ~1e-6 of its mass: the tail term."""
    v = 300 if ctx.small else 32000
    x = torch.zeros(1, 2, v)
    x[..., :3] = 12.0 + (0 if ctx.small else 2.4)
    te = pk.SparseLogprobs(torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([0, 3, 6]),
                           torch.log(torch.tensor([0.3] * 6)))
    rl, rg, _ = R.distill_loss(x.double(), te.offsets, te.token_ids, te.logprobs.double())
    for be in ctx.kern:
        xx = x.to(ctx.dev).clone().requires_grad_(True)
        loss, _ = pk.distill_loss(xx, _on(te, ctx.dev), backend=be)
        loss.backward()
        err = abs(float(loss) - rl) / rl
        err_g = maxabs(xx.grad, rg) / float(abs(rg).max())
        report(f"distill_student_mass_near_one[{be}]", "ok" if err < 1e-5 and err_g < 1e-4
               else "FAIL", f"loss rel {err:.2e}, dlogits rel {err_g:.2e}")


@check
def distill_from_hidden(ctx):
    """distill_loss_from_hidden (chunks) vs distill_loss on the materialised logits."""
    n, h, v, k = (8, 16, 300, 8) if ctx.small else (512, 1024, 32000, 32)
    gen = torch.Generator().manual_seed(2)
    hid = torch.randn(1, n, h, generator=gen).to(ctx.dev)
    w = (torch.randn(v, h, generator=gen) * h ** -0.5).to(ctx.dev)
    te = _on(_teacher(n, v, k, gen), ctx.dev)
    for be in ctx.kern:
        a = hid.clone().requires_grad_(True)
        lh, _ = pk.distill_loss_from_hidden(a, w, te, chunk_size=max(1, n // 3), backend=be)
        lh.backward()
        b_ = hid.clone().requires_grad_(True)
        ll, _ = pk.distill_loss(b_ @ w.T, te, backend=be)
        ll.backward()
        err = abs(float(lh) - float(ll)) / abs(float(ll))
        err_g = maxabs(a.grad, b_.grad) / float(b_.grad.abs().max())
        report(f"distill_from_hidden[{be}]", "ok" if err < 1e-5 and err_g < 1e-4 else "FAIL",
               f"loss rel {err:.2e}, d hidden rel {err_g:.2e}")


CHECKS = [distill_vs_reference, distill_student_mass_near_one, distill_from_hidden]

if __name__ == "__main__":
    sys.exit(main(CHECKS, __doc__))
