"""CPU benchmark: ppo_loss forward+backward, the fused `cpu` kernel against the eager
PyTorch composite (log_softmax -> gather -> ratio -> clip -> masked mean, with entropy),
torch.compile of that composite, and the physical floor, all measured in the same run.

    python benchmarks/cpu_bench.py                 # N=4096 tokens, V=32768, float32
    python benchmarks/cpu_bench.py --dtype bfloat16
    python benchmarks/cpu_bench.py --n 512 --v 4096 --reps 3   # a quick look

The floor is what any fused forward+backward must at least do: read the logits once and
write a gradient of their size once into mapped memory (`out.copy_(logits)` into a buffer
allocated and touched before the timing). Variants:
  cpu (fused)             pk.ppo_loss(..., backend="cpu"); loss.backward()
  cpu, inplace_backward   the gradient written over the logits (no gradient buffer)
  cpu, (loss / 3)         gradient accumulation: grad_output 1/3, rescaled in place
  cpu, grad_scale=1/3     the same, with the scale known in the forward (no extra pass)
  cpu, gspo (two-phase)   a sequence-level loss: statistics pass, [B, T] middle, gradient
                          pass (one more read of the logits than the fused single pass)
  eager composite, torch.compile of it
Reports the median wall time of forward+backward, the ratios to the fused kernel and to
the floor, and the peak extra resident memory of one forward+backward (measured in a fresh
subprocess per variant, from Linux's VmHWM after resetting it), in units of one [N, V]
float32 buffer. Timings are not tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import ppo_kernels as pk
from ppo_kernels import _torch_impl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402  (the timing loop, the floor and the peak probe)

P = pk.LossSpec.build()  # ppo_loss's defaults (clip 0.2, no KL, no entropy)


def make_inputs(n, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = 8
    t = n // b
    logits = (torch.randn(b, t, v, generator=g) * 2).to(dtype)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.1
    with torch.no_grad():
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
    old = lp + 0.1 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    return logits, tokens, mask, old, adv


def composite(logits, tokens, mask, old, adv, p=P):
    """The eager composite's loss with the options p (report.py passes a gspo p)."""
    w = _torch_impl.agg_weights(mask, "token-mean")
    return _torch_impl.ppo_loss(logits, tokens, mask, old, adv, w, None, None, p)[0]


def fused(logits, tokens, mask, old, adv):
    return pk.ppo_loss(logits, tokens, old, adv, mask, backend="cpu")[0]


def fused_inplace(logits, tokens, mask, old, adv):
    # (the step() below hands in a non-leaf: the logits' storage receives the gradient)
    return pk.ppo_loss(logits, tokens, old, adv, mask, backend="cpu", inplace_backward=True)[0]


def fused_accum(logits, tokens, mask, old, adv):
    return pk.ppo_loss(logits, tokens, old, adv, mask, backend="cpu")[0] / 3


def fused_grad_scale(logits, tokens, mask, old, adv):
    return pk.ppo_loss(logits, tokens, old, adv, mask, backend="cpu", grad_scale=1 / 3)[0] / 3


_compiled = None


def compiled(logits, tokens, mask, old, adv):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(composite, dynamic=False)
    return _compiled(logits, tokens, mask, old, adv)


def fused_gspo(logits, tokens, mask, old, adv):
    return pk.ppo_loss(logits, tokens, old, adv, mask, backend="cpu", policy_loss="gspo")[0]


_floor = _measure.CopyFloor()


def floor(logits, *_):
    """Not a loss: the read + write of [N, V] that every forward+backward needs."""
    return _floor(logits)


VARIANTS = {"cpu (fused)": fused, "cpu, inplace_backward": fused_inplace,
            "cpu, (loss / 3)": fused_accum, "cpu, grad_scale=1/3": fused_grad_scale,
            "cpu, gspo (two-phase)": fused_gspo,
            "eager composite": composite, "torch.compile": compiled, "floor (copy)": floor}


def prepare(fn, inputs):
    """Work a variant needs before each step that is not part of it (untimed): the
    in-place variant overwrites its input, so it gets a fresh copy (as a model's output
    would be fresh)."""
    if fn is not fused_inplace:
        return inputs
    src = _inplace_src.get(inputs[0].shape)
    if src is None:
        src = _inplace_src[inputs[0].shape] = inputs[0].clone()
    return (src.copy_(inputs[0]), *inputs[1:])


