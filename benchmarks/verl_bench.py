"""verl's policy-loss registry: ppo_kernels' registered losses ("ppo_kernels*") against verl's
own functions (core_algos.compute_policy_loss_<mode>) on the same [B, T] log-probs, forward
+ backward (the loss and d loss / d log_prob, verl's metrics included: both return them as
Python floats).

    python benchmarks/verl_bench.py                      # B=64, T=2048, float32, 1 thread
    python benchmarks/verl_bench.py --b 8 --t 256 --reps 3

Printed per loss mode and loss_agg_mode: the median wall time of verl's function and of ours,
their ratio, torch.compile of verl's function and the copy floor (read + write of one [B, T]
tensor, what any forward+backward over log_prob needs), all measured in the same run, and
the peak memory above the resident set of one call (verl / ours). The registry's inputs
are log-probs, so verl's own function is the eager composite it replaces.
Timings are not tests (tests/test_integrations_verl.py checks the values).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import CopyFloor, median_s, peak_extra_bytes  # noqa: E402


def inputs(b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -8.0 * torch.rand(b, t, generator=g)
    lp = old + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[1] = False
    return old, lp, adv * mask, mask


def config(mode):
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig
    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                           policy_loss=PolicyLossConfig(loss_mode=mode))


def step(fn, old, lp0, adv, mask, agg, cfg):
    lp = lp0.clone().requires_grad_()
    loss, metrics = fn(old, lp, adv, mask, agg, cfg, None)
    loss.backward()
    return loss, metrics


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--b", type=int, default=64)
    ap.add_argument("--t", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import warnings
    warnings.filterwarnings("ignore")
    from verl.trainer.ppo import core_algos as ca

    import ppo_kernels.integrations.verl as pv  # noqa: F401  (registers the losses)
    old, lp, adv, mask = inputs(a.b, a.t)
    floor = CopyFloor()
    floor.map(lp)
    t_floor = median_s(lambda: floor(lp), reps=a.reps)
    print(f"# verl_bench: B={a.b} T={a.t} float32, {a.threads} thread(s), median of "
          f"{a.reps}, forward+backward; copy floor {t_floor * 1e3:.3f} ms")
    print(f"{'mode':8s} {'loss_agg_mode':24s} {'verl ms':>9s} {'ours ms':>9s} {'ours/verl':>9s}"
          f" {'compile ms':>10s} {'x floor':>8s} {'peak MiB v/o':>13s}")
    cases = [("vanilla", agg) for agg in ("token-mean", "seq-mean-token-sum",
                                          "seq-mean-token-mean", "seq-mean-token-sum-norm")]
    cases += [("gspo", "seq-mean-token-mean"), ("cispo", "token-mean"),
              ("sapo", "seq-mean-token-mean")]
    for mode, agg in cases:
        cfg = config(mode)
        theirs = ca.get_policy_loss_fn(mode)
        ours = ca.get_policy_loss_fn(f"ppo_kernels_{mode}")
        tv = median_s(lambda: step(theirs, old, lp, adv, mask, agg, cfg), reps=a.reps)
        to = median_s(lambda: step(ours, old, lp, adv, mask, agg, cfg), reps=a.reps)
        tc = float("nan")
        if not a.no_compile:
            try:
                comp = torch.compile(theirs)
                tc = median_s(lambda: step(comp, old, lp, adv, mask, agg, cfg), reps=a.reps,
                              warmup=2)
            except Exception:  # (torch.compile may not lower verl's .item() metrics)
                tc = float("nan")
        pv_ = peak_extra_bytes(lambda: step(theirs, old, lp, adv, mask, agg, cfg)) / 2**20
        po = peak_extra_bytes(lambda: step(ours, old, lp, adv, mask, agg, cfg)) / 2**20
        print(f"{mode:8s} {agg:24s} {tv * 1e3:9.2f} {to * 1e3:9.2f} {to / tv:9.2f} "
              f"{tc * 1e3:10.2f} {to / t_floor:8.1f} {pv_:6.1f}/{po:<6.1f}")


if __name__ == "__main__":
    main()
