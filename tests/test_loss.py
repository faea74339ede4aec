"""Tests of ppo_kernels/loss.py: pk.ppo_loss and pk.value_loss.

ppo_loss on every backend against the numpy float64 reference, on fresh random inputs: loss,
metrics and the gradient with respect to the logits, over vocabulary sizes, dtypes, layouts,
padding patterns and every option of the vanilla PPO loss (the policy-loss menu:
test_loss_menu.py; precision: test_loss_precision.py; bad arguments:
test_loss_bad_inputs.py). Inputs at the edges: empty batches, NaN on masked positions,
-inf logits, clamped log-ratios, a one-entry vocabulary, non-contiguous tokens and masks,
and a NaN on a valid token, which must reach the loss and the gradient.
value_loss against the reference and by hand."""

import math

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as ref
from ppo_kernels.testing import make_mask

from helpers.asserts import (METRIC_KEYS, TOL, assert_close_np, assert_grad_close, assert_metrics,
                             to_np)
from helpers.backends import BACKENDS, BACKENDS_CPU, CPU, TORCH, combine
from helpers.inputs import SMALL_MASK, logits_for, make_inputs, small_inputs

AGG = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def run(be, inp, *, agg="token-mean", use_ref=False, use_isw=False, grad_scale=1.0,
        inplace=False, tok_weights=None, requires_grad=True, **opts):
    """Runs pk.ppo_loss on be and the reference; returns (loss, metrics, grad, expected)
    where grad is the gradient with respect to the logits as passed (the view)."""
    leaf, logits = logits_for(inp, be, requires_grad)
    dev = be.t
    kw = dict(opts, loss_agg_mode=agg, inplace_backward=inplace, backend=be.name)
    if use_isw:
        kw["rollout_is_weights"] = dev(inp["isw"])
    r = dev(inp["ref"]) if use_ref else None
    loss, metrics = pk.ppo_loss(logits, dev(inp["tokens"]), dev(inp["old"]), dev(inp["adv"]),
                                dev(inp["mask"]), r, **kw)
    rkw = {k: v for k, v in opts.items()}
    if use_isw:
        rkw["rollout_is_weights"] = inp["isw"]
    e_loss, e_met, e_grad = ref.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"],
                                         inp["mask"], inp["ref"] if use_ref else None,
                                         loss_agg_mode=agg, **rkw)
    grad = None
    if requires_grad:
        if agg == "none":
            w = dev(tok_weights)
            (loss * w).sum().backward()
            e_grad = e_grad * tok_weights.double().numpy()[..., None] if e_grad.ndim == 3 \
                else e_grad
        else:
            (loss * grad_scale).backward()
            e_grad = e_grad * grad_scale
        grad = leaf.grad if logits is leaf else logits.grad
        if inplace:
            grad = leaf.grad
    return loss, metrics, grad, (e_loss, e_met, e_grad)


def check(be, inp, dtype=torch.float32, **kw):
    loss, met, grad, (e_loss, e_met, e_grad) = run(be, inp, **kw)
    rtol, atol, grel = TOL[dtype]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == acc
    assert_close_np(loss, e_loss, rtol=rtol, atol=atol, what="loss")
    assert_metrics(met, e_met, rtol=max(rtol, 2e-6), atol=max(atol, 2e-6))
    if grad is not None:
        assert grad.dtype == dtype and grad.shape == e_grad.shape
        assert_grad_close(grad, e_grad, grel)
    return loss, met, grad


# ------------------------------------------------------------------ sizes and dtypes

SIZES = [(3, 5, 1), (3, 5, 7), (4, 3, 37), (2, 7, 257), (3, 5, 1000), (2, 3, 32000),
         (1, 1, 7), (1, 1, 1000)]


@pytest.mark.parametrize("be,B,T,V", combine(BACKENDS, SIZES, lambda B, T, V: f"B{B}T{T}V{V}"))
def test_matches_reference_sizes(be, B, T, V, gen):
    inp = make_inputs(B, T, V, gen)
    if B * T == 1:  # a single token: keep its ratio inside the band so it has a gradient
        lp, _ = ref.token_logprobs(inp["base"], inp["tokens"])
        inp["old"] = torch.from_numpy(lp).float() + 0.05
    loss, met, grad = check(be, inp)
    if V > 1:
        assert float(grad.abs().max()) > 0
    # the options most runs use, on the same inputs
    check(be, inp, use_ref=True, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)


