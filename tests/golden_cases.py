"""The frozen table of outputs: every public op over a grid of options, on the CPU backend
(and the eager composite), with fixed inputs. tests/test_golden.py recomputes each case and
compares it with tests/data/golden_cpu.npz bit for bit, so that a restructuring of how the
options travel to the kernels cannot change any result.

    python tests/golden_cases.py          # rewrite tests/data/golden_cpu.npz (only when a
                                          # result is meant to change; say why in the commit)
    python tests/golden_cases.py --refreeze 'f32/cpu/logits/gspo*' ...
        # rewrite only the cases whose prefix matches a pattern (fnmatch), where a computation
        # changed its rounding but not its result: refused unless every array of theirs is
        # within BOUND_ULPS of its frozen value; each re-frozen case records the platform
        # that made it (a "made:<case>" entry), which the exactness rule of test_golden.py
        # then reads for it in place of the table's tags.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import platform
import sys

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_kernels as pk

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden_cpu.npz")
TAGS = ("torch_version", "cpu_capability", "cpu_model")
# the entries "made:<case prefix>": the TAGS of the platform that re-froze that case
MADE = "made:"
# (measured when the table was written, on an AMD EPYC with AVX-512, against
# ATEN_CPU_CAPABILITY=avx2 and =default there: at most 19 ulps, VESPO's float64 loss, whose
# sequence ratio reaches 1.8e8; 64 leaves room for other CPUs' summation orders)
BOUND_ULPS = 64
B, T, V, H = 3, 6, 13, 8


def _draws(seed):
    """(normal(shape, scale), uniform(shape), integers(hi, shape)): float64 draws with the
    same bits on every machine. torch.randn's float32 path is vectorised per CPU capability
    (other bits under ATEN_CPU_CAPABILITY=default), so the draws are built from integers
    (numpy's RandomState, a frozen stream): uniforms k / 2^24 (exact), normals the centred
    sum of four of them times sqrt(3) (Irwin-Hall: mean 0, variance 1; one rounding)."""
    rs = np.random.RandomState(seed)
    unit = float(1 << 24)
    uniform = lambda shape: rs.randint(0, 1 << 24, size=shape) / unit  # noqa: E731
    normal = lambda shape, scale=1.0: torch.from_numpy(  # noqa: E731
        (sum(uniform(shape) for _ in range(4)) - 2.0) * (scale * math.sqrt(3.0)))
    integers = lambda hi, shape: torch.from_numpy(rs.randint(0, hi, size=shape))  # noqa: E731
    return normal, lambda shape: torch.from_numpy(uniform(shape)), integers


def _inputs(dtype=torch.float32):
    normal, uniform, integers = _draws(1234)
    logits = normal((B, T + 1, V), 3.0).to(dtype)
    logits[0, 1] *= 8.0  # a confident row
    tokens = integers(V, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2] = False  # an empty sequence
    mask[2, 0] = True
    logp = torch.log_softmax(logits[:, :T].double(), -1).gather(-1, tokens[..., None])[..., 0]
    noise = lambda s: normal((B, T), s)  # noqa: E731
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    old = (logp + noise(0.3)).to(acc)
    ref = (logp + noise(0.2)).to(acc)
    rollout = (old.double() + noise(0.1)).to(acc)
    adv = normal((B, T)).to(acc)
    seq_adv = normal((B,)).to(acc)
    isw = (0.5 + uniform((B, T))).to(acc)
    values = normal((B, T)).to(acc)
    scores = normal((B,)).to(acc)
    hidden = normal((B, T + 1, H)).to(dtype)
    weight = normal((V, H), 0.7).to(dtype)
    bias = normal((V,), 0.1).to(dtype)
    return dict(logits=logits, tokens=tokens, mask=mask, old=old, ref=ref, rollout=rollout,
                adv=adv, seq_adv=seq_adv, isw=isw, values=values, scores=scores,
                hidden=hidden, weight=weight, bias=bias)


def _loss_cases():
    """(name, keywords) of ppo_loss; the inputs named by the '_in' key are swapped in."""
    cases = []
    for pl in ("vanilla", "cispo", "sapo", "gspo", "gspo-token"):
        for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                     "seq-mean-token-sum-norm", "none"):
            kw = dict(policy_loss=pl, loss_agg_mode=mode, kl_coef=0.1, entropy_coef=0.01)
            if pl in ("gspo", "gspo-token"):
                kw.update(clip_eps_low=3e-3, clip_eps_high=4e-3)
            cases.append((f"{pl}/{mode}", kw))
    for est in ("k1", "k2", "k3", "abs", "k1+", "k3+"):
        for bc in (False, True):
            cases.append((f"kl/{est}/bias{bc}", dict(kl_coef=0.2, kl_estimator=est,
                                                     kl_bias_correction=bc)))
    cases += [
        ("vanilla/dual", dict(dual_clip_c=3.0, clip_eps_high=0.28)),
        ("gspo/dual", dict(policy_loss="gspo", dual_clip_c=3.0, clip_eps_low=3e-3,
                           clip_eps_high=4e-3)),
        ("cispo/trl", dict(policy_loss="cispo", clip_eps_low=1.0, clip_eps_high=4.0)),
        ("sapo/tau", dict(policy_loss="sapo", sapo_tau_pos=0.7, sapo_tau_neg=1.3)),
        ("onpolicy", dict(_in="no_old", kl_coef=0.1)),
        ("seq_adv", dict(_in="seq_adv", policy_loss="gspo")),
        ("isw", dict(_in="isw", entropy_coef=0.02)),
        ("entropy_agg", dict(entropy_coef=0.05, entropy_agg_mode="token-mean",
                             loss_agg_mode="seq-mean-token-sum")),
        ("temperature", dict(temperature=0.7, kl_coef=0.05, entropy_coef=0.01)),
        ("grad_scale", dict(grad_scale=0.25, kl_coef=0.05)),
        ("global_counts", dict(global_num_tokens=20.0, loss_agg_mode="token-mean")),
        ("global_seqs", dict(global_num_seqs=5.0, loss_agg_mode="seq-mean-token-mean")),
        ("norm_length", dict(norm_length=9.0, loss_agg_mode="seq-mean-token-sum-norm")),
        ("inplace", dict(inplace_backward=True, kl_coef=0.1, entropy_coef=0.01)),
        ("off_policy", dict(_in="rollout", off_policy_mask_threshold=0.01)),
        ("per_token", dict(return_per_token=True, entropy_coef=0.01)),
    ]
    for rc in ("tis", "tis-seq", "mis", "mis-seq", "geo-seq"):
        cases.append((f"rc/{rc}", dict(_in="rollout", rollout_correction=rc,
                                       rollout_is_threshold=1.5 if rc != "geo-seq" else 1.2)))
    # (appended last: the [::4] subsets of the other dtypes keep their old cases)
    cases += [
        ("dppo-tv/token-mean", dict(policy_loss="dppo-tv", clip_eps_low=0.01,
                                    clip_eps_high=0.02, kl_coef=0.1, entropy_coef=0.01)),
        ("dppo-tv/cap", dict(policy_loss="dppo-tv", clip_eps_low=0.01, dual_clip_c=1.2,
                             loss_agg_mode="seq-mean-token-mean")),
        ("dppo-kl/token-mean", dict(policy_loss="dppo-kl", clip_eps_low=0.005,
                                    clip_eps_high=0.01, kl_coef=0.1, kl_bias_correction=True)),
        ("dppo-kl/none", dict(policy_loss="dppo-kl", clip_eps_low=0.005, dual_clip_c=1.3,
                              loss_agg_mode="none")),
        ("vespo/token-mean", dict(policy_loss="vespo", kl_coef=0.1, entropy_coef=0.01)),
        ("vespo/seq_adv", dict(_in="seq_adv", policy_loss="vespo", vespo_k_pos=1.0,
                               vespo_lambda_neg=4.0, loss_agg_mode="seq-mean-token-mean")),
        ("off_policy/seq_adv", dict(_in="rollout_seq_adv", off_policy_mask_threshold=0.01)),
    ]
    return cases


def _backward(loss, leaves):
    total = loss if loss.dim() == 0 else loss.sum()
    grads = torch.autograd.grad(total, [x for x in leaves if x is not None])
    return grads


def _pack(out, prefix, loss, metrics, grads, grad_names):
    out[prefix + "/loss"] = loss.detach().float().numpy() if loss.dtype == torch.bfloat16 \
        else loss.detach().numpy()
    for k, v in metrics.items():
        out[f"{prefix}/m/{k}"] = v.detach().numpy()
    for n, gr in zip(grad_names, grads):
        gr = gr.detach()
        out[f"{prefix}/d{n}"] = (gr.float() if gr.dtype == torch.bfloat16 else gr).numpy()


def _loss_call(inp, kw):
    kw = dict(kw)
    which = kw.pop("_in", None)
    old = None if which == "no_old" else inp["old"]
    adv = inp["seq_adv"] if which in ("seq_adv", "rollout_seq_adv") else inp["adv"]
    if which == "isw":
        kw["rollout_is_weights"] = inp["isw"]
    if which in ("rollout", "rollout_seq_adv"):
        kw["rollout_logprobs"] = inp["rollout"]
    return old, adv, kw


# ATen's transcendental functions of float / double tensors run MKL's vector math (VML) on
# x86, whose code path MKL picks per CPU vendor and ISA (MKL_CBWR=COMPATIBLE or =AVX2 moves
# their last bits): a case whose call runs one of them beside our kernels (the eager middle
# of a sequence-level or two-phase loss) is exact only on the same CPU model
# (https://www.intel.com/content/www/us/en/docs/onemkl/developer-guide-linux/2024-2/
# obtaining-numerically-reproducible-results.html).
VML_OPS = frozenset({"exp", "expm1", "log", "log1p", "log2", "log10", "sigmoid", "tanh",
                     "log_sigmoid_forward", "log_sigmoid_backward", "pow", "sqrt", "rsqrt",
                     "erf", "erfc", "sin", "cos", "tan", "atan", "asin", "acos", "sinh",
                     "cosh", "lgamma"})
# the case prefixes (f32/cpu/logits/gspo/none, ...) whose call ran one: filled by compute()
RUNS_VML = set()


class _VmlSpy(TorchDispatchMode):
    """Records whether any op of VML_OPS was dispatched (from Python or from C++)."""

    hit = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__.rstrip("_") in VML_OPS:
            self.hit = True
        return func(*args, **(kwargs or {}))


def _watched(prefix, fn):
    """fn() under _VmlSpy; prefix goes into RUNS_VML where it dispatched a VML op."""
    spy = _VmlSpy()
    with spy:
        result = fn()
    if spy.hit:
        RUNS_VML.add(prefix)
    return result


def compute():
    """{key: array} of every case (and RUNS_VML, the cases that ran torch's VML ops)."""
    out = {}
    RUNS_VML.clear()
    for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16"),
                       (torch.float64, "f64")):
        inp = _inputs(dtype)
        cases = _loss_cases() if dtype == torch.float32 else _loss_cases()[::4]
        backends = ("cpu", "torch") if dtype == torch.float32 else ("cpu",)
        for backend in backends:
            for name, kw in cases:
                old, adv, kw = _loss_call(inp, kw)
                x = inp["logits"].clone().requires_grad_(True)
                prefix = f"{tag}/{backend}/logits/{name}"

                def run():
                    loss, metrics = pk.ppo_loss(x, inp["tokens"], old, adv, inp["mask"],
                                                inp["ref"], backend=backend, **kw)
                    return loss, metrics, _backward(loss, [x])
                _pack(out, prefix, *_watched(prefix, run), ["logits"])
                if dtype == torch.bfloat16 or kw.get("inplace_backward"):
                    continue
                h = inp["hidden"].clone().requires_grad_(True)
                w = inp["weight"].clone().requires_grad_(True)
                b = inp["bias"].clone().requires_grad_(True)
                loss, metrics = pk.ppo_loss_from_hidden(
                    h, w, inp["tokens"], old, adv, inp["mask"], inp["ref"], lm_head_bias=b,
                    chunk_size=4, backend=backend, **kw)
                grads = _backward(loss, [h, w, b])
                _pack(out, f"{tag}/{backend}/hidden/{name}", loss, metrics, grads,
                      ["hidden", "weight", "bias"])
        # packed sequences: the valid tokens of each row, back to back
        lens = inp["mask"].sum(1)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        sel = inp["mask"].reshape(-1)
        for name, kw in (("vanilla", dict(kl_coef=0.1)),
                         ("gspo", dict(policy_loss="gspo", clip_eps_low=3e-3,
                                       clip_eps_high=4e-3, loss_agg_mode="seq-mean-token-mean"))):
            x = inp["logits"][:, :T].reshape(B * T, V)[sel].clone().requires_grad_(True)
            pick = lambda t: t.reshape(B * T)[sel]  # noqa: E731

            def run():
                loss, metrics = pk.ppo_loss(x, pick(inp["tokens"]), pick(inp["old"]),
                                            pick(inp["adv"]), None, pick(inp["ref"]),
                                            cu_seqlens=cu, backend="cpu", **kw)
                return loss, metrics, _backward(loss, [x])
            _pack(out, f"{tag}/cpu/packed/{name}", *_watched(f"{tag}/cpu/packed/{name}", run),
                  ["logits"])
        # token log-probs, from logits and from hidden
        x = inp["logits"].clone().requires_grad_(True)

        def run():
            logp, ent = pk.token_logprobs(x, inp["tokens"], inp["mask"], temperature=0.9,
                                          return_entropy=True, backend="cpu")
            grads = _backward((logp * inp["adv"].to(logp.dtype)).sum() + ent.sum(), [x])
            return logp, {"entropy": ent}, grads
        _pack(out, f"{tag}/cpu/token_logprobs", *_watched(f"{tag}/cpu/token_logprobs", run),
              ["logits"])
        h = inp["hidden"].clone().requires_grad_(True)
        w = inp["weight"].clone().requires_grad_(True)
        logp, ent = pk.token_logprobs_from_hidden(h, w, inp["tokens"], inp["mask"],
                                                  logit_softcap=5.0, return_entropy=True,
                                                  chunk_size=5, backend="cpu")
        grads = _backward(logp.sum() + 0.5 * ent.sum(), [h, w])
        _pack(out, f"{tag}/cpu/token_logprobs_from_hidden", logp, {"entropy": ent}, grads,
              ["hidden", "weight"])
        # the rollout side
        for est in ("k1", "k3"):
            r = _watched(f"{tag}/cpu/score_rollout/{est}", lambda: pk.score_rollout(
                inp["logits"], inp["tokens"], inp["ref"], inp["values"], inp["scores"],
                inp["mask"], kl_coef=0.05, kl_estimator=est, gamma=0.99, lam=0.9,
                backend="cpu"))
            for field, v in zip(r._fields, r):
                out[f"{tag}/cpu/score_rollout/{est}/{field}"] = v.numpy()
        a, ret = _watched(f"{tag}/cpu/gae", lambda: pk.gae(
            inp["scores"][:, None].expand(B, T).contiguous(), inp["values"], inp["mask"],
            gamma=0.97, lam=0.9, backend="cpu"))
        out[f"{tag}/cpu/gae/advantages"], out[f"{tag}/cpu/gae/returns"] = a.numpy(), ret.numpy()
    return out


def platform_tags():
    """What the results depend on besides the code: the torch build, the CPU capability its
    kernels and ours dispatch to, and the CPU itself (the BLAS of the matmuls and some of
    torch's reductions take per-model paths: the same capability on another vendor's CPU
    rounds a matmul differently)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith(("model name", "CPU part"))), model)
    except OSError:
        pass
    return dict(torch_version=torch.__version__,
                cpu_capability=torch.backends.cpu.get_cpu_capability(), cpu_model=model)


def within_bound(key, a, b):
    """(ok, error in ulps of the largest entry): |a - b| <= BOUND_ULPS * eps * max|b|, eps
    the rounding unit of the case's dtype (bfloat16's for the bf16 cases: their gradients
    are bfloat16 values), max|b| at least 1 for a 0-d loss or metric."""
    eps = float(torch.finfo(torch.bfloat16).eps) if key.startswith("bf16/") \
        else float(np.finfo(b.dtype).eps)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return False, float("inf")
    fin = ~np.isnan(b)
    scale = float(np.abs(b[fin]).max()) if fin.any() else 0.0
    if b.ndim == 0:  # a loss or a metric: a mean of per-token terms of order 1 (ratios,
        scale = max(scale, 1.0)  # advantages, log-probs) that can cancel to near 0
    err = float(np.abs(a[fin] - b[fin]).max()) if fin.any() else 0.0
    ulps = err / (eps * scale) if scale > 0 else (0.0 if err == 0 else float("inf"))
    return ulps <= BOUND_ULPS, ulps


def case_of(key):
    """The case of an array's key, the call that made it: the key without its last part (and
    a metric's "m/"): f32/cpu/logits/gspo/token-mean/m/clip_frac ->
    f32/cpu/logits/gspo/token-mean, f32/cpu/gae/returns -> f32/cpu/gae."""
    parts = key.split("/")[:-1]
    return "/".join(parts[:-1] if parts[-1] == "m" else parts)


def refreeze(patterns):
    """Rewrites the arrays of the cases matching patterns with this platform's results and
    records the platform per case; raises ValueError where a pattern matches no case or an
    array moved by more than BOUND_ULPS (a changed result, not a changed rounding)."""
    frozen = dict(np.load(DATA))
    out = compute()
    cases = sorted({case_of(k) for k in out
                    if any(fnmatch.fnmatchcase(case_of(k), p) for p in patterns)})
    for p in patterns:
        if not any(fnmatch.fnmatchcase(c, p) for c in cases):
            raise ValueError(f"--refreeze {p!r} matches no case")
    tags = platform_tags()
    worst = {}
    for k, a in out.items():
        c = case_of(k)
        if c not in cases:
            continue
        ok, ulps = within_bound(k, a, frozen[k])
        if not ok:
            raise ValueError(f"{k}: {ulps:.1f} ulps from its frozen value (bound "
                             f"{BOUND_ULPS}): a changed result, not a rounding")
        worst[c] = max(worst.get(c, 0.0), ulps)
        frozen[k] = a
    for c in cases:
        frozen[MADE + c] = np.array([tags[t] for t in TAGS])
        print(f"re-froze {c}: {worst[c]:.2f} ulps at most")
    np.savez_compressed(DATA, **frozen)
    print(f"re-froze {len(cases)} cases in {DATA}, made with {tags}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refreeze", nargs="+", metavar="PATTERN",
                    help="rewrite only the cases matching these fnmatch patterns")
    args = ap.parse_args(argv)
    if args.refreeze:
        return refreeze(args.refreeze)
    os.makedirs(os.path.dirname(DATA), exist_ok=True)
    out = compute()
    tags = platform_tags()
    np.savez_compressed(DATA, **{k: np.array(v) for k, v in tags.items()}, **out)
    print(f"wrote {len(out)} arrays to {DATA}, made with {tags}")


if __name__ == "__main__":
    sys.exit(main())
