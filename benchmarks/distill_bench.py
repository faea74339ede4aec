"""Benchmark of pk.distill_loss (top-k distillation), forward + backward on the CPU (or a
CUDA device with --device cuda), against

  fused            pk.distill_loss(logits, teacher) (the kernel writes dlogits in the
                   forward; backward only scales)
  eager composite  plain PyTorch on the materialised logits: log_softmax, gather, the same
                   formula (pk.distill.distill_terms_torch, the torch backend)
  torch.compile    torch.compile of that composite
  copy floor       one read + one write of the logits (what any forward + backward needs)

    python benchmarks/distill_bench.py                 # N = 256, 1024; V = 32000; k = 64
    python benchmarks/distill_bench.py --quick         # a smoke test (seconds)
    python benchmarks/distill_bench.py --n 1024 --v 151936 --k 20 --dtype bfloat16

Every variant computes the same loss (token-mean, tail on); the script checks the losses and
gradients against the fused one first. Time: the median wall time of forward + backward.
Peak memory: the peak extra bytes of one step above the memory before it (CPU: Linux's
VmHWM in a fresh subprocess per variant, after a warm-up step, with glibc's mmap threshold
fixed; CUDA: max_memory_allocated), the gradient (or the floor's copy) included, printed in
MiB and as ratios to the fused kernel's. On a shared machine, OMP_NUM_THREADS=1 gives the
steadiest numbers (oversubscribed OpenMP regions, the argument checks' sort among them,
slow down by tens of times).
Timings are not tests.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import ppo_kernels as pk
from ppo_kernels import distill as _d

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402


def make_inputs(n, v, k, dtype, device, seed=0):
    """logits [B, T, V] (B = 8 or 1), a teacher CSR with k ids per position (the teacher's
    top-k of a random softmax), token-mean weights."""
    g = torch.Generator().manual_seed(seed)
    b = 8 if n % 8 == 0 else 1
    logits = (torch.randn(b, n // b, v, generator=g) * 2).to(dtype)
    t_logits = torch.randn(n, v, generator=g) * 2
    lp = torch.log_softmax(t_logits, -1)
    top = torch.topk(lp, k, dim=-1)
    teacher = pk.SparseLogprobs(top.indices.reshape(-1), torch.arange(0, n * k + 1, k),
                                top.values.reshape(-1).contiguous())
    return logits.to(device), pk.SparseLogprobs(*(x.to(device) for x in teacher))


def composite(logits, teacher):
    """The eager PyTorch composite on the materialised logits: log_softmax, gather, the same
    formula (the torch backend's function, called directly: no checks)."""
    b, t, v = logits.shape
    n = b * t
    ids, off, lt = teacher.token_ids, teacher.offsets, teacher.logprobs
    row_of = torch.repeat_interleave(torch.arange(n, device=ids.device), off[1:] - off[:-1],
                                     output_size=ids.numel())
    valid = torch.ones(n, dtype=torch.bool, device=logits.device)
    kl, _, _ = _d.distill_terms_torch(logits.float().reshape(n, v), ids, row_of, lt.float(),
                                      valid, True)
    return kl.sum() / n


_compiled = None


def variants(device):
    global _compiled
    fused_backend = "auto"

    def fused(x, te):
        return pk.distill_loss(x, te, backend=fused_backend)[0]

    def compiled(x, te):
        global _compiled
        if _compiled is None:
            _compiled = torch.compile(composite, dynamic=False)
        return _compiled(x, te)

    return {"fused": fused, "eager composite": composite, "torch.compile": compiled}


def step_of(fn, logits, teacher):
    def step():
        x = logits.detach().requires_grad_()
        fn(x, teacher).backward()
        return x.grad
    return step


def peak_child(name, n, v, k, dtype, device):
    """(this script, --peak-of name): one warm-up step, then the peak of one step."""
    logits, teacher = make_inputs(n, v, k, dtype, device)
    if name == "copy floor":
        def step():  # (a fresh output buffer per step: its allocation is in the peak)
            return _measure.CopyFloor()(logits)
    else:
        step = step_of(variants(device)[name], logits, teacher)
    step()
    pk.empty_cache()
    if device == "cuda":
        return _measure.CudaMeter().peak_extra_bytes(step)
    return _measure.peak_extra_bytes(step)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--v", type=int, default=32000)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--peak-of", help=argparse.SUPPRESS)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    if a.peak_of:
        print(peak_child(a.peak_of, a.n[0], a.v, a.k, dtype, a.device))
        return
    if a.device == "cpu":
        _measure.reexec_with(_measure.MMAP_ENV)
    if a.quick:
        a.n, a.v, a.k, a.reps = [64], 2000, 16, 3
    meter = _measure.CudaMeter() if a.device == "cuda" else _measure.CpuMeter()
    names = list(variants(a.device))
    if a.no_compile:
        names.remove("torch.compile")
    print(f"distill_loss fwd+bwd, V={a.v} k={a.k} {a.dtype} on {a.device} "
          f"(threads={torch.get_num_threads()})")
    for n in a.n:
        logits, teacher = make_inputs(n, a.v, a.k, dtype, a.device)
        grads = {}
        for name in names:  # the same loss and gradient first
            x = logits.detach().requires_grad_()
            loss = variants(a.device)[name](x, teacher)
            loss.backward()
            grads[name] = (float(loss.detach()), x.grad.float())
        ref_loss, ref_grad = grads["fused"]
        for name, (l_, g_) in grads.items():
            assert abs(l_ - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss)), (name, l_, ref_loss)
            err = float((g_ - ref_grad).abs().max() / ref_grad.abs().max().clamp(min=1e-30))
            assert err < (2e-2 if dtype != torch.float32 else 1e-4), (name, err)
        times = {}
        for name in names:
            times[name] = meter.median_s(step_of(variants(a.device)[name], logits, teacher),
                                         reps=a.reps)
        floor = _measure.CopyFloor()
        floor.map(logits)
        times["copy floor"] = meter.median_s(lambda: floor(logits), reps=a.reps)
        peaks = {}
        for name in names + ["copy floor"]:
            if a.device == "cpu":
                peaks[name] = _measure.child_peak(
                    [os.path.abspath(__file__), "--peak-of", name, "--n", n, "--v", a.v,
                     "--k", a.k, "--dtype", a.dtype, "--device", a.device],
                    _measure.MMAP_ENV)
            else:
                peaks[name] = peak_child(name, n, a.v, a.k, dtype, a.device)
        nv = n * a.v * 4 / 2**20
        print(f"\nN={n}  ([N, V] float32 = {nv:.1f} MiB)")
        print(f"{'variant':18s} {'time ms':>9s} {'/fused':>8s} {'/floor':>8s} "
              f"{'peak MiB':>9s} {'/fused':>8s}")
        for name in names + ["copy floor"]:
            print(f"{name:18s} {times[name] * 1e3:9.2f} {times[name] / times['fused']:8.2f} "
                  f"{times[name] / times['copy floor']:8.2f} {peaks[name] / 2**20:9.1f} "
                  f"{peaks[name] / max(peaks['fused'], 1):8.2f}")


if __name__ == "__main__":
    main()
