"""Tests of ppo_kernels/from_hidden.py: pk.ppo_loss_from_hidden /
pk.token_logprobs_from_hidden / pk.score_rollout_from_hidden (docs/FROM_HIDDEN.md), the ops
with the LM head fused in, against the unfused op on materialised logits (pk.ppo_loss with
backend="cpu"), the numpy float64 reference, gradcheck, and a spy showing that no tensor
of more than chunk_size * V elements is created."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_kernels as pk
from ppo_kernels import head_chunks
from ppo_kernels import reference as ref

from helpers.backends import triton_interpreter
from helpers.inputs import head_inputs, head_logits, make_teacher

POLICY_LOSSES = ("vanilla", "cispo", "sapo", "gspo", "gspo-token", "dppo-tv", "dppo-kl",
                 "vespo")


def params(d):
    return [x for x in (d["hidden"], d["W"], d["b"]) if x is not None and x.requires_grad]


def grads(loss, d):
    ps = params(d)
    return torch.autograd.grad(loss, ps) if ps else ()


def run_pair(d, *, cap=None, chunk_size=3, layout="btH", **kw):
    """(fused loss, metrics, grads), (unfused loss, metrics, grads)."""
    h, T = d["hidden"], d["tokens"].shape[1]
    tok, mask, old, adv, rl = d["tokens"], d["mask"], d["old"], d["adv"], d["ref"]
    if layout == "NH":
        hh = h[:, :T].reshape(-1, h.shape[-1])
        tok, mask, old, adv, rl = (x.reshape(-1) for x in (tok, mask, old, adv, rl))
        kw = {k: (v.reshape(-1) if isinstance(v, torch.Tensor) and v.shape == d["mask"].shape
                  else v) for k, v in kw.items()}
    else:
        hh = h
    loss, m = pk.ppo_loss_from_hidden(hh, d["W"], tok, old, adv, mask, rl,
                                      lm_head_bias=d["b"], logit_softcap=cap,
                                      chunk_size=chunk_size, **kw)
    g = grads(loss if loss.dim() == 0 else loss.sum(), d)
    loss2, m2 = pk.ppo_loss(head_logits(hh, d["W"], d["b"], cap), tok, old, adv, mask, rl,
                            backend="cpu", **kw)
    g2 = grads(loss2 if loss2.dim() == 0 else loss2.sum(), d)
    return (loss, m, g), (loss2, m2, g2)


def assert_pair(a, b, rtol=1e-5, atol=1e-6, grad_rtol=None):
    (loss, m, g), (loss2, m2, g2) = a, b
    torch.testing.assert_close(loss, loss2, rtol=rtol, atol=atol)
    assert set(m) == set(m2)
    for k in m2:
        torch.testing.assert_close(m[k], m2[k], rtol=rtol, atol=atol, msg=k)
    assert len(g) == len(g2)
    for x, y in zip(g, g2):
        assert x.dtype == y.dtype and x.shape == y.shape
        if grad_rtol is None:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
        else:  # relative to the gradient's scale
            err = (x.double() - y.double()).abs().max()
            assert err <= grad_rtol * y.double().abs().max() + 1e-6, (err, y.abs().max())


KL_ENT = dict(kl_coef=0.1, ref_logprobs=None, entropy_coef=0.01)


@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.parametrize("chunk", ["1", "3", "N", "N+5"])
def test_every_policy_loss_every_chunking(policy_loss, chunk):
    d = head_inputs(seed=POLICY_LOSSES.index(policy_loss))
    n = d["tokens"].numel()
    c = {"1": 1, "3": 3, "N": n, "N+5": n + 5}[chunk]
    assert_pair(*run_pair(d, chunk_size=c, policy_loss=policy_loss, kl_coef=0.1,
                          entropy_coef=0.01))


@pytest.mark.parametrize("kw", [
    dict(kl_coef=0.2, kl_estimator="k3"),
    dict(kl_coef=0.2, kl_estimator="k1+", kl_bias_correction=True),
    dict(entropy_coef=0.05),
    dict(entropy_coef=0.05, entropy_agg_mode="token-mean", loss_agg_mode="seq-mean-token-sum"),
    dict(temperature=0.7, entropy_coef=0.01),
    dict(dual_clip_c=3.0, clip_eps_high=0.28),
    dict(loss_agg_mode="token-sum"),
    dict(loss_agg_mode="seq-mean-token-mean"),
    dict(loss_agg_mode="seq-mean-token-sum-norm", norm_length=7),
    dict(global_num_tokens=40.0, global_num_seqs=5),
    dict(rollout_correction="tis"),
    dict(off_policy_mask_threshold=0.01),
    dict(policy_loss="gspo", entropy_coef=0.02, temperature=1.3),
    dict(old_logprobs=None),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_options(kw):
    d = head_inputs(seed=11)
    kw = dict(kw)
    if "rollout_correction" in kw or "off_policy_mask_threshold" in kw:
        kw["rollout_logprobs"] = d["roll"]
    if "old_logprobs" in kw:
        d["old"] = kw.pop("old_logprobs")
    assert_pair(*run_pair(d, **kw))


def test_rollout_is_weights_per_sequence():
    d = head_inputs(seed=12)
    isw = torch.rand(3) + 0.5
    assert_pair(*run_pair(d, rollout_is_weights=isw, kl_coef=0.1))


@pytest.mark.parametrize("layout", ["btH", "bt1H", "NH"])
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_layouts(layout, policy_loss):
    d = head_inputs(seed=3, extra_pos=layout == "bt1H")
    (loss, m, g), b = run_pair(d, layout=layout, policy_loss=policy_loss, entropy_coef=0.01)
    assert_pair((loss, m, g), b)
    if layout == "bt1H":
        assert (g[0][:, -1] == 0).all()  # the ignored last position


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo-token"])
def test_masked_rows_get_zero_gradient(policy_loss):
    d = head_inputs(seed=4)
    a, b = run_pair(d, policy_loss=policy_loss, kl_coef=0.1, entropy_coef=0.02)
    assert_pair(a, b)
    assert (a[2][0][~d["mask"]] == 0).all()


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
@pytest.mark.parametrize("cap", [None, 2.5])
def test_bias_and_softcap_against_unfused(policy_loss, cap):
    d = head_inputs(seed=5, bias=True)
    assert_pair(*run_pair(d, cap=cap, policy_loss=policy_loss, kl_coef=0.1, entropy_coef=0.03,
                          temperature=0.9))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_nan_on_masked_positions_stays_out(policy_loss, backend):
    """NaN hidden states and per-token inputs on padded positions: the result is that of
    the same batch with them zeroed (the unfused op would carry the NaN hidden into dW)."""
    d = head_inputs(seed=28, bias=True)
    pad = ~d["mask"]
    kw = dict(policy_loss=policy_loss, kl_coef=0.1, entropy_coef=0.01, chunk_size=4,
              backend=backend)
    clean = pk.ppo_loss_from_hidden(d["hidden"], d["W"], d["tokens"], d["old"], d["adv"],
                                    d["mask"], d["ref"], lm_head_bias=d["b"], **kw)
    g_clean = grads(clean[0], d)
    h = d["hidden"].detach().clone()
    h[pad] = float("nan")
    h.requires_grad_()
    old, adv = d["old"].clone(), d["adv"].clone()
    old[pad], adv[pad] = float("nan"), float("nan")
    dirty = pk.ppo_loss_from_hidden(h, d["W"], d["tokens"], old, adv, d["mask"], d["ref"],
                                    lm_head_bias=d["b"], **kw)
    g_dirty = torch.autograd.grad(dirty[0], (h, d["W"], d["b"]))
    torch.testing.assert_close(dirty[0], clean[0])
    for k in clean[1]:
        torch.testing.assert_close(dirty[1][k], clean[1][k], msg=k)
    for x, y in zip(g_dirty, g_clean):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("policy_loss", ["vanilla", "sapo", "gspo"])
def test_softcap_against_numpy_reference(policy_loss):
    """The fused result in float64 against ppo_kernels.reference on z = cap * tanh(h W^T /
    cap), its gradient chained by hand: dx = dz (1 - tanh^2), dh = dx W, dW = dx^T h."""
    cap = 1.5
    d = head_inputs(seed=6, dtype=torch.float64, bias=True, scale=1.2)
    loss, m = pk.ppo_loss_from_hidden(d["hidden"], d["W"], d["tokens"], d["old"], d["adv"],
                                      d["mask"], d["ref"], lm_head_bias=d["b"],
                                      logit_softcap=cap, chunk_size=4, policy_loss=policy_loss,
                                      kl_coef=0.1, entropy_coef=0.02)
    gh, gw, gb = torch.autograd.grad(loss, (d["hidden"], d["W"], d["b"]))
    h = d["hidden"].detach().numpy()
    w = d["W"].detach().numpy()
    bb = d["b"].detach().numpy()
    th = np.tanh((h @ w.T + bb) / cap)
    loss_r, m_r, dz = ref.ppo_loss(cap * th, d["tokens"].numpy(), d["old"].numpy(),
                                   d["adv"].numpy(), d["mask"].numpy(), d["ref"].numpy(),
                                   policy_loss=policy_loss, kl_coef=0.1, entropy_coef=0.02)
    dx = dz * (1 - th ** 2)
    np.testing.assert_allclose(float(loss.detach()), loss_r, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gh.numpy(), dx @ w, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(gw.numpy(), np.einsum("btv,bth->vh", dx, h), rtol=1e-9,
                               atol=1e-12)
    np.testing.assert_allclose(gb.numpy(), dx.sum((0, 1)), rtol=1e-9, atol=1e-12)
    for k in ("entropy", "clip_frac", "approx_kl", "kl_ref", "ratio_mean"):
        np.testing.assert_allclose(float(m[k]), m_r[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("frozen", ["W", "hidden", "bias", "W+bias"])
def test_frozen_inputs(frozen):
    d = head_inputs(seed=7, bias=True)
    if "W" in frozen:
        d["W"].requires_grad_(False)
    if "bias" in frozen:
        d["b"].requires_grad_(False)
    if frozen == "hidden":
        d["hidden"].requires_grad_(False)
    a, b = run_pair(d, kl_coef=0.1)
    assert len(a[2]) == len(params(d))
    assert_pair(a, b)


def test_everything_frozen_and_no_grad():
    d = head_inputs(seed=8)
    with torch.no_grad():
        loss, m = pk.ppo_loss_from_hidden(d["hidden"], d["W"], d["tokens"], d["old"], d["adv"],
                                          d["mask"], chunk_size=2, policy_loss="gspo")
    assert not loss.requires_grad
    loss2, m2 = pk.ppo_loss(head_logits(d["hidden"], d["W"]).detach(), d["tokens"], d["old"],
                            d["adv"], d["mask"], policy_loss="gspo", backend="cpu")
    torch.testing.assert_close(loss, loss2)


def test_tied_embeddings():
    """W shared with the input embedding: both paths' gradients add up on W."""
    d = head_inputs(seed=9)
    W = d["W"]
    ids = torch.randint(0, W.shape[0], d["hidden"].shape[:2])

    def model():
        return torch.tanh(W[ids] + d["hidden"])  # embedding lookup of the same weight

    loss, _ = pk.ppo_loss_from_hidden(model(), W, d["tokens"], d["old"], d["adv"], d["mask"],
                                      chunk_size=4)
    g = torch.autograd.grad(loss, (W, d["hidden"]))
    loss2, _ = pk.ppo_loss(head_logits(model(), W), d["tokens"], d["old"], d["adv"], d["mask"],
                           backend="cpu")
    g2 = torch.autograd.grad(loss2, (W, d["hidden"]))
    torch.testing.assert_close(loss, loss2)
    for x, y in zip(g, g2):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_transposed_weight_view():
    """W given as E.t() of an [H, V] matrix (strides (1, V)): the gradient reaches E."""
    d = head_inputs(seed=27)
    E = d["W"].detach().t().contiguous().requires_grad_()
    args = (d["tokens"], d["old"], d["adv"], d["mask"])
    loss, _ = pk.ppo_loss_from_hidden(d["hidden"], E.t(), *args, chunk_size=4)
    loss2, _ = pk.ppo_loss(d["hidden"] @ E, *args, backend="cpu")
    for x, y in zip(torch.autograd.grad(loss, (d["hidden"], E)),
                    torch.autograd.grad(loss2, (d["hidden"], E))):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 0), (0, 3)])
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_empty_batch(shape, policy_loss):
    h = torch.randn(*shape, 4, requires_grad=True)
    W = torch.randn(7, 4, requires_grad=True)
    tok, z = torch.zeros(shape, dtype=torch.long), torch.zeros(shape)
    loss, m = pk.ppo_loss_from_hidden(h, W, tok, z, z, policy_loss=policy_loss)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(m["num_tokens"]) == 0.0
    assert h.grad.shape == h.shape and (W.grad == 0).all()


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_bf16(policy_loss, cap):
    """bf16 hidden and W: gradients in bf16, within 2e-2 (relative to the gradient's scale)
    of the unfused bf16 op, and no further from the float64 result than the unfused bf16
    op is (both are about 1e-2 off it: bf16 logits)."""
    d = head_inputs(B=4, T=6, H=16, V=40, seed=10, dtype=torch.bfloat16, bias=True)
    kw = dict(policy_loss=policy_loss, kl_coef=0.05, entropy_coef=0.01)
    a, b = run_pair(d, cap=cap, chunk_size=5, **kw)
    for x, p in zip(a[2], params(d)):
        assert x.dtype == torch.bfloat16 and x.shape == p.shape
    assert_pair(a, b, rtol=1e-2, atol=1e-3, grad_rtol=2e-2)
    p64 = [p.detach().double().requires_grad_() for p in params(d)]
    loss64, _ = pk.ppo_loss(head_logits(*p64, cap), d["tokens"], d["old"], d["adv"], d["mask"],
                            d["ref"], backend="cpu", **kw)
    for x, y, z in zip(a[2], b[2], torch.autograd.grad(loss64, p64)):
        scale = z.abs().max()
        err_fused = (x.double() - z).abs().max() / scale
        err_unfused = (y.double() - z).abs().max() / scale
        assert err_fused <= max(2 * err_unfused, 1e-2), (err_fused, err_unfused)


