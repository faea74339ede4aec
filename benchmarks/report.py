"""The benchmark report: every op over sizes (N tokens, V vocabulary, dtype), each fused
kernel beside the eager composite, torch.compile of it and the copy floor, all measured in
one run; writes a CSV and PNG plots of time and peak memory (`make report`).

    python benchmarks/report.py                # CPU, ~10 min on 2 cores -> benchmarks/results/
    python benchmarks/report.py --quick        # tiny sizes, a smoke test (~20 s)
    python benchmarks/report.py --replot       # the plots again from <out>'s CSV (no timing)
    python benchmarks/report.py --device cuda  # on a GPU: the cuda and triton backends (unrun)
    TRITON_INTERPRET=1 python benchmarks/report.py --device cuda --dry-run --quick
                                               # that code path on CPU tensors (slow: Triton's
                                               # interpreter; "cuda" rows skipped)

Sizes: an N sweep at V = the base V and a V sweep at N = the base N, each dtype. CPU
default: N 256, 1024, 4096 at V = 32768; V 8192, 32768, 131072 at N = 256; H = 256;
float32 and bfloat16. GPU default: N 2048, 8192, 32768 at V = 32768; V 32768, 151936 at
N = 8192; H = 2048. Files: <out>/{cpu,gpu}_report.csv, _time.png, _memory.png, _vocab.png
(benchmarks/_report_plots.py says what each shows).

Ops (inputs as benchmarks/cpu_bench.py and from_hidden_bench.py make them, B = 8 sequences
of T = N / 8 tokens, logits [B, T, V]):
  token_logprobs        forward, no grad (the old / reference log-probs)
  ppo_loss              forward + backward (token-mean, clip 0.2, the entropy metric)
  ppo_loss_gspo         the same with policy_loss="gspo" (the two-phase path)
  score_rollout         forward: logprobs, KL (k1), rewards, GAE advantages (no whitening)
  gae                   the reverse scan alone, float32 [B, T] (no V)
  ppo_loss_from_hidden  forward + backward from hidden [B, T, H] and the head W [V, H]
Backends: the fused kernel ("cpu"; "cuda" and "triton" on the GPU), "torch" (the eager
composite, backend="torch"), "torch.compile" (of that composite, dynamic=False; for
score_rollout the logits part only, the GAE scan runs eager: dynamo unrolls its loop over T,
which took 111 s to compile at T = 512 here; gae itself is compiled only up to
--gae-compile-max-t), and for ppo_loss_from_hidden "<fused>, materialised" (logits =
h @ W.T, then ppo_loss on them). The floor (op "floor", backend "copy") is one read + one
write of the [N, V] logits into mapped memory (_measure.CopyFloor), of [2, B, T] for gae.

CSV (one row per measurement): op, backend, N, V, H, dtype, median_ms, vs_floor (time over
the floor's at the same N, V, dtype), vs_fused (over the fused kernel's), peak_extra_mib,
reps. Time: the median of reps calls after one warm-up (compiles happen there), reps chosen
so a measurement takes about --target-s (at least --min-reps). Peak memory (MiB): on the
CPU, one call in a window opened after the warm-up: VmHWM (reset) minus VmRSS before it,
in this process, which runs with glibc's mmap threshold fixed (_measure.MMAP_ENV) so that
every freed large buffer leaves the RSS and none is reused unseen, and with the CPU kernels'
recycled gradient buffer handed back first (pk.empty_cache); --memory child measures each
in a fresh process instead, as from_hidden_bench.py does (5x slower; it agreed within
0.3 MiB on every op at N=1024, V=32768). On the GPU,
max_memory_allocated minus memory_allocated before the call; times from CUDA events. The
peak includes the outputs (the gradient). Timings are not tests.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402

if __name__ == "__main__":
    _measure.reexec_with(_measure.MMAP_ENV)  # before torch loads (in-process peaks: above)

import torch  # noqa: E402

import _report_plots  # noqa: E402
from _report_ops import OPS, Skipped, inputs_for, variants  # noqa: E402, F401 (OPS: tests)

import ppo_kernels as pk  # noqa: E402

COLUMNS = ["op", "backend", "N", "V", "H", "dtype", "median_ms", "vs_floor", "vs_fused",
           "peak_extra_mib", "reps"]


# ------------------------------------------------------------------ the grid

def grid(a):
    """[(N, V, dtype)], the base point's first, then by size: the N sweep at V = base V,
    the V sweep at N = base N."""
    bn, bv = a.base
    pts = {(bn, bv)} | {(n, bv) for n in a.n_sweep} | {(bn, v) for v in a.v_sweep}
    pts = [(bn, bv)] + sorted(pts - {(bn, bv)}, key=lambda p: (p[0] * p[1], p[0]))
    return [(n, v, d) for d in a.dtypes for n, v in pts]


def ops_at(n, v, dtype, a, gae_done):
    """The ops measured at this point: gae only once per N (float32, no V)."""
    ops = [o for o in a.ops if o != "gae"]
    if "gae" in a.ops and n not in gae_done:
        gae_done.add(n)
        ops.append("gae")
    return ops


# ------------------------------------------------------------------ measuring

def measure(step, x, meter, a, warm_out=None):
    """(median s, peak extra bytes, reps) of step(x): one warm-up call (its output goes to
    warm_out), one call in the peak-memory window, then the timed ones."""
    res = step(x)
    if warm_out is not None:
        warm_out.append(res)
    del res
    pk.empty_cache()
    t0 = time.perf_counter()
    peak = meter.peak_extra_bytes(lambda: step(x))
    first = time.perf_counter() - t0
    reps = max(a.min_reps, min(a.max_reps, math.ceil(a.target_s / max(first, 1e-6))))
    t = meter.median_s(lambda: step(x), None, reps, 0)
    pk.empty_cache()
    return t, peak, reps


def rel_err(got, ref):
    got = got if isinstance(got, (tuple, list)) else (got,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    return max(float((g.double() - r.double()).abs().max() /
                     r.double().abs().max().clamp(min=1e-30)) for g, r in zip(got, ref))


def child_peak(op, backend, n, v, dtype, a):
    args = [os.path.abspath(__file__), "--peak-of", op, backend, "--n-sweep", n, "--base", n, v,
            "--h", a.h, "--dtypes", dtype, "--device", a.device,
            "--gae-compile-max-t", a.gae_compile_max_t] + (["--dry-run"] if a.dry_run else [])
    return _measure.child_peak(args)


def peak_here(a, fused, device, meter):
    """--peak-of OP BACKEND: one warm-up and one call in the window, bytes to stdout."""
    op, backend = a.peak_of
    n, v = a.base
    x = inputs_for(op, n, v, a.h, getattr(torch, a.dtypes[0]), device)
    step = (lambda y: _FLOOR(y["both"] if op == "gae" else y["logits"])) if backend == "copy" \
        else variants(op, fused, device, a.gae_compile_max_t)[backend]
    step(x)
    pk.empty_cache()
    print(meter.peak_extra_bytes(lambda: step(x)))


_FLOOR = _measure.CopyFloor()


class Stop(Exception):
    """The budget is spent or SIGTERM (a timeout) came: write what was measured."""


def _on_sigterm(*_):
    raise Stop("SIGTERM")


def run(a, fused, device, meter, bar, rows):
    """Measures the grid into rows (CSV dicts), each grid point's as it completes; stops at
    --budget-s or SIGTERM (raises Stop, the rows so far kept)."""
    gae_done, checked, t_start = set(), set(), time.perf_counter()
    for n, v, dname in grid(a):
        dtype = getattr(torch, dname)
        torch._dynamo.reset()  # one shape per compiled function: no recompile limit reached
        at_point = []
        try:
            for op in ["floor"] + ops_at(n, v, dname, a, gae_done):
                if time.perf_counter() - t_start > a.budget_s:
                    raise Stop(f"budget of {a.budget_s:.0f} s spent, before {op} N={n} V={v} "
                               f"{dname}")
                measure_op(op, n, v, dname, dtype, a, fused, device, meter, bar, checked,
                           at_point)
        finally:
            rows += ratios(at_point, fused)


def measure_op(op, n, v, dname, dtype, a, fused, device, meter, bar, checked, at_point):
    """Measures every backend of op at one grid point into at_point (and checks their
    outputs against the eager composite's, at the first point of each op and dtype)."""
    x = inputs_for(op, n, v, a.h, dtype, device)
    table = ({"copy": lambda y: _FLOOR(y["logits"])} if op == "floor"
             else variants(op, fused, device, a.gae_compile_max_t))
    if op == "gae":  # its own floor: a [2, B, T] copy
        table = {"copy": lambda y: _FLOOR(y["both"]), **table}
    outs = {}
    for backend, step in table.items():
        if a.quick and backend == "torch.compile" and (
                (n, v) != tuple(a.base) or dname != a.dtypes[0]):
            bar.update()  # (--quick: compiling would take most of a smoke run)
            continue
        bar.set_postfix_str(f"{op} {backend} N={n} V={v} {dname}"[:60])
        warm = [] if op != "floor" and (op, dname) not in checked else None
        try:
            t, peak, reps = measure(step, x, meter, a, warm)
        except (Skipped, ValueError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not a.dry_run:
                raise
            bar.write(f"skipped {op} {backend} N={n} V={v} {dname}: "
                      f"{str(e).splitlines()[0][:100]}")
            bar.update()
            continue
        if warm:
            outs[backend] = warm[0]
        if a.memory == "child":
            peak = child_peak(op, backend, n, v, dname, a)
        is_floor = backend == "copy"
        at_point.append(dict(op="floor" if is_floor else op, backend=backend, N=n,
                             V="" if op == "gae" else v,
                             H=a.h if op == "ppo_loss_from_hidden" else "",
                             dtype="float32" if op == "gae" else dname,
                             median_ms=t * 1e3, peak_extra_mib=peak / 2**20, reps=reps,
                             _gae=op == "gae"))
        bar.update()
    _FLOOR.clear()
    if outs and "torch" in outs:
        checked.add((op, dname))
        tol = 1e-3 if dname == "float32" else 5e-2
        for backend, got in outs.items():
            if backend not in ("torch", "copy") and not rel_err(got, outs["torch"]) <= tol:
                bar.write(f"WARNING {op} {backend} N={n} V={v} {dname}: max rel. "
                          f"difference to torch {rel_err(got, outs['torch']):.1e}")
    del x, outs
    gc.collect()


def ratios(at_point, fused):
    """Fills vs_floor and vs_fused (over the first of the fused backends measured) of one
    grid point's rows."""
    floor = {r["_gae"]: r["median_ms"] for r in at_point if r["op"] == "floor"}
    fz = {}
    for be in reversed(fused):
        fz.update({r["op"]: r["median_ms"] for r in at_point if r["backend"] == be})
    for r in at_point:
        f = floor.get(r.pop("_gae"))
        r["vs_floor"] = r["median_ms"] / f if f else ""
        r["vs_fused"] = r["median_ms"] / fz[r["op"]] if r["op"] in fz else ""
    return at_point


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
                     median_ms=float(r["median_ms"]), vs_floor=num(r["vs_floor"], float),
                     vs_fused=num(r["vs_fused"], float), peak_extra_mib=float(r["peak_extra_mib"]),
                     reps=int(r["reps"])) for r in csv.DictReader(f)]