DTYPE_CASES = [(torch.bfloat16, 3, 5, 37), (torch.float16, 3, 5, 37), (torch.float64, 3, 5, 37),
               (torch.bfloat16, 2, 3, 1000), (torch.float16, 2, 3, 1000),
               (torch.float64, 2, 3, 1000)]


@pytest.mark.parametrize("be,dtype,B,T,V", combine(
    BACKENDS, [(d, B, T, V) for d, B, T, V in DTYPE_CASES],
    lambda d, B, T, V: f"{str(d)[6:]}-V{V}"))
def test_matches_reference_dtypes(be, dtype, B, T, V, gen):
    inp = make_inputs(B, T, V, gen, dtype=dtype)
    check(be, inp, dtype=dtype, use_ref=True, kl_coef=0.1, entropy_coef=0.02,
          clip_eps_high=0.28, use_isw=True)


def test_interp_filter_is_used():
    """The large shapes above are not run on the Triton interpreter (it is too slow)."""
    ids = [p.id for p in combine(BACKENDS, SIZES, lambda B, T, V: f"V{V}")]
    assert "triton-V32000" not in ids and "triton-V1000" not in ids and "triton-V37" in ids
    assert "cpu-V32000" in ids


# ------------------------------------------------------------------ options

OPTIONS = [
    dict(),
    dict(clip_eps_low=0.1, clip_eps_high=0.28),
    dict(clip_eps_low=0.0, clip_eps_high=0.0),
    dict(dual_clip_c=1.3),
    dict(dual_clip_c=3.0, clip_eps_high=0.3),
    dict(use_ref=True, kl_coef=0.2, kl_estimator="k1"),
    dict(use_ref=True, kl_coef=0.2, kl_estimator="k2"),
    dict(use_ref=True, kl_coef=0.2, kl_estimator="k3"),
    dict(use_ref=True, kl_coef=0.2, kl_estimator="abs"),
    dict(use_ref=True, kl_coef=0.0, kl_estimator="k2"),  # kl_ref metric without a penalty
    dict(entropy_coef=0.01),
    dict(entropy_coef=-0.05),
    dict(temperature=0.7),
    dict(temperature=1.7, entropy_coef=0.02),
    dict(use_isw=True),
    dict(use_isw=True, dual_clip_c=2.0, use_ref=True, kl_coef=0.1, kl_estimator="k3",
         entropy_coef=0.01, temperature=0.9, clip_eps_low=0.15, clip_eps_high=0.25),
    dict(global_num_tokens=50),
    dict(agg="seq-mean-token-sum"),
    dict(agg="seq-mean-token-mean"),
    dict(agg="seq-mean-token-sum-norm"),
    dict(agg="seq-mean-token-sum-norm", norm_length=11),
    dict(agg="seq-mean-token-mean", use_isw=True, use_ref=True, kl_coef=0.3,
         kl_estimator="abs", entropy_coef=0.03),
]


def _opt_id(o):
    return "-".join(f"{k}={v}" for k, v in o.items()) or "default"


@pytest.mark.parametrize("opts", OPTIONS, ids=_opt_id)
def test_options(be, opts, gen):
    inp = make_inputs(3, 5, 37, gen)
    if "dual_clip_c" in opts:  # make sure the dual clip is the active value somewhere
        b, t = np.argwhere(inp["mask"].numpy())[0]
        inp["adv"][b, t] = -1.0
        lp, _ = ref.token_logprobs(inp["base"], inp["tokens"], inp["mask"],
                                   opts.get("temperature", 1.0))
        inp["old"][b, t] = float(lp[b, t]) - np.log(opts["dual_clip_c"] + 1.0)
    loss, met, grad = check(be, inp, **opts)
    if "dual_clip_c" in opts:
        assert float(met["dual_clip_frac"]) > 0
    if opts.get("use_ref"):
        assert float(met["kl_ref"]) != 0


