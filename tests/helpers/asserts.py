"""The tests' comparisons: closeness to numpy and to the reference, the tolerance tables,
relative errors, and that an error names the bad argument.

ppo_kernels.testing holds the public tolerances (testing.tolerance: what a backend promises
users' CI). TOL and TOK_TOL here are tighter where the suite can be (the same inputs every
run), so they stay the suite's own."""

import math

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as ref

def to_np(x):
    return x.detach().cpu().double().numpy()


def assert_close_np(actual, expected, rtol, atol, what=""):
    a = to_np(actual) if isinstance(actual, torch.Tensor) else np.asarray(actual, np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert not np.isnan(a).any(), f"{what}: NaN in output"
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=what)


def assert_grad_close(actual, expected, rel, what="dlogits", floor=1e-30):
    """max |actual - expected| <= rel * max |expected| + floor."""
    a = to_np(actual)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.isfinite(a).all(), f"{what}: non-finite values"
    scale = float(np.abs(e).max()) if e.size else 0.0
    err = float(np.abs(a - e).max()) if e.size else 0.0
    assert err <= rel * scale + floor, f"{what}: max abs err {err:.3e} vs scale {scale:.3e}"


# tolerances per logits dtype: (rtol loss/metrics, atol loss/metrics, rel dlogits)
TOL = {torch.float32: (2e-6, 2e-6, 3e-6), torch.bfloat16: (1e-5, 1e-5, 1e-2),
       torch.float16: (1e-5, 1e-5, 1e-2), torch.float64: (1e-10, 1e-11, 1e-10)}


METRIC_KEYS = {"num_tokens", "num_seqs", "clip_frac", "clip_frac_high", "clip_frac_low", "dual_clip_frac", "approx_kl",
               "kl_ref", "entropy", "ratio_mean", "ratio_max"}


# the option of ppo_loss -> the metric that shows it acted on some (not all) tokens
_RC_MASKING = ("mis", "mis-seq", "geo-seq")


def assert_active(metrics, kw=None, *fracs, **exact):
    """Asserts that the options a case names were active on its inputs, from the metrics
    ppo_loss returned (verl's tests assert ``masked_any > 0`` the same way): a case whose
    random inputs never switch an option on cannot catch a bug in it.

    From ``kw`` (ppo_loss's keyword arguments): dual_clip_c -> 0 < dual_clip_frac < 1;
    a DPPO loss with old_logprobs -> 0 < clip_frac < 1 (the trust region trips);
    rollout_correction mis / mis-seq / geo-seq -> 0 < rollout_masked_frac < 1; tis /
    tis-seq -> rollout_is_max == the upper bound (the truncation bites);
    off_policy_mask_threshold -> 0 < off_policy_masked_frac < 1. ``fracs``: more metric
    names that must lie strictly between 0 and 1; ``exact``: metric=value pairs."""
    kw = dict(kw or {})
    want = list(fracs)
    if kw.get("dual_clip_c") is not None:
        want.append("dual_clip_frac")
    if str(kw.get("policy_loss", "")).startswith("dppo") and kw.get("old", True) is not None:
        want.append("clip_frac")
    mode = kw.get("rollout_correction")
    if mode in _RC_MASKING:
        want.append("rollout_masked_frac")
    elif mode in ("tis", "tis-seq"):
        thr = kw.get("rollout_is_threshold", 2.0)
        exact.setdefault("rollout_is_max", thr[1] if isinstance(thr, (tuple, list)) else thr)
    if kw.get("off_policy_mask_threshold") is not None:
        want.append("off_policy_masked_frac")
    for k in want:
        v = float(metrics[k])
        assert 0.0 < v < 1.0, f"{k} = {v}: the option is inactive (0) or acts on everything"
    for k, v in exact.items():
        assert float(metrics[k]) == pytest.approx(v, rel=1e-6), \
            f"{k} = {float(metrics[k])}, expected {v}: the option is inactive"


def assert_metrics(metrics, expected, rtol=2e-6, atol=2e-6):
    assert set(metrics) == set(expected), set(metrics) ^ set(expected)
    for k, v in metrics.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0, k
        assert v.dtype == torch.float32, (k, v.dtype)
        assert not v.requires_grad, k
        assert_close_np(v, expected[k], rtol=rtol, atol=atol, what=f"metric {k}")


