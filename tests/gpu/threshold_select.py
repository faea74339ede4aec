"""GPU device check of the re-derived kept sets' threshold on the cuda backend
(csrc/cuda/threshold_select.cuh: one block per row of bfloat16 / float16 logits, an exact
count histogram of the row's 16-bit values in shared memory): its threshold equals the CPU
op's (csrc/cpu/sampling.cpp) on the same rows, bit for bit, for top_k / top_p / min_p alone
and together, a temperature per row, masked rows, rows of one sign, integer logits (ties),
+0 and -0 entries (a top-k cut at 0 keeps both), flat rows whose top-p boundary lies among the negative values (the kernel's third sweep),
-inf entries, and strided rows (Tl = T + 1, odd V: every address phase of a 16-byte pack).
A top-p threshold may differ only where the target mass lies within 1e-9 of a group's
cumulative mass (the float64 sums run in another order and through another exp). And a
row's threshold is the same alone and in its batch; and threshold_kept_fwd's kept
statistics on it are the CPU op's.

    python tests/gpu/threshold_select.py [--device cpu --small] [--budget-s S]

(tests/gpu/_harness.py: the CHECK lines, the budget, the CPU dry run, which compares the
CPU op with itself: a check of this script.)
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from _harness import check, main, ops, report


def rows(kind, B, T, V, dtype, g):
    """[B, T + 1, V] logits of one family (the last position unread: strided rows)."""
    x = torch.randn(B, T + 1, V, generator=g)
    if kind == "mixed":
        x = x * 3.0
    elif kind == "positive":
        x = x * 2.0 + 20.0
    elif kind == "negative":
        x = x * 2.0 - 20.0
    elif kind == "ties":
        x = torch.randint(-3, 4, (B, T + 1, V), generator=g).float()
    elif kind == "zeros":  # +0 and -0 (two keys of one value), a top-k cut often at 0
        x = torch.randint(-1, 2, (B, T + 1, V), generator=g).float()
        x[(x == 0) & (torch.rand(B, T + 1, V, generator=g) < 0.5)] = -0.0
    elif kind == "flat":  # top-p's boundary among the negatives
        x = x * 0.05 - 0.01
    elif kind == "neginf":
        x = x * 3.0
        x[torch.rand(B, T + 1, V, generator=g) < 0.3] = float("-inf")
    return x.to(dtype)


def params(B, T, V, g):
    """Per-row top_k (V: off), top_p (1: off), min_p (0: off), each off in some rows."""
    k = torch.randint(1, max(2, min(V, 200)), (B, T), generator=g)
    k[torch.rand(B, T, generator=g) < 0.3] = V
    p = torch.rand(B, T, generator=g, dtype=torch.float64) * 0.98 + 0.01
    p[torch.rand(B, T, generator=g) < 0.2] = 1.0
    mp = torch.rand(B, T, generator=g, dtype=torch.float64) * 0.2
    mp[torch.rand(B, T, generator=g) < 0.5] = 0.0
    return k, p, mp


def near_boundary(x, inv, p, cut, ta):
    """Whether top-p's decision at ta, the lower of two thresholds of one row, is within
    float64 rounding: the mass of the survivors (x >= cut) strictly above ta within 1e-9 of
    p times their mass."""
    v = x[np.isfinite(x) | (x == -np.inf)]
    s = v[v >= cut]
    e = np.exp((s - s.max()) * inv)
    total = e.sum()
    above = e[s > ta].sum()
    return abs(above - p * total) <= 1e-9 * total


@check
def threshold_vs_cpu(ctx):
    """The device op's threshold equals the CPU op's, row by row."""
    be = ctx.kern[0]
    g = torch.Generator().manual_seed(17)
    Vs = (7, 1003) if ctx.small else (7, 1003, 32771, 151936)
    for dtype in (torch.bfloat16, torch.float16):
        for V in Vs:
            for kind in ("mixed", "positive", "negative", "ties", "zeros", "flat", "neginf"):
                B, T = (2, 3) if ctx.small else (4, 16 if V < 100000 else 4)
                x = rows(kind, B, T, V, dtype, g)
                mask = torch.rand(B, T, generator=g) > 0.1
                k, p, mp = params(B, T, V, g)
                temps = (0.5 + torch.rand(B, T, generator=g)).float()
                for rule, tt in (((k, None, None), None), ((None, p, None), None),
                                 ((None, None, mp), None), ((k, p, mp), temps)):
                    dev = [r.to(ctx.dev) if r is not None else None for r in rule]
                    got = getattr(ops, ctx.prefix[be] + "sampling_threshold")(
                        x.to(ctx.dev)[:, :T], mask.to(ctx.dev), 0.8, *dev,
                        tt.to(ctx.dev) if tt is not None else None).cpu()
                    want = ops.sampling_threshold(x[:, :T], mask, 0.8, *rule, tt)
                    bad = []
                    for i in torch.nonzero(got != want).tolist():
                        b, t = i
                        if rule[1] is None:
                            bad.append((b, t))
                            continue
                        inv = 1.0 / (float(tt[b, t]) if tt is not None else 0.8)
                        cut = float(ops.sampling_threshold(
                            x[b:b + 1, t:t + 1], mask[b:b + 1, t:t + 1], 1.0 / inv,
                            *(r[b:b + 1, t:t + 1] if r is not None else None
                              for r in (rule[0], None, rule[2])), None))
                        ta = min(float(got[b, t]), float(want[b, t]))
                        if not near_boundary(x[b, t].double().numpy(), inv, float(p[b, t]),
                                             cut, ta):
                            bad.append((b, t))
                    name = f"threshold[{be} {str(dtype)[6:]} V={V} {kind} " \
                           f"{'k' if rule[0] is not None else ''}" \
                           f"{'p' if rule[1] is not None else ''}" \
                           f"{'m' if rule[2] is not None else ''}{' temps' if tt is not None else ''}]"
                    report(name, "ok" if not bad else "FAIL",
                           "" if not bad else f"rows {bad[:4]}: got "
                           f"{[float(got[i]) for i in bad[:2]]} want {[float(want[i]) for i in bad[:2]]}")


@check
def threshold_alone_and_in_batch(ctx):
    """A row's threshold: the same bits alone (its own contiguous [1, 1, V]) and in its
    strided batch."""
    be = ctx.kern[0]
    g = torch.Generator().manual_seed(23)
    V = 1001 if ctx.small else 151936
    n = 4 if ctx.small else 64
    x = rows("mixed", 1, n, V, torch.bfloat16, g).to(ctx.dev)
    mask = torch.ones(1, n, dtype=torch.bool, device=ctx.dev)
    k, p, mp = (r.to(ctx.dev) for r in params(1, n, V, g))
    op = getattr(ops, ctx.prefix[be] + "sampling_threshold")
    full = op(x[:, :n], mask, 1.0, k, p, mp, None)
    bad = []
    for i in (0, 1, n // 2, n - 1):
        one = op(x[:, i:i + 1].contiguous(), mask[:, :1], 1.0, k[:, i:i + 1], p[:, i:i + 1],
                 mp[:, i:i + 1], None)
        if not torch.equal(one, full[:, i:i + 1]):
            bad.append(i)
    report(f"threshold_invariance[{be} bf16 V={V}]", "ok" if not bad else "FAIL",
           f"{n} rows" + ("" if not bad else f": rows {bad}"))


@check
def threshold_kept_vs_cpu(ctx):
    """threshold_kept_fwd (on the cuda backend's 16-bit logits one kernel: the select, then
    the kept statistics on its threshold, csrc/cuda/threshold_select.cuh kept_stats) against
    the CPU op on the same rows: the same threshold (rows where the two differ, the top-p
    rounding case above, are left out), the same kept size and missing flags, the float
    statistics within 1e-5 (the CPU op's float sums; the device's in float64 from the
    select's bins on top-p rows, else float sums of a sweep)."""
    be = ctx.kern[0]
    g = torch.Generator().manual_seed(29)
    Vs = (1003,) if ctx.small else (1003, 151936)
    for dtype in (torch.bfloat16, torch.float16):
        for V in Vs:
            for kind in ("mixed", "ties", "zeros", "flat", "neginf"):
                B, T = (2, 3) if ctx.small else (4, 8)
                x = rows(kind, B, T, V, dtype, g)
                mask = torch.rand(B, T, generator=g) > 0.1
                tokens = torch.randint(0, V, (B, T), generator=g)
                k, p, mp = params(B, T, V, g)
                temps = (0.5 + torch.rand(B, T, generator=g)).float()
                dev = [r.to(ctx.dev) for r in (x[:, :T], tokens, mask, k, p, mp, temps)]
                got = [o.cpu() for o in getattr(ops, ctx.prefix[be] + "threshold_kept_fwd")(
                    dev[0], dev[1], dev[2], 0.8, *dev[3:6], dev[6])]
                want = ops.threshold_kept_fwd(x[:, :T], tokens, mask, 0.8, k, p, mp, temps)
                same = got[6] == want[6]
                bad = []
                for i, (a, b) in enumerate(zip(got[:6], want[:6])):
                    a, b = a[same], b[same]
                    ok = (torch.equal(a, b) if i >= 4 else
                          torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5,
                                         equal_nan=True))
                    if not ok:
                        bad.append(("logp", "entropy", "kept_max", "kept_log_sum", "size",
                                    "missing")[i])
                report(f"threshold_kept[{be} {str(dtype)[6:]} V={V} {kind}]",
                       "ok" if not bad else "FAIL",
                       f"{int(same.sum())} of {B * T} rows on one threshold"
                       + ("" if not bad else f": {bad}"))


CHECKS = [threshold_vs_cpu, threshold_alone_and_in_batch, threshold_kept_vs_cpu]

if __name__ == "__main__":
    sys.exit(main(CHECKS, __doc__))
