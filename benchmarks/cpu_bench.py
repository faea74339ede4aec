"""CPU benchmark: ppo_loss forward+backward, the fused `cpu` kernel against the plain PyTorch
composite (log_softmax -> gather -> ratio -> clip -> masked mean), its F.cross_entropy form,
torch.compile of it, the library's eager composite (backend="torch") and the copy floor, all
measured in the same run. A configuration of the package's entry point
(`python -m ppo_kernels.bench`, docs/BENCHMARKING.md), which measures and prints the table.

    python benchmarks/cpu_bench.py                 # N=4096 tokens, V=32768, float32
    python benchmarks/cpu_bench.py --dtype bfloat16
    python benchmarks/cpu_bench.py --n 512 --v 4096 --reps 3   # a quick look

Rows besides the baselines (more fused calls, each one's options changed):
  fused                   pk.ppo_loss(..., backend="cpu"); loss.backward()
  cpu, inplace_backward   the gradient written over the logits (no gradient buffer)
  cpu, (loss / 3)         gradient accumulation: grad_output 1/3, rescaled in place
  cpu, grad_scale=1/3     the same, with the scale known in the forward (no extra pass)
  cpu, gspo (two-phase)   a sequence-level loss: statistics pass, [B, T] middle, gradient
                          pass (one more read of the logits than the fused single pass)
The floor is what any fused forward+backward must at least do: read the logits once and
write a gradient of their size once into mapped memory. Reports min / median / max wall
time of forward+backward, the ratios to the fused kernel and the floor, and the peak extra
resident memory of one forward+backward (VmHWM, with glibc's mmap threshold set), in MiB
and in [N, V] float32 buffers. Timings are not tests.
"""

from __future__ import annotations

import argparse
import os

from ppo_kernels import bench

EXTRA = ["cpu, inplace_backward:inplace_backward=true",
         "cpu, (loss / 3):backward_scale=1/3",
         "cpu, grad_scale=1/3:grad_scale=1/3,backward_scale=1/3",
         "cpu, gspo (two-phase):policy_loss=gspo"]


def argv_for(a):
    """The entry point's command line for this script's arguments."""
    return ["--op", "ppo_loss", "--B", "8", "--T", str(max(1, a.n // 8)), "--V", str(a.v),
            "--dtype", a.dtype, "--backend", "cpu", "--mode", "fwd+bwd", "--reps", str(a.reps),
            "--warmup", str(a.warmup), "--mask-frac", "0.1",
            *[x for e in EXTRA for x in ("--extra", e)],
            *(["--json", a.json] if a.json else []), *(["--no-compile"] if a.no_compile else [])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="Tokens (rows), 8 sequences of N / 8.")
    ap.add_argument("--v", type=int, default=32768, help="The vocabulary size.")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="The logits' dtype.")
    ap.add_argument("--reps", type=int, default=5, help="Timed calls of each variant.")
    ap.add_argument("--warmup", type=int, default=2, help="Untimed calls of each variant first.")
    ap.add_argument("--no-compile", action="store_true", help="Skip the torch.compile row.")
    ap.add_argument("--json", help="Also write the results here (the entry point's JSON).")
    a = ap.parse_args()
    bench.reexec_with(bench.MMAP_ENV)  # (the peak memory: see bench.main)
    res = bench.run(argv_for(a))
    rows = {r["variant"]: r for r in res["points"][0]["modes"]["fwd+bwd"]}
    t = rows["fused"]["median_ms"]
    nv = a.n * a.v * 4

    def bufs(name):
        peak = rows[name]["peak_extra_bytes"]
        return float("nan") if peak is None else peak / nv

    def ratio(name):
        return rows[name]["median_ms"] / t if name in rows else float("nan")
    print(f"\ntargets: >= 3x eager (got {ratio('eager composite'):.2f}x), "
          f">= 1.5x torch.compile (got {ratio('torch.compile'):.2f}x), "
          f"within 2x of the floor (got {t / rows['floor']['median_ms']:.2f}x), "
          f"peak extra <= 1.05 [N,V] buffers (got {bufs('fused'):.3f})")
    print(f"backward scale: (loss / 3).backward() costs {ratio('cpu, (loss / 3)'):.2f}x the "
          f"time and {bufs('cpu, (loss / 3)'):.3f} buffers (loss.backward(): 1.00x, "
          f"{bufs('fused'):.3f}); with grad_scale=1/3: {ratio('cpu, grad_scale=1/3'):.2f}x, "
          f"{bufs('cpu, grad_scale=1/3'):.3f} buffers")
    print(f"two-phase path (gspo): {ratio('cpu, gspo (two-phase)'):.2f}x the fused single "
          f"pass, {bufs('cpu, gspo (two-phase)'):.3f} buffers")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    main()
