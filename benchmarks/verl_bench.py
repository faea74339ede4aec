"""verl's policy-loss registry: ppo_kernels' registered losses ("ppo_kernels*") against verl's
own functions (core_algos.compute_policy_loss_<mode>) on the same [B, T] log-probs, forward
+ backward (the loss and d loss / d log_prob, verl's metrics included: both return them as
Python floats).

    python benchmarks/verl_bench.py                      # B=64, T=2048, float32, 1 thread
    python benchmarks/verl_bench.py --b 8 --t 256 --reps 3

Printed per loss mode (every registered one) and loss_agg_mode (sapo: its own): the wall times
of verl's function and of ours, run in alternation (one call of each per round, so that the
noise of a shared machine falls on both alike), min and median over the rounds; the ratio
ours / verl of the minima and the median of the per-round ratios; torch.compile of verl's
function and the copy floor (read + write of one [B, T] tensor, what any forward+backward
over log_prob needs), all measured in the same run, and the peak memory above the resident
set of one call (verl / ours). The registry's inputs
are log-probs, so verl's own function is the eager composite it replaces.
Timings are not tests (tests/test_integrations_verl.py checks the values).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import CopyFloor, median_s, peak_extra_bytes  # noqa: E402

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm")
MODES = ("vanilla", "gspo", "cispo", "sapo", "dppo_tv", "dppo_kl")


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


def alternated(fa, fb, reps, warmup=2):
    """Wall times (s) of fa() and fb() called in alternation, reps rounds after warmup:
    (times of fa, times of fb)."""
    for _ in range(warmup):
        fa(), fb()
    ta, tb = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        fb()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return ta, tb


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--b", type=int, default=64)
    ap.add_argument("--t", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated verl loss modes (default: every registered one)")
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
    print(f"# verl_bench: B={a.b} T={a.t} float32, {a.threads} thread(s), {a.reps} rounds "
          f"of verl / ours alternated, forward+backward; copy floor {t_floor * 1e3:.3f} ms")
    print(f"{'mode':8s} {'loss_agg_mode':24s} {'verl ms min/med':>16s} {'ours ms min/med':>16s}"
          f" {'ours/verl min/med':>18s} {'compile ms':>10s} {'x floor':>8s} "
          f"{'peak MiB v/o':>13s}")
    cases = [(mode, agg) for mode in a.modes.split(",")
             for agg in (("seq-mean-token-mean",) if mode == "sapo" else AGG_MODES)]
    for mode, agg in cases:
        cfg = config(mode)
        theirs = ca.get_policy_loss_fn(mode)
        ours = ca.get_policy_loss_fn(f"ppo_kernels_{mode}")
        tvs, tos = alternated(lambda: step(theirs, old, lp, adv, mask, agg, cfg),
                              lambda: step(ours, old, lp, adv, mask, agg, cfg), a.reps)
        tv, to = statistics.median(tvs), statistics.median(tos)
        ratio_min = min(tos) / min(tvs)
        ratio_med = statistics.median(o / v for o, v in zip(tos, tvs))
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
        print(f"{mode:8s} {agg:24s} {min(tvs) * 1e3:7.2f}/{tv * 1e3:<8.2f} "
              f"{min(tos) * 1e3:7.2f}/{to * 1e3:<8.2f} {ratio_min:8.2f}/{ratio_med:<9.2f} "
              f"{tc * 1e3:10.2f} {to / t_floor:8.1f} {pv_:6.1f}/{po:<6.1f}", flush=True)


if __name__ == "__main__":
    main()