@pytest.mark.parametrize("agg", AGG)
def test_global_num_tokens_and_norm_length_scale(agg, gen):
    """global_num_tokens replaces the token-mean denominator; norm_length the -norm one."""
    inp = make_inputs(3, 6, 11, gen)
    n = int(inp["mask"].sum())
    base, _, g0, _ = run(CPU, inp, agg=agg)
    if agg == "token-mean":
        l2, _, g2, _ = run(CPU, inp, agg=agg, global_num_tokens=4 * n)
        factor = 0.25
    elif agg == "seq-mean-token-sum-norm":
        l2, _, g2, _ = run(CPU, inp, agg=agg, norm_length=12)
        factor = 0.5
    else:
        l2, _, g2, _ = run(CPU, inp, agg=agg, global_num_tokens=4 * n, norm_length=12)
        factor = 1.0  # neither applies to these modes
    assert float(l2.detach()) == pytest.approx(factor * float(base.detach()), rel=1e-6)
    torch.testing.assert_close(g2, g0 * factor, rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------ loss_agg_mode="none"

@pytest.mark.parametrize("opts", [dict(), dict(use_ref=True, kl_coef=0.1, kl_estimator="k2",
                                               entropy_coef=0.02, use_isw=True,
                                               dual_clip_c=1.5, temperature=1.3)],
                         ids=["default", "all-options"])
def test_agg_none_per_token(be, opts, gen):
    inp = make_inputs(3, 5, 37, gen)
    w = torch.randn(3, 5, generator=gen)
    loss, met, grad, (e_loss, e_met, e_grad) = run(be, inp, agg="none", tok_weights=w, **opts)
    assert loss.shape == (3, 5) and loss.dtype == torch.float32
    assert_close_np(loss, e_loss, rtol=2e-6, atol=2e-6, what="per-token loss")
    assert torch.all(loss.detach().cpu()[~inp["mask"]] == 0)
    assert_metrics(met, e_met)
    assert_grad_close(grad, e_grad, 1e-5)
    # the aggregated modes are weighted sums of the per-token loss
    m = inp["mask"].float()
    for agg in AGG:
        agg_loss, _, _, _ = run(be, inp, agg=agg, requires_grad=False, **opts)
        wts = torch.from_numpy(ref.agg_weights(m, agg)).float()
        assert float(agg_loss) == pytest.approx(float((wts * loss.detach().cpu()).sum()),
                                                rel=1e-5, abs=1e-6)


# ------------------------------------------------------------------ layouts

@pytest.mark.parametrize("layout", ["view", "raw", "tbatch"])
def test_strided_layouts(be, layout, gen):
    inp = make_inputs(3, 5, 37, gen, layout=layout)
    leaf_before = inp["full"].clone()
    loss, met, grad = check(be, inp, use_ref=True, kl_coef=0.1, entropy_coef=0.01)
    if layout == "raw":
        assert grad.shape == (3, 6, 37)
        assert torch.all(grad[:, -1] == 0)  # the last (ignored) position
    assert torch.equal(inp["full"], leaf_before)  # inputs untouched


def test_strided_view_is_not_copied(gen):
    """logits[:, :-1] of a [B, T + 1, V] tensor reaches the kernel as the view itself: the
    gradient lands in the parent's storage layout (zero on the dropped position)."""
    inp = make_inputs(3, 5, 37, gen, layout="view")
    leaf, logits = logits_for(inp, CPU)
    loss, _ = pk.ppo_loss(logits, inp["tokens"], inp["old"], inp["adv"], inp["mask"],
                          backend="cpu")
    loss.backward()
    assert leaf.grad.shape == (3, 6, 37)
    assert torch.all(leaf.grad[:, -1] == 0)
    _, _, e_grad = ref.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"], inp["mask"])
    assert_grad_close(leaf.grad[:, :-1], e_grad, 1e-5)


@pytest.mark.parametrize("agg", ["token-mean", "none"])
def test_flat_input(be, agg, gen):
    """[N, V] logits with tokens [N] and [N] per-token tensors."""
    inp = make_inputs(1, 13, 37, gen, padding="random")
    flat = {k: (v[0] if k not in ("full", "layout", "base") else v) for k, v in inp.items()}
    logits = be.t(inp["full"][0, :13].contiguous()).requires_grad_(True)
    w = torch.randn(13, generator=gen)
    loss, met = pk.ppo_loss(logits, be.t(flat["tokens"]), be.t(flat["old"]), be.t(flat["adv"]),
                            be.t(flat["mask"]), be.t(flat["ref"]), kl_coef=0.1,
                            entropy_coef=0.01, loss_agg_mode=agg, backend=be.name)
    e_loss, e_met, e_grad = ref.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"],
                                         inp["mask"], inp["ref"], kl_coef=0.1,
                                         entropy_coef=0.01, loss_agg_mode=agg)
    if agg == "none":
        assert loss.shape == (13,)
        assert_close_np(loss, e_loss[0], rtol=2e-6, atol=2e-6)
        (loss * be.t(w)).sum().backward()
        e_grad = e_grad * w.double().numpy()[None, :, None]
    else:
        assert loss.shape == ()
        assert_close_np(loss, e_loss, rtol=2e-6, atol=2e-6)
        loss.backward()
    assert_metrics(met, e_met)
    assert logits.grad.shape == (13, 37)
    assert_grad_close(logits.grad, e_grad[0], 1e-5)


