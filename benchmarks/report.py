"""The benchmark report: every op over sizes, a configuration of the benchmark entry point
(`ppo-kernels-bench`, ppo_kernels/bench.py): at each grid point one `bench.run` per op, so
the fused kernel, the plain composite a user writes, its F.cross_entropy form,
torch.compile of it, the library's eager composite (and, from hidden states, the
materialised logits) and the op's floor are timed interleaved in one run, after the entry
point's agreement check. Writes a CSV and PNG plots of time and peak memory (`make report`).

    python benchmarks/report.py                # CPU, 1 thread, CPU clock -> benchmarks/results/
    python benchmarks/report.py --quick        # tiny sizes, a smoke test (tests/test_report.py)
    python benchmarks/report.py --replot       # the plots and summary from <out>'s CSV again
    python benchmarks/report.py --device cuda  # on a GPU: the cuda and triton backends (unrun)

Each (op, point) is the command `ppo-kernels-bench --op OP --B 8 --T N/8 --V V [--H H]
--dtype D --mode MODE --reps R --warmup W [--opt ...]` (printed with --verbose). Sizes: an
N sweep at the base V and a V sweep at the base N, each dtype. CPU default: N 256, 1024,
4096 at V 32768; V 8192, 32768, 131072 at N 256; H 256; float32 and bfloat16 (from
hidden states float32 alone: --hidden-dtypes); 1 thread timed with the thread's CPU time
(--clock cpu: other jobs on a shared machine do not inflate it). GPU default: N 2048, 8192
at V 32768; V 32768, 151936 at N 8192; H 2048. The CSV is written after each
measurement; --resume measures only what it lacks.
Files: <out>/{cpu,gpu}_report.csv, _time.png, _memory.png, _vocab.png
(benchmarks/_report_plots.py says what each shows).

Ops (report name: entry point op, options, mode):
  token_logprobs        token_logprobs, forward (the old / reference log-probs)
  ppo_loss              ppo_loss, the op's defaults (token-mean, clip 0.2), fwd+bwd
  ppo_loss_gspo         ppo_loss with policy_loss=gspo (the two-phase path), fwd+bwd
  score_rollout         score_rollout, forward (logprobs, KL, rewards, GAE advantages)
  gae                   gae, float32 [B, T] (no V; once per N)
  ppo_loss_from_hidden  ppo_loss_from_hidden from hidden [B, T, H] and the head W [V, H]
CSV (one row per measurement): op, backend (the fused backend's name, or the entry point's
row name: "plain composite", "F.cross_entropy", "torch.compile", "eager composite",
"<fused>, materialised", "floor"), N, V, H, dtype, min_ms, median_ms, max_ms, vs_floor
(median over the op's floor at that point: one read + one write of the logits; the head's
matmuls from hidden states; a [2, B, T] copy for gae), vs_fused, peak_extra_mib, reps.
docs/BENCHMARKING.md describes the clocks and the memory measurement. Timings are not tests.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

if __name__ == "__main__":
    _measure.reexec_with(_measure.MMAP_ENV)  # before torch loads (the peak memory counts)

import torch  # noqa: E402

import _report_plots  # noqa: E402

from ppo_kernels import bench  # noqa: E402

COLUMNS = ["op", "backend", "N", "V", "H", "dtype", "min_ms", "median_ms", "max_ms",
           "vs_floor", "vs_fused", "peak_extra_mib", "reps"]
# report name -> (entry point op, its --opt arguments, mode)
CONFIGS = {
    "token_logprobs": ("token_logprobs", [], "fwd"),
    "ppo_loss": ("ppo_loss", [], "fwd+bwd"),
    "ppo_loss_gspo": ("ppo_loss", ["--opt", "policy_loss=gspo"], "fwd+bwd"),
    "score_rollout": ("score_rollout", [], "fwd"),
    "gae": ("gae", [], "fwd"),
    "ppo_loss_from_hidden": ("ppo_loss_from_hidden", [], "fwd+bwd"),
}
OPS = list(CONFIGS)
B = 8  # sequences per batch: T = N / 8


def grid(a):
    """[(N, V, dtype)], the base point's first, then by size: the N sweep at V = base V,
    the V sweep at N = base N."""
    bn, bv = a.base
    pts = {(bn, bv)} | {(n, bv) for n in a.n_sweep} | {(bn, v) for v in a.v_sweep}
    pts = [(bn, bv)] + sorted(pts - {(bn, bv)}, key=lambda p: (p[0] * p[1], p[0]))
    return [(n, v, d) for d in a.dtypes for n, v in pts]


def bench_args(op, n, v, dtype, backend, a, compile_here):
    """The entry point's arguments for one report op at one point."""
    bop, opts, mode = CONFIGS[op]
    args = ["--op", bop, "--B", str(B), "--T", str(n // B), "--V", str(v), "--H", str(a.h),
            "--dtype", "float32" if op == "gae" else dtype, "--device", a.device,
            "--backend", backend, "--mode", mode, "--reps", str(a.reps),
            "--warmup", str(a.warmup), "--gae-compile-max-t", str(a.gae_compile_max_t),
            # (the cross-entropy yardstick is for a call's fixed cost at small shapes)
            "--skip", "cross-entropy loss", "--quiet", *opts]
    if a.device == "cpu":
        args += ["--threads", str(a.threads), "--clock", a.clock]
    if not compile_here:
        args.append("--no-compile")
    return args


def rows_of(result, op, fused, baselines=True):
    """The CSV rows of one bench.run result (one point, one mode)."""
    p = result["points"][0]
    (mode_rows,) = p["modes"].values()
    by = {r["variant"]: r for r in mode_rows}
    floor = by.get("floor", {}).get("median_ms")
    names = {"fused": fused, "materialised": f"{fused}, materialised"}
    out = []
    for r in mode_rows:
        if not baselines and r["variant"] != "fused":
            continue
        peak = r["peak_extra_bytes"]
        out.append(dict(op=op, backend=names.get(r["variant"], r["variant"]), N=p["N"],
                        V="" if op == "gae" else p["V"],
                        H=p["H"] if op == "ppo_loss_from_hidden" else "",
                        dtype=result["dtype"], min_ms=r["min_ms"], median_ms=r["median_ms"],
                        max_ms=r["max_ms"],
                        vs_floor=r["median_ms"] / floor if floor else "",
                        vs_fused=r["vs"]["fused"],
                        peak_extra_mib=peak / 2**20 if peak is not None else 0.0,
                        reps=r["reps"]))
    return out


def measure_point(op, n, v, dtype, a, fused, compile_here):
    """bench.run for op at (n, v, dtype): the first fused backend with every baseline, each
    further one (GPU: triton) as its fused row alone. Returns (rows, disagreements)."""
    rows, bad = [], []
    for i, be in enumerate(fused):
        torch._dynamo.reset()  # one shape per compiled function: no recompile limit reached
        args = bench_args(op, n, v, dtype, be, a, compile_here and i == 0)
        if i:
            args += ["--skip", "plain composite,F.cross_entropy,torch.compile,"
                               "eager composite,materialised,floor"]
        if a.verbose:
            print(shlex.join(["ppo-kernels-bench", *args]), file=sys.stderr)
        res = bench.run(args)
        new = rows_of(res, op, be, baselines=i == 0)
        if i:  # its ratios against the first backend's floor and fused row
            first = {r["backend"]: r for r in rows}
            for r in new:
                r["vs_fused"] = r["median_ms"] / first[fused[0]]["median_ms"]
                fl = first.get("floor")
                r["vs_floor"] = r["median_ms"] / fl["median_ms"] if fl else ""
        rows += new
        bad += [f"{op} {name} N={n} V={v} {dtype}: max rel. difference "
                f"{d['value_max_rel_diff']:.1e} / grad {d['grad_max_rel_diff']}"
                for d_point in res["points"] for name, d in d_point["agreement"].items()
                if not d["agrees"]]
    return rows, bad


def measurement_key(op, n, v, dtype):
    """(op, N, V, dtype) of a measurement as its CSV rows hold it: gae is float32 [B, T],
    with no V (0 here)."""
    return (op, n, 0, "float32") if op == "gae" else (op, n, v, dtype)


def run(a, fused, rows, csv_path):
    """Measures the grid into rows, writing the CSV after each measurement (an interrupted
    run keeps what it measured; --resume skips what the CSV holds); stops after
    --budget-s."""
    t0 = time.perf_counter()
    # what the CSV holds already, by measurement_key; gae has one per N
    seen = {(r["op"], r["N"], r["V"] or 0, r["dtype"]) for r in rows}
    jobs = []
    for n, v, d in grid(a):
        for op in a.ops:
            key = measurement_key(op, n, v, d)
            if key not in seen and (op != "ppo_loss_from_hidden" or d in a.hidden_dtypes):
                seen.add(key)
                jobs.append((op, n, v, d))
    try:
        from tqdm import tqdm
        jobs_iter = tqdm(jobs, unit="op", dynamic_ncols=True)
        def write(s):
            jobs_iter.write(s, file=sys.stderr)
    except ImportError:  # (the GPU image may lack it)
        jobs_iter, write = jobs, lambda s: print(s, file=sys.stderr, flush=True)
    for op, n, v, d in jobs_iter:
        if time.perf_counter() - t0 > a.budget_s:
            write(f"stopped: budget of {a.budget_s:.0f} s spent, before {op} N={n} V={v} {d}")
            break
        if hasattr(jobs_iter, "set_postfix_str"):
            jobs_iter.set_postfix_str(f"{op} N={n} V={v} {d}"[:60])
        compile_here = not a.quick or ((n, v) == tuple(a.base) and d == a.dtypes[0])
        new, bad = measure_point(op, n, v, d, a, fused, compile_here)
        rows += new
        write_csv(rows, csv_path)
        for line in bad:
            write(f"WARNING {line}")


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.4g}" if isinstance(r[k], float) else r[k]) for k in COLUMNS})