def test_bf16_dw_accumulates_in_float32():
    """One row per chunk: dW is the float32 sum of the chunks' bf16 products, rounded to
    bf16 once; summing in bf16 would drift."""
    B, T, H, V = 8, 32, 8, 32
    d = head_inputs(B=B, T=T, H=H, V=V, seed=13, dtype=torch.bfloat16)
    d["hidden"].requires_grad_(False)
    loss, _ = pk.ppo_loss_from_hidden(d["hidden"], d["W"], d["tokens"], d["old"], d["adv"],
                                      d["mask"], chunk_size=1, loss_agg_mode="token-sum")
    (gw,) = torch.autograd.grad(loss, d["W"])
    assert gw.dtype == torch.bfloat16
    x = head_logits(d["hidden"], d["W"]).detach().requires_grad_()
    loss2, _ = pk.ppo_loss(x, d["tokens"], d["old"], d["adv"], d["mask"],
                           loss_agg_mode="token-sum", backend="cpu")
    (dx,) = torch.autograd.grad(loss2, x)
    dx, h = dx.reshape(-1, V), d["hidden"].reshape(-1, H)
    exact = dx.double().T @ h.double()
    bf16_sum = torch.zeros(V, H, dtype=torch.bfloat16)
    for r in range(dx.shape[0]):
        bf16_sum += torch.outer(dx[r], h[r])

    exact = exact.detach()

    def rel(g):
        return float((g.detach().double() - exact).abs().max() / exact.abs().max())

    assert rel(gw) < 5e-3 and rel(gw) < rel(bf16_sum), (rel(gw), rel(bf16_sum))


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_bf16_dw_accumulates_in_place_with_accum_dtype(policy_loss):
    """accum_dtype=the weight's dtype: each chunk's product added into a bf16 dW in place
    (one rounding per chunk, as Liger-Kernel's default); the default float32 sum is the
    closer one to the exact dW. The emulation: per chunk of one row, the float32 sum of
    the bf16 accumulator and the row's exact float32 outer product, rounded to bf16."""
    B, T, H, V = 4, 16, 8, 32
    d = head_inputs(B=B, T=T, H=H, V=V, seed=13, dtype=torch.bfloat16)
    d["hidden"].requires_grad_(False)
    args = (d["hidden"], d["W"], d["tokens"], d["old"], d["adv"], d["mask"])
    kw = dict(chunk_size=1, loss_agg_mode="token-sum", policy_loss=policy_loss)
    (g32,) = torch.autograd.grad(pk.ppo_loss_from_hidden(*args, **kw)[0], d["W"])
    (g16,) = torch.autograd.grad(
        pk.ppo_loss_from_hidden(*args, accum_dtype=torch.bfloat16, **kw)[0], d["W"])
    assert g16.dtype == g32.dtype == torch.bfloat16
    x = head_logits(d["hidden"], d["W"]).detach().requires_grad_()
    loss2, _ = pk.ppo_loss(x, d["tokens"], d["old"], d["adv"], d["mask"],
                           loss_agg_mode="token-sum", policy_loss=policy_loss, backend="cpu")
    (dx,) = torch.autograd.grad(loss2, x)
    dx, h = dx.reshape(-1, V), torch.where(d["mask"].reshape(-1, 1),
                                           d["hidden"].reshape(-1, H), 0.0)
    emu = torch.outer(dx[0].float(), h[0].float()).bfloat16()
    for r in range(1, dx.shape[0]):
        emu = (emu.float() + torch.outer(dx[r].float(), h[r].float())).bfloat16()
    exact = (dx.double().T @ h.double()).detach()

    def rel(g):
        return float((g.detach().double() - exact).abs().max() / exact.abs().max())

    # the kernels' dz of the fused and the unfused op agree to float32 rounding, so the two
    # bf16 sums can differ by an ulp of the larger entries
    torch.testing.assert_close(g16, emu, rtol=2 ** -7, atol=2 ** -7 * float(emu.abs().max()))
    assert rel(g32) < rel(g16), (rel(g32), rel(g16))