# ------------------------------------------------------------------ edge cases

@pytest.mark.parametrize("agg", AGG + ["none"])
def test_neg_inf_logits(be, agg, gen):
    """-inf (banned) entries: p = 0, no NaN anywhere, values still match the reference."""
    inp = make_inputs(3, 5, 37, gen, neginf=True)
    w = torch.rand(3, 5, generator=gen)
    loss, met, grad, (e_loss, e_met, e_grad) = run(
        be, inp, agg=agg, tok_weights=w, use_ref=True, kl_coef=0.1, entropy_coef=0.05,
        temperature=0.8)
    assert not torch.isnan(loss).any()
    assert all(not torch.isnan(v) for v in met.values())
    assert torch.isfinite(grad).all()
    assert_close_np(loss, e_loss, rtol=2e-6, atol=2e-6)
    assert_metrics(met, e_met)
    assert_grad_close(grad, e_grad, 1e-5)
    banned = torch.isinf(inp["full"][:, :5])
    assert torch.all(grad.detach().cpu()[banned] == 0)


@pytest.mark.parametrize("agg", AGG + ["none"])
def test_all_masked(be, agg, gen):
    """An all-masked batch: loss 0, zero gradient, metrics 0, never NaN."""
    inp = make_inputs(3, 5, 37, gen, padding="all")
    w = torch.rand(3, 5, generator=gen)
    loss, met, grad, _ = run(be, inp, agg=agg, tok_weights=w, use_ref=True, kl_coef=0.1,
                             entropy_coef=0.05, use_isw=True)
    assert torch.all(loss == 0)
    assert torch.all(grad == 0)
    for k, v in met.items():
        assert float(v) == 0.0, k


def test_empty_row_and_single_token(be, gen):
    inp = make_inputs(3, 5, 37, gen, padding="empty_row")
    for agg in AGG:
        check(be, inp, agg=agg, entropy_coef=0.01)
    check(be, make_inputs(1, 1, 37, gen), agg="seq-mean-token-mean")


# ------------------------------------------------------------------ backward variants