def summary(rows, fused):
    """A few headline ratios: at the largest N of each op and dtype (fused: the fused
    backends, the first one measured is shown)."""
    print(f"\n{'op':<22}{'dtype':<10}{'N':>6}{'V':>8}{'fused ms':>10}{'/ floor':>10}"
          f"{'torch':>10}{'compile':>10}{'peak MiB':>10}  (torch, compile: x the fused time)")
    for op in OPS:
        for d in ("float32", "bfloat16"):
            mine = [r for r in rows if r["op"] == op and r["dtype"] == d]
            if not mine:
                continue
            n, v = max((r["N"], r["V"] or 0) for r in mine)
            at = {r["backend"]: r for r in mine if r["N"] == n and (r["V"] or 0) == v}
            be = next((b for b in fused if b in at), None)
            if be is None:
                continue
            fl = at[be]["vs_floor"]
            fl = f"{fl:.3g}x" if fl != "" else "-"
            cell = [f"{at[b]['vs_fused']:.3g}x" if b in at else "-"
                    for b in ("torch", "torch.compile")]
            print(f"{op:<22}{d:<10}{n:>6}{v or '':>8}{at[be]['median_ms']:>10.4g}{fl:>10}"
                  f"{cell[0]:>10}{cell[1]:>10}{at[be]['peak_extra_mib']:>10.1f}  ({be})")


