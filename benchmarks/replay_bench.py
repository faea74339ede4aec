"""Cost of sampling replay (docs/SAMPLING.md) over the plain op, on the CPU.

For each shape: pk.ppo_loss forward + backward on the C++ kernels without a kept set (the
fused single pass), with a given SamplingMask (kept sets of k <= 512 ids, mean about 8:
what vLLM's --return-sampling-mask returns at top_p ~ 0.9 on a confident policy), and with
the set re-derived from top_k / top_p (the threshold pre-pass over every row), both also
with a per-sequence temperature tensor (_row_temp); plus the
eager composite with the given mask (backend="torch", which materialises [N, V]),
torch.compile of the plain eager composite, and the copy floor (read the logits once,
write a gradient of their size once), all measured in the same run. Printed: median
seconds, the ratios to the plain fused op, to the eager composite and to the floor, and
the peak extra resident memory of one step (fresh process per measurement with --peak).

    python benchmarks/replay_bench.py [--quick] [--compile] [--peak]
    python benchmarks/replay_bench.py --device cuda --backend triton   (GPU; unrun)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import ppo_kernels as pk
from ppo_kernels import _torch_impl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

P = pk.LossSpec.build()


DEVICE, BACKEND = "cpu", "cpu"


def make_inputs(n, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = 4
    t = n // b
    logits = torch.randn(b, t, v, generator=g) * 3
    tokens = torch.randint(0, v, (b, t), generator=g)
    with torch.no_grad():
        lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    old = lp + 0.1 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    # kept sets of k ids, k geometric with mean ~8, capped at 512, the token among them
    k = torch.distributions.Geometric(probs=torch.tensor(1 / 8.0)).sample((n,)).long() + 1
    k = k.clamp(max=512)
    ids = [torch.cat([tokens.reshape(-1)[i:i + 1], torch.randint(0, v, (int(k[i]) - 1,),
                                                                 generator=g)]).unique()
           for i in range(n)]
    offs = torch.cat([torch.zeros(1, dtype=torch.long),
                      torch.tensor([len(x) for x in ids]).cumsum(0)])
    sm = pk.SamplingMask(torch.cat(ids).to(DEVICE), offs.to(DEVICE))
    return (logits.to(DEVICE), tokens.to(DEVICE), old.to(DEVICE), adv.to(DEVICE), sm)


def step_fn(name, compiled=None):
    def plain(logits, tokens, old, adv, sm):
        return pk.ppo_loss(logits, tokens, old, adv, backend=BACKEND)[0]

    def given(logits, tokens, old, adv, sm):
        return pk.ppo_loss(logits, tokens, old, adv, sampling_mask=sm, backend=BACKEND)[0]

    def rederived(logits, tokens, old, adv, sm):
        return pk.ppo_loss(logits, tokens, old, adv, top_k=1024, top_p=0.8, backend=BACKEND)[0]

    def _temps(tokens):  # one temperature per sequence (prime-rl's schedules)
        return torch.linspace(0.7, 1.3, tokens.shape[0], device=tokens.device)

    def given_row_temp(logits, tokens, old, adv, sm):
        return pk.ppo_loss(logits, tokens, old, adv, sampling_mask=sm, temperature=_temps(tokens),
                           backend=BACKEND)[0]

    def rederived_row_temp(logits, tokens, old, adv, sm):
        return pk.ppo_loss(logits, tokens, old, adv, top_k=1024, top_p=0.8,
                           temperature=_temps(tokens), backend=BACKEND)[0]

    def eager_given(logits, tokens, old, adv, sm):
        return pk.ppo_loss(logits, tokens, old, adv, sampling_mask=sm, backend="torch")[0]

    def composite(logits, tokens, old, adv, sm):
        mask = torch.ones_like(tokens, dtype=torch.bool)
        w = _torch_impl.agg_weights(mask, "token-mean")
        return _torch_impl.ppo_loss(logits, tokens, mask, old, adv, w, None, None, P)[0]

    fns = dict(plain=plain, given=given, rederived=rederived, given_row_temp=given_row_temp,
               rederived_row_temp=rederived_row_temp, eager_given=eager_given,
               composite=composite)
    if name == "compiled":
        return compiled
    return fns[name]


FLOOR = _measure.CopyFloor()


def run_step(fn, inputs):
    if fn is None:  # the floor
        FLOOR(inputs[0])
        return
    x = inputs[0].requires_grad_(True)
    fn(x, *inputs[1:]).backward()
    x.grad = None
    if x.is_cuda:
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small N, few repetitions")
    ap.add_argument("--compile", action="store_true", help="also torch.compile the composite")
    ap.add_argument("--peak", action="store_true", help="peak extra memory per step (CPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="cpu", help="the kernel backend (cpu, triton, cuda)")
    args = ap.parse_args()
    global DEVICE, BACKEND
    DEVICE, BACKEND = args.device, args.backend
    n = 32 if args.quick else 128
    reps = 3 if args.quick else 5
    names = ["plain", "given", "rederived", "given_row_temp", "rederived_row_temp",
             "eager_given", "composite"]
    compiled = None
    if args.compile:
        compiled = torch.compile(step_fn("composite"))
        names.append("compiled")
    print(f"sampling replay, backend={BACKEND} on {DEVICE} ({torch.get_num_threads()} CPU "
          f"threads), ppo_loss forward "
          f"+ backward, float32, N = {n} rows; given masks: k <= 512, mean ~8; re-derived: "
          f"top_k=1024, top_p=0.8")
    for v in (32768, 151936):
        inputs = make_inputs(n, v)
        sm = inputs[4]
        t = {}
        for name in names:
            fn = step_fn(name, compiled)
            t[name] = _measure.median_s(lambda: run_step(fn, inputs), reps=reps, warmup=1)
        t["floor"] = _measure.median_s(lambda: run_step(None, inputs), reps=reps, warmup=1)
        mean_k = float((sm.offsets[1:] - sm.offsets[:-1]).float().mean())
        print(f"V = {v}: mean kept size {mean_k:.1f}")
        for name, s in t.items():
            line = (f"  {name:18s} {s * 1e3:9.2f} ms  x{s / t['plain']:6.2f} plain  "
                    f"x{s / t['composite']:6.2f} eager  x{s / t['floor']:6.2f} floor")
            if args.peak and name != "floor" and DEVICE == "cpu":
                fn = step_fn(name, compiled)
                peak = _measure.peak_extra_bytes(lambda: run_step(fn, inputs))
                line += f"  peak +{peak / 2**20:7.1f} MiB"
            print(line)


if __name__ == "__main__":
    main()
