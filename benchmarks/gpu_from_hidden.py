"""The loss from hidden states on a GPU: pk.ppo_loss_from_hidden (bf16 logits; dW summed
in bf16 in place with accum_dtype=torch.bfloat16; float32 logits with
logits_dtype=torch.float32) against materialised
logits + pk.ppo_loss and Liger-Kernel's fused-linear GRPO loss (LigerFusedLinearGRPOLoss,
when importable), forward+backward time (CUDA events, median) and peak allocated memory
beyond the inputs, bf16, with 0% and 50% of the tokens masked, and checks that the
gradients agree:
- fused (bf16 logits), and with the bf16 dW sum, vs materialised bf16 logits +
  pk.ppo_loss;
- fused with float32 logits vs a materialised float32 reference (hidden.float() @
  weight.float().t() + pk.ppo_loss on float32 leaves). Against the bf16 reference a few
  tokens near a clip edge flip their clip decision (|d logp| up to ~8e-3 between bf16 and
  float32 logits) and the max / max metric charges a flipped token's whole gradient (the
  first GPU run's 2.2e-1 at N = 8192): both metrics are printed, max|d| / max|ref| and the
  norm-relative ||d|| / ||ref||;
- Liger's loss against ours (the same loss: GRPO's per-sequence token mean, no KL).
The first GPU run (2026-12-04) timed the first three; this version is unrun on a GPU.
`--device cpu --quick` runs the same code on the CPU kernels (a dry run of this script,
not a measurement).

    python benchmarks/gpu_from_hidden.py [--quick] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ppo_kernels as pk  # noqa: E402


def make(n, h, v, dtype, device, masked=0.0, seed=0):
    """[8, n / 8] tokens, hidden [8, n / 8, h], weight [v, h]; a fraction ``masked`` of the
    positions masked (at random); old log-probs near the current ones; advantages per
    sequence."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    b = 8
    t = n // b
    hidden = (torch.randn(b, t, h, generator=g) / h ** 0.5).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g)).to(dtype).to(device)
    tokens = torch.randint(0, v, (b, t), generator=g).to(device)
    mask = (torch.rand(b, t, generator=g) >= masked).to(device)
    with torch.no_grad():
        lp = pk.token_logprobs_from_hidden(hidden, weight, tokens, mask)
    old = lp + 0.05 * torch.randn(b, t, generator=g).to(device)
    adv = torch.randn(b, generator=g).to(device)  # per sequence, as GRPO
    return hidden, weight, tokens, mask, old, adv


def fused(hidden, weight, tokens, mask, old, adv):
    return pk.ppo_loss_from_hidden(hidden, weight, tokens, old, adv, mask,
                                   loss_agg_mode="seq-mean-token-mean")[0]


def fused_bf16_accum(hidden, weight, tokens, mask, old, adv):
    # dW summed in the weight's dtype in place (Liger's default): no [V, H] float32 buffer
    return pk.ppo_loss_from_hidden(hidden, weight, tokens, old, adv, mask,
                                   loss_agg_mode="seq-mean-token-mean",
                                   accum_dtype=weight.dtype)[0]


def fused_fp32_logits(hidden, weight, tokens, mask, old, adv):
    """logits_dtype=torch.float32: each chunk's bf16 matmul with a float32 output (cuBLAS,
    torch.mm out_dtype), no bf16 rounding of the logits (docs/FROM_HIDDEN.md)."""
    return pk.ppo_loss_from_hidden(hidden, weight, tokens, old, adv, mask,
                                   loss_agg_mode="seq-mean-token-mean",
                                   logits_dtype=torch.float32)[0]


def materialised(hidden, weight, tokens, mask, old, adv):
    logits = hidden @ weight.t()
    return pk.ppo_loss(logits, tokens, old, adv, mask, loss_agg_mode="seq-mean-token-mean")[0]


def reference_fp32(hidden, weight, tokens, mask, old, adv):
    """The materialised float32 reference: float32 logits (each bf16 product is exact in
    float32; float32 sums) + pk.ppo_loss. Called on float32 leaves (step_fp32)."""
    logits = hidden.float() @ weight.float().t()
    return pk.ppo_loss(logits, tokens, old, adv, mask, loss_agg_mode="seq-mean-token-mean")[0]


def liger():
    """Liger's module (loss_type "grpo": the per-sequence token mean, no KL, as the ones
    above), or None."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as e:  # not installed in the H200 image: carry its wheel (gpu_check.sh)
        print(f"liger: not importable ({type(e).__name__}: {e})")
        return None
    loss = LigerFusedLinearGRPOLoss(beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
                                    temperature=1.0, use_ref_model=False, loss_type="grpo")

    def run(hidden, weight, tokens, mask, old, adv):
        # LigerFusedLinearGRPOLoss.forward(_input, lin_weight, selected_token_ids,
        # attention_mask, advantages, bias, ref_per_token_logps, old_per_token_logps, ...)
        # (liger_kernel/chunked_loss/grpo_loss.py): _input is [B, T, H], lin_weight [V, H];
        # by keyword, so an order mistake cannot pass silently. Returns (loss, metrics).
        out = loss(_input=hidden, lin_weight=weight, selected_token_ids=tokens,
                   attention_mask=mask.to(hidden.dtype), advantages=adv, bias=None,
                   ref_per_token_logps=None, old_per_token_logps=old)
        return out[0] if isinstance(out, tuple) else out

    return run


def step(fn, inputs, leaf_dtype=None):
    """fn's loss and its gradients in hidden and weight (leaves of leaf_dtype if given)."""
    hidden, weight = (x.detach().to(leaf_dtype or x.dtype).requires_grad_(True)
                      for x in inputs[:2])
    loss = fn(hidden, weight, *inputs[2:])
    loss.backward()
    return float(loss.detach()), hidden.grad, weight.grad


