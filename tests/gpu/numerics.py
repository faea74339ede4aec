"""GPU device checks of the numerics at the edges, each kernel backend against the eager
composite or the float64 reference (ppo_kernels/reference.py):

- finfo_min_block: a leading half of the vocabulary at finfo.min (HF-style masks): loss,
  entropy and dlogits finite;
- tiny_temperature_backward: the token_logprobs backward of a 5-logit row at temperatures
  1e-3 and 1e-10 against the eager composite;
- accuracy_vs_reference: float32 [4, 64, 32000] logits with confident rows (old log-probs
  drawn near the log-probs of those logits): logp, entropy and dlogits against reference.py
  within the device tolerances (csrc/cuda/NOTES.md: logp / H absolute, dlogits relative to
  the row's largest entry), and the suite's test_vocab_one_with_odd_unit_stride on the GPU
  backends (its cuda and triton_cuda ids must both pass).

    python tests/gpu/numerics.py [--device cpu --small] [--budget-s S]

(tests/gpu/_harness.py: the CHECK lines, the budget, the CPU dry run.)
"""

from __future__ import annotations

import subprocess
import sys

import torch

from _harness import ROOT, check, finite, inputs, main, maxabs, report

import ppo_kernels as pk  # noqa: E402  (after _harness: the repository root on sys.path)
from ppo_kernels import reference as R  # noqa: E402


