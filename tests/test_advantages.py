"""The rollout side: gae, kl_penalized_rewards, whiten, score_rollout, and value_loss, against
the numpy float64 reference and hand-computed cases."""

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as ref

from conftest import assert_close_np, make_inputs, make_mask

KL = ["k1", "k2", "k3", "abs"]


def rand_seq(B, T, gen, padding="mixed"):
    r = torch.randn(B, T, generator=gen)
    v = torch.randn(B, T, generator=gen)
    m = make_mask(B, T, gen, padding)
    return r, v, m


# ------------------------------------------------------------------ gae

@pytest.mark.parametrize("padding", ["left", "right", "interior", "random", "none",
                                     "empty_row", "all"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.0, 0.95), (1.0, 0.0),
                                       (1.0, 1.0), (0.0, 0.0)])
def test_gae_matches_reference(be, padding, gamma, lam, gen):
    r, v, m = rand_seq(3, 13, gen, padding)
    adv, ret = pk.gae(be.t(r), be.t(v), be.t(m), gamma=gamma, lam=lam, backend=be.name)
    e_adv, e_ret = ref.gae(r, v, m, gamma=gamma, lam=lam)
    assert adv.dtype == torch.float32 and adv.shape == (3, 13)
    assert_close_np(adv, e_adv, rtol=1e-5, atol=1e-5, what="advantages")
    assert_close_np(ret, e_ret, rtol=1e-5, atol=1e-5, what="returns")
    assert torch.all(adv.cpu()[~m] == 0) and torch.all(ret.cpu()[~m] == 0)


@pytest.mark.parametrize("padding", ["right", "interior", "left"])
def test_gae_bootstrap_values(be, padding, gen):
    r, v, m = rand_seq(4, 9, gen, padding)
    boot = torch.randn(4, generator=gen)
    adv, ret = pk.gae(be.t(r), be.t(v), be.t(m), gamma=0.97, lam=0.9,
                      bootstrap_values=be.t(boot), backend=be.name)
    e_adv, e_ret = ref.gae(r, v, m, gamma=0.97, lam=0.9, bootstrap_values=boot)
    assert_close_np(adv, e_adv, rtol=1e-5, atol=1e-5)
    assert_close_np(ret, e_ret, rtol=1e-5, atol=1e-5)
    no_boot, _ = pk.gae(be.t(r), be.t(v), be.t(m), gamma=0.97, lam=0.9, backend=be.name)
    assert not torch.allclose(adv, no_boot)  # the bootstrap value does enter


def test_gae_long_sequence_and_float64(be, gen):
    T = 300 if be.small else 2049
    r, v, m = rand_seq(2, T, gen, "random")
    for dtype, tol in ((torch.float32, 2e-4), (torch.float64, 1e-10)):
        adv, ret = pk.gae(be.t(r.to(dtype)), be.t(v.to(dtype)), be.t(m), gamma=0.999,
                          lam=0.97, backend=be.name)
        assert adv.dtype == dtype
        e_adv, e_ret = ref.gae(r.to(dtype), v.to(dtype), m, gamma=0.999, lam=0.97)
        assert_close_np(adv, e_adv, rtol=tol, atol=tol)
        assert_close_np(ret, e_ret, rtol=tol, atol=tol)


def test_gae_by_hand(be):
    """Interior gap, left and right padding give the same numbers as the compact sequence."""
    r = torch.tensor([1.0, -0.5, 2.0])
    v = torch.tensor([0.25, 0.5, -1.0])
    compact, _ = pk.gae(be.t(r[None]), be.t(v[None]), gamma=0.9, lam=0.8, backend=be.name)
    a2 = 2.0 - (-1.0)
    a1 = -0.5 + 0.9 * -1.0 - 0.5 + 0.72 * a2
    a0 = 1.0 + 0.9 * 0.5 - 0.25 + 0.72 * a1
    np.testing.assert_allclose(compact.cpu()[0].numpy(), [a0, a1, a2], rtol=1e-6)
    for pos in ([2, 3, 4], [0, 1, 2], [0, 2, 4], [1, 3, 4]):
        rr = torch.full((1, 5), 7.0)
        vv = torch.full((1, 5), -3.0)
        m = torch.zeros(1, 5, dtype=torch.bool)
        rr[0, pos], vv[0, pos], m[0, pos] = r, v, True
        adv, ret = pk.gae(be.t(rr), be.t(vv), be.t(m), gamma=0.9, lam=0.8, backend=be.name)
        np.testing.assert_allclose(adv.cpu()[0, pos].numpy(), [a0, a1, a2], rtol=1e-6)
        np.testing.assert_allclose(ret.cpu()[0, pos].numpy(), np.array([a0, a1, a2]) + v.numpy(),
                                   rtol=1e-6)


def test_gae_no_gradient(gen):
    r, v, m = rand_seq(2, 5, gen)
    v.requires_grad_(True)
    adv, ret = pk.gae(r, v, m)
    assert not adv.requires_grad and not ret.requires_grad


