"""GPU device check of more than 65,536 rows and 64-bit offsets: B = 1, T = 70000,
V = 32768 bf16 logits (2.3e9 elements, past 2^31) with a gradient, the vocabulary split
left to the row count and forced (PPO_CUDA_SPLIT=4): logp, entropy and dlogits of the
first and last 4 rows against the float64 reference, and a zero gradient on the ignored
last position.

    python tests/gpu/big_rows_64bit.py [--device cpu --small] [--budget-s S]

(tests/gpu/_harness.py: the CHECK lines, the budget, the CPU dry run.)
"""

from __future__ import annotations

import os
import sys

import torch

from _harness import check, main, maxabs, report, slot_args

from ppo_kernels import reference as R  # noqa: E402  (after _harness: the root on sys.path)


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
            _, ltok, lp, ent, dl = op(x, tok, mask, old, adv, w, None, None, None,
                                      *slot_args(0.2, 0.2, 0.0, 0.0, 2, 0.0, 1.0, 1.0, 0, 1.0,
                                                 1.05, False), True)
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


CHECKS = [big_rows_64bit]

if __name__ == "__main__":
    sys.exit(main(CHECKS, __doc__))