def test_accum_dtype_holds_no_float32_dw():
    """The in-place bf16 sum holds no [V, H] float32 tensor; the default float32 one
    does (several chunks), and a single chunk none (its product is dW)."""
    B, T, H, V = 2, 8, 4, 24
    d = head_inputs(B=B, T=T, H=H, V=V, seed=14, dtype=torch.bfloat16)
    args = (d["hidden"], d["W"], d["tokens"], d["old"], d["adv"], d["mask"])

    def float32_dw(**kw):
        with _Sizes() as sizes:
            loss, _ = pk.ppo_loss_from_hidden(*args, **kw)
            loss.backward()
        return (V, H, torch.float32) in sizes.typed

    assert float32_dw(chunk_size=3)
    assert not float32_dw(chunk_size=3, accum_dtype=torch.bfloat16)
    assert not float32_dw(chunk_size=B * T)
    assert d["W"].grad.dtype == torch.bfloat16


def test_accum_dtype_of_token_logprobs_and_distill_from_hidden():
    """token_logprobs_from_hidden (dW in its backward) and distill_loss_from_hidden take
    accum_dtype too: the bf16 in-place sum is within bf16 rounding of the float32 one."""
    d = head_inputs(B=2, T=8, H=4, V=24, seed=16, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(16)
    te = make_teacher(16, 24, gen)

    def dw(fn, **kw):
        w = d["W"].detach().requires_grad_()
        out = fn(w, **kw)
        (g,) = torch.autograd.grad(out, w)
        return g.double()

    def logprobs(w, **kw):
        lp, ent = pk.token_logprobs_from_hidden(d["hidden"], w, d["tokens"], d["mask"],
                                                return_entropy=True, chunk_size=3, **kw)
        return lp.float().sum() + ent.float().sum()

    def distill(w, **kw):
        return pk.distill_loss_from_hidden(d["hidden"], w, te, d["mask"], chunk_size=3,
                                           **kw)[0]

    for fn in (logprobs, distill):
        a, b = dw(fn), dw(fn, accum_dtype=torch.bfloat16)
        assert not torch.equal(a, b)  # (six chunks: the bf16 sum rounds per chunk)
        assert float((a - b).abs().max()) <= 2 ** -6 * float(a.abs().max()), fn.__name__


def test_accum_dtype_float32_and_float64_weights():
    """accum_dtype of a float32 / float64 head: None or its own dtype, the same result."""
    for dtype in (torch.float32, torch.float64):
        d = head_inputs(B=2, T=6, H=4, V=10, seed=15, dtype=dtype)
        args = (d["hidden"], d["W"], d["tokens"], d["old"], d["adv"], d["mask"])
        (a,) = torch.autograd.grad(pk.ppo_loss_from_hidden(*args, chunk_size=2)[0], d["W"])
        (b,) = torch.autograd.grad(pk.ppo_loss_from_hidden(*args, chunk_size=2,
                                                           accum_dtype=dtype)[0], d["W"])
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_grad_scale_and_rescaled_backward(policy_loss):
    d = head_inputs(seed=14, bias=True)
    loss2, _ = pk.ppo_loss(head_logits(d["hidden"], d["W"], d["b"]), d["tokens"], d["old"],
                           d["adv"], d["mask"], policy_loss=policy_loss, backend="cpu")
    g_ref = torch.autograd.grad(loss2, params(d))
    for gs, div in [(1.0, 3.0), (0.25, 4.0), (0.25, 1.0), (2.0, 0.5)]:
        loss, _ = pk.ppo_loss_from_hidden(d["hidden"], d["W"], d["tokens"], d["old"], d["adv"],
                                          d["mask"], lm_head_bias=d["b"], chunk_size=4,
                                          policy_loss=policy_loss, grad_scale=gs)
        torch.testing.assert_close(loss, loss2)
        for p in params(d):
            p.grad = None
        (loss / div).backward(retain_graph=True)
        for p, r in zip(params(d), g_ref):
            torch.testing.assert_close(p.grad, r / div, rtol=1e-5, atol=1e-7)
        # a second backward through the retained graph (another scale) replays right
        for p in params(d):
            p.grad = None
        (loss * 3.0).backward()
        for p, r in zip(params(d), g_ref):
            torch.testing.assert_close(p.grad, r * 3.0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_gradients_accumulate(policy_loss):
    """.grad accumulates over a retained graph's two backwards and over two forwards (the
    saved buffers are not handed out as .grad and then rescaled under it)."""
    d = head_inputs(seed=30, bias=True)
    loss2, _ = pk.ppo_loss(head_logits(d["hidden"], d["W"], d["b"]), d["tokens"], d["old"],
                           d["adv"], d["mask"], policy_loss=policy_loss, backend="cpu")
    g_ref = torch.autograd.grad(loss2, params(d))

    def fused():
        return pk.ppo_loss_from_hidden(d["hidden"], d["W"], d["tokens"], d["old"], d["adv"],
                                       d["mask"], lm_head_bias=d["b"], chunk_size=4,
                                       policy_loss=policy_loss)[0]

    loss = fused()
    (loss / 3).backward(retain_graph=True)
    (loss * 2).backward()
    fused().backward()
    (fused() * 0.5).backward()
    for p, r in zip(params(d), g_ref):
        torch.testing.assert_close(p.grad, r * (1 / 3 + 2 + 1 + 0.5), rtol=1e-5, atol=1e-6)


# (cispo and gspo-token are not gradcheck-able: their value and their gradient differ by
# design, a detached weight / a straight-through ratio)
@pytest.mark.parametrize("policy_loss", ["vanilla", "sapo", "gspo"])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_gradcheck(policy_loss, cap):
    d = head_inputs(B=2, T=3, H=4, V=5, seed=15, dtype=torch.float64, bias=True)
    d["mask"][1, 1] = False

    def f(h, w, b):
        return pk.ppo_loss_from_hidden(h, w, d["tokens"], d["old"], d["adv"], d["mask"],
                                       d["ref"], lm_head_bias=b, logit_softcap=cap,
                                       chunk_size=2, policy_loss=policy_loss, kl_coef=0.1,
                                       entropy_coef=0.05, clip_eps_low=0.5)[0]

    assert torch.autograd.gradcheck(f, (d["hidden"], d["W"], d["b"]))


# ------------------------------------------------------------------ token_logprobs_from_hidden

@pytest.mark.parametrize("layout", ["btH", "bt1H", "NH"])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_token_logprobs_from_hidden(layout, cap):
    d = head_inputs(seed=16, extra_pos=layout == "bt1H", bias=True)
    T = d["tokens"].shape[1]
    h, tok, mask = d["hidden"], d["tokens"], d["mask"]
    if layout == "NH":
        h, tok, mask = h.reshape(-1, h.shape[-1]), tok.reshape(-1), mask.reshape(-1)
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(tok.shape, generator=g), torch.randn(tok.shape, generator=g)
    lp, ent = pk.token_logprobs_from_hidden(h, d["W"], tok, mask, lm_head_bias=d["b"],
                                            logit_softcap=cap, temperature=0.8,
                                            return_entropy=True, chunk_size=4)
    lp2, ent2 = pk.token_logprobs(head_logits(h, d["W"], d["b"], cap), tok, mask,
                                  temperature=0.8, return_entropy=True, backend="cpu")
    torch.testing.assert_close(lp, lp2)
    torch.testing.assert_close(ent, ent2)
    ga = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), params(d))
    gb = torch.autograd.grad((lp2 * w1).sum() + (ent2 * w2).sum(), params(d))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    # logp only
    lp = pk.token_logprobs_from_hidden(h, d["W"], tok, mask, lm_head_bias=d["b"],
                                       logit_softcap=cap, chunk_size=1)
    lp2 = pk.token_logprobs(head_logits(h, d["W"], d["b"], cap), tok, mask, backend="cpu")
    ga = torch.autograd.grad((lp * w1).sum(), params(d))
    gb = torch.autograd.grad((lp2 * w1).sum(), params(d))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    if layout == "bt1H":
        assert (ga[0][:, T:] == 0).all()