@pytest.mark.parametrize("layout", ["aligned", "raw"])
def test_inplace_backward(be, layout, gen):
    inp = make_inputs(3, 5, 37, gen, layout=layout)
    opts = dict(use_ref=True, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    loss_a, met_a, g_a = check(be, inp, **opts)
    loss_b, met_b, g_b = check(be, inp, inplace=True, **opts)
    assert torch.equal(loss_a, loss_b)
    torch.testing.assert_close(g_b, g_a, rtol=0, atol=1e-7 * float(g_a.abs().max()))
    for k in METRIC_KEYS:
        assert torch.equal(met_a[k], met_b[k]), k
    # grad_output != 1 also scales the in-place gradient
    _, _, g_c = check(be, inp, inplace=True, grad_scale=3.5, **opts)
    torch.testing.assert_close(g_c, 3.5 * g_a, rtol=1e-6, atol=1e-9)


def test_inplace_backward_reuses_the_logits_storage(gen):
    """The gradient that flows out of ppo_loss into the model (here a non-leaf: the output
    of a multiply standing in for lm_head) lives in the logits' own storage."""
    inp = make_inputs(3, 5, 37, gen)
    x = inp["full"][:, :5].contiguous().requires_grad_(True)
    logits = x * 2.0
    seen = []
    logits.register_hook(lambda g: seen.append(g.data_ptr()))
    ptr = logits.data_ptr()
    loss, _ = pk.ppo_loss(logits, inp["tokens"], inp["old"], inp["adv"], inp["mask"],
                          inplace_backward=True, backend="cpu")
    loss.backward()
    assert seen == [ptr]  # no [N, V] gradient buffer was allocated
    _, _, e_grad = ref.ppo_loss(2.0 * inp["base"], inp["tokens"], inp["old"], inp["adv"],
                                inp["mask"])
    assert_grad_close(x.grad, 2.0 * e_grad, 1e-5)


@pytest.mark.parametrize("scale", [3.5, -0.25, 0.0])
def test_grad_output_scaling(be, scale, gen):
    inp = make_inputs(3, 5, 37, gen)
    loss, met, grad = check(be, inp, grad_scale=scale, use_ref=True, kl_coef=0.1)
    if scale == 0.0:
        assert torch.all(grad == 0)


def test_no_grad_and_detached_logits(be, gen):
    """Without autograd the loss and metrics are the same and no gradient is computed."""
    inp = make_inputs(3, 5, 37, gen)
    l1, m1, _, _ = run(be, inp, requires_grad=False)
    with torch.no_grad():
        leaf, logits = logits_for(inp, be)
        l2, m2 = pk.ppo_loss(logits, be.t(inp["tokens"]), be.t(inp["old"]), be.t(inp["adv"]),
                             be.t(inp["mask"]), backend=be.name)
    assert not l1.requires_grad and not l2.requires_grad
    assert float(l1) == pytest.approx(float(l2), rel=1e-6)
    assert set(m1) == set(m2)
    for k in m1:
        assert float(m1[k]) == pytest.approx(float(m2[k]), rel=1e-6, abs=1e-7), k
    assert leaf.grad is None


def test_backends_agree_with_each_other(gen):
    """cpu and torch on the same larger input (V = 32000 not a multiple of any block):
    loss, metrics and gradient agree with each other and with the reference."""
    inp = make_inputs(2, 6, 32003, gen, padding="random")
    l1, m1, g1, (e_loss, e_met, e_grad) = run(CPU, inp, use_ref=True, kl_coef=0.1,
                                              entropy_coef=0.01)
    l2, m2, g2, _ = run(TORCH, inp, use_ref=True, kl_coef=0.1, entropy_coef=0.01)
    assert float(l1.detach()) == pytest.approx(float(l2.detach()), rel=5e-6, abs=1e-7)
    assert_grad_close(g1, to_np(g2), 1e-5)
    assert set(m1) == set(m2)
    for k in m1:
        assert float(m1[k]) == pytest.approx(float(m2[k]), rel=5e-6, abs=1e-7), k
    for loss, met, grad in ((l1, m1, g1), (l2, m2, g2)):
        assert_close_np(loss.detach(), e_loss, rtol=5e-6, atol=1e-7, what="loss")
        assert_metrics(met, e_met, rtol=5e-6, atol=2e-6)
        assert_grad_close(grad, e_grad, 1e-5)


# ------------------------------------------------------------------ gradcheck

GC_CASES = [dict(agg=a) for a in AGG + ["none"]] + [
    dict(agg="token-mean", entropy_coef=0.05, use_ref=True, kl_coef=0.2, kl_estimator="k3"),
    dict(agg="seq-mean-token-mean", entropy_coef=-0.1, use_ref=True, kl_coef=0.3,
         kl_estimator="k2", dual_clip_c=1.5, use_isw=True, temperature=0.8),
    dict(agg="none", entropy_coef=0.05, use_ref=True, kl_coef=0.2, kl_estimator="k1"),
]


GC_PARAMS = [pytest.param(b.values[0], c, id=f"{b.id}-{_opt_id(c)}", marks=b.marks)
             for b in BACKENDS for c in GC_CASES
             if not (b.values[0].small and c is not GC_CASES[5])]  # interpreter: one case


@pytest.mark.parametrize("be,opts", GC_PARAMS)
def test_gradcheck(be, opts, gen):
    """torch.autograd.gradcheck in float64 (the Triton interpreter: one case, fast mode)."""
    inp = make_inputs(2, 3, 5, gen, dtype=torch.float64, padding="mixed")
    opts = dict(opts)
    agg = opts.pop("agg")
    dev = be.t
    kw = dict(opts)
    use_ref = kw.pop("use_ref", False)
    if kw.pop("use_isw", False):
        kw["rollout_is_weights"] = dev(inp["isw"])
    r = dev(inp["ref"]) if use_ref else None
    logits = dev(inp["full"][:, :3].contiguous()).requires_grad_(True)

    def f(x):
        return pk.ppo_loss(x, dev(inp["tokens"]), dev(inp["old"]), dev(inp["adv"]),
                           dev(inp["mask"]), r, loss_agg_mode=agg, backend=be.name, **kw)[0]

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=be.small)


# ------------------------------------------------------------------ inputs at the edges
# (CPU tensors: cpu, torch and the Triton interpreter)

