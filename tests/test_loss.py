"""pk.ppo_loss on every backend against the numpy float64 reference, on fresh random inputs:
loss, metrics and the gradient with respect to the logits, over vocabulary sizes, dtypes,
layouts, padding patterns and every option."""

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as ref

from conftest import (BACKENDS, CPU, METRIC_KEYS, TOL, TORCH,
                      assert_close_np, assert_grad_close, assert_metrics, combine, logits_for,
                      make_inputs, to_np)

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
    assert leaf.grad is None


def test_backends_agree_with_each_other(gen):
    """cpu and torch on the same larger input (V = 32000 not a multiple of any block)."""
    inp = make_inputs(2, 6, 32003, gen, padding="random")
    l1, m1, g1, _ = run(CPU, inp, use_ref=True, kl_coef=0.1, entropy_coef=0.01)
    l2, m2, g2, _ = run(TORCH, inp, use_ref=True, kl_coef=0.1, entropy_coef=0.01)
    assert float(l1.detach()) == pytest.approx(float(l2.detach()), rel=5e-6, abs=1e-7)
    assert_grad_close(g1, to_np(g2), 1e-5)


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
