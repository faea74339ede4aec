"""pk.distill_loss (top-k distillation) forward + backward against the plain composite a
user writes, torch.compile of it, the library's eager composite and the copy floor: a
configuration of the benchmark entry point (`ppo-kernels-bench`, ppo_kernels/bench.py).

    python benchmarks/distill_bench.py                 # N = 256, 1024; V = 32000; k = 64
    python benchmarks/distill_bench.py --quick         # a smoke test (seconds)
    python benchmarks/distill_bench.py --n 1024 --v 151936 --k 20 --dtype bfloat16

is the command

    ppo-kernels-bench --op distill_loss --B 8 --T N/8,... --V V --teacher-k K --dtype D \\
        --mode fwd+bwd --reps R [--threads 1 --clock cpu]

Every row computes the same loss (token-mean, tail on): the entry point checks the losses
and gradients against the fused one first. On a shared machine --threads 1 (with the
thread's CPU time as the clock) gives the steadiest numbers. Timings are not tests.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

from ppo_kernels import bench  # noqa: E402


def argv_for(a):
    n = [32, 64] if a.quick else a.n
    return ["--op", "distill_loss", "--B", "8", "--T", ",".join(str(max(1, x // 8)) for x in n),
            "--V", str(512 if a.quick else a.v), "--teacher-k", str(min(a.k, 16) if a.quick
                                                                   else a.k),
            "--dtype", a.dtype, "--device", a.device, "--mode", "fwd+bwd",
            "--reps", str(1 if a.quick else a.reps),
            *(["--threads", "1", "--clock", "cpu"] if a.threads_1 else []),
            *(["--no-compile"] if a.no_compile else []),
            *(["--json", a.json] if a.json else [])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[256, 1024], help="Tokens N.")
    ap.add_argument("--v", type=int, default=32000, help="Vocabulary size.")
    ap.add_argument("--k", type=int, default=64, help="The teacher's ids per position.")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=5, help="Timed calls of each row.")
    ap.add_argument("--quick", action="store_true", help="N 32, 64; V 512: a smoke test.")
    ap.add_argument("--no-compile", action="store_true", help="Skip the torch.compile row.")
    ap.add_argument("--threads-1", action="store_true",
                    help="One thread, timed with its CPU time (steady on a shared machine).")
    ap.add_argument("--json", help="Also write the entry point's JSON to this file.")
    a = ap.parse_args()
    args = argv_for(a)
    print(shlex.join(["ppo-kernels-bench", *args]), flush=True)
    bench.run(args)


if __name__ == "__main__":
    _measure.reexec_with(_measure.MMAP_ENV)
    main()