class _NoBar:
    def __init__(self, total=None, **_):
        self.total, self.done = total, 0

    def update(self, k=1):
        self.done += k

    def set_postfix_str(self, s):
        print(f"[{self.done}/{self.total}] {s}", file=sys.stderr, flush=True)

    def write(self, s):
        print(s, file=sys.stderr, flush=True)

    def close(self):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: tiny sizes, 1 rep, torch.compile at the base point "
                         "in float32 only")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dry-run", action="store_true",
                    help="with --device cuda: that code path on CPU tensors (backends that "
                         "need a GPU are skipped; triton runs with TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results"), help="output folder")
    ap.add_argument("--n-sweep", type=int, nargs="+", help="tokens N of the N sweep")
    ap.add_argument("--v-sweep", type=int, nargs="+", help="vocabularies V of the V sweep")
    ap.add_argument("--base", type=int, nargs=2, metavar=("N", "V"),
                    help="the N sweep runs at this V, the V sweep at this N")
    ap.add_argument("--h", type=int, help="hidden size of ppo_loss_from_hidden")
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"])
    ap.add_argument("--ops", nargs="+", choices=OPS, default=OPS)
    ap.add_argument("--target-s", type=float, help="seconds of timed calls per measurement")
    ap.add_argument("--min-reps", type=int)
    ap.add_argument("--max-reps", type=int, default=25)
    ap.add_argument("--gae-compile-max-t", type=int, default=64,
                    help="torch.compile of the GAE scan only up to this T (compile time ~ T)")
    ap.add_argument("--memory", default="inprocess", choices=["inprocess", "child"],
                    help="peak memory in this process (default) or a fresh one per variant")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="start no new op after this many seconds (then write what was "
                         "measured; a SIGTERM does the same)")
    ap.add_argument("--replot", action="store_true",
                    help="no measuring: the plots and summary from <out>'s CSV again")
    ap.add_argument("--peak-of", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    cpu_defaults = dict(n_sweep=[256, 1024, 4096], v_sweep=[8192, 32768, 131072],
                        base=[256, 32768], h=256, dtypes=["float32", "bfloat16"],
                        target_s=0.5, min_reps=3)
    gpu_defaults = dict(n_sweep=[2048, 8192, 32768], v_sweep=[32768, 151936],
                        base=[8192, 32768], h=2048, dtypes=["bfloat16", "float32"],
                        target_s=0.2, min_reps=5)
    quick = dict(n_sweep=[32, 64], v_sweep=[512], base=[64, 512], h=32,
                 dtypes=["float32", "bfloat16"], target_s=0.0, min_reps=1, max_reps=1)
    on_gpu = a.device == "cuda" and not a.dry_run
    for k, val in (quick if a.quick else gpu_defaults if on_gpu else cpu_defaults).items():
        if getattr(a, k) is None or (k == "max_reps" and a.quick):
            setattr(a, k, val)
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (--dry-run runs this path on "
                         "CPU tensors)")
    device = torch.device("cuda" if on_gpu else "cpu")
    fused = ["cuda", "triton"] if a.device == "cuda" else ["cpu"]
    meter = _measure.CudaMeter() if on_gpu else _measure.CpuMeter()
    if a.peak_of:
        return peak_here(a, fused, device, meter)

    prefix = "gpu" if a.device == "cuda" else "cpu"
    csv_path = os.path.join(a.out, f"{prefix}_report.csv")
    if a.replot:
        rows = read_csv(csv_path)
        print("\n".join(_report_plots.plot_all(rows, a, prefix, fused[0])))
        return summary(rows, fused)
    os.makedirs(a.out, exist_ok=True)
    info = pk.build_info()
    print(f"benchmark report on {'CPU tensors (dry run of the cuda path)' if a.dry_run else device}"
          f": {torch.get_num_threads()} threads, SIMD {info['cpu_capability']}"
          + (f", {torch.cuda.get_device_name()}" if on_gpu else "")
          + f"; memory {a.memory}; out {a.out}", flush=True)
    g = grid(a)
    gae_n = {n for n, _, _ in g}
    total = sum(1 + sum(len(variants(o, fused, device, a.gae_compile_max_t)) for o in a.ops
                        if o != "gae") for _ in g) + ("gae" in a.ops) * len(gae_n) * (
        2 + len(fused) + 1)
    try:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="meas", dynamic_ncols=True)
    except ImportError:  # (the GPU image may lack it)
        bar = _NoBar(total=total)
    t0, rows = time.perf_counter(), []
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        run(a, fused, device, meter, bar, rows)
    except Stop as e:
        bar.write(f"stopped: {e}; writing what was measured")
    bar.close()
    write_csv(rows, csv_path)
    pngs = _report_plots.plot_all(rows, a, prefix, fused[0])
    print(f"{len(rows)} measurements in {time.perf_counter() - t0:.0f} s -> {csv_path}"
          + "".join(f", {p}" for p in pngs))
    summary(rows, fused)


if __name__ == "__main__":
    main()