@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("B,T", [(0, 3), (2, 0), (0, 0)])
def test_empty_batch_ppo_loss_and_logprobs(be, B, T):
    """Empty batches (B = 0, T = 0 or both): ppo_loss gives a zero loss, zero metrics
    and a gradient of the logits' shape; token_logprobs and gae give [B, T] outputs."""
    d = small_inputs(B, T)
    logits = d["logits"].requires_grad_()
    loss, metrics = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], backend=be.name)
    loss.backward()
    assert loss.item() == 0.0
    assert logits.grad.shape == (B, T, 5)
    assert all(v.item() == 0.0 for v in metrics.values())
    lp, ent = pk.token_logprobs(d["logits"].detach(), d["tokens"], return_entropy=True,
                                backend=be.name)
    assert lp.shape == ent.shape == (B, T)
    adv, ret = pk.gae(torch.randn(B, T), torch.randn(B, T), backend=be.name)
    assert adv.shape == ret.shape == (B, T)


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_nan_logits_on_masked_rows_are_never_read(be):
    """NaN logits on masked positions are never read: loss, metrics and gradient are
    those of the clean call (and of the reference), the masked rows' gradient is 0."""
    d = small_inputs()
    logits = d["logits"].clone()
    logits[~SMALL_MASK] = float("nan")
    logits.requires_grad_()
    loss, metrics = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], SMALL_MASK,
                                entropy_coef=0.01, backend=be.name)
    loss.backward()
    clean = d["logits"].clone().requires_grad_()
    c_loss, c_met = pk.ppo_loss(clean, d["tokens"], d["old"], d["adv"], SMALL_MASK,
                                entropy_coef=0.01, backend=be.name)
    c_loss.backward()
    assert math.isfinite(loss.item())
    assert all(math.isfinite(v.item()) for v in metrics.values())
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[~SMALL_MASK] == 0).all()
    assert loss.item() == pytest.approx(c_loss.item(), rel=1e-6, abs=1e-7)
    assert set(metrics) == set(c_met)
    for k in metrics:
        assert metrics[k].item() == pytest.approx(c_met[k].item(), rel=1e-6, abs=1e-7), k
    torch.testing.assert_close(logits.grad, clean.grad, rtol=1e-6, atol=1e-8)
    e_loss, e_met, e_grad = ref.ppo_loss(d["logits"].double(), d["tokens"], d["old"], d["adv"],
                                         SMALL_MASK, entropy_coef=0.01)
    assert loss.item() == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert_metrics(metrics, e_met, rtol=2e-5, atol=2e-6)
    assert_grad_close(logits.grad, e_grad, 3e-6)


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_metrics_ignore_nan_on_masked_positions(be):
    """NaN old / ref logprobs on masked positions reach neither the loss nor any
    metric: both are those of the clean call (and of the reference)."""
    d = small_inputs()
    old, ref_lp = d["old"].clone(), d["ref"].clone()
    old[~SMALL_MASK] = float("nan")
    ref_lp[~SMALL_MASK] = float("nan")
    loss, m = pk.ppo_loss(d["logits"], d["tokens"], old, d["adv"], SMALL_MASK,
                          ref_logprobs=ref_lp, kl_coef=0.1, backend=be.name)
    assert math.isfinite(loss.item())
    bad = [k for k, v in m.items() if not math.isfinite(v.item())]
    assert not bad, bad
    c_loss, c_m = pk.ppo_loss(d["logits"], d["tokens"], d["old"], d["adv"], SMALL_MASK,
                              ref_logprobs=d["ref"], kl_coef=0.1, backend=be.name)
    assert loss.item() == pytest.approx(c_loss.item(), rel=1e-6, abs=1e-7)
    assert set(m) == set(c_m)
    for k in m:
        assert m[k].item() == pytest.approx(c_m[k].item(), rel=1e-6, abs=1e-7), k
    e_loss, e_met, _ = ref.ppo_loss(d["logits"].double(), d["tokens"], d["old"], d["adv"],
                                    SMALL_MASK, d["ref"], kl_coef=0.1)
    assert loss.item() == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert_metrics(m, e_met, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_all_neginf_row_except_token(be):
    """Rows whose only finite logit is the sampled token's: logp = 0 and entropy 0 (not
    NaN), a finite gradient, an entropy metric of 0."""
    d = small_inputs(1, 3, 7)
    logits = torch.full((1, 3, 7), float("-inf"))
    logits[0, torch.arange(3), d["tokens"][0]] = 1.5
    logits.requires_grad_()
    loss, m = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], entropy_coef=0.1,
                          backend=be.name)
    loss.backward()
    lp, ent = pk.token_logprobs(logits.detach(), d["tokens"], return_entropy=True,
                                backend=be.name)
    assert (lp == 0).all() and (ent.abs() == 0).all()
    assert torch.isfinite(logits.grad).all()
    assert m["entropy"].item() == 0.0


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_token_own_logit_neginf(be):
    """logp = -inf; the log-ratio clamp keeps the loss and gradient finite, with the
    reference's values (ratio e^-20, the entropy of the remaining entries)."""
    d = small_inputs(1, 3, 7)
    logits = d["logits"][:1].clone()
    logits[0, torch.arange(3), d["tokens"][0]] = float("-inf")
    logits.requires_grad_()
    loss, m = pk.ppo_loss(logits, d["tokens"][:1], d["old"][:1], d["adv"][:1],
                          entropy_coef=0.1, backend=be.name)
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(logits.grad).all()
    assert math.isfinite(m["approx_kl"].item()) and math.isfinite(m["ratio_max"].item())
    e_loss, e_met, e_grad = ref.ppo_loss(logits.detach().double(), d["tokens"][:1],
                                         d["old"][:1], d["adv"][:1], entropy_coef=0.1)
    assert loss.item() == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert_metrics(m, e_met, rtol=2e-5, atol=2e-6)
    assert_grad_close(logits.grad, e_grad, 3e-6)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("old", [1e30, -1e30, float("inf"), float("-inf")])