# ------------------------------------------------------------------ kl_penalized_rewards

@pytest.mark.parametrize("est", KL)
@pytest.mark.parametrize("padding", ["left", "right", "interior", "random", "empty_row", "all"])
def test_kl_penalized_rewards_matches_reference(est, padding, gen):
    B, T = 4, 9
    lp = -torch.rand(B, T, generator=gen) * 3
    rl = -torch.rand(B, T, generator=gen) * 3
    m = make_mask(B, T, gen, padding)
    s = torch.randn(B, generator=gen)
    r = pk.kl_penalized_rewards(s, lp, rl, m, kl_coef=0.07, kl_estimator=est)
    e = ref.kl_penalized_rewards(s, lp, rl, m, kl_coef=0.07, kl_estimator=est)
    assert r.dtype == torch.float32
    assert_close_np(r, e, rtol=1e-6, atol=1e-6)
    assert torch.all(r[~m] == 0)


@pytest.mark.parametrize("mask,last", [([1, 1, 1, 0, 0], 2),   # right padding
                                       ([0, 0, 1, 1, 1], 4),   # left padding
                                       ([1, 1, 0, 1, 0], 3),   # interior gap: the LAST valid
                                       ([0, 1, 0, 0, 0], 1),
                                       ([1, 1, 1, 1, 1], 4)])
def test_score_placement(mask, last):
    """The score lands on the last valid token: not the first padding token, not index
    sum(mask) - 1 under left padding or with a gap."""
    m = torch.tensor([mask], dtype=torch.bool)
    lp = torch.zeros(1, 5)
    r = pk.kl_penalized_rewards(torch.tensor([2.5]), lp, lp.clone(), m, kl_coef=0.1)
    expected = torch.zeros(1, 5)
    expected[0, last] = 2.5
    assert torch.equal(r, expected)


def test_kl_penalized_rewards_mask_dtypes(gen):
    lp = -torch.rand(2, 4, generator=gen)
    rl = -torch.rand(2, 4, generator=gen)
    mb = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)
    s = torch.tensor([1.0, -1.0])
    r0 = pk.kl_penalized_rewards(s, lp, rl, mb, kl_coef=0.2)
    for m in (mb.int(), mb.float(), mb.long()):
        assert torch.equal(pk.kl_penalized_rewards(s, lp, rl, m, kl_coef=0.2), r0)


# ------------------------------------------------------------------ whiten

@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("padding", ["left", "right", "interior", "random", "none"])
def test_whiten_matches_reference(shift_mean, padding, gen):
    x = torch.randn(3, 8, generator=gen) * 4 + 2
    m = make_mask(3, 8, gen, padding)
    out = pk.whiten(x, m, shift_mean=shift_mean)
    e = ref.whiten(x, m, shift_mean=shift_mean)
    assert_close_np(out, e, rtol=1e-5, atol=1e-5)
    assert torch.all(out[~m] == 0)
    vals = out[m].double()
    if shift_mean:
        assert float(vals.mean()) == pytest.approx(0.0, abs=1e-5)
        assert float(vals.var(unbiased=True)) == pytest.approx(1.0, rel=1e-4)  # unbiased
    else:
        assert float(vals.mean()) == pytest.approx(float(x[m].mean()), rel=1e-5, abs=1e-5)


def test_whiten_unbiased_variance_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    out = pk.whiten(x, m, eps=0.0)
    np.testing.assert_allclose(out[0].numpy(), [-1.0, 0.0, 1.0, 0.0], atol=1e-6)  # var = 1


def test_whiten_degenerate():
    x = torch.tensor([[3.0, 5.0, 7.0]])
    one = pk.whiten(x, torch.tensor([[0, 1, 0]], dtype=torch.bool))
    assert torch.equal(one, torch.zeros(1, 3))  # one valid token: centred only, never NaN
    none = pk.whiten(x, torch.zeros(1, 3, dtype=torch.bool))
    assert torch.equal(none, torch.zeros(1, 3))
    one_noshift = pk.whiten(x, torch.tensor([[0, 1, 0]], dtype=torch.bool), shift_mean=False)
    assert torch.isfinite(one_noshift).all()
    assert torch.equal(one_noshift, torch.tensor([[0.0, 5.0, 0.0]]))  # centred, mean added back
    np.testing.assert_allclose(one_noshift.numpy(),
                               ref.whiten(x, np.array([[0, 1, 0]]), shift_mean=False))
    const = pk.whiten(torch.full((1, 3), 2.0), torch.ones(1, 3, dtype=torch.bool))
    assert torch.isfinite(const).all() and torch.all(const == 0)


