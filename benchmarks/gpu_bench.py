"""GPU benchmark of ppo_kernels.ppo_loss against the memory-bandwidth floor and baselines.

For N tokens in {2048, 8192} and V in {32768, 151936} (bf16 logits [B, T + 1, V], the
model's raw output) it times forward and forward+backward, and the peak memory of each, of
`pk.ppo_loss` on the backends cuda, triton and torch (the package's eager composite, with
its metrics), of the plain eager loss `eager` (log_softmax -> gather -> ratio -> clip ->
masked token mean, nothing else: what a trainer writes by hand), of torch.compile of that
plain loss (`compile`), and of Liger-Kernel's `triton_grpo_loss` when importable; and a
device-to-device copy of the logits in the same run, the practical bandwidth ceiling
(METHOD.md). Advantages are per sequence (GRPO), so every row computes the same loss,
Liger's included, and each reports its relative error against the torch backend. (The
first GPU run, 2026-12-04, ran the earlier version; the eager / compile rows, the per-sequence
advantages and the forward's peak are unrun on a GPU.)

Bytes the op must move: forward reads the logits once (N V 2 bytes); forward+backward also
writes dlogits once. Achieved bandwidth = bytes / time; "%copy" = that over the copy's.
Times: CUDA events around each call, warm-up first, median of the repeats, an L2 flush (a
write of a buffer larger than L2) before every repeat, outside the timed region.
Also: long-T GAE (B = 8, T = 32768) per backend, and peak memory over the inputs.

    python benchmarks/gpu_bench.py                     # on a GPU; JSON to $OUT if set
    python benchmarks/gpu_bench.py --device cpu --small  # CPU smoke run of this script

Tuning knobs of the CUDA backend (csrc/cuda/row_kernels.cuh, plan_rows) can be swept with
--cuda-variants "default;PPO_CUDA_CLUSTER=1;PPO_CUDA_CLUSTER=1,PPO_CUDA_ROWS_PER_SM=1" (each
a row, its knobs separated by commas; none changes a result bit: the reduction tree is a
function of V only, csrc/cuda/NOTES.md).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ppo_kernels as pk  # noqa: E402


# ------------------------------------------------------------------ timing

class Timer:
    """Median time in ms of fn() over repeats; CUDA events and an L2 flush on the GPU."""

    def __init__(self, device, warmup, reps, flush_mb=256):
        self.device = device
        self.warmup, self.reps = warmup, reps
        self.flush = (torch.empty(flush_mb * 2**20, dtype=torch.uint8, device=device)
                      if device.type == "cuda" else None)

    def __call__(self, fn, setup=None):
        for _ in range(self.warmup):
            if setup:
                setup()
            fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            if setup:
                setup()
            if self.device.type == "cuda":
                self.flush.zero_()  # evict the logits from L2: every repeat starts cold
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), (min(times), max(times))


def peak_extra_mb(device, fn):
    """Peak memory allocated during fn() above what was allocated before (MB), GPU only."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# ------------------------------------------------------------------ inputs