def read_csv(path):
    """The rows of write_csv back, numbers as numbers ("" where a column does not apply)."""
    def num(x, kind):
        return kind(x) if x != "" else ""
    with open(path, newline="") as f:
        return [dict(r, N=int(r["N"]), V=num(r["V"], int), H=num(r["H"], int),
                     **{k: float(r[k]) for k in ("min_ms", "median_ms", "max_ms",
                                                 "peak_extra_mib")},
                     vs_floor=num(r["vs_floor"], float), vs_fused=num(r["vs_fused"], float),
                     reps=int(r["reps"])) for r in csv.DictReader(f)]


SUMMARY_COLS = ["plain composite", "F.cross_entropy", "torch.compile", "eager composite"]


def summary(rows, fused):
    """The fused median, its ratio to the floor and each baseline's median over the fused
    one, at the largest N of each op and dtype."""
    print(f"\n{'op':<22}{'dtype':<10}{'N':>6}{'V':>8}{'fused ms':>10}{'/ floor':>9}"
          + "".join(f"{c[:10]:>11}" for c in SUMMARY_COLS) + f"{'peak MiB':>10}"
          + "  (baselines: x the fused median)")
    for op in OPS:
        for d in ("float32", "bfloat16"):
            mine = [r for r in rows if r["op"] == op and r["dtype"] == d]
            if not mine:
                continue
            n, v = max((r["N"], r["V"] or 0) for r in mine)
            at = {r["backend"]: r for r in mine if r["N"] == n and (r["V"] or 0) == v}
            if fused not in at:
                continue
            fl = at[fused]["vs_floor"]
            cells = "".join(f"{at[b]['vs_fused']:>10.3g}x" if b in at else f"{'-':>11}"
                            for b in SUMMARY_COLS)
            print(f"{op:<22}{d:<10}{n:>6}{v or '':>8}{at[fused]['median_ms']:>10.4g}"
                  f"{(f'{fl:.3g}x' if fl != '' else '-'):>9}{cells}"
                  f"{at[fused]['peak_extra_mib']:>10.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="A smoke test: tiny sizes, 1 timed call, torch.compile at the base "
                         "point in the first dtype only.")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu: the cpu backend; cuda: the cuda and triton backends.")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results"), help="The output folder.")
    ap.add_argument("--n-sweep", type=int, nargs="+", help="Tokens N of the N sweep.")
    ap.add_argument("--v-sweep", type=int, nargs="+", help="Vocabularies V of the V sweep.")
    ap.add_argument("--base", type=int, nargs=2, metavar=("N", "V"),
                    help="The N sweep runs at this V, the V sweep at this N.")
    ap.add_argument("--h", type=int, help="The hidden size of ppo_loss_from_hidden.")
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"],
                    help="The logits' (the hidden states' and head's) dtypes.")
    ap.add_argument("--ops", nargs="+", choices=OPS, default=OPS, help="The report's ops.")
    ap.add_argument("--hidden-dtypes", nargs="+", choices=["float32", "bfloat16"],
                    help="The dtypes of ppo_loss_from_hidden (CPU default: float32 alone: "
                         "on a CPU without bfloat16 units torch's bfloat16 matmuls take a "
                         "slow path, 30 s for one [256, 32768] x [32768, 256] on an AVX2 "
                         "machine; GPU and --quick: every dtype).")
    ap.add_argument("--resume", action="store_true",
                    help="Keep the rows of <out>'s CSV and measure only what it lacks.")
    ap.add_argument("--reps", type=int, help="Timed calls of each variant per point.")
    ap.add_argument("--warmup", type=int, default=1,
                    help="Untimed calls of each variant first (torch.compile compiles here).")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads).")
    ap.add_argument("--clock", default="cpu", choices=["cpu", "wall"],
                    help="CPU timings: the thread's CPU time (needs --threads 1) or wall time.")
    ap.add_argument("--gae-compile-max-t", type=int, default=64,
                    help="torch.compile of the GAE scan only up to this T (compile time ~ T).")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="Start no new measurement after this many seconds, then write what "
                         "was measured.")
    ap.add_argument("--replot", action="store_true",
                    help="No measuring: the plots and summary from <out>'s CSV again.")
    ap.add_argument("--verbose", action="store_true",
                    help="Print the entry point command of each measurement.")
    a = ap.parse_args()
    on_gpu = a.device == "cuda"
    defaults = (dict(n_sweep=[32, 64], v_sweep=[512], base=[64, 512], h=32,
                     dtypes=["float32", "bfloat16"], reps=1) if a.quick else
                dict(n_sweep=[2048, 8192], v_sweep=[32768, 151936], base=[8192, 32768],
                     h=2048, dtypes=["bfloat16", "float32"], reps=10) if on_gpu else
                dict(n_sweep=[256, 1024, 4096], v_sweep=[8192, 32768, 131072],
                     base=[256, 32768], h=256, dtypes=["float32", "bfloat16"], reps=5))
    for k, val in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, val)
    if a.hidden_dtypes is None:
        a.hidden_dtypes = a.dtypes if on_gpu or a.quick else ["float32"]
    fused = ["cuda", "triton"] if on_gpu else ["cpu"]
    prefix = "gpu" if on_gpu else "cpu"
    csv_path = os.path.join(a.out, f"{prefix}_report.csv")
    if a.replot:
        rows = read_csv(csv_path)
        print("\n".join(_report_plots.plot_all(rows, a, prefix, fused[0])))
        return summary(rows, fused[0])
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    os.makedirs(a.out, exist_ok=True)
    info = bench.pk.build_info()
    print(f"benchmark report on {a.device}: {a.threads if not on_gpu else ''} "
          f"{'thread(s), clock ' + a.clock if not on_gpu else torch.cuda.get_device_name()}"
          f", SIMD {info['cpu_capability']}, torch {torch.__version__}, {a.reps} timed "
          f"calls per variant; out {a.out}", flush=True)
    rows = read_csv(csv_path) if a.resume and os.path.exists(csv_path) else []
    t0 = time.perf_counter()
    run(a, fused, rows, csv_path)
    write_csv(rows, csv_path)
    pngs = _report_plots.plot_all(rows, a, prefix, fused[0])
    print(f"{len(rows)} measurements in {time.perf_counter() - t0:.0f} s -> {csv_path}"
          + "".join(f", {p}" for p in pngs))
    summary(rows, fused[0])


if __name__ == "__main__":
    main()
