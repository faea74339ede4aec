"""The tensor-parallel rows of the benchmark entry point (`ppo-kernels-bench --tp N`): the
fused op with its vocabulary split over N processes (gloo, CPU), timed beside the unsharded
rows of the same run.

Each rank builds the same inputs as the unsharded rows (bench.make_inputs, same seed) and
keeps its slice of the vocabulary: logits [..., v0:v1], or the head's rows W[v0:v1]; the op
is called with tp_group and vocab_start (README, "Tensor-parallel vocabulary"). The ranks
run with the threads of the unsharded rows each, so with --threads 1 and N ranks on N
cores the ideal time is the unsharded fused time / N (each rank reads and writes V / N of
every row); `vs ideal` is the measured median over that. Per timed round every rank meets
at a barrier first, then rank 0's clock times its call (which waits for the collectives).
Also timed alone, on the same ranks: the collectives of the forward (the all-gather of the
per-row statistics, 6 float32 per row; the validity header every call starts with,
rank_agreement.checks_together) and, from hidden states, the backward's all-reduce of
d hidden (float32 [N, H]).

Launched with torch.multiprocessing (spawn) on a free localhost port; CPU only. Timings
are not tests.
"""

from __future__ import annotations

import os
import queue
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ppo_kernels import rank_agreement, vocab_parallel

TP_OPS = ("ppo_loss", "ppo_loss_from_hidden")


def vocab_slice(v, rank, world):
    """[v0, v1) of rank's vocabulary (the last rank takes the remainder)."""
    width = v // world
    v0 = rank * width
    return v0, (v if rank == world - 1 else v0 + width)


def _worker(rank, world, port, job, results):
    bench = job["bench"]  # (the entry point's functions, pickled by reference)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(job["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        op, (b, t, v, h) = job["op"], job["size"]
        x = bench.make_inputs(op, b, t, v, h, job["dtype"], "cpu", job["mask_frac"], 64,
                              job["seed"])
        v0, v1 = vocab_slice(v, rank, world)
        from_hidden = op.endswith("_from_hidden")
        key = "w" if from_hidden else "logits"
        x[key] = (x[key][v0:v1] if key == "w" else x[key][..., v0:v1]).contiguous()
        group = dist.group.WORLD
        opts = dict(job["opts"], tp_group=group, vocab_start=v0)
        var = bench.Variant(f"fused, tp {world}", bench.fused_fn(op, job["backend"], opts),
                            "fused", scale=float(job["opts"].get("backward_scale", 1.0)))
        meter = bench.CpuMeter(job["clock"])
        stats = torch.zeros(b * t, 6)
        d_hidden = torch.zeros(b * t, h)
        src = x[key]
        # in place: each call gets a fresh copy of the slice (the gradient overwrites it)
        prep = (lambda: dict(x, logits=src.clone())) if job["opts"].get("inplace_backward") \
            else (lambda: x)
        vals, _ = bench.step(var, prep(), job["modes"][0], op)  # (the agreement check's)
        rows = {"value": [float(t.detach().double().sum()) for t in vals]}
        for mode in job["modes"]:
            for _ in range(job["warmup"]):
                bench.step(var, prep(), mode, op)
            times = []
            for _ in range(job["reps"]):
                dist.barrier()
                times += meter.times_s(lambda ready: bench.step(var, ready, mode, op),
                                       prep, reps=1, warmup=0)
            rows[mode] = [bench.time_row(var.name, "fused", times)]
        alone = [("tp all-gather alone", lambda: vocab_parallel.all_gather(stats, group)),
                 ("tp validity header alone", lambda: rank_agreement.checks_together(
                     {"tp_group": group}, lambda: None, lambda r: {}))]
        if from_hidden and "fwd+bwd" in job["modes"]:
            alone.append(("tp all-reduce alone",
                          lambda: dist.all_reduce(d_hidden, group=group)))
        for name, fn in alone:
            times = []
            for _ in range(job["reps"]):
                dist.barrier()
                times += meter.times_s(lambda _r: fn(), lambda: None, reps=1, warmup=0)
            for mode in job["modes"]:
                if name != "tp all-reduce alone" or mode == "fwd+bwd":
                    rows[mode].append(bench.time_row(name, "collective", times))
        if rank == 0:
            results.put(rows)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp_rows(world, job):
    """{mode: [row], "value": [the sum of each output]} of the fused op split over `world`
    gloo ranks (rank 0's), and its collectives timed alone. job: op, size (B, T, V, H),
    dtype, backend, opts, modes, reps, warmup, threads, clock, mask_frac, seed, and bench:
    an object with the entry point's make_inputs, fused_fn, Variant, step, CpuMeter and
    time_row (this module does not import it). A rank that fails raises here (torch's
    ProcessRaisedException, with its traceback) instead of leaving this call waiting."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.start_processes(_worker, args=(world, free_port(), job, results), nprocs=world,
                               start_method="spawn", join=False)
    while True:
        try:
            rows = results.get(timeout=1.0)
            break
        except queue.Empty:
            if procs.join(timeout=0):  # (raises when a rank failed)
                raise RuntimeError("--tp: the ranks exited without results")
    procs.join()
    return rows


def check(a, op, device):
    """Raises SystemExit saying why --tp cannot run here; nothing without --tp."""
    if a.tp <= 1:
        return
    if device != "cpu":
        raise SystemExit("--tp launches gloo ranks on the CPU: use --device cpu")
    if op not in TP_OPS:
        raise SystemExit(f"--tp: {op} is not wired (one of {', '.join(TP_OPS)})")
    if min(a.V) < a.tp:
        raise SystemExit(f"--tp {a.tp}: V must be at least the number of ranks")