def test_whiten_is_differentiable(gen):
    x = torch.randn(2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    m = make_mask(2, 5, gen)
    assert torch.autograd.gradcheck(lambda t: pk.whiten(t, m), (x,))


# ------------------------------------------------------------------ score_rollout

def _rollout_case(gen, B=3, T=5, V=37, padding="mixed", layout="aligned"):
    inp = make_inputs(B, T, V, gen, padding=padding, layout=layout)
    values = torch.randn(B, T, generator=gen)
    scores = torch.randn(B, generator=gen)
    return inp, values, scores


@pytest.mark.parametrize("est", KL)
@pytest.mark.parametrize("whiten", [True, False])
def test_score_rollout_matches_reference(be, est, whiten, gen):
    inp, values, scores = _rollout_case(gen)
    kw = dict(kl_coef=0.05, kl_estimator=est, gamma=0.99, lam=0.9, temperature=0.8)
    logits = be.t(inp["full"][:, :5].contiguous())
    out = pk.score_rollout(logits, be.t(inp["tokens"]), be.t(inp["ref"]), be.t(values),
                           be.t(scores), be.t(inp["mask"]), whiten=whiten, backend=be.name, **kw)
    e = ref.score_rollout(inp["base"], inp["tokens"], inp["ref"], values, scores, inp["mask"],
                          whiten_advantages=whiten, **kw)
    assert isinstance(out, pk.Rollout)
    for name in ("logprobs", "kl", "rewards", "advantages", "returns"):
        got = getattr(out, name)
        assert got.dtype == torch.float32 and got.shape == (3, 5), name
        assert_close_np(got, e[name], rtol=1e-5, atol=1e-5, what=name)
        assert torch.all(got.cpu()[~inp["mask"]] == 0), name


@pytest.mark.parametrize("layout", ["view", "raw", "tbatch"])
@pytest.mark.parametrize("padding", ["left", "interior", "empty_row", "all"])
def test_score_rollout_layouts_and_padding(be, layout, padding, gen):
    inp, values, scores = _rollout_case(gen, padding=padding, layout=layout)
    from conftest import logits_for
    _, logits = logits_for(inp, be, requires_grad=False)
    out = pk.score_rollout(logits, be.t(inp["tokens"]), be.t(inp["ref"]), be.t(values),
                           be.t(scores), be.t(inp["mask"]), kl_coef=0.1, backend=be.name)
    e = ref.score_rollout(inp["base"], inp["tokens"], inp["ref"], values, scores, inp["mask"],
                          kl_coef=0.1)
    for name in ("logprobs", "kl", "rewards", "advantages", "returns"):
        assert_close_np(getattr(out, name), e[name], rtol=1e-5, atol=1e-5, what=name)


def test_score_rollout_returns_before_whitening(be, gen):
    """returns = unwhitened advantages + values; the whitened advantages differ from them."""
    inp, values, scores = _rollout_case(gen, padding="right")
    args = (be.t(inp["full"][:, :5].contiguous()), be.t(inp["tokens"]), be.t(inp["ref"]),
            be.t(values), be.t(scores), be.t(inp["mask"]))
    w = pk.score_rollout(*args, kl_coef=0.1, whiten=True, backend=be.name)
    nw = pk.score_rollout(*args, kl_coef=0.1, whiten=False, backend=be.name)
    torch.testing.assert_close(w.returns, nw.returns)
    m = be.t(inp["mask"])
    torch.testing.assert_close(nw.returns, torch.where(m, nw.advantages + be.t(values), 0.0))
    torch.testing.assert_close(w.advantages, pk.whiten(nw.advantages, m), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(w.advantages, nw.advantages)
    # and each piece equals the separate public ops
    lp = pk.token_logprobs(args[0], args[1], m, backend=be.name)
    torch.testing.assert_close(nw.logprobs, lp, rtol=1e-6, atol=1e-6)
    r = pk.kl_penalized_rewards(args[4], lp, args[2], m, kl_coef=0.1)
    torch.testing.assert_close(nw.rewards, r, rtol=1e-5, atol=1e-6)
    adv, ret = pk.gae(r, args[3], m, gamma=1.0, lam=0.95, backend=be.name)
    torch.testing.assert_close(nw.advantages, adv, rtol=1e-5, atol=1e-5)


def test_score_rollout_float64_and_bf16_logits(gen):
    inp, values, scores = _rollout_case(gen)
    for dtype in (torch.float64, torch.bfloat16):
        lg = inp["full"][:, :5].to(dtype)
        out = pk.score_rollout(lg, inp["tokens"], inp["ref"], values, scores, inp["mask"],
                               kl_coef=0.1, backend="cpu")
        assert out.logprobs.dtype == torch.float32
        e = ref.score_rollout(lg.double(), inp["tokens"], inp["ref"], values, scores,
                              inp["mask"], kl_coef=0.1)
        assert_close_np(out.logprobs, e["logprobs"], rtol=1e-5, atol=1e-5)
        assert_close_np(out.advantages, e["advantages"], rtol=1e-4, atol=1e-4)


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
