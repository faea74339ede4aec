"""Cost of sampling replay (docs/SAMPLING.md) over the plain op: a configuration of the
benchmark entry point (`ppo-kernels-bench`, ppo_kernels/bench.py).

For each V one run of the entry point, ppo_loss forward + backward, float32 (--dtype),
B = 4 sequences of N / 4 tokens (--n): the fused op without a kept set (the fused row), the plain
composite a user writes, its F.cross_entropy form, the library's eager composite and the
copy floor, and as extra fused rows (`--extra`): a given SamplingMask of 8 ids per position
(what vLLM's sampler returns at top_p ~ 0.9 on a confident policy), the same with a
per-sequence temperature tensor (0.7 to 1.3, prime-rl's schedules), the set re-derived
from top_k = 1024, top_p = 0.8 (the threshold pre-pass over every row), that with the
per-sequence temperature, and top_p = 0.9 alone; all interleaved in the same run. The extra rows compute another
loss than the fused row (a kept set), so the agreement check lists them as not compared;
tests/test_sampling.py checks them against the reference.

    python benchmarks/replay_bench.py [--quick] [--compile] [--json replay.json]
    python benchmarks/replay_bench.py --device cuda --backend triton   (GPU; unrun)
    python benchmarks/replay_bench.py --device cuda --backend triton --n 8192 \
        --v 151936 --dtype bfloat16 --reps 3 --skip 'plain composite,...'
                                                        (gpu_check.sh's shape)

Each V is the command

    ppo-kernels-bench --op ppo_loss --B 4 --T N/4 --V V --mode fwd+bwd --reps R --no-compile \\
        --extra 'given mask (k 8):sampling_mask_k=8' \\
        --extra 'given mask, temperature per seq:sampling_mask_k=8,temperature_per_seq=0.7:1.3' \\
        --extra 'top_k 1024, top_p 0.8:top_k=1024,top_p=0.8' \\
        --extra 'top_k 1024, top_p 0.8, temperature per seq:top_k=1024,top_p=0.8,\
temperature_per_seq=0.7:1.3' \
        --extra 'top_p 0.9:top_p=0.9'

Timings are not tests.
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

EXTRA = ["given mask (k 8):sampling_mask_k=8",
         "given mask, temperature per seq:sampling_mask_k=8,temperature_per_seq=0.7:1.3",
         "top_k 1024, top_p 0.8:top_k=1024,top_p=0.8",
         "top_p 0.9:top_p=0.9",
         "top_k 1024, top_p 0.8, temperature per seq:top_k=1024,top_p=0.8,"
         "temperature_per_seq=0.7:1.3"]


def argv_for(a, v):
    n = a.n or (32 if a.quick else 128)
    return ["--op", "ppo_loss", "--B", "4", "--T", str(n // 4), "--V", str(v),
            "--dtype", a.dtype, "--device", a.device, "--backend", a.backend,
            "--mode", "fwd+bwd",
            "--reps", str(3 if a.quick else a.reps), "--warmup", "1",
            *[x for e in EXTRA for x in ("--extra", e)],
            *([] if not a.skip else ["--skip", a.skip]),
            *([] if a.compile else ["--no-compile"])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 32 rows, 3 timed calls.")
    ap.add_argument("--compile", action="store_true",
                    help="Also torch.compile the plain composite.")
    ap.add_argument("--reps", type=int, default=5, help="Timed calls of each row.")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", default="cpu", help="The kernel backend (cpu, triton, cuda).")
    ap.add_argument("--n", type=int, default=None,
                    help="Rows (tokens), a multiple of 4 (default 128, 32 with --quick).")
    ap.add_argument("--v", type=int, nargs="+", default=[32768, 151936],
                    help="Vocabulary sizes (default 32768 151936).")
    ap.add_argument("--dtype", default="float32", help="The logits' dtype (default float32).")
    ap.add_argument("--skip", default=None,
                    help="Rows to leave out, as the entry point's --skip (e.g. 'eager "
                         "composite,plain composite').")
    ap.add_argument("--json", help="Write the runs' results (one per V) to this file.")
    a = ap.parse_args()
    results = {}
    for v in a.v:
        args = argv_for(a, v)
        print(shlex.join(["ppo-kernels-bench", *args]), flush=True)
        results[v] = bench.run(args)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    _measure.reexec_with(_measure.MMAP_ENV)
    main()
