"""The loss from hidden states on a GPU: pk.ppo_loss_from_hidden (bf16 logits, and float32
logits with logits_dtype=torch.float32) against materialised
logits + pk.ppo_loss and Liger-Kernel's fused-linear GRPO loss (LigerFusedLinearGRPOLoss,
when importable), forward+backward time (CUDA events, median) and peak allocated memory
beyond the inputs, bf16, with a check that the fused and materialised gradients agree.
Written for benchmarks/gpu_check.sh; UNRUN on a GPU so far. `--device cpu --quick` runs
the same code on the CPU kernels (a dry run of this script, not a measurement).

    python benchmarks/gpu_from_hidden.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import ppo_kernels as pk


def make(n, h, v, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    b = 8
    t = n // b
    hidden = (torch.randn(b, t, h, generator=g) / h ** 0.5).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g)).to(dtype).to(device)
    tokens = torch.randint(0, v, (b, t), generator=g).to(device)
    mask = (torch.rand(b, t, generator=g) > 0.1).to(device)
    with torch.no_grad():
        lp = pk.token_logprobs_from_hidden(hidden, weight, tokens, mask)
    old = lp + 0.05 * torch.randn(b, t, generator=g).to(device)
    adv = torch.randn(b, generator=g).to(device)  # per sequence, as GRPO
    return hidden, weight, tokens, mask, old, adv


def fused(hidden, weight, tokens, mask, old, adv):
    return pk.ppo_loss_from_hidden(hidden, weight, tokens, old, adv, mask,
                                   loss_agg_mode="seq-mean-token-mean")[0]


def fused_fp32_logits(hidden, weight, tokens, mask, old, adv):
    """logits_dtype=torch.float32: each chunk's bf16 matmul with a float32 output (cuBLAS,
    torch.mm out_dtype), no bf16 rounding of the logits (docs/FROM_HIDDEN.md)."""
    return pk.ppo_loss_from_hidden(hidden, weight, tokens, old, adv, mask,
                                   loss_agg_mode="seq-mean-token-mean",
                                   logits_dtype=torch.float32)[0]


def materialised(hidden, weight, tokens, mask, old, adv):
    logits = hidden @ weight.t()
    return pk.ppo_loss(logits, tokens, old, adv, mask, loss_agg_mode="seq-mean-token-mean")[0]


def liger():
    """Liger's module (bnpo-free grpo normalisation, no KL, as the two above), or None."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as e:  # not installed in the H200 image: carry its wheel (gpu_check.sh)
        print(f"liger: not importable ({type(e).__name__}: {e})")
        return None
    loss = LigerFusedLinearGRPOLoss(beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
                                    temperature=1.0, use_ref_model=False, loss_type="grpo")

    def run(hidden, weight, tokens, mask, old, adv):
        out = loss(weight, hidden, tokens, mask.to(hidden.dtype), adv, None, None, old)
        return out[0] if isinstance(out, tuple) else out

    return run


def step(fn, inputs):
    hidden, weight = (x.detach().requires_grad_(True) for x in inputs[:2])
    fn(hidden, weight, *inputs[2:]).backward()
    return hidden.grad, weight.grad


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
    ap.add_argument("--json")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    sizes = [(256, 64, 1000)] if a.quick else [(2048, 4096, 151936), (8192, 4096, 151936)]
    variants = {"fused from hidden": fused, "fused, fp32 logits": fused_fp32_logits,
                "logits + ppo_loss": materialised}
    lg = liger()
    if lg is not None:
        variants["liger fused-linear GRPO"] = lg
    rows = []
    for n, h, v in sizes:
        inputs = make(n, h, v, dtype, a.device)
        g1, w1 = step(fused, inputs)
        g2, w2 = step(materialised, inputs)
        err = max(float((g1.float() - g2.float()).abs().max() / g2.float().abs().max()),
                  float((w1.float() - w2.float()).abs().max() / w2.float().abs().max()))
        print(f"CHECK {'ok' if err < 2e-2 else 'FAIL'} from-hidden vs materialised N={n} "
              f"V={v}: max rel grad diff {err:.2e}")
        g3, w3 = step(fused_fp32_logits, inputs)
        err = max(float((g3.float() - g2.float()).abs().max() / g2.float().abs().max()),
                  float((w3.float() - w2.float()).abs().max() / w2.float().abs().max()))
        print(f"CHECK {'ok' if err < 2e-2 else 'FAIL'} fp32 logits vs materialised N={n} "
              f"V={v}: max rel grad diff {err:.2e}")
        for name, fn in variants.items():
            try:
                ms, peak = measure(fn, inputs, 3 if a.quick else 5, gpu)
            except Exception as e:  # report, keep measuring the others
                print(f"{name}: failed ({type(e).__name__}: {str(e)[:200]})")
                continue
            rows.append(dict(n=n, h=h, v=v, variant=name, ms=ms, peak_mib=peak))
            print(f"N={n:6d} H={h} V={v} {name:<26} {ms:9.2f} ms  peak {peak:9.1f} MiB")
        mine = {r["variant"]: r for r in rows if r["n"] == n}
        if "fused from hidden" in mine and "fused, fp32 logits" in mine:
            b, f = mine["fused from hidden"], mine["fused, fp32 logits"]
            print(f"N={n:6d} fp32 logits / bf16 logits: time {f['ms'] / b['ms']:.2f}x, peak "
                  f"{f['peak_mib'] / b['peak_mib']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