def compare_with_reference(be, logits, tokens, old, adv, mask, ref_lp, *, grad_rel=3e-6,
                           loss_rel=2e-6, metric_tol=2e-5, ref_kw=None, active=None, **kw):
    """Runs pk.ppo_loss on backend ``be`` (CPU tensors) and the reference on the same
    inputs; asserts loss, metrics (those the reference has) and dlogits agree. ``ref_kw``
    overrides arguments for the reference only (it takes [B, T, V] only). ``active``:
    None, or a tuple of extra metric names for assert_active, which then checks that the
    options in kw were active. Returns (loss, metrics, dlogits)."""
    leaf = logits.detach().clone().requires_grad_(True)
    loss, met = pk.ppo_loss(leaf, tokens, old, adv, mask, ref_lp, backend=be.name, **kw)
    (loss.sum() if loss.dim() else loss).backward()
    rk = dict(logits=logits.detach().double(), tokens=tokens, old=old, adv=adv, mask=mask,
              ref=ref_lp, kw=kw)
    rk.update(ref_kw or {})
    e_loss, e_met, e_grad = ref.ppo_loss(rk["logits"], rk["tokens"], rk["old"], rk["adv"],
                                         rk["mask"], rk["ref"], **rk["kw"])
    e_loss = np.asarray(e_loss).reshape(loss.shape)
    got = to_np(loss)
    assert np.isfinite(got).all(), "non-finite loss"
    np.testing.assert_allclose(got, e_loss, rtol=loss_rel,
                               atol=loss_rel * max(1.0, float(np.abs(e_loss).max(initial=0))))
    for k, v in met.items():
        assert v.dim() == 0 and v.dtype == torch.float32 and not v.requires_grad, k
        if k in e_met:
            assert math.isfinite(float(v)), k
            assert float(v) == pytest.approx(e_met[k], rel=metric_tol, abs=metric_tol), k
    g = to_np(leaf.grad).reshape(e_grad.shape)
    assert np.isfinite(g).all(), "non-finite dlogits"
    scale = float(np.abs(e_grad).max(initial=0.0))
    err = float(np.abs(g - e_grad).max(initial=0.0))
    assert err <= grad_rel * scale + 1e-30, f"dlogits: err {err:.3e} vs scale {scale:.3e}"
    if active is not None:
        assert_active(met, dict(kw, old=old), *active)
    return loss, met, leaf.grad


# per-token outputs are accumulated in float32 (float64) whatever the logits' dtype, and the
# reference sees the same (rounded) logits: they match tightly even for bf16/fp16 logits.
TOK_TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-5, 1e-6),
           torch.float16: (1e-5, 1e-6), torch.float64: (1e-10, 1e-12)}


def grad_tol(dtype, expected):
    """dlogits come back in the logits' dtype: bf16 keeps 8 bits, fp16 11."""
    scale = float(np.abs(expected).max()) if np.size(expected) else 1.0
    rtol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3,
            torch.float64: 1e-10}[dtype]
    return rtol, rtol * max(scale, 1e-30) * 0.1


def rel_err(actual, expected):
    """max |actual - expected| / |expected| (entry by entry)."""
    a = actual.detach().cpu().double().numpy() if torch.is_tensor(actual) else actual
    e = np.asarray(expected, dtype=np.float64)
    return float(np.max(np.abs(a - e) / np.maximum(np.abs(e), 1e-300)))


def max_rel_err(actual, expected, *, floor=1e-30, nonfinite=False):
    """max |actual - expected| / max(max |expected|, floor), in float64 (tensors): the error
    relative to the largest reference entry, which one small entry cannot inflate (the
    multi-process cases compare a sharded op with the whole one this way). The shapes must
    agree; empty tensors give 0. ``floor``: 1e-30 keeps it relative everywhere, a larger
    one makes it absolute below that scale. ``nonfinite``: the reference may hold +-inf
    (masked -inf logits): entries equal there count as 0, and the scale is then 1."""
    a = torch.as_tensor(actual).detach().double().cpu()
    e = torch.as_tensor(expected).detach().double().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"shape {list(a.shape)} vs {list(e.shape)}")
    if a.numel() == 0:
        return 0.0
    d = (a - e).abs()
    scale = float(e.abs().max())
    if nonfinite:
        d = d.nan_to_num(0.0)
        if not torch.isfinite(e).all():
            scale = 1.0
    return float(d.max()) / max(scale, floor)


def expm1_minus_x64(u):
    """e^u - 1 - u in float64 to ~1e-16 relative: a 25-term series below |u| = 0.5."""
    u = np.asarray(u, dtype=np.float64)
    s = np.zeros_like(u)
    term = u * u / 2.0
    for k in range(3, 28):
        s += term
        term = term * u / k
    return np.where(np.abs(u) < 0.5, s, np.expm1(u) - u)


def raises_naming(fn, name, types=(ValueError, TypeError)):
    """fn() raises one of types (exactly those, not a subclass such as IndexError: the
    exception's type must be ValueError or TypeError) naming ``name``."""
    with pytest.raises(Exception) as info:
        fn()
    e = info.value
    assert type(e) in types, f"expected ValueError / TypeError naming {name!r}, got " \
                             f"{type(e).__name__}: {e}"
    assert name in str(e), f"the message does not name {name!r}: {e}"
    return e