def step(fn, inputs):
    if fn is floor:
        return floor(inputs[0])
    logits = inputs[0].detach().requires_grad_(True)
    loss = fn(logits.view_as(logits) if fn is fused_inplace else logits, *inputs[1:])
    loss.backward()
    return logits.grad


_inplace_src = {}


def time_variant(fn, inputs, reps, warmup):
    """Median seconds of one forward+backward (the refill of prepare() untimed)."""
    return _measure.median_s(lambda ready: step(fn, ready), lambda: prepare(fn, inputs),
                             reps, warmup)


def peak_child(name, n, v, dtype):
    """Runs one forward+backward in this script as a subprocess; returns extra peak bytes."""
    return _measure.child_peak([os.path.abspath(__file__), "--peak-of", name, "--n", n,
                                "--v", v, "--dtype", dtype])


def measure_peak_here(name, n, v, dtype):
    inputs = make_inputs(n, v, getattr(torch, dtype))
    fn = VARIANTS[name]
    small = make_inputs(64, 128, getattr(torch, dtype))
    step(fn, prepare(fn, small))  # load/compile outside the window
    inputs = prepare(fn, inputs)  # its refill buffer stands for the model's output
    if fn is floor:  # the floor's output buffer is mapped memory by definition
        _floor.map(inputs[0])
    print(_measure.peak_extra_bytes(lambda: step(fn, inputs)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="tokens (rows)")
    ap.add_argument("--v", type=int, default=32768, help="vocabulary size")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--peak-of", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peak_of:
        return measure_peak_here(a.peak_of, a.n, a.v, a.dtype)

    dtype = getattr(torch, a.dtype)
    inputs = make_inputs(a.n, a.v, dtype)
    buf = a.n * a.v * 4
    info = pk.build_info()
    print(f"ppo_loss forward+backward on the CPU: N={a.n} V={a.v} {a.dtype}, "
          f"{torch.get_num_threads()} threads, SIMD {info['cpu_capability']}")
    ref = step(composite, inputs)
    got = step(fused, inputs)
    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    print(f"max |dlogits(cpu) - dlogits(eager)| / max |dlogits| = {err:.2e}")
    rows = {}
    for name, fn in VARIANTS.items():
        t = time_variant(fn, inputs, a.reps, a.warmup)
        peak = peak_child(name, a.n, a.v, a.dtype)
        rows[name] = {"seconds": t, "peak_extra_bytes": peak, "peak_extra_nv": peak / buf}
    t_cpu = rows["cpu (fused)"]["seconds"]
    t_floor = rows["floor (copy)"]["seconds"]
    print(f"\n{'variant':<24}{'time [ms]':>10}{'/ cpu (fused)':>15}{'/ floor':>9}"
          f"{'peak extra [N,V fp32 bufs]':>28}")
    for name, r in rows.items():
        print(f"{name:<24}{r['seconds'] * 1e3:>10.1f}{r['seconds'] / t_cpu:>14.2f}x"
              f"{r['seconds'] / t_floor:>8.2f}x{r['peak_extra_nv']:>28.3f}")
    print(f"\ntargets: >= 3x eager (got {rows['eager composite']['seconds'] / t_cpu:.2f}x), "
          f">= 1.5x torch.compile (got {rows['torch.compile']['seconds'] / t_cpu:.2f}x), "
          f"within 2x of the floor (got {t_cpu / t_floor:.2f}x), "
          f"peak extra <= 1.05 [N,V] buffers (got {rows['cpu (fused)']['peak_extra_nv']:.3f})")
    acc, gs = rows["cpu, (loss / 3)"], rows["cpu, grad_scale=1/3"]
    print(f"backward scale: (loss / 3).backward() costs {acc['seconds'] / t_cpu:.2f}x the time "
          f"and {acc['peak_extra_nv']:.3f} buffers (loss.backward(): 1.00x, "
          f"{rows['cpu (fused)']['peak_extra_nv']:.3f}); with grad_scale=1/3: "
          f"{gs['seconds'] / t_cpu:.2f}x, {gs['peak_extra_nv']:.3f} buffers")
    tp = rows["cpu, gspo (two-phase)"]
    print(f"two-phase path (gspo): {tp['seconds'] / t_cpu:.2f}x the fused single pass, "
          f"{tp['peak_extra_nv']:.3f} buffers")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"n": a.n, "v": a.v, "dtype": a.dtype, "threads": torch.get_num_threads(),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    main()
