"""Tensor-parallel vocabulary on the CPU (gloo): the overhead of splitting V over ranks, a
configuration of the benchmark entry point (`ppo-kernels-bench --tp`, ppo_kernels/bench_tp.py).

    python benchmarks/tp_bench.py                  # N=2048 tokens, V=32000, H=512, 2 ranks
    python benchmarks/tp_bench.py --n 512 --v 8000 --reps 3 --json tp.json   # a quick look

Three runs of the entry point, forward+backward, one thread per process (so 2 ranks use
the machine's 2 cores as the unsharded op uses one: the ideal split time is the unsharded
fused time / tp), each timing the unsharded fused op, the split one and its collective
alone in one run:

    ppo-kernels-bench --op ppo_loss --B 1 --T N --V V --tp 2 --threads 1 --mode fwd+bwd \\
        --skip 'plain composite,F.cross_entropy,torch.compile,eager composite,floor'
    the same with --opt policy_loss=gspo (the two-phase path the split takes anyway)
    ppo-kernels-bench --op ppo_loss_from_hidden --H 512 ... (and the d hidden all-reduce)

Prints min / median / max, the ratio to the ideal, and the bytes each collective moves per
row; --json writes the three results. Timings are not tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

from ppo_kernels import bench  # noqa: E402

SKIP = "plain composite,F.cross_entropy,torch.compile,eager composite,floor,materialised"
RUNS = {"vanilla": ("ppo_loss", []), "gspo": ("ppo_loss", ["--opt", "policy_loss=gspo"]),
        "from hidden (vanilla)": ("ppo_loss_from_hidden", [])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2048, help="Tokens (one sequence of N).")
    ap.add_argument("--v", type=int, default=32000, help="Vocabulary size.")
    ap.add_argument("--h", type=int, default=512, help="Hidden size (from hidden states).")
    ap.add_argument("--tp", type=int, default=2, help="Ranks the vocabulary is split over.")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=5, help="Timed calls of each row.")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="wall, or the calling thread's CPU time (rank 0's: it does not "
                         "count the time spent waiting for the other ranks).")
    ap.add_argument("--json", help="Write the three entry point results to this file.")
    a = ap.parse_args(argv)
    results = {}
    for name, (op, opts) in RUNS.items():
        args = ["--op", op, "--B", "1", "--T", str(a.n), "--V", str(a.v), "--H", str(a.h),
                "--dtype", a.dtype, "--tp", str(a.tp), "--threads", "1", "--clock", a.clock,
                "--mode", "fwd+bwd", "--reps", str(a.reps), "--warmup", "1", "--no-memory",
                "--skip", SKIP, "--quiet", *opts]
        print(shlex.join(["ppo-kernels-bench", *args]), flush=True)
        results[name] = bench.run(args)
    print(f"\n# tp_bench: N={a.n} V={a.v} H={a.h} {a.dtype}, tp={a.tp} (gloo, 1 thread per "
          f"process), {a.reps} timed calls, forward+backward, clock {a.clock}")
    print(f"{'row':46s} {'min ms':>8s} {'median ms':>10s} {'max ms':>8s} {'x ideal':>8s}")
    for name, res in results.items():
        for r in res["points"][0]["modes"]["fwd+bwd"]:
            label = {"fused": f"unsharded, {name}"}.get(r["variant"], f"{r['variant']}, {name}")
            ideal = f"{r['vs_ideal']:8.2f}" if "vs_ideal" in r else ""
            print(f"{label:46s} {r['min_ms']:8.1f} {r['median_ms']:10.1f} {r['max_ms']:8.1f} "
                  f"{ideal}")
    item = 2 if a.dtype == "bfloat16" else 4
    print(f"\nper row and rank: logits {a.v // a.tp * item} B read (twice on the split path), "
          f"dlogits {a.v // a.tp * item} B written;")
    print(f"  statistics all-gather: sends 24 B (6 float32: the statistics and the token id), "
          f"receives {24 * (a.tp - 1)} B (one collective per forward, none in the backward),")
    print("  after the validity header (40 B per rank and call, not per row);")
    print(f"  from hidden, d hidden all-reduce: {a.h * 4} B per row (float32), a ring moves "
          f"{2 * (a.tp - 1) * a.h * 4 // a.tp} B per row and rank.")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    _measure.reexec_with(_measure.MMAP_ENV)
    sys.exit(main())