def test_token_logprobs_from_hidden_gradcheck():
    d = head_inputs(B=2, T=3, H=4, V=5, seed=17, dtype=torch.float64, bias=True)

    def f(h, w, b):
        lp, ent = pk.token_logprobs_from_hidden(h, w, d["tokens"], d["mask"], lm_head_bias=b,
                                                logit_softcap=2.0, return_entropy=True,
                                                chunk_size=2)
        return lp, ent

    assert torch.autograd.gradcheck(f, (d["hidden"], d["W"], d["b"]))


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_loss_agg_mode_none(policy_loss):
    d = head_inputs(seed=18, bias=True)
    assert_pair(*run_pair(d, cap=2.0, loss_agg_mode="none", policy_loss=policy_loss,
                          kl_coef=0.1, entropy_coef=0.01))


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_torch_backend_is_the_composite(policy_loss):
    d = head_inputs(seed=19, bias=True)
    kw = dict(lm_head_bias=d["b"], logit_softcap=2.0, policy_loss=policy_loss, kl_coef=0.1,
              entropy_coef=0.01)
    args = (d["hidden"], d["W"], d["tokens"], d["old"], d["adv"], d["mask"], d["ref"])
    loss, m = pk.ppo_loss_from_hidden(*args, backend="torch", **kw)
    loss2, m2 = pk.ppo_loss_from_hidden(*args, backend="cpu", chunk_size=2, **kw)
    torch.testing.assert_close(loss, loss2)
    for x, y in zip(grads(loss, d), grads(loss2, d)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@triton_interpreter
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_triton_backend_interpreter(policy_loss):
    """The Triton ops on the chunks (interpreter: small shapes)."""
    d = head_inputs(B=2, T=5, H=6, V=13, seed=25, bias=True)
    kw = dict(lm_head_bias=d["b"], logit_softcap=2.0, policy_loss=policy_loss, kl_coef=0.1,
              entropy_coef=0.01, chunk_size=3)
    args = (d["hidden"], d["W"], d["tokens"], d["old"], d["adv"], d["mask"], d["ref"])
    loss, m = pk.ppo_loss_from_hidden(*args, backend="triton", **kw)
    loss2, m2 = pk.ppo_loss_from_hidden(*args, backend="cpu", **kw)
    torch.testing.assert_close(loss, loss2, rtol=1e-5, atol=1e-6)
    (loss / 3).backward()
    g = [p.grad.clone() for p in params(d)]
    for p in params(d):
        p.grad = None
    (loss2 / 3).backward()
    for x, p in zip(g, params(d)):
        torch.testing.assert_close(x, p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("flat", [False, True])
def test_torch_backend_token_logprobs_and_none(flat):
    d = head_inputs(seed=26, bias=True)
    h, tok, mask, old, adv = d["hidden"], d["tokens"], d["mask"], d["old"], d["adv"]
    if flat:
        h = h.reshape(-1, h.shape[-1])
        tok, mask, old, adv = (x.reshape(-1) for x in (tok, mask, old, adv))
    kw = dict(lm_head_bias=d["b"], logit_softcap=2.0)
    for be in ("torch", "cpu"):
        lp, ent = pk.token_logprobs_from_hidden(h, d["W"], tok, mask, return_entropy=True,
                                                backend=be, chunk_size=4, **kw)
        assert lp.shape == tok.shape and ent.shape == tok.shape
        loss, _ = pk.ppo_loss_from_hidden(h, d["W"], tok, old, adv, mask, backend=be,
                                          loss_agg_mode="none", entropy_coef=0.1,
                                          chunk_size=4, **kw)
        assert loss.shape == tok.shape
        out = (lp, ent, loss, grads(loss.sum() + lp.sum(), d))
        if be == "torch":
            want = out
    for x, y in zip(out[:3], want[:3]):
        torch.testing.assert_close(x, y)
    for x, y in zip(out[3], want[3]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ nothing of [N, V] is stored

class _Sizes(TorchDispatchMode):
    """Records the shape (and, in typed, the shape and dtype) of every tensor any op (aten
    or ppo_kernels) returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []
        self.typed = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
                self.typed.add(tuple(t.shape) + (t.dtype,))
        return out


def _largest_vocab_tensor(shapes, V):
    return max((int(np.prod(s)) for s in shapes if s and s[-1] == V), default=0)


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_no_tensor_larger_than_a_chunk(policy_loss, cap):
    B, T, H, V, c = 4, 16, 2, 50, 3  # N V = 3200 > V H = 100 and N H = 128
    d = head_inputs(B=B, T=T, H=H, V=V, seed=20, bias=True)
    spy_calls = []
    real = head_chunks.chunk_logits

    def spy(h, w, b, cap_, *rest):
        z = real(h, w, b, cap_, *rest)
        spy_calls.append(tuple(z.shape))
        return z

    head_chunks.chunk_logits = spy
    try:
        with _Sizes() as sizes:
            loss, _ = pk.ppo_loss_from_hidden(d["hidden"], d["W"], d["tokens"], d["old"],
                                              d["adv"], d["mask"], lm_head_bias=d["b"],
                                              logit_softcap=cap, chunk_size=c,
                                              policy_loss=policy_loss, entropy_coef=0.01)
            loss.backward()
    finally:
        head_chunks.chunk_logits = real
    n = B * T
    passes = 2 if policy_loss == "gspo" else 1
    # per pass one call per chunk that has kept rows, and one for the masked rows' logits
    # (a zero hidden state) where a chunk skips its masked rows (head_chunks.live_rows)
    lives = head_chunks.live_rows(d["mask"].reshape(-1), c, H)
    skips = [x for x in lives if x is not None]
    assert skips and len(lives) == -(-n // c)
    per_pass = sum(1 for x in lives if x is None or x.numel()) + 1
    assert len(spy_calls) == passes * per_pass
    assert max(s[0] for s in spy_calls) == c
    biggest = _largest_vocab_tensor(sizes.shapes, V)
    assert biggest == c * V, biggest  # the chunk's logits and nothing larger
    # the instrument does see [N, V] when the logits are materialised
    with _Sizes() as sizes2:
        loss2, _ = pk.ppo_loss(head_logits(d["hidden"], d["W"], d["b"], cap), d["tokens"],
                               d["old"], d["adv"], d["mask"], policy_loss=policy_loss,
                               entropy_coef=0.01, backend="cpu")
        loss2.backward()
    assert _largest_vocab_tensor(sizes2.shapes, V) == n * V


def test_token_logprobs_no_tensor_larger_than_a_chunk():
    B, T, H, V, c = 4, 16, 2, 50, 5
    d = head_inputs(B=B, T=T, H=H, V=V, seed=21)
    with _Sizes() as sizes:
        lp, ent = pk.token_logprobs_from_hidden(d["hidden"], d["W"], d["tokens"], d["mask"],
                                                return_entropy=True, chunk_size=c)
        (lp.sum() + ent.sum()).backward()
    assert _largest_vocab_tensor(sizes.shapes, V) == c * V


def test_default_chunk_size():
    assert head_chunks.default_chunk_size(32000, torch.bfloat16) == (256 << 20) // (32000 * 2)
    assert head_chunks.default_chunk_size(151936, torch.float32) == (256 << 20) // (151936 * 4)
    assert head_chunks.default_chunk_size(1 << 40, torch.float32) == 1
    # half the dW accumulator where that is more than 256 MiB: H a / (2 e) rows
    v, h = 151936, 4096
    assert head_chunks.default_chunk_size(v, torch.bfloat16) == 883
    assert head_chunks.default_chunk_size(v, torch.bfloat16, v * h * 4) == 4096
    assert head_chunks.default_chunk_size(v, torch.bfloat16, v * h * 2) == 2048
    assert head_chunks.default_chunk_size(v, torch.float32, v * h * 4) == 2048
    assert head_chunks.default_chunk_size(v, torch.bfloat16, v * h * 4, 2) == 2048
    assert head_chunks.default_chunk_size(32000, torch.bfloat16, 32000 * 256 * 4) == \
        (256 << 20) // (32000 * 2)  # (a small head: the 256 MiB floor)
    d = head_inputs(seed=22)
    assert_pair(*run_pair(d, chunk_size=None))


def test_default_chunk_size_counts_the_accumulator(monkeypatch):
    """head_options counts dW's accumulator (accum_dtype's bytes) only where the weight
    takes a gradient."""
    monkeypatch.setattr(head_chunks, "CHUNK_BYTES", 64)
    h3 = torch.zeros(2, 8, 8, dtype=torch.bfloat16)  # 16 rows: more than any chunk below
    w = torch.zeros(16, 8, dtype=torch.bfloat16)
    chunk = head_chunks.head_options
    assert chunk(h3, w, None, None).chunk == 2  # 64 B of bf16 logits: 2 rows of 16
    w.requires_grad_()
    assert chunk(h3, w, None, None, buffers=1).chunk == 8  # 16 * 8 * 4 / 2 B: 8 rows
    assert chunk(h3, w, None, None).chunk == 4  # two chunk buffers: half each
    assert chunk(h3, w, None, None, accum_dtype=torch.bfloat16, buffers=1).chunk == 4
    assert chunk(h3, w, None, None, torch.float32, buffers=1).chunk == 4  # float32 logits
    assert chunk(h3, w, None, 5).chunk == 5
    with torch.no_grad():
        assert chunk(h3, w, None, None).chunk == 2


@pytest.mark.parametrize("kw,buffers", [
    (dict(), 1), (dict(logit_softcap=3.0), 2), (dict(policy_loss="gspo"), 2),
    (dict(loss_agg_mode="none"), 2), (dict(top_k=4), 2)])
def test_default_chunk_counts_the_buffers_of_the_path(monkeypatch, kw, buffers):
    """ppo_loss_from_hidden's default chunk: one chunk buffer on the fused single pass,
    two on the two-phase path (the logits and dz), with a soft cap (its derivative) and
    for loss_agg_mode="none" (token_logprobs_from_hidden's backward)."""
    monkeypatch.setattr(head_chunks, "CHUNK_BYTES", 16)
    d = head_inputs(B=2, T=8, H=4, V=8, seed=17, dtype=torch.float32)
    seen = []
    real = head_chunks.HeadRows.__init__

    def spy(self, be, head, *rest, **kw2):
        seen.append(head.chunk)
        real(self, be, head, *rest, **kw2)

    monkeypatch.setattr(head_chunks.HeadRows, "__init__", spy)
    loss, _ = pk.ppo_loss_from_hidden(d["hidden"], d["W"], d["tokens"], d["old"], d["adv"],
                                      d["mask"], **kw)
    # the accumulator 8 * 4 * 4 = 128 B: chunks of 64 / buffers B (above the 16 B floor),
    # 8 float32 logits (32 B) a row
    assert seen and set(seen) == {2 // buffers}, seen


# ------------------------------------------------------------------ bad input

def _call(d, **over):
    a = dict(hidden=d["hidden"], lm_head_weight=d["W"], tokens=d["tokens"],
             old_logprobs=d["old"], advantages=d["adv"], response_mask=d["mask"])
    a.update(over)
    return pk.ppo_loss_from_hidden(**a)


@pytest.mark.parametrize("over,exc,name", [
    (lambda d: dict(lm_head_weight=d["W"][:, :-1]), ValueError, "lm_head_weight"),
    (lambda d: dict(lm_head_weight=d["W"][0]), ValueError, "lm_head_weight"),
    (lambda d: dict(hidden=d["hidden"][..., :-1]), ValueError, "lm_head_weight"),
    (lambda d: dict(lm_head_weight=d["W"].double()), TypeError, "lm_head_weight"),
    (lambda d: dict(hidden=d["hidden"].double()), TypeError, "lm_head_weight"),
    (lambda d: dict(lm_head_bias=torch.zeros(3)), ValueError, "lm_head_bias"),
    (lambda d: dict(lm_head_bias=torch.zeros(13, dtype=torch.float64)), TypeError,
     "lm_head_bias"),
    (lambda d: dict(chunk_size=0), ValueError, "chunk_size"),
    (lambda d: dict(chunk_size=-2), ValueError, "chunk_size"),
    (lambda d: dict(chunk_size=2.0), TypeError, "chunk_size"),
    (lambda d: dict(chunk_size=True), TypeError, "chunk_size"),
    (lambda d: dict(logit_softcap=0.0), ValueError, "logit_softcap"),
    (lambda d: dict(accum_dtype="float32"), TypeError, "accum_dtype"),
    (lambda d: dict(accum_dtype=torch.float64), ValueError, "accum_dtype"),
    (lambda d: dict(accum_dtype=torch.bfloat16), ValueError, "accum_dtype"),
    (lambda d: dict(hidden=d["hidden"][0, 0]), ValueError, "hidden"),
    (lambda d: dict(hidden=d["hidden"].int()), TypeError, "hidden"),
    (lambda d: dict(hidden=d["hidden"][:, :-1]), ValueError, "tokens"),
    (lambda d: dict(tokens=d["tokens"] + 100), ValueError, "tokens"),
    (lambda d: dict(advantages=d["adv"][:, :-1]), ValueError, "advantages"),
    (lambda d: dict(policy_loss="nope"), ValueError, "policy_loss"),
    (lambda d: dict(kl_coef=0.1), ValueError, "ref_logprobs"),
    (lambda d: dict(backend="nope"), ValueError, "backend"),
])
def test_bad_inputs(over, exc, name):
    d = head_inputs(seed=23)
    with pytest.raises(exc, match=name):
        _call(d, **over(d))


def test_float16_runs_and_matches():
    d = head_inputs(B=2, T=4, H=8, V=20, seed=29, dtype=torch.float16)
    a, b = run_pair(d, grad_scale=1024.0, kl_coef=0.1)
    assert_pair(a, b, rtol=1e-2, atol=1e-3, grad_rtol=2e-2)


def test_bad_inputs_token_logprobs():
    d = head_inputs(seed=24)
    with pytest.raises(ValueError, match="chunk_size"):
        pk.token_logprobs_from_hidden(d["hidden"], d["W"], d["tokens"], chunk_size=0)
    with pytest.raises(ValueError, match="lm_head_weight"):
        pk.token_logprobs_from_hidden(d["hidden"], d["W"].t(), d["tokens"])
    with pytest.raises(TypeError, match="lm_head_weight"):
        pk.token_logprobs_from_hidden(d["hidden"], d["W"].double(), d["tokens"])


# ------------------------------------------------------------------ score_rollout_from_hidden

def _rollout_inputs(d, seed=30):
    g = torch.Generator().manual_seed(seed)
    B, T = d["tokens"].shape
    values = torch.randn(B, T, generator=g)
    scores = torch.randn(B, generator=g)
    return values, scores


def _assert_rollout(a, b, **tol):
    assert type(a) is type(b) and a._fields == b._fields
    for name, x, y in zip(a._fields, a, b):
        assert x.dtype == torch.float32 and x.shape == y.shape, name
        assert not x.requires_grad, name
        torch.testing.assert_close(x, y, msg=name, **tol)


@pytest.mark.parametrize("chunk", [1, 4, 7, 100, None])
@pytest.mark.parametrize("est,whiten", [("k1", True), ("k3", False), ("k2", True),
                                        ("abs", True)])
def test_score_rollout_from_hidden(chunk, est, whiten):
    d = head_inputs(B=4, T=6, seed=31)
    values, scores = _rollout_inputs(d)
    kw = dict(kl_coef=0.1, kl_estimator=est, gamma=0.99, lam=0.9, temperature=0.8,
              whiten=whiten)
    got = pk.score_rollout_from_hidden(d["hidden"], d["W"], d["tokens"], d["ref"], values,
                                       scores, d["mask"], chunk_size=chunk, **kw)
    with torch.no_grad():
        logits = head_logits(d["hidden"], d["W"])
    want = pk.score_rollout(logits, d["tokens"], d["ref"], values, scores, d["mask"],
                            backend="cpu", **kw)
    _assert_rollout(got, want)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_score_rollout_from_hidden_vapo_lambdas(backend):
    """VAPO's decoupled and length-adaptive lambda reach the GAE of the from-hidden path."""
    d = head_inputs(B=4, T=6, seed=32)
    values, scores = _rollout_inputs(d)
    kw = dict(kl_coef=0.1, gamma=0.99, lam="length-adaptive", lam_alpha=0.5, value_lam=1.0,
              whiten=False)
    got = pk.score_rollout_from_hidden(d["hidden"], d["W"], d["tokens"], d["ref"], values,
                                       scores, d["mask"], chunk_size=3, backend=backend, **kw)
    with torch.no_grad():
        logits = head_logits(d["hidden"], d["W"])
    want = pk.score_rollout(logits, d["tokens"], d["ref"], values, scores, d["mask"],
                            backend="cpu", **kw)
    _assert_rollout(got, want)
    plain = pk.score_rollout(logits, d["tokens"], d["ref"], values, scores, d["mask"],
                             backend="cpu", kl_coef=0.1, gamma=0.99, lam=0.95, whiten=False)
    assert not torch.allclose(got.returns, plain.returns)
    with pytest.raises(ValueError, match="lam_alpha"):
        pk.score_rollout_from_hidden(d["hidden"], d["W"], d["tokens"], d["ref"], values,
                                     scores, d["mask"], kl_coef=0.1, lam="length-adaptive")


@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("extra_pos", [False, True])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_score_rollout_from_hidden_bias_softcap_layouts(cap, extra_pos, backend):
    d = head_inputs(B=3, T=5, seed=32, bias=True, extra_pos=extra_pos)
    values, scores = _rollout_inputs(d, seed=33)
    mask = d["mask"].float()  # a float mask, as the demo passes it
    kw = dict(kl_coef=0.05)
    got = pk.score_rollout_from_hidden(d["hidden"], d["W"], d["tokens"], d["ref"], values,
                                       scores, mask, lm_head_bias=d["b"], logit_softcap=cap,
                                       chunk_size=2, backend=backend, **kw)
    with torch.no_grad():
        logits = head_logits(d["hidden"], d["W"], d["b"], cap)  # [B, T + 1, V] with extra_pos
    want = pk.score_rollout(logits, d["tokens"], d["ref"], values, scores, mask,
                            backend="cpu", **kw)
    _assert_rollout(got, want)
    # masked positions are 0 in every output
    for x in got:
        assert (x[~d["mask"]] == 0).all()


@pytest.mark.parametrize("cap", [None, 3.0])
def test_score_rollout_from_hidden_bf16(cap):
    d = head_inputs(B=3, T=8, H=16, V=40, seed=34, dtype=torch.bfloat16, bias=True)
    values, scores = _rollout_inputs(d, seed=35)
    kw = dict(kl_coef=0.1, kl_estimator="k3", whiten=False)
    got = pk.score_rollout_from_hidden(d["hidden"], d["W"], d["tokens"], d["ref"], values,
                                       scores, d["mask"], lm_head_bias=d["b"],
                                       logit_softcap=cap, chunk_size=5, **kw)
    with torch.no_grad():
        logits = head_logits(d["hidden"], d["W"], d["b"], cap)  # bf16, as the model's
    want = pk.score_rollout(logits, d["tokens"], d["ref"], values, scores, d["mask"],
                            backend="cpu", **kw)
    _assert_rollout(got, want, rtol=1e-2, atol=1e-2)
    # and whitened
    kw["whiten"] = True
    got = pk.score_rollout_from_hidden(d["hidden"], d["W"], d["tokens"], d["ref"], values,
                                       scores, d["mask"], lm_head_bias=d["b"],
                                       logit_softcap=cap, chunk_size=5, **kw)
    want = pk.score_rollout(logits, d["tokens"], d["ref"], values, scores, d["mask"],
                            backend="cpu", **kw)
    _assert_rollout(got, want, rtol=1e-2, atol=1e-2)


def test_score_rollout_from_hidden_float64_and_no_grad_graph():
    d = head_inputs(B=2, T=4, seed=36, dtype=torch.float64)
    values, scores = _rollout_inputs(d, seed=37)
    got = pk.score_rollout_from_hidden(d["hidden"], d["W"], d["tokens"], d["ref"], values,
                                       scores, d["mask"], kl_coef=0.2, chunk_size=3)
    with torch.no_grad():
        logits = head_logits(d["hidden"], d["W"])
    want = pk.score_rollout(logits, d["tokens"], d["ref"], values, scores, d["mask"],
                            kl_coef=0.2, backend="cpu")
    _assert_rollout(got, want)  # float32 outputs (the inputs require grad: none is tracked)
    assert d["hidden"].grad is None and d["W"].grad is None


def test_score_rollout_from_hidden_no_tensor_larger_than_a_chunk():
    B, T, H, V, c = 4, 16, 2, 50, 5
    d = head_inputs(B=B, T=T, H=H, V=V, seed=38, bias=True)
    values, scores = _rollout_inputs(d, seed=39)
    with _Sizes() as sizes:
        pk.score_rollout_from_hidden(d["hidden"], d["W"], d["tokens"], d["ref"], values,
                                     scores, d["mask"], lm_head_bias=d["b"], logit_softcap=2.0,
                                     chunk_size=c, kl_coef=0.1)
    assert _largest_vocab_tensor(sizes.shapes, V) == c * V


@pytest.mark.parametrize("over,exc,name", [
    (lambda d, v, s: dict(hidden=d["hidden"].reshape(-1, d["hidden"].shape[-1]),
                          tokens=d["tokens"].reshape(-1)), ValueError, "hidden"),
    (lambda d, v, s: dict(lm_head_weight=d["W"][:, :-1]), ValueError, "lm_head_weight"),
    (lambda d, v, s: dict(lm_head_weight=d["W"].double()), TypeError, "lm_head_weight"),
    (lambda d, v, s: dict(ref_logprobs=d["ref"][:, :-1]), ValueError, "ref_logprobs"),
    (lambda d, v, s: dict(values=v[:1]), ValueError, "values"),
    (lambda d, v, s: dict(scores=s[:-1]), ValueError, "scores"),
    (lambda d, v, s: dict(kl_coef=-1.0), ValueError, "kl_coef"),
    (lambda d, v, s: dict(kl_estimator="k9"), ValueError, "kl_estimator"),
    (lambda d, v, s: dict(gamma=1.5), ValueError, "gamma"),
    (lambda d, v, s: dict(lam=-0.1), ValueError, "lam"),
    (lambda d, v, s: dict(temperature=0.0), ValueError, "temperature"),
    (lambda d, v, s: dict(temperature=torch.ones(d["tokens"].shape[0] + 1)), ValueError,
     "temperature"),
    (lambda d, v, s: dict(temperature=torch.full(d["tokens"].shape, -1.0)), ValueError,
     "temperature"),
    (lambda d, v, s: dict(logits_dtype=torch.float16), ValueError, "logits_dtype"),
    (lambda d, v, s: dict(logits_dtype="float32"), TypeError, "logits_dtype"),
    (lambda d, v, s: dict(chunk_size=0), ValueError, "chunk_size"),
    (lambda d, v, s: dict(logit_softcap=-1.0), ValueError, "logit_softcap"),
    (lambda d, v, s: dict(tokens=d["tokens"] + 100), ValueError, "tokens"),
    (lambda d, v, s: dict(backend="nope"), ValueError, "backend"),
])
def test_score_rollout_from_hidden_bad_inputs(over, exc, name):
    d = head_inputs(seed=40)
    values, scores = _rollout_inputs(d, seed=41)
    a = dict(hidden=d["hidden"], lm_head_weight=d["W"], tokens=d["tokens"],
             ref_logprobs=d["ref"], values=values, scores=scores, response_mask=d["mask"],
             kl_coef=0.1)
    a.update(over(d, values, scores))
    with pytest.raises(exc, match=name):
        pk.score_rollout_from_hidden(**a)


# ------------------------------------------------------------------ logits_dtype=float32

def _bf16_head(seed, B=3, T=6, H=16, V=37):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(B, T, H, generator=g) * 2).to(torch.bfloat16)
    W = torch.randn(V, H, generator=g).to(torch.bfloat16)
    b = torch.randn(V, generator=g).to(torch.bfloat16)
    tok = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    old = -torch.rand(B, T, generator=g) - 0.5
    adv = torch.randn(B, T, generator=g)
    return hid, W, b, tok, mask, old, adv


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_float32_logits_of_bf16_inputs(backend, policy_loss):
    """bf16 hidden / head with logits_dtype=float32: the float32 computation on the
    bf16-rounded inputs (well under 1e-5), unlike the default bf16 logits; gradients in
    bf16, within bf16 rounding of the float32 ones."""
    hid, W, b, tok, mask, old, adv = _bf16_head(201)
    kw = dict(policy_loss=policy_loss, entropy_coef=0.01, temperature=0.7, chunk_size=5,
              lm_head_bias=b, backend=backend)
    h16, w16 = hid.clone().requires_grad_(True), W.clone().requires_grad_(True)
    loss, met = pk.ppo_loss_from_hidden(h16, w16, tok, old, adv, mask,
                                        logits_dtype=torch.float32, return_per_token=True, **kw)
    loss.backward()
    h32, w32 = hid.float().requires_grad_(True), W.float().requires_grad_(True)
    kw32 = dict(kw, lm_head_bias=b.float())
    want, wm = pk.ppo_loss_from_hidden(h32, w32, tok, old, adv, mask, return_per_token=True,
                                       **kw32)
    want.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    lp, wlp = met["per_token_logprobs"], wm["per_token_logprobs"]
    assert float((lp - wlp).abs().max()) <= 1e-5 * max(1.0, float(wlp.abs().max()))
    assert h16.grad.dtype == torch.bfloat16 and w16.grad.dtype == torch.bfloat16
    for got, ref32 in ((h16.grad, h32.grad), (w16.grad, w32.grad)):
        err = float((got.float() - ref32).abs().max())
        assert err <= 1e-2 * float(ref32.abs().max()), err
    default, dm = pk.ppo_loss_from_hidden(hid, W, tok, old, adv, mask, return_per_token=True,
                                          **kw)
    # the default path rounds each logit to bf16 (8 bits): visibly different log-probs
    assert float((dm["per_token_logprobs"] - wlp).abs().max()) > 1e-4


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_float32_logits_token_logprobs_and_score(backend):
    hid, W, b, tok, mask, old, adv = _bf16_head(211)
    lp, h = pk.token_logprobs_from_hidden(hid, W, tok, mask, lm_head_bias=b,
                                          logits_dtype=torch.float32, return_entropy=True,
                                          chunk_size=4, backend=backend)
    e_lp, e_h = pk.token_logprobs_from_hidden(hid.float(), W.float(), tok, mask,
                                              lm_head_bias=b.float(), return_entropy=True,
                                              chunk_size=4, backend=backend)
    assert float((lp - e_lp).abs().max()) <= 1e-5 * max(1.0, float(e_lp.abs().max()))
    assert float((h - e_h).abs().max()) <= 1e-5 * max(1.0, float(e_h.abs().max()))
    d_lp = pk.token_logprobs_from_hidden(hid, W, tok, mask, lm_head_bias=b, chunk_size=4,
                                         backend=backend)
    assert float((d_lp - e_lp).abs().max()) > 1e-4
    B, T = tok.shape
    g = torch.Generator().manual_seed(212)
    r = pk.score_rollout_from_hidden(hid, W, tok, old, torch.randn(B, T, generator=g),
                                     torch.randn(B, generator=g), mask, lm_head_bias=b,
                                     kl_coef=0.1, logits_dtype=torch.float32, chunk_size=4,
                                     backend=backend)
    assert float((r.logprobs - e_lp).abs().max()) <= 1e-5 * max(1.0, float(e_lp.abs().max()))


def test_float32_logits_is_a_no_op_for_float32_inputs():
    hid, W, b, tok, mask, old, adv = _bf16_head(221)
    hid, W = hid.float(), W.float()
    a = pk.token_logprobs_from_hidden(hid, W, tok, mask, chunk_size=4, backend="cpu")
    c = pk.token_logprobs_from_hidden(hid, W, tok, mask, chunk_size=4, backend="cpu",
                                      logits_dtype=torch.float32)
    assert torch.equal(a, c)
    with pytest.raises(ValueError, match="logits_dtype"):
        pk.token_logprobs_from_hidden(hid.double(), W.double(), tok, mask,
                                      logits_dtype=torch.float32)


# ------------------------------------------------------------------ sampling replay, tp_group

def test_replay_tensor_parallel_head_two_ranks(tmp_path):
    """tests/replay_hidden_rank_cases.py on 2 gloo processes: the LM head's rows split
    [0, 6) / [6, 13), a given SamplingMask (sets lacking their token included), float32:
    token_logprobs_from_hidden (return_full, kept entropy, soft cap, bias, chunks of 3 rows
    and one chunk, per-sequence temperature), ppo_loss_from_hidden (vanilla, gspo with the
    KL and the entropy over the kept set, the full entropy with a soft cap, per-token
    temperature) and score_rollout_from_hidden (kl_logprobs full / kept) give the
    single-process op's values on the full head; d hidden (summed over the group) and each
    rank's dW / db slice likewise. No chunk's logits exceed chunk_size rows x V_r columns;
    re-derived sets stay NotImplementedError; an id outside the vocabulary a ValueError."""
    import pathlib

    from helpers.ranks import run_ranks
    script = pathlib.Path(__file__).parent / "replay_hidden_rank_cases.py"
    ranks = run_ranks(script, tmp_path, n=2)
    for rank, res in enumerate(ranks):
        assert len(res) == 33, sorted(res)
        for k, v in res.items():
            if k == "top_p":
                assert v.startswith("raised top_k / top_p / min_p with tp_group"), v
            elif k == "out_of_range":
                assert v.startswith("raised sampling_mask.token_ids"), v
            elif k == "chunk_shapes":
                n, rows, cols = v.split(" ", 2)
                # forward + backward over 10 rows in chunks of 3: 4 + 4 calls
                assert (int(n), int(rows), cols) == (8, 3, "[6]" if rank == 0 else "[7]"), v
            else:
                assert v <= 2e-6, (k, v)