def make_inputs(n_tokens, vocab, device, dtype, seq_len, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = min(seq_len, n_tokens)
    B = max(1, n_tokens // T)
    logits = (torch.randn(B, T + 1, vocab, generator=g, dtype=torch.float32) * 2).to(dtype)
    logits = logits.to(device)
    tokens = torch.randint(0, vocab, (B, T), generator=g).to(device)
    mask = torch.rand(B, T, generator=g) > 0.1
    mask = mask.to(device)
    # old_logprobs near the current ones, so most ratios are inside the clip band and the
    # gradient of almost every row is non-zero (a clipped row's gradient is all zeros and
    # a kernel may skip re-reading it: that would flatter the fused kernels)
    with torch.no_grad():
        logp = torch.empty(B, T, device=device)
        for b in range(B):
            z = logits[b, :T].float()
            logp[b] = z.gather(-1, tokens[b, :, None])[:, 0] - torch.logsumexp(z, -1)
    old = logp + 0.05 * torch.randn(B, T, generator=g).to(device)
    # per sequence (GRPO), written per token: the same loss for Liger's [B] advantages
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous().to(device)
    return dict(logits=logits, tokens=tokens, old_logprobs=old, advantages=adv,
                response_mask=mask)


# ------------------------------------------------------------------ backends

class Skip(Exception):
    """A backend that is not available here (reported as skipped, not failed)."""


def liger_fn():
    """Liger-Kernel's triton_grpo_loss, or None (not installed: skipped cleanly)."""
    for mod in ("liger_kernel.transformers.grpo_loss", "liger_kernel.chunked_loss.grpo_loss"):
        try:
            m = __import__(mod, fromlist=["triton_grpo_loss"])
            return m.triton_grpo_loss
        except Exception:  # ImportError, or a Liger that fails to import on this stack
            continue
    return None


def plain_loss(x, tokens, old, adv, mask, clip_eps, entropy_coef):
    """The plain eager PPO loss from logits [B, T + 1, V] (what a trainer writes by hand):
    log_softmax -> gather -> ratio -> clip -> token mean over the mask (minus
    entropy_coef * the entropy, when nonzero). No metrics. The `eager` baseline, and the
    function torch.compile compiles for `compile`."""
    T = tokens.shape[1]
    logp_all = torch.log_softmax(x[:, :T].float(), dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if entropy_coef:
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        per_token = per_token - entropy_coef * entropy
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp(min=1)


def make_runner(name, inp, kwargs, compiled_cache):
    """A callable (requires_grad) -> loss for backend `name`, or raises to mark it skipped."""
    if name in ("cuda", "triton", "torch", "cpu"):
        def run(x):
            loss, _ = pk.ppo_loss(x, inp["tokens"], inp["old_logprobs"], inp["advantages"],
                                  inp["response_mask"], backend=name, **kwargs)
            return loss
        return run
    if name in ("eager", "compile"):
        if name == "compile" and "fn" not in compiled_cache:
            compiled_cache["fn"] = torch.compile(plain_loss, dynamic=True)
        fn = compiled_cache["fn"] if name == "compile" else plain_loss
        eps, ent = kwargs["clip_eps_low"], kwargs["entropy_coef"]
        return lambda x: fn(x, inp["tokens"], inp["old_logprobs"], inp["advantages"],
                            inp["response_mask"], eps, ent)
    if name == "liger":
        fn = liger_fn()
        if fn is None:
            raise Skip("liger_kernel not importable")
        params = inspect.signature(fn).parameters
        adv_seq = inp["advantages"][:, 0].contiguous()  # Liger takes per-sequence advantages
        extra = {}
        for k, v in (("temperature", 1.0), ("beta", 0.0), ("eps_low", 0.2), ("eps_high", 0.2),
                     ("inplace", False)):
            if k in params:
                extra[k] = v

        def run(x):
            out = fn(x, inp["old_logprobs"], None, inp["tokens"], adv_seq,
                     inp["response_mask"].float(), **extra)
            loss = out[0] if isinstance(out, (tuple, list)) else out
            # Liger returns per-token losses (B, L) unless reduced: token-mean like ours
            if loss.dim() > 0:
                m = inp["response_mask"]
                loss = (loss * m).sum() / m.sum().clamp(min=1)
            return loss
        return run
    raise ValueError(name)


# ------------------------------------------------------------------ one configuration

def bench_config(n_tokens, vocab, args, device, timer, backends, results, deadline):
    inp = make_inputs(n_tokens, vocab, device, args.dtype, args.seq_len)
    logits = inp["logits"]
    B, Tl, V = logits.shape
    T = Tl - 1
    esize = logits.element_size()
    bytes_fwd = B * T * V * esize                      # read the valid logits once
    bytes_fwdbwd = bytes_fwd + B * Tl * V * esize       # + write dlogits once
    kwargs = dict(clip_eps_low=0.2, kl_coef=0.0, entropy_coef=args.entropy_coef)

    row = dict(N=B * T, V=V, B=B, T=T, dtype=str(args.dtype).replace("torch.", ""))
    # the ceiling: a device-to-device copy of the logits (bytes read + written)
    dst = torch.empty_like(logits)
    t_copy, _ = timer(lambda: dst.copy_(logits))
    del dst
    copy_gbs = 2 * logits.numel() * esize / (t_copy * 1e-3) / 1e9
    row["copy_ms"], row["copy_GBs"] = t_copy, copy_gbs
    print(f"\nN={B * T} V={V} ({B}x{T}, {args.dtype}): copy {t_copy:.3f} ms = "
          f"{copy_gbs:.0f} GB/s; floor fwd {bytes_fwd / copy_gbs / 1e6:.3f} ms, "
          f"fwd+bwd {bytes_fwdbwd / copy_gbs / 1e6:.3f} ms", flush=True)

    compiled = {}
    ref_loss = None
    ref_grad = None
    variants = [("", {})]
    if args.cuda_variants:
        variants = []
        for spec in args.cuda_variants.split(";"):
            env = dict(kv.split("=", 1) for kv in spec.split(",") if "=" in kv)
            variants.append((spec if env else "", env))
    for name in backends:
        for vname, env in (variants if name == "cuda" else [("", {})]):
            label = name + (f"[{vname}]" if vname else "")
            if time.time() > deadline:
                results.append(dict(row, backend=label, status="skipped (time budget)"))
                print(f"  {label:28s} skipped: time budget", flush=True)
                continue
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                run = make_runner(name, inp, kwargs, compiled)
                x_fwd = logits  # no grad: the kernels skip the gradient sweep
                with torch.no_grad():
                    t_f, spread_f = timer(lambda: run(x_fwd))
                    loss_val = float(run(x_fwd))
                x = logits.detach().clone().requires_grad_(True)

                def fwd_bwd():
                    x.grad = None
                    run(x).backward()
                t_fb, spread_fb = timer(fwd_bwd)
                with torch.no_grad():
                    mem_f = peak_extra_mb(device, lambda: run(x_fwd))
                mem = peak_extra_mb(device, fwd_bwd)
                grad_rows = x.grad[:, : min(T, 16)].float()
                del x
                if name == "torch" and not vname:
                    ref_loss, ref_grad = loss_val, grad_rows
                rec = dict(row, backend=label, status="ok", fwd_ms=t_f, fwdbwd_ms=t_fb,
                           fwd_spread=spread_f, fwdbwd_spread=spread_fb,
                           fwd_GBs=bytes_fwd / (t_f * 1e-3) / 1e9,
                           fwdbwd_GBs=bytes_fwdbwd / (t_fb * 1e-3) / 1e9,
                           peak_extra_MB=mem, peak_fwd_extra_MB=mem_f, loss=loss_val)
                rec["fwd_pct_copy"] = 100 * rec["fwd_GBs"] / copy_gbs
                rec["fwdbwd_pct_copy"] = 100 * rec["fwdbwd_GBs"] / copy_gbs
                if ref_loss is not None:
                    rec["loss_rel_err_vs_torch"] = abs(loss_val - ref_loss) / max(abs(ref_loss),
                                                                                 1e-30)
                    rec["grad_rel_err_vs_torch"] = float(
                        (grad_rows - ref_grad).norm() / ref_grad.norm().clamp(min=1e-30))
                results.append(rec)
                print(f"  {label:28s} fwd {t_f:8.3f} ms {rec['fwd_GBs']:6.0f} GB/s "
                      f"({rec['fwd_pct_copy']:5.1f}% copy) | fwd+bwd {t_fb:8.3f} ms "
                      f"{rec['fwdbwd_GBs']:6.0f} GB/s ({rec['fwdbwd_pct_copy']:5.1f}%) | "
                      f"peak fwd +{mem_f:.0f} / f+b +{mem:.0f} MB | loss {loss_val:.6g}"
                      + (f" relerr {rec['loss_rel_err_vs_torch']:.1e}/"
                         f"{rec['grad_rel_err_vs_torch']:.1e}"
                         if "loss_rel_err_vs_torch" in rec else ""), flush=True)
            except Skip as e:
                results.append(dict(row, backend=label, status=f"skipped: {e}"))
                print(f"  {label:28s} skipped: {e}", flush=True)
            except Exception as e:  # report and go on: one broken backend must not hide others
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                results.append(dict(row, backend=label, status="failed: " + msg))
                print(f"  {label:28s} FAILED {msg}", flush=True)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    del inp, logits


def bench_gae(args, device, timer, backends, results):
    B, T = (8, 32768) if not args.small else (2, 300)
    g = torch.Generator(device="cpu").manual_seed(1)
    r = torch.randn(B, T, generator=g).to(device)
    v = torch.randn(B, T, generator=g).to(device)
    m = (torch.rand(B, T, generator=g) > 0.05).to(device)
    print(f"\nGAE B={B} T={T}", flush=True)
    ref = None
    for name in [b for b in backends if b in ("cuda", "triton", "torch", "cpu")]:
        try:
            fn = lambda: pk.gae(r, v, m, gamma=0.99, lam=0.95, backend=name)  # noqa: E731
            t, spread = timer(fn)
            adv, _ = fn()
            if ref is None:
                ref = adv
            err = float((adv - ref).abs().max())
            results.append(dict(op="gae", B=B, T=T, backend=name, status="ok", ms=t,
                                spread=spread, max_abs_diff_vs_first=err))
            print(f"  {name:10s} {t:8.3f} ms   max|diff| vs first {err:.1e}", flush=True)
        except Exception as e:
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            results.append(dict(op="gae", B=B, T=T, backend=name, status="failed: " + msg))
            print(f"  {name:10s} FAILED {msg}", flush=True)


def summary_table(results):
    """The short table printed last: fwd+bwd ms, %copy and speedups of cuda / triton."""
    lines = []
    cfgs = []
    for r in results:
        if "V" in r and (r["N"], r["V"]) not in cfgs:
            cfgs.append((r["N"], r["V"]))
    hdr = f"{'N':>5} {'V':>6} {'backend':28s} {'fwd ms':>8} {'f+b ms':>8} {'f+b %copy':>9} " \
          f"{'x eager':>7} {'x compile':>9} {'x liger':>7} {'fwd MB':>8} {'f+b MB':>8}"
    lines.append(hdr)
    for n, vv in cfgs:
        rows = [r for r in results if r.get("N") == n and r.get("V") == vv]
        by = {r["backend"]: r for r in rows if r.get("status") == "ok"}

        def speed(base, r):
            b = by.get(base)
            return f"{b['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}" if b else "-"
        for r in rows:
            if r.get("status") != "ok":
                lines.append(f"{n:>5} {vv:>6} {r['backend']:28s} {r['status'][:60]}")
                continue
            lines.append(f"{n:>5} {vv:>6} {r['backend']:28s} {r['fwd_ms']:8.3f} "
                         f"{r['fwdbwd_ms']:8.3f} {r['fwdbwd_pct_copy']:8.1f}% "
                         f"{speed('eager', r):>7} {speed('compile', r):>9} "
                         f"{speed('liger', r):>7} {r['peak_fwd_extra_MB']:8.0f} "
                         f"{r['peak_extra_MB']:8.0f}")
    for r in results:
        if r.get("op") == "gae":
            lines.append(f"GAE {r['B']}x{r['T']} {r['backend']:10s} "
                         + (f"{r['ms']:.3f} ms" if r["status"] == "ok" else r["status"][:60]))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--dry-run", action="store_true", help="same as --device cpu --small")
    ap.add_argument("--backends", default=None,
                    help="comma list; default torch,cuda,triton,eager,compile,liger (GPU) "
                         "or torch,cpu,eager,compile (CPU)")
    ap.add_argument("--n", default=None, help="comma list of token counts")
    ap.add_argument("--v", default=None, help="comma list of vocabulary sizes")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--entropy-coef", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="stop starting new measurements after this many seconds")
    ap.add_argument("--cuda-variants", default="",
                    help='";"-separated launch-knob settings for the cuda backend (the '
                         'knobs of one setting ","-separated), e.g. '
                         '"default;PPO_CUDA_CLUSTER=1,PPO_CUDA_THREADS=256"')
    ap.add_argument("--no-gae", action="store_true")
    ap.add_argument("--json", default=None, help="JSON path (default $OUT/gpu_bench.json)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.small = "cpu", True
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --small for a smoke run", file=sys.stderr)
        return 2
    args.dtype = getattr(torch, args.dtype)
    if args.small:
        ns = [64, 200]
        vs = [1000, 4099]
        args.seq_len = min(args.seq_len, 32)
        args.warmup, args.reps = min(args.warmup, 1), min(args.reps, 3)
    else:
        ns, vs = [2048, 8192], [32768, 151936]
    if args.n:
        ns = [int(s) for s in args.n.split(",")]
    if args.v:
        vs = [int(s) for s in args.v.split(",")]
    # the two shapes first (N 8192 x V 151936, then N 2048 x V 32768), so that a
    # --budget-s that runs out costs the other shapes, never those
    first = [(8192, 151936), (2048, 32768)]
    shapes = [(n, v) for n, v in first if n in ns and v in vs]
    shapes += [(n, v) for n in ns for v in vs if (n, v) not in shapes]
    if args.backends:
        backends = args.backends.split(",")
    elif device.type == "cuda":
        backends = ["torch", "cuda", "triton", "eager", "compile", "liger"]
    else:
        backends = ["torch", "cpu", "eager", "compile"]
    if "torch" in backends:  # the reference for the error columns runs first
        backends = ["torch"] + [b for b in backends if b != "torch"]

    info = dict(torch=torch.__version__, device=(torch.cuda.get_device_name()
                                                 if device.type == "cuda" else "cpu"),
                build=pk.build_info(), backends=backends, small=args.small)
    print(json.dumps(info), flush=True)
    timer = Timer(device, args.warmup, args.reps)
    deadline = time.time() + args.budget_s
    results = []
    for n, v in shapes:
        bench_config(n, v, args, device, timer, backends, results, deadline)
    if not args.no_gae:
        bench_gae(args, device, timer, backends, results)

    out = args.json or (os.path.join(os.environ["OUT"], "gpu_bench.json")
                        if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(dict(info=info, results=results), f, indent=1,
                      default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
        print(f"\nwrote {out}")
    print("\n" + summary_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
