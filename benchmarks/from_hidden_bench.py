"""CPU benchmark: the PPO loss from the last hidden states and the LM head weight, forward +
backward (gradients to hidden and to the head weight), against N. A configuration of the
package's entry point (`python -m ppo_kernels.bench --op ppo_loss_from_hidden`,
docs/BENCHMARKING.md), which measures and prints the tables; rows:

  fused                   pk.ppo_loss_from_hidden(h, W, ...) (chunks of --chunk rows; the
                          [N, V] logits are never stored; docs/FROM_HIDDEN.md)
  fused, fp32 logits      the same with logits_dtype=torch.float32: with --dtype bfloat16,
                          each chunk's logits in float32 (vLLM head_dtype=float32, SGLang
                          enable_fp32_lm_head); with --dtype float32 it is the fused row again
  materialised            logits = h @ W.T, then pk.ppo_loss(logits, ...) (the fused logits
                          kernel on the whole [N, V] logits)
  plain composite         F.linear, then log_softmax -> gather -> ratio -> clip -> masked mean
  F.cross_entropy         the same with logp = -F.cross_entropy(reduction="none")
  torch.compile           torch.compile of the plain composite
  eager composite         pk.ppo_loss_from_hidden(..., backend="torch")
  floor                   the head's three matmuls (the forward's logits, d hidden, dW)

    python benchmarks/from_hidden_bench.py            # H=512 V=32000 N=256,1024,4096 fp32
    python benchmarks/from_hidden_bench.py --quick    # a smoke test (seconds)
    python benchmarks/from_hidden_bench.py --n 1024 4096 --v 151936 --dtype bfloat16

Every row computes the same loss (token-mean vanilla clipped surrogate, clip 0.2, no KL, no
entropy bonus); the entry point compares the losses and gradients with the fused one first.
The chunked plain-PyTorch loops this script timed before (TRL's chunking, with and without
torch.utils.checkpoint) are not rows of the entry point; --variants still accepts their
names and says so. Timings are not tests.
"""

from __future__ import annotations

import argparse
import os

from ppo_kernels import bench

# this script's former row names -> the entry point's (None: no longer a row)
VARIANTS = {"fused": "fused", "fused, fp32 logits": "fused, fp32 logits",
            "materialised + ppo_loss": "materialised", "eager composite": "eager composite",
            "torch.compile": "torch.compile", "chunked torch (TRL)": None,
            "chunked + checkpoint": None}
BASELINES = ["plain composite", "F.cross_entropy", "torch.compile", "eager composite",
             "materialised", "floor"]


def argv_for(a):
    """The entry point's command line for this script's arguments."""
    b = 8 if all(n % 8 == 0 for n in a.n) else 1
    names = None if a.variants is None else {VARIANTS[x] for x in a.variants} - {None}
    skip = [] if names is None else [x for x in BASELINES if x not in names]
    extra = [] if names is not None and "fused, fp32 logits" not in names else \
        ["--extra", "fused, fp32 logits:logits_dtype=float32"]
    return ["--op", "ppo_loss_from_hidden", "--B", str(b),
            "--T", ",".join(str(n // b) for n in a.n), "--V", str(a.v), "--H", str(a.h),
            "--dtype", a.dtype, "--backend", "cpu", "--mode", "fwd+bwd",
            "--reps", str(a.reps), "--warmup", str(a.warmup), "--mask-frac", "0.1",
            "--opt", f"chunk_size={a.chunk}", *extra,
            *[x for s in skip for x in ("--skip", s)], *(["--json", a.json] if a.json else [])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=None,
                    help="Tokens (rows), several allowed (default 256 1024 4096).")
    ap.add_argument("--h", type=int, default=None, help="The hidden size (default 512).")
    ap.add_argument("--v", type=int, default=None, help="The vocabulary size (default 32000).")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="The dtype of the hidden states and the head.")
    ap.add_argument("--chunk", type=int, default=None,
                    help="Rows per chunk of the fused rows (default 1024).")
    ap.add_argument("--reps", type=int, default=None, help="Timed repetitions (default 3).")
    ap.add_argument("--warmup", type=int, default=1, help="Untimed calls of each row first.")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                    help="A subset of the rows (fused always runs).")
    ap.add_argument("--quick", action="store_true",
                    help="A smoke test: H=64 V=2048 N=64,256 chunk 64, 1 rep.")
    ap.add_argument("--json", help="Also write the results here (the entry point's JSON).")
    a = ap.parse_args()
    quick = dict(n=[64, 256], h=64, v=2048, chunk=64, reps=1)
    full = dict(n=[256, 1024, 4096], h=512, v=32000, chunk=1024, reps=3)
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    gone = [x for x in a.variants or [] if VARIANTS[x] is None]
    if gone:
        print(f"not rows of the entry point (skipped): {', '.join(gone)}")
    bench.reexec_with(bench.MMAP_ENV)  # (the peak memory: see bench.main)
    bench.run(argv_for(a))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    main()
