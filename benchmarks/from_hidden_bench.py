"""CPU benchmark: the PPO loss from the last hidden states and the LM head weight, forward +
backward (gradients to hidden and to the head weight), against N, for

  fused                   pk.ppo_loss_from_hidden(h, W, ...) (chunks of --chunk rows; the
                          [N, V] logits are never stored; docs/FROM_HIDDEN.md)
  fused, fp32 logits      the same with logits_dtype=torch.float32: with --dtype bfloat16,
                          each chunk's logits in float32 (vLLM head_dtype=float32, SGLang
                          enable_fp32_lm_head); on the CPU the weight is widened to float32
                          once per pass (torch.mm has no float32 output for bf16 operands
                          there). With --dtype float32 it is the fused variant again
  materialised + ppo_loss logits = h @ W.T, then pk.ppo_loss(logits, ...) (the fused row
                          kernel on the whole [N, V] logits)
  eager composite         pk.ppo_loss_from_hidden(..., backend="torch"): F.linear, then the
                          eager PyTorch composite (log_softmax -> gather -> ratio -> clip)
  torch.compile           torch.compile of that composite (F.linear + _torch_impl.ppo_loss)
  chunked torch (TRL)     plain PyTorch, as TRL does it: a loop over chunks of --chunk rows,
                          logits_c = h_c @ W.T, log_softmax / gather / ratio / clip per
                          chunk, the chunks' losses summed; autograd (which keeps every
                          chunk's logits and log-softmax for the backward)
  chunked + checkpoint    the same, each chunk under torch.utils.checkpoint (recomputed in
                          the backward: one chunk alive at a time)

    python benchmarks/from_hidden_bench.py            # H=512 V=32000 N=256,1024,4096 fp32
    python benchmarks/from_hidden_bench.py --quick    # a smoke test (seconds)
    python benchmarks/from_hidden_bench.py --n 1024 4096 --v 151936 --dtype bfloat16

Every variant computes the same loss (token-mean vanilla clipped surrogate, clip 0.2, no
KL, no entropy bonus); the script checks the losses and gradients against the fused one
first (the float32-logits variant against the fused float32 computation on the rounded
inputs). The pk variants also compute the entropy metric (the kernel gets it for free), the
plain-torch ones do not.

Time: the median wall time of forward + backward, all variants in this process. Peak
memory: as benchmarks/cpu_bench.py measures it, one fresh subprocess per variant and N,
Linux's VmHWM after resetting it (/proc/self/clear_refs) minus VmRSS before the step;
in the child one warm-up step at the same shape first (torch.compile compiles there, not
inside the window) and glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_), so that the
warm-up's freed large buffers go back to the OS instead of being reused unseen (and
pk.empty_cache() hands back the gradient buffer the CPU kernels recycle). The peak
includes the gradients d hidden [N, H] and dW [V, H] that every variant returns; it is
printed in MiB and in units of one [N, V] float32 buffer. Timings are not tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import ppo_kernels as pk
from ppo_kernels import _torch_impl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402  (the timing loop and the peak probe)
from cpu_bench import P  # noqa: E402  (the same loss options)

CLIP = P.clip_eps_low


def make_inputs(n, h, v, dtype, seed=0):
    """hidden [B, T, H], W [V, H], tokens, mask, old, adv ([B, T]) with B = 8 (or 1)."""
    g = torch.Generator().manual_seed(seed)
    b = 8 if n % 8 == 0 else 1
    t = n // b
    hidden = torch.randn(b, t, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * (2.0 / h ** 0.5)).to(dtype)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.1
    with torch.no_grad():
        lp = torch.log_softmax(F.linear(hidden, w).float(), -1).gather(
            -1, tokens[..., None])[..., 0]
    old = lp + 0.1 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    return hidden, w, tokens, mask, old, adv


# ------------------------------------------------------------------ the variants
# each: (hidden, W, tokens, mask, old, adv, chunk) -> scalar loss, differentiable in both

def fused(h, w, tokens, mask, old, adv, chunk):
    return pk.ppo_loss_from_hidden(h, w, tokens, old, adv, mask, chunk_size=chunk,
                                   clip_eps_low=CLIP, backend="cpu")[0]


def fused_fp32_logits(h, w, tokens, mask, old, adv, chunk):
    return pk.ppo_loss_from_hidden(h, w, tokens, old, adv, mask, chunk_size=chunk,
                                   clip_eps_low=CLIP, backend="cpu",
                                   logits_dtype=torch.float32)[0]


def materialised(h, w, tokens, mask, old, adv, chunk):
    return pk.ppo_loss(F.linear(h, w), tokens, old, adv, mask, clip_eps_low=CLIP,
                       backend="cpu")[0]


def eager(h, w, tokens, mask, old, adv, chunk):
    return pk.ppo_loss_from_hidden(h, w, tokens, old, adv, mask, clip_eps_low=CLIP,
                                   backend="torch")[0]


def composite(h, w, tokens, mask, old, adv):
    """What backend="torch" runs, as one plain function (torch.compile can trace it: no
    argument checks, no host reads)."""
    logits = F.linear(torch.where(mask[..., None], h, 0.0), w)
    weights = _torch_impl.agg_weights(mask, "token-mean")
    return _torch_impl.ppo_loss(logits, tokens, mask, old, adv, weights, None, None, P)[0]


_compiled = None


def compiled(h, w, tokens, mask, old, adv, chunk):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(composite, dynamic=False)
    return _compiled(h, w, tokens, mask, old, adv)


def _chunk_loss(h_c, w, tok_c, m_c, old_c, adv_c, n_valid):
    logits = h_c @ w.t()
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tok_c[:, None])[:, 0]
    ratio = torch.exp(logp - old_c)
    pg = -torch.minimum(ratio * adv_c, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * adv_c)
    return torch.where(m_c, pg, 0.0).sum() / n_valid


def _chunked(h, w, tokens, mask, old, adv, chunk, checkpoint):
    hh = h.reshape(-1, h.shape[-1])
    tok, m, o, a = (x.reshape(-1) for x in (tokens, mask, old, adv))
    n_valid = m.sum().clamp(min=1)
    loss = 0.0
    for r0 in range(0, hh.shape[0], chunk):
        args = (hh[r0:r0 + chunk], w, tok[r0:r0 + chunk], m[r0:r0 + chunk],
                o[r0:r0 + chunk], a[r0:r0 + chunk], n_valid)
        if checkpoint:
            loss = loss + torch.utils.checkpoint.checkpoint(_chunk_loss, *args,
                                                            use_reentrant=False)
        else:
            loss = loss + _chunk_loss(*args)
    return loss


def chunked(h, w, tokens, mask, old, adv, chunk):
    return _chunked(h, w, tokens, mask, old, adv, chunk, False)


def chunked_ckpt(h, w, tokens, mask, old, adv, chunk):
    return _chunked(h, w, tokens, mask, old, adv, chunk, True)


VARIANTS = {"fused": fused, "fused, fp32 logits": fused_fp32_logits,
            "materialised + ppo_loss": materialised,
            "eager composite": eager, "torch.compile": compiled,
            "chunked torch (TRL)": chunked, "chunked + checkpoint": chunked_ckpt}


def step(fn, inputs, chunk):
    hidden, w = (x.detach().requires_grad_(True) for x in inputs[:2])
    loss = fn(hidden, w, *inputs[2:], chunk)
    loss.backward()
    return loss.detach(), hidden.grad, w.grad


def time_variant(fn, inputs, chunk, reps, warmup):
    """Median seconds of one forward + backward."""
    return _measure.median_s(lambda: step(fn, inputs, chunk), None, reps, warmup)


# ------------------------------------------------------------------ peak memory (child)

def peak_child(name, n, a):
    """Extra peak bytes of one forward + backward, in a fresh process (_measure.MMAP_ENV)."""
    return _measure.child_peak([os.path.abspath(__file__), "--peak-of", name, "--n", n,
                                "--h", a.h, "--v", a.v, "--dtype", a.dtype, "--chunk", a.chunk],
                               _measure.MMAP_ENV)


def measure_peak_here(name, n, a):
    inputs = make_inputs(n, a.h, a.v, getattr(torch, a.dtype))
    fn = VARIANTS[name]
    res = step(fn, inputs, a.chunk)  # load / compile at this shape, outside the window
    del res
    pk.empty_cache()  # the CPU kernels' recycled [N, V] gradient buffer: counted in the window
    print(_measure.peak_extra_bytes(lambda: step(fn, inputs, a.chunk)))


# ------------------------------------------------------------------ main

def check(inputs, chunk):
    """max relative difference of (loss, d hidden, dW) of each variant to the fused one;
    the float32-logits variant's to the fused float32 computation on the same (rounded)
    hidden states and weight, which is what it computes (the bf16 logits' rounding can
    flip clip decisions: the two paths' gradients then differ by far more than rounding)."""
    ref = step(fused, inputs, chunk)
    ref32 = step(fused, [x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
                         for x in inputs], chunk)
    out = {}
    for name, fn in VARIANTS.items():
        got = step(fn, inputs, chunk)
        want = ref32 if name == "fused, fp32 logits" else ref
        out[name] = max(float((x.double() - y.double()).abs().max() /
                              y.double().abs().max().clamp(min=1e-30))
                        for x, y in zip(got, want))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=None,
                    help="tokens (rows), several allowed (default 256 1024 4096)")
    ap.add_argument("--h", type=int, default=None, help="hidden size (default 512)")
    ap.add_argument("--v", type=int, default=None, help="vocabulary size (default 32000)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chunk", type=int, default=None,
                    help="rows per chunk of the fused and the chunked variants (default 1024)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                    help="a subset of the variants (fused always runs)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: H=64 V=2048 N=64,256 chunk 64, 1 rep")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--peak-of", help=argparse.SUPPRESS)
    a = ap.parse_args()
    quick = dict(n=[64, 256], h=64, v=2048, chunk=64, reps=1)
    full = dict(n=[256, 1024, 4096], h=512, v=32000, chunk=1024, reps=3)
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.peak_of:
        return measure_peak_here(a.peak_of, a.n[0], a)
    names = list(VARIANTS) if a.variants is None else \
        ["fused"] + [x for x in a.variants if x != "fused"]
    dtype = getattr(torch, a.dtype)
    info = pk.build_info()
    print(f"PPO loss from hidden, forward + backward on the CPU: H={a.h} V={a.v} {a.dtype}, "
          f"chunk {a.chunk} rows, {torch.get_num_threads()} threads, SIMD "
          f"{info['cpu_capability']}")
    small = make_inputs(min(a.n), a.h, a.v, dtype, seed=1)
    errs = check(small, min(a.chunk, max(1, min(a.n) // 3)))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    print(f"max rel. difference of (loss, d hidden, dW) to fused at N={min(a.n)}: " +
          ", ".join(f"{k} {v:.1e}" for k, v in errs.items() if k in names))
    bad = [k for k, v in errs.items() if k in names and not v <= tol]
    if bad:
        raise SystemExit(f"variants disagree with the fused loss beyond {tol}: {bad}")

    results = []
    for n in a.n:
        inputs = make_inputs(n, a.h, a.v, dtype)
        buf = n * a.v * 4
        rows = {}
        for name in names:
            t = time_variant(VARIANTS[name], inputs, a.chunk, a.reps, a.warmup)
            peak = peak_child(name, n, a)
            rows[name] = {"seconds": t, "peak_extra_bytes": peak, "peak_extra_nv": peak / buf}
        results.append({"n": n, "rows": rows})
        t_f = rows["fused"]["seconds"]
        t_m = rows.get("materialised + ppo_loss", {}).get("seconds")
        print(f"\nN={n} (one [N, V] float32 buffer = {buf / 2**20:.0f} MiB)")
        print(f"{'variant':<26}{'time [ms]':>10}{'/ fused':>9}{'peak extra [MiB]':>18}"
              f"{'[N,V] bufs':>12}")
        for name, r in rows.items():
            print(f"{name:<26}{r['seconds'] * 1e3:>10.1f}{r['seconds'] / t_f:>8.2f}x"
                  f"{r['peak_extra_bytes'] / 2**20:>18.1f}{r['peak_extra_nv']:>12.3f}")
        if t_m is not None:
            print(f"time fused / (materialised + ppo_loss) = {t_f / t_m:.2f}")
        if "fused, fp32 logits" in rows:
            r32, p16 = rows["fused, fp32 logits"], rows["fused"]["peak_extra_bytes"]
            p32 = r32["peak_extra_bytes"]
            print(f"fp32 logits / {a.dtype} logits: time {r32['seconds'] / t_f:.2f}x, peak "
                  f"extra {p32 / max(p16, 1):.2f}x ({(p32 - p16) / 2**20:+.1f} MiB)")

    if "materialised + ppo_loss" in names:
        print("\nsummary: time ratio fused / (materialised + ppo_loss), peak extra MiB")
        print(f"{'N':>6}{'ratio':>8}" + "".join(f"{k[:22]:>24}" for k in names))
        for r in results:
            rows = r["rows"]
            ratio = rows["fused"]["seconds"] / rows["materialised + ppo_loss"]["seconds"]
            print(f"{r['n']:>6}{ratio:>8.2f}" +
                  "".join(f"{rows[k]['peak_extra_bytes'] / 2**20:>24.1f}" for k in names))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"h": a.h, "v": a.v, "dtype": a.dtype, "chunk": a.chunk,
                       "threads": torch.get_num_threads(), "check": errs,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    main()