def test_extreme_old_logprobs_are_clamped(be, old):
    """old_logprobs of +-1e30 and +-inf: the clamped log-ratio keeps the loss finite
    and equal to the reference's, and gives no gradient (the clamp is active on every
    token)."""
    d = small_inputs()
    logits = d["logits"].requires_grad_()
    loss, m = pk.ppo_loss(logits, d["tokens"], torch.full((2, 3), old), d["adv"],
                          backend=be.name)
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad == 0).all()  # the log-ratio clamp is active everywhere: no gradient
    e_loss, _, _ = ref.ppo_loss(d["logits"].detach().double(), d["tokens"],
                                torch.full((2, 3), old, dtype=torch.float64), d["adv"])
    assert loss.item() == pytest.approx(e_loss, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("where", ["logit", "advantage", "old"])
def test_nan_on_a_valid_token_reaches_the_gradient(be, where):
    """A NaN on a valid position makes the loss NaN and must not be hidden from the
    gradient either (a gradient-norm check is how training loops notice): every backend
    gives a NaN in the row of that token, as autograd does."""
    d = small_inputs()
    logits, adv, old = d["logits"].clone(), d["adv"].clone(), d["old"].clone()
    if where == "logit":
        logits[1, 2, 3] = float("nan")
    elif where == "advantage":
        adv[1, 2] = float("nan")
    else:
        old[1, 2] = float("nan")
    x = logits.requires_grad_(True)
    loss, _ = pk.ppo_loss(x, d["tokens"], old, adv, backend=be.name)
    loss.backward()
    assert torch.isnan(loss.detach())
    assert torch.isnan(x.grad[1, 2]).any()


@pytest.mark.parametrize("be", BACKENDS)
def test_vocab_one_with_odd_unit_stride(be):
    """V = 1 logits whose vocabulary dimension has stride 6 (a permuted view): logp = 0
    and the loss is -A. Every backend, the GPU ones on CUDA tensors (tests/gpu/numerics.py
    runs the cuda and triton_cuda ids on a GPU)."""
    # [2, 3, 1], strides (3, 1, 6), made on the backend's device (a copy could re-stride it)
    logits = torch.randn(1, 2, 3, device=be.device).permute(1, 2, 0)
    assert logits.stride() == (3, 1, 6)
    tokens = torch.zeros(2, 3, dtype=torch.long, device=be.device)
    lp = pk.token_logprobs(logits, tokens, backend=be.name)
    assert (lp == 0).all()
    loss, _ = pk.ppo_loss(logits, tokens, be.t(torch.zeros(2, 3)), be.t(torch.ones(2, 3)),
                          backend=be.name)
    assert loss.item() == -1.0


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_non_contiguous_tokens_and_mask(be):
    """Non-contiguous tokens and masks (transposed storage) give the results of
    contiguous ones in ppo_loss, token_logprobs and gae (DESIGN.md: non-contiguous inputs
    are accepted)."""
    d = small_inputs()
    tokT = d["tokens"].t().contiguous().t()
    maskT = SMALL_MASK.t().contiguous().t()
    e_loss, _, _ = ref.ppo_loss(d["logits"].double(), d["tokens"], d["old"], d["adv"],
                                SMALL_MASK)
    loss, _ = pk.ppo_loss(d["logits"], tokT, d["old"], d["adv"], maskT, backend=be.name)
    assert loss.item() == pytest.approx(e_loss, rel=1e-5, abs=1e-6)
    lp = pk.token_logprobs(d["logits"], tokT, maskT, backend=be.name)
    e_lp, _ = ref.token_logprobs(d["logits"].double(), d["tokens"], SMALL_MASK)
    assert_close_np(lp, e_lp * SMALL_MASK.numpy(), rtol=1e-5, atol=1e-6)
    adv, _ = pk.gae(torch.ones(3, 2).t(), torch.zeros(3, 2).t(), maskT, backend=be.name)
    e_adv, _ = ref.gae(torch.ones(2, 3), torch.zeros(2, 3), SMALL_MASK)
    assert_close_np(adv, e_adv, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ value_loss

@pytest.mark.parametrize("clip_range", [None, 0.0, 0.2, 5.0])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                 "seq-mean-token-sum-norm", "none"])
def test_value_loss_matches_reference(clip_range, agg, gen):
    B, T = 3, 7
    v = torch.randn(B, T, generator=gen, dtype=torch.float64)
    vo = v + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4
    r = torch.randn(B, T, generator=gen, dtype=torch.float64)
    m = make_mask(B, T, gen)
    e_loss, e_met, e_dv = ref.value_loss(v, vo, r, m, clip_range=clip_range, loss_agg_mode=agg)
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        x = v.to(dtype).requires_grad_(True)
        loss, met = pk.value_loss(x, vo.to(dtype), r.to(dtype), m, clip_range=clip_range,
                                  loss_agg_mode=agg)
        assert loss.dtype == dtype
        assert_close_np(loss, e_loss, rtol=tol, atol=tol)
        assert set(met) == {"vf_clip_frac"}
        assert float(met["vf_clip_frac"]) == pytest.approx(e_met["vf_clip_frac"], abs=1e-7)
        loss.sum().backward()
        assert_close_np(x.grad, e_dv, rtol=tol * 10, atol=tol * 10, what="dvalues")
    if clip_range == 0.0:
        assert e_met["vf_clip_frac"] > 0