@check
def finfo_min_block(ctx):
    """A leading half of the vocabulary at finfo.min: loss, H, dlogits finite."""
    V = 4096 if ctx.small else 32768
    dt = torch.bfloat16
    logits, _, mask, old, adv = inputs(ctx, 2, 4, V, dt)
    logits[..., : V // 2] = torch.finfo(dt).min
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(V // 2, V, (2, 4), generator=g).to(ctx.dev)
    out = []
    for be in ctx.kern:
        x = logits.detach().clone().requires_grad_(True)
        loss, _ = pk.ppo_loss(x, tokens, old, adv, mask, entropy_coef=0.01, backend=be)
        loss.backward()
        lp, ent = pk.token_logprobs(logits, tokens, mask, return_entropy=True, backend=be)
        ok = finite(loss, x.grad, lp, ent)
        out.append(f"{be}={'finite' if ok else 'NaN/inf'}")
        report(f"finfo_min[{be}]", "ok" if ok else "FAIL",
               f"loss {float(loss):.6g} H[0,0] {float(ent[0, 0]):.6g}")
    print("   " + ", ".join(out))


@check
def tiny_temperature_backward(ctx):
    """token_logprobs backward on the 5-logit row at T = 1e-3, 1e-10 vs torch."""
    base = torch.tensor([[[1.5410, -0.2934, -2.1788, 0.5684, -1.0845]]])
    for temp in (1e-3, 1e-10):
        for tok in range(5):
            tokens = torch.tensor([[tok]], device=ctx.dev)
            grads = {}
            for be in ["torch"] + ctx.kern:
                x = base.to(ctx.dev).clone().requires_grad_(True)
                lp, ent = pk.token_logprobs(x, tokens, temperature=temp, return_entropy=True,
                                            backend=be)
                (lp.sum() + 0.1 * ent.sum()).backward()
                grads[be] = x.grad.double().cpu()
            for be in ctx.kern:
                g, r = grads[be], grads["torch"]
                err = float(((g - r).abs() / (r.abs() + 1e-30 * (1 / temp))).max()) \
                    if finite(g) else float("inf")
                ok = finite(g) and float((g - r).abs().max()) <= 3e-6 * float(r.abs().max()) + 1e-30
                if not ok or tok == 2:
                    report(f"tiny_temperature[{be} T={temp:g} tok={tok}]", "ok" if ok else "FAIL",
                           f"max rel err {err:.2e}")


def row_rel_err(got, want):
    """max over rows of max|got - want| / max|want| in that row (the last dimension): the
    device tolerance of dlogits is relative to the row's largest entry (csrc/cuda/NOTES.md,
    "dlogits ~2e-7 relative to the largest entry of the row"). A row whose reference is all
    zeros (masked) counts its largest |got| instead, so it must come out exactly 0."""
    got = torch.as_tensor(got).double().cpu()
    want = torch.as_tensor(want).double().cpu()
    err = (got - want).abs().amax(-1)
    scale = want.abs().amax(-1)
    return float(torch.where(scale > 0, err / scale.clamp(min=1e-300), err).max())


@check
def accuracy_vs_reference(ctx):
    """fp32 [4, 64, 32000] randn*2 + confident rows: logp, H, dlogits vs reference.py."""
    B, T, V = (2, 8, 1000) if ctx.small else (4, 64, 32000)
    logits, tokens, mask, _, adv = inputs(ctx, B, T, V, torch.float32, extra_pos=False)
    logits[:, ::4].scatter_(-1, tokens[:, ::4, None], 22.0)  # confident rows: 1 - p ~ e^-20
    lg = logits.double().cpu()
    # old log-probs near the current ones of THESE logits (after the confident rows are
    # set), as in training: built before, the confident rows had log-ratios of 8-18 and
    # dlogits up to 24
    g = torch.Generator().manual_seed(2)
    lp_now = torch.log_softmax(lg, -1).gather(-1, tokens.cpu()[..., None])[..., 0]
    old = (lp_now + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    old = old.to(ctx.dev)
    rlp, rent = R.token_logprobs(lg, tokens.cpu(), mask.cpu(), 1.0)
    _, _, rdl = R.ppo_loss(lg, tokens.cpu(), old.double().cpu(), adv.double().cpu(),
                           mask.cpu(), entropy_coef=0.01)
    nc = [t for t in range(T) if t % 4]  # the ordinary (not confident) positions
    backends = ctx.kern + (["cpu"] if ctx.gpu else [])
    for be in backends:
        x = logits.detach().clone().requires_grad_(True)
        if be == "cpu" and ctx.gpu:
            x = logits.detach().cpu().clone().requires_grad_(True)
            tk, mk, od, ad = tokens.cpu(), mask.cpu(), old.cpu(), adv.cpu()
        else:
            tk, mk, od, ad = tokens, mask, old, adv
        lp, ent = pk.token_logprobs(x.detach(), tk, mk, return_entropy=True, backend=be)
        loss, _ = pk.ppo_loss(x, tk, od, ad, mk, entropy_coef=0.01, backend=be)
        loss.backward()
        e_lp, e_h = maxabs(lp, rlp), maxabs(ent, rent)
        e_g = row_rel_err(x.grad[:, nc], torch.as_tensor(rdl)[:, nc])
        e_gc = row_rel_err(x.grad[:, ::4], torch.as_tensor(rdl)[:, ::4])
        rel_conf = float(((lp[:, ::4].double().cpu() - torch.as_tensor(rlp)[:, ::4]).abs()
                          / torch.as_tensor(rlp)[:, ::4].abs().clamp(min=1e-30)).max())
        # device tolerances (csrc/cuda/NOTES.md): exp2f 2 ulp, log1pf/expm1f 1 ulp -> ~3e-7
        # abs on logp / H; dlogits ~2e-7 relative to the row's largest entry for the
        # softmax, times the ratio exp(logp - old), whose relative error is logp's absolute
        # error (bounded 2e-6 here): 2.5e-6 on the ordinary rows. Confident rows (all
        # entries ~e^-20, the policy and entropy terms of one size) keep "~1e-6 relative
        # digits" (NOTES.md): 5e-6. (CPU kernels, which emulate the device functions, at
        # this shape: 1.1e-6 and 2.7e-6.)
        ok = (e_lp < 2e-6 and e_h < 2e-5 and e_g < 2.5e-6 and e_gc < 5e-6
              and rel_conf < 2e-5)
        report(f"accuracy[{be}]", "ok" if ok else "FAIL",
               f"max|err| logp {e_lp:.1e} H {e_h:.1e}; dlogits row-relative {e_g:.1e}, "
               f"confident rows {e_gc:.1e} (max |dlogits| "
               f"{float(torch.as_tensor(rdl).abs().max()):.2g}); confident logp rel "
               f"{rel_conf:.1e}")
    vocab_one_odd_stride(ctx)


def vocab_one_odd_stride(ctx):
    """The suite's V = 1 odd-stride test (tests/test_loss.py) in a pytest subprocess, on
    this device's kernel backends: the cuda and triton_cuda ids on a GPU (the cpu and
    triton-interpreter ids on the CPU dry run). ok only if each named id PASSED: a skip, a
    deselection or nothing run is a FAIL."""
    ids = ["cuda", "triton_cuda"] if ctx.gpu else ["cpu", "triton"]
    nodes = [f"tests/test_loss.py::test_vocab_one_with_odd_unit_stride[{i}]" for i in ids]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                        *nodes], capture_output=True, text=True, timeout=120, cwd=ROOT)
    passed = [n for n in nodes if f"PASSED {n}" in r.stdout]
    last = (r.stdout.strip().splitlines() or ["?"])[-1]
    ok = r.returncode == 0 and len(passed) == len(nodes)
    report(f"vocab_one_odd_stride[{','.join(ids)}]", "ok" if ok else "FAIL",
           f"{len(passed)}/{len(nodes)} passed; {last[:80]}")


CHECKS = [finfo_min_block, tiny_temperature_backward, accuracy_vs_reference]

if __name__ == "__main__":
    sys.exit(main(CHECKS, __doc__))
