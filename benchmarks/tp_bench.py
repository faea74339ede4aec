"""Tensor-parallel vocabulary on the CPU (gloo): the overhead of splitting V over ranks.

    python benchmarks/tp_bench.py                  # N=2048 tokens, V=32000, 2 ranks, float32
    python benchmarks/tp_bench.py --n 512 --v 8000 --reps 3   # a quick look

Every variant runs with one thread per process, so that the 2 TP ranks use the machine's
2 cores as the unsharded op uses one: the ideal TP time is then the unsharded time / tp
(each rank reads and writes V / tp of every row), and the ratio measured / ideal is the
overhead (the collective, the merge of the statistics, the extra read of the logits of the
two-phase path that a split vocabulary takes). Measured in the same run: the unsharded
fused op (one pass over the logits), the unsharded two-phase path (gspo: the same passes
as TP), the split op for vanilla and gspo, the collective alone (the all-gather of the
per-row statistics) and, from hidden states, the all-reduce of d hidden. Prints the median
forward+backward wall time and the bytes each collective moves per row. Timings are not
tests.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ppo_kernels as pk


def inputs(n, v, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(logits=(torch.randn(1, n, v, generator=g) * 2).to(dtype),
                tokens=torch.randint(0, v, (1, n), generator=g),
                old=torch.randn(1, n, generator=g) * 0.1 - 2.0,
                adv=torch.randn(1, n, generator=g),
                hidden=torch.randn(1, n, h, generator=g).to(dtype),
                weight=(torch.randn(v, h, generator=g) * 0.05).to(dtype))


def median_ms(fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def loss_step(x, logits, policy, **kw):
    def run():
        z = logits.detach().requires_grad_()
        loss, _ = pk.ppo_loss(z, x["tokens"], x["old"], x["adv"], policy_loss=policy, **kw)
        loss.backward()
    return run


def hidden_step(x, weight, **kw):
    def run():
        h = x["hidden"].detach().requires_grad_()
        w = weight.detach().requires_grad_()
        loss, _ = pk.ppo_loss_from_hidden(h, w, x["tokens"], x["old"], x["adv"], **kw)
        loss.backward()
    return run


def worker(rank, world, port, a, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = inputs(a.n, a.v, a.h, getattr(torch, a.dtype))
    v_r = a.v // world
    v0 = rank * v_r
    v1 = a.v if rank == world - 1 else v0 + v_r
    local = x["logits"][..., v0:v1].contiguous()
    tp = dict(tp_group=dist.group.WORLD, vocab_start=v0)
    res = {}
    for policy in ("vanilla", "gspo"):
        dist.barrier()
        res[f"tp, {policy}"] = median_ms(loss_step(x, local, policy, **tp), a.reps)
    stats = torch.zeros(1, a.n, 6)
    dist.barrier()
    res["all-gather of the statistics alone"] = median_ms(
        lambda: pk.vocab_parallel.all_gather(stats, dist.group.WORLD), a.reps)
    dist.barrier()
    res["validity header alone (rank_agreement)"] = median_ms(
        lambda: pk.rank_agreement.checks_together({"tp_group": dist.group.WORLD},
                                                  lambda: None, lambda r: {}), a.reps)
    w_local = x["weight"][v0:v1].contiguous()
    dist.barrier()
    res["tp, from hidden (vanilla)"] = median_ms(hidden_step(x, w_local, **tp), a.reps)
    dh = torch.zeros(a.n, a.h)
    dist.barrier()
    res["all-reduce of d hidden alone"] = median_ms(
        lambda: dist.all_reduce(dh, group=dist.group.WORLD), a.reps)
    if rank == 0:
        queue.put(res)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--v", type=int, default=32000)
    ap.add_argument("--h", type=int, default=512)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    x = inputs(a.n, a.v, a.h, getattr(torch, a.dtype))
    base = {
        "unsharded, vanilla (fused: one pass)": median_ms(loss_step(x, x["logits"], "vanilla"),
                                                          a.reps),
        "unsharded, gspo (two-phase: two passes)": median_ms(
            loss_step(x, x["logits"], "gspo"), a.reps),
        "unsharded, from hidden (vanilla)": median_ms(hidden_step(x, x["weight"]), a.reps),
    }
    del x
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(worker, args=(a.tp, free_port(), a, queue), nprocs=a.tp,
                       start_method="spawn", join=False)
    tp = queue.get()
    item = torch.empty((), dtype=getattr(torch, a.dtype)).element_size()
    print(f"# tp_bench: N={a.n} V={a.v} H={a.h} {a.dtype}, tp={a.tp} (gloo, 1 thread per "
          f"process), median of {a.reps}, forward+backward")
    print(f"{'variant':44s} {'ms':>9s} {'x ideal':>8s}")
    ideal = {"tp, vanilla": base["unsharded, vanilla (fused: one pass)"] / a.tp,
             "tp, gspo": base["unsharded, gspo (two-phase: two passes)"] / a.tp,
             "tp, from hidden (vanilla)": base["unsharded, from hidden (vanilla)"] / a.tp}
    for k, ms in {**base, **tp}.items():
        ratio = f"{ms / ideal[k]:8.2f}" if k in ideal else ""
        print(f"{k:44s} {ms:9.1f} {ratio}")
    print(f"\nper row and rank: logits {a.v // a.tp * item} B read (twice on the split path), "
          f"dlogits {a.v // a.tp * item} B written;")
    print(f"  statistics all-gather: sends 24 B (6 float32: the statistics and the token id), "
          f"receives {24 * (a.tp - 1)} B (one collective per forward, none in the backward),")
    print(f"  after the validity header (40 B per rank and call, not per row);")
    print(f"  from hidden, d hidden all-reduce: {a.h * 4} B per row (float32), a ring moves "
          f"{2 * (a.tp - 1) * a.h * 4 // a.tp} B per row and rank.")


if __name__ == "__main__":
    sys.exit(main())