def grad_errors(got, ref):
    """(max|d| / max|ref|, ||d|| / ||ref||) over the hidden and the weight gradients (the
    larger of the two each)."""
    mm = nr = 0.0
    for a, b in zip(got, ref):
        d = a.float() - b.float()
        mm = max(mm, float(d.abs().max() / b.float().abs().max().clamp(min=1e-30)))
        nr = max(nr, float(d.norm() / b.float().norm().clamp(min=1e-30)))
    return mm, nr


def measure(fn, inputs, reps, gpu):
    step(fn, inputs)  # warm-up (and autotuning)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        if gpu:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(fn, inputs)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step(fn, inputs)
            times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if gpu else float("nan")
    return statistics.median(times), peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--masked", default="0,0.5",
                    help="comma list of the fractions of masked tokens (default 0,0.5)")
    ap.add_argument("--dtype", default="bfloat16", help="hidden and weight dtype")
    ap.add_argument("--json")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --quick for a dry run", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    sizes = [(256, 64, 1000)] if a.quick else [(2048, 4096, 151936), (8192, 4096, 151936)]
    fracs = [float(x) for x in a.masked.split(",")]
    variants = {"fused from hidden": fused, "fused, bf16 dW accum": fused_bf16_accum,
                "fused, fp32 logits": fused_fp32_logits, "logits + ppo_loss": materialised}
    lg = liger()
    if lg is not None:
        variants["liger fused-linear GRPO"] = lg
    rows, fails = [], 0

    def check(ok, what):
        nonlocal fails
        fails += not ok
        print(f"CHECK {'ok' if ok else 'FAIL'} {what}", flush=True)

    for n, h, v in sizes:
        for frac in fracs:
            inputs = make(n, h, v, dtype, a.device, masked=frac)
            tag = f"N={n} V={v} masked={frac:.0%}"
            l1, *g1 = step(fused, inputs)
            l2, *g2 = step(materialised, inputs)
            mm, nr = grad_errors(g1, g2)
            check(mm < 2e-2, f"from-hidden vs materialised {tag}: grad max/max {mm:.2e}, "
                             f"norm-relative {nr:.2e}")
            del g1
            _, *g1 = step(fused_bf16_accum, inputs)
            mm, nr = grad_errors(g1, g2)
            check(mm < 2e-2, f"from-hidden, bf16 dW sum, vs materialised {tag}: grad max/max "
                             f"{mm:.2e}, norm-relative {nr:.2e}")
            del g1
            # float32 logits against the materialised float32 reference
            _, *g3 = step(fused_fp32_logits, inputs)
            lr, *gr = step(reference_fp32, inputs, leaf_dtype=torch.float32)
            mm, nr = grad_errors(g3, gr)
            check(mm < 2e-2 and nr < 1e-2, f"fp32 logits vs materialised fp32 {tag}: grad "
                                           f"max/max {mm:.2e}, norm-relative {nr:.2e}")
            mm2, nr2 = grad_errors(g3, g2)  # the first run's comparison, for the record
            print(f"   fp32 logits vs materialised bf16 {tag}: grad max/max {mm2:.2e}, "
                  f"norm-relative {nr2:.2e} (clip flips count whole; info)", flush=True)
            del g2, g3, gr
            if lg is not None:
                try:
                    l4 = float(lg(*inputs))
                    d = abs(l4 - l2) / max(abs(l2), 1e-30)
                    check(d < 1e-2, f"liger loss vs ours {tag}: {l4:.6g} vs {l2:.6g} "
                                    f"(rel {d:.1e})")
                except Exception as e:  # report, the timings still run
                    check(False, f"liger call {tag}: {type(e).__name__}: {str(e)[:200]}")
            for name, fn in variants.items():
                try:
                    ms, peak = measure(fn, inputs, 3 if a.quick else 5, gpu)
                except Exception as e:  # report, keep measuring the others
                    print(f"{name}: failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
                    rows.append(dict(n=n, h=h, v=v, masked=frac, variant=name,
                                     status=f"failed: {type(e).__name__}: {str(e)[:200]}"))
                    continue
                rows.append(dict(n=n, h=h, v=v, masked=frac, variant=name, status="ok", ms=ms,
                                 peak_mib=peak))
                print(f"N={n:6d} H={h} V={v} masked {frac:4.0%} {name:<26} {ms:9.2f} ms  "
                      f"peak {peak:9.1f} MiB", flush=True)
            mine = {r["variant"]: r for r in rows
                    if r["n"] == n and r["masked"] == frac and r["status"] == "ok"}
            base = mine.get("logits + ppo_loss")
            for name, r in mine.items():  # the targets' ratios: time and peak / materialised
                if base is not None and name != "logits + ppo_loss":
                    print(f"N={n:6d} masked {frac:4.0%} {name:<26} / materialised: time "
                          f"{r['ms'] / base['ms']:.2f}x, peak "
                          f"{r['peak_mib'] / base['peak_mib']:.2f}x", flush=True)
            if "fused from hidden" in mine and "fused, fp32 logits" in mine:
                b, f = mine["fused from hidden"], mine["fused, fp32 logits"]
                print(f"N={n:6d} masked {frac:4.0%} fp32 logits / bf16 logits: time "
                      f"{f['ms'] / b['ms']:.2f}x, peak {f['peak_mib'] / b['peak_mib']:.2f}x",
                      flush=True)
            del inputs
            if gpu:
                torch.cuda.empty_cache()
            if a.json:  # after every configuration: a timeout keeps what was measured
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print(f"{fails} FAIL")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