def test_value_loss_by_hand():
    v = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    vo = torch.tensor([[0.0, 0.0, 0.0]])
    ret = torch.tensor([[0.0, 1.0, 3.0]])
    loss, met = pk.value_loss(v, vo, ret, clip_range=0.5)
    # token 0: (1-0)^2 = 1 vs clip 0.5 -> 0.25: unclipped larger
    # token 1: (0-1)^2 = 1 vs clip 0 -> 1: equal, not strictly larger
    # token 2: (2-3)^2 = 1 vs clip 0.5 -> 6.25: clipped larger
    assert float(loss.detach()) == pytest.approx(0.5 * (1 + 1 + 6.25) / 3)
    assert float(met["vf_clip_frac"]) == pytest.approx(1 / 3)
    loss.backward()
    # clipped branch active at token 2 and v is outside the band: no gradient there
    np.testing.assert_allclose(v.grad.numpy(), [[1.0 / 3, -1.0 / 3, 0.0]], atol=1e-7)


def test_value_loss_flat_and_all_masked():
    v = torch.randn(6, requires_grad=True)
    loss, met = pk.value_loss(v, v.detach(), torch.zeros(6), clip_range=0.2)
    assert loss.shape == ()
    assert float(loss) == pytest.approx(0.5 * float((v ** 2).mean()), rel=1e-6)
    m = torch.zeros(2, 3, dtype=torch.bool)
    x = torch.randn(2, 3, requires_grad=True)
    loss, met = pk.value_loss(x, x.detach() + 1, torch.randn(2, 3), m, clip_range=0.1)
    loss.backward()
    assert float(loss) == 0.0 and float(met["vf_clip_frac"]) == 0.0
    assert torch.all(x.grad == 0) and not torch.isnan(x.grad).any()


def test_value_loss_masked_nan_gives_zero_grad():
    """NaN returns on masked positions: value_loss and its gradient are finite, the
    masked positions' gradient is 0."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2, 3, generator=g).requires_grad_()
    returns = torch.randn(2, 3, generator=g)
    returns[~SMALL_MASK] = float("nan")
    loss, _ = pk.value_loss(values, torch.randn(2, 3, generator=g), returns, SMALL_MASK,
                            clip_range=0.2)
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(values.grad).all()
    assert (values.grad[~SMALL_MASK] == 0).all()
