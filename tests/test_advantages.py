"""Tests of ppo_kernels/advantages.py, the rollout side: gae, kl_penalized_rewards, whiten
and score_rollout, against the numpy float64 reference and hand-computed cases; empty
batches, garbage on masked positions, float16 inputs of whiten; bad arguments (a
ValueError or TypeError naming the argument, as in test_loss_bad_inputs.py)."""

import math

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ppo_kernels as pk
from ppo_kernels import reference as ref
from ppo_kernels.testing import make_mask

from helpers.asserts import assert_close_np
from helpers.backends import KERNELS_CPU
from helpers.bad_inputs import (BAD_B, BAD_T, BAD_V, META, PUBLIC_FUNCS, assert_bad_input_raises,
                                bad_row_id, base_gae, oob)
from helpers.inputs import SMALL_MASK, make_inputs, small_inputs

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


# ------------------------------------------------------------------ VAPO's lambdas

@pytest.mark.parametrize("padding", ["left", "right", "interior", "random", "empty_row", "all"])
@pytest.mark.parametrize("lam,value_lam", [(0.9, 1.0), (0.95, 0.0), (0.0, 1.0), (1.0, 0.5)])
@pytest.mark.parametrize("boot", [False, True])
def test_gae_value_lam_matches_reference(be, padding, lam, value_lam, boot, gen):
    """Decoupled GAE: advantages with lam, returns = GAE of value_lam + values."""
    r, v, m = rand_seq(3, 13, gen, padding)
    bv = torch.randn(3, generator=gen) if boot else None
    adv, ret = pk.gae(be.t(r), be.t(v), be.t(m), gamma=0.99, lam=lam, value_lam=value_lam,
                      bootstrap_values=None if bv is None else be.t(bv), backend=be.name)
    e_adv, e_ret = ref.gae(r, v, m, gamma=0.99, lam=lam, value_lam=value_lam,
                           bootstrap_values=bv)
    assert_close_np(adv, e_adv, rtol=1e-5, atol=1e-5, what="advantages")
    assert_close_np(ret, e_ret, rtol=1e-5, atol=1e-5, what="returns")
    assert torch.all(adv.cpu()[~m] == 0) and torch.all(ret.cpu()[~m] == 0)
    # the advantages are those of lam alone, the returns those of value_lam alone
    a1, _ = pk.gae(be.t(r), be.t(v), be.t(m), gamma=0.99, lam=lam,
                   bootstrap_values=None if bv is None else be.t(bv), backend=be.name)
    _, r2 = pk.gae(be.t(r), be.t(v), be.t(m), gamma=0.99, lam=value_lam,
                   bootstrap_values=None if bv is None else be.t(bv), backend=be.name)
    torch.testing.assert_close(adv, a1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret, r2, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padding", ["left", "right", "interior", "random", "empty_row", "all"])
@pytest.mark.parametrize("alpha,T", [(0.3, 13), (2.0, 13), (0.05, 45), (1e-6, 13), (1e6, 13)])
@pytest.mark.parametrize("value_lam", [None, 1.0])
def test_gae_length_adaptive_matches_reference(be, padding, alpha, T, value_lam, gen):
    """Length-adaptive GAE: lambda_b = max(0, 1 - 1 / (alpha l_b)) per sequence."""
    r, v, m = rand_seq(3, T, gen, padding)
    adv, ret = pk.gae(be.t(r), be.t(v), be.t(m), gamma=0.999, lam="length-adaptive",
                      lam_alpha=alpha, value_lam=value_lam, backend=be.name)
    e_adv, e_ret = ref.gae(r, v, m, gamma=0.999, lam="length-adaptive", lam_alpha=alpha,
                           value_lam=value_lam)
    assert adv.dtype == torch.float32 and adv.shape == (3, T)
    assert_close_np(adv, e_adv, rtol=1e-5, atol=1e-5, what="advantages")
    assert_close_np(ret, e_ret, rtol=1e-5, atol=1e-5, what="returns")
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    # row by row, the plain GAE of that row's own lambda
    lams = ref.length_adaptive_lam(m, alpha)
    for b in range(3):
        a_b, r_b = pk.gae(be.t(r[b:b + 1]), be.t(v[b:b + 1]), be.t(m[b:b + 1]), gamma=0.999,
                          lam=float(np.float32(lams[b])), value_lam=value_lam,
                          backend=be.name)
        torch.testing.assert_close(adv[b:b + 1], a_b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ret[b:b + 1], r_b, rtol=1e-6, atol=1e-6)


def test_gae_length_adaptive_float64(be, gen):
    r, v, m = rand_seq(3, 40, gen, "random")
    r, v = r.double(), v.double()
    adv, ret = pk.gae(be.t(r), be.t(v), be.t(m), gamma=0.99, lam="length-adaptive",
                      lam_alpha=0.1, value_lam=0.97, backend=be.name)
    assert adv.dtype == torch.float64
    e_adv, e_ret = ref.gae(r, v, m, gamma=0.99, lam="length-adaptive", lam_alpha=0.1,
                           value_lam=0.97)
    assert_close_np(adv, e_adv, rtol=1e-12, atol=1e-12)
    assert_close_np(ret, e_ret, rtol=1e-12, atol=1e-12)


def test_gae_value_lam_none_is_bit_identical(be, gen):
    """value_lam=None (and value_lam == lam) gives today's results bit for bit."""
    r, v, m = rand_seq(4, 17, gen, "interior")
    before = pk.gae(be.t(r), be.t(v), be.t(m), gamma=0.99, lam=0.9, backend=be.name)
    for vl in (None, 0.9):
        now = pk.gae(be.t(r), be.t(v), be.t(m), gamma=0.99, lam=0.9, value_lam=vl,
                     backend=be.name)
        assert torch.equal(before[0], now[0]) and torch.equal(before[1], now[1])
    # length-adaptive with value_lam=None: returns = advantages + values, exactly
    adv, ret = pk.gae(be.t(r), be.t(v), be.t(m), gamma=0.99, lam="length-adaptive",
                      lam_alpha=0.2, backend=be.name)
    assert torch.equal(ret, torch.where(be.t(m), adv + be.t(v), 0.0))


def test_gae_value_lam_by_hand(be):
    """gamma 0.9, lam 0.8, value_lam 1: deltas 1.2, -1.9, 3.0; advantages with 0.72, the
    returns are the discounted rewards-to-go (2.17, 1.3, 2.0); an interior gap changes
    nothing."""
    r = torch.tensor([1.0, -0.5, 2.0])
    v = torch.tensor([0.25, 0.5, -1.0])
    # d2 = 2 + 0.9 * 0 + 1 = 3; d1 = -0.5 + 0.9 * -1 - 0.5 = -1.9; d0 = 1 + 0.9 * 0.5 - 0.25
    a = [1.2 + 0.72 * (-1.9 + 0.72 * 3.0), -1.9 + 0.72 * 3.0, 3.0]  # 1.3872, 0.26, 3
    g = [1.2 + 0.9 * (-1.9 + 0.9 * 3.0), -1.9 + 0.9 * 3.0, 3.0]  # 1.92, 0.8, 3
    rets = [g[0] + 0.25, g[1] + 0.5, g[2] - 1.0]  # 2.17, 1.3, 2.0
    np.testing.assert_allclose(rets, [1.0 + 0.9 * (-0.5 + 0.9 * 2.0), -0.5 + 0.9 * 2.0, 2.0])
    rr = torch.tensor([[1.0, 9.0, -0.5, 2.0]])
    vv = torch.tensor([[0.25, -4.0, 0.5, -1.0]])
    m = torch.tensor([[True, False, True, True]])
    adv, ret = pk.gae(be.t(rr), be.t(vv), be.t(m), gamma=0.9, lam=0.8, value_lam=1.0,
                      backend=be.name)
    np.testing.assert_allclose(adv.cpu()[0].numpy(), [a[0], 0.0, a[1], a[2]], rtol=1e-6)
    np.testing.assert_allclose(ret.cpu()[0].numpy(), [rets[0], 0.0, rets[1], rets[2]],
                               rtol=1e-6)
    np.testing.assert_allclose(a, [1.3872, 0.26, 3.0], rtol=1e-12)
    np.testing.assert_allclose(rets, [2.17, 1.3, 2.0], rtol=1e-12)


def test_gae_length_adaptive_by_hand(be):
    """alpha 0.5, gamma 1: valid lengths 4, 2, 1, 0 give lambda 1 - 1 / (0.5 * 4) = 0.5,
    1 - 1 / 1 = 0, max(0, 1 - 2) = 0 and 0 (empty)."""
    nan = float("nan")  # masked positions are never read
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0, nan],
                      [nan, 2.0, nan, -1.0, nan],
                      [nan, nan, nan, nan, 3.0],
                      [nan] * 5])
    v = torch.tensor([[0.5, 0.5, 0.5, 0.5, nan],
                      [nan, 0.25, nan, 0.75, nan],
                      [nan, nan, nan, nan, 1.0],
                      [nan] * 5])
    m = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 0, 1, 0], [0, 0, 0, 0, 1], [0] * 5]).bool()
    np.testing.assert_array_equal(ref.length_adaptive_lam(m, 0.5), [0.5, 0.0, 0.0, 0.0])
    torch.testing.assert_close(pk.advantages.length_adaptive_lam(m, 0.5),
                               torch.tensor([0.5, 0.0, 0.0, 0.0]), rtol=0, atol=0)
    # row 0, lambda 0.5: deltas 1, 0, 0, 0.5; A3 = 0.5, A2 = 0.25, A1 = 0.125, A0 = 1.0625
    # row 1, lambda 0: A = the deltas, 2 + 0.75 - 0.25 = 2.5 and -1 - 0.75 = -1.75
    # row 2: 3 - 1 = 2
    e_adv = [[1.0625, 0.125, 0.25, 0.5, 0.0], [0.0, 2.5, 0.0, -1.75, 0.0],
             [0.0, 0.0, 0.0, 0.0, 2.0], [0.0] * 5]
    e_ret = [[1.5625, 0.625, 0.75, 1.0, 0.0], [0.0, 2.75, 0.0, -1.0, 0.0],
             [0.0, 0.0, 0.0, 0.0, 3.0], [0.0] * 5]
    # value_lam = 1: the undiscounted rewards-to-go 2, 1, 1, 1 (row 0), 1, -1 (row 1), 3
    e_mc = [[2.0, 1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, -1.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 3.0], [0.0] * 5]
    adv, ret = pk.gae(be.t(r), be.t(v), be.t(m), gamma=1.0, lam="length-adaptive",
                      lam_alpha=0.5, backend=be.name)
    np.testing.assert_allclose(adv.cpu().numpy(), e_adv, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ret.cpu().numpy(), e_ret, rtol=1e-6, atol=1e-7)
    adv1, mc = pk.gae(be.t(r), be.t(v), be.t(m), gamma=1.0, lam="length-adaptive",
                      lam_alpha=0.5, value_lam=1.0, backend=be.name)
    assert torch.equal(adv1, adv)
    np.testing.assert_allclose(mc.cpu().numpy(), e_mc, rtol=1e-6, atol=1e-7)


def test_length_adaptive_lam_values():
    """lambda = 1 - 1 / (alpha l), clamped at 0; l = 0 gives 0 (no division by zero)."""
    m = torch.zeros(5, 40, dtype=torch.bool)
    for i, n in enumerate([0, 1, 2, 4, 40]):
        m[i, 40 - n:] = True  # left padding: only the count matters
    la = pk.advantages.length_adaptive_lam
    torch.testing.assert_close(la(m, 0.05, torch.float64),
                               torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(la(m, 0.5, torch.float64),
                               torch.tensor([0.0, 0.0, 0.0, 0.5, 0.95], dtype=torch.float64))
    # extreme alphas stay in [0, 1] without NaN (1 / (alpha l) overflows or vanishes)
    for alpha in (5e-324, 1e-300, 1e300, 1.7e308):
        lam = la(m, alpha, torch.float64)
        assert torch.isfinite(lam).all() and (lam >= 0).all() and (lam <= 1).all()
        np.testing.assert_allclose(lam.numpy(), ref.length_adaptive_lam(m, alpha))
    assert la(m, 1e300)[1:].eq(1.0).all()
    # the mask's nonzero entries count (float masks), on a [B, 0] mask every lambda is 0
    torch.testing.assert_close(la(m.float(), 0.5), la(m, 0.5))
    assert la(torch.ones(3, 0, dtype=torch.bool), 0.5).eq(0).all()


def test_gae_length_adaptive_empty_batches(be):
    for B, T in [(0, 4), (3, 0)]:
        z = be.t(torch.zeros(B, T))
        adv, ret = pk.gae(z, z, be.t(torch.ones(B, T, dtype=torch.bool)),
                          lam="length-adaptive", lam_alpha=0.05, value_lam=1.0,
                          backend=be.name)
        assert adv.shape == ret.shape == (B, T)


@pytest.mark.parametrize("kw,match,exc", [
    (dict(lam="length-adaptive"), "lam_alpha", ValueError),
    (dict(lam="length-adaptive", lam_alpha=0.0), "lam_alpha", ValueError),
    (dict(lam="length-adaptive", lam_alpha=-0.05), "lam_alpha", ValueError),
    (dict(lam="length-adaptive", lam_alpha=math.inf), "lam_alpha", ValueError),
    (dict(lam="length-adaptive", lam_alpha=math.nan), "lam_alpha", ValueError),
    (dict(lam="length-adaptive", lam_alpha="0.05"), "lam_alpha", TypeError),
    (dict(lam="length-adaptive", lam_alpha=0.05, value_lam=1.5), "value_lam", ValueError),
    (dict(lam=0.95, lam_alpha=0.05), "lam_alpha", ValueError),
    (dict(lam="Length-Adaptive", lam_alpha=0.05), "lam", ValueError),
])
@pytest.mark.parametrize("fn", ["gae", "score_rollout"])
def test_lambda_options_bad_pairs(fn, kw, match, exc):
    """The option pairs a one-argument row cannot express: lam="length-adaptive" without a
    positive finite lam_alpha, a lam_alpha with a numeric lam."""
    f, base = PUBLIC_FUNCS[fn]
    with pytest.raises(exc, match=match) as info:
        f(**{**base(), **kw})
    assert str(info.value).split(":")[0].strip() == match


def test_gae_length_adaptive_lam_alpha_boundaries():
    """A tiny or huge lam_alpha is accepted (lambda 0 or 1 everywhere)."""
    g = base_gae()
    for alpha, lam in ((1e-300, 0.0), (1e300, 1.0)):
        adv, ret = pk.gae(**g, lam="length-adaptive", lam_alpha=alpha)
        e = pk.gae(**g, lam=lam)
        torch.testing.assert_close(adv, e[0])
        torch.testing.assert_close(ret, e[1])


HYP = settings(max_examples=int(os.environ.get("PPO_HYPOTHESIS_EXAMPLES", 60)), deadline=None,
              suppress_health_check=[HealthCheck.too_slow])


@HYP
@given(B=st.integers(1, 4), T=st.integers(0, 70), seed=st.integers(0, 2**31 - 1),
       p_mask=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
       gamma=st.sampled_from([0.0, 0.9, 0.99, 1.0]),
       lam=st.one_of(st.sampled_from([0.0, 0.5, 0.95, 1.0]), st.just("length-adaptive")),
       alpha=st.sampled_from([0.01, 0.05, 0.3, 1.0, 1e3]),
       value_lam=st.sampled_from([None, 0.0, 0.9, 1.0]), boot=st.booleans())
def test_gae_vapo_lambdas_property(B, T, seed, p_mask, gamma, lam, alpha, value_lam, boot):
    """Random shapes, masks and lambda options: the CPU kernel (float32 and float64) and
    the eager composite against the float64 reference; the returns depend on value_lam
    alone, the advantages on lam alone."""
    g = torch.Generator().manual_seed(seed)
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    m = torch.rand(B, T, generator=g) >= p_mask
    bv = torch.randn(B, generator=g) if boot else None
    kw = dict(gamma=gamma, lam=lam, value_lam=value_lam,
              lam_alpha=alpha if lam == "length-adaptive" else None)
    e_adv, e_ret = ref.gae(r, v, m, bootstrap_values=bv, **kw)
    for backend in ("cpu", "torch"):
        for dt, tol in ((torch.float32, 2e-5), (torch.float64, 1e-11)):
            adv, ret = pk.gae(r.to(dt), v.to(dt), m, bootstrap_values=None if bv is None
                              else bv.to(dt), backend=backend, **kw)
            assert adv.dtype == ret.dtype == dt
            assert_close_np(adv, e_adv, rtol=tol, atol=tol, what=f"{backend} advantages")
            assert_close_np(ret, e_ret, rtol=tol, atol=tol, what=f"{backend} returns")
    if value_lam is not None and lam != "length-adaptive":
        _, ret_v = ref.gae(r, v, m, gamma=gamma, lam=value_lam, bootstrap_values=bv)
        adv_l, _ = ref.gae(r, v, m, gamma=gamma, lam=lam, bootstrap_values=bv)
        np.testing.assert_allclose(e_ret, ret_v, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(e_adv, adv_l, rtol=1e-12, atol=1e-12)


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


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e19), (torch.float32, 1e30),
                                         (torch.float16, 300.0)])
def test_whiten_large_values(dtype, scale):
    """Values whose squares overflow the input's dtype (float32 from |x| ~ 1.8e19, float16
    from 256) whiten as the reference does: the statistics are float64."""
    x = (torch.tensor([[3.0, -1.0, 2.0, 0.5]]) * scale).to(dtype)
    m = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    out = pk.whiten(x, m)
    e = ref.whiten(x.double().numpy(), m.numpy())
    assert out.dtype == dtype
    np.testing.assert_allclose(out.double().numpy(), e, rtol=2e-3 if dtype == torch.float16
                               else 1e-6, atol=1e-6)


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


@pytest.mark.parametrize("lams", [dict(lam=0.9, value_lam=1.0),
                                  dict(lam="length-adaptive", lam_alpha=0.4),
                                  dict(lam="length-adaptive", lam_alpha=0.4, value_lam=1.0)])
@pytest.mark.parametrize("padding", ["random", "interior", "empty_row"])
@pytest.mark.parametrize("whiten", [True, False])
def test_score_rollout_vapo_lambdas_match_reference(be, lams, padding, whiten, gen):
    """score_rollout's GAE with VAPO's decoupled / length-adaptive lambda, against the
    reference and against pk.gae of its own rewards."""
    inp, values, scores = _rollout_case(gen, padding=padding)
    kw = dict(kl_coef=0.05, kl_estimator="k3", gamma=0.99, temperature=0.8, **lams)
    logits = be.t(inp["full"][:, :5].contiguous())
    args = (logits, be.t(inp["tokens"]), be.t(inp["ref"]), be.t(values), be.t(scores),
            be.t(inp["mask"]))
    out = pk.score_rollout(*args, whiten=whiten, backend=be.name, **kw)
    e = ref.score_rollout(inp["base"], inp["tokens"], inp["ref"], values, scores, inp["mask"],
                          whiten_advantages=whiten, **kw)
    for name in ("logprobs", "kl", "rewards", "advantages", "returns"):
        assert_close_np(getattr(out, name), e[name], rtol=1e-5, atol=1e-5, what=name)
        assert torch.all(getattr(out, name).cpu()[~inp["mask"]] == 0), name
    if not whiten:
        adv, ret = pk.gae(out.rewards, be.t(values), be.t(inp["mask"]), gamma=0.99,
                          backend=be.name, **lams)
        torch.testing.assert_close(out.advantages, adv, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.returns, ret, rtol=1e-6, atol=1e-6)
    plain = pk.score_rollout(*args, whiten=whiten, backend=be.name,
                             **{**kw, "lam": 0.9, "lam_alpha": None, "value_lam": None})
    # the options do enter: the returns (value_lam) or the advantages (length-adaptive)
    # differ from lam = 0.9's; the advantages of lam = 0.9 stay as they were
    if lams.get("value_lam") is not None:
        assert not torch.allclose(plain.returns, out.returns)
    if lams["lam"] == "length-adaptive":
        assert not torch.allclose(plain.advantages, out.advantages)
    else:
        torch.testing.assert_close(plain.advantages, out.advantages, rtol=0, atol=0)


def test_score_rollout_value_lam_none_is_bit_identical(be, gen):
    inp, values, scores = _rollout_case(gen, padding="interior")
    args = (be.t(inp["full"][:, :5].contiguous()), be.t(inp["tokens"]), be.t(inp["ref"]),
            be.t(values), be.t(scores), be.t(inp["mask"]))
    a = pk.score_rollout(*args, kl_coef=0.1, lam=0.9, backend=be.name)
    for vl in (None, 0.9):
        b = pk.score_rollout(*args, kl_coef=0.1, lam=0.9, value_lam=vl, backend=be.name)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", ["view", "raw", "tbatch"])
@pytest.mark.parametrize("padding", ["left", "interior", "empty_row", "all"])
def test_score_rollout_layouts_and_padding(be, layout, padding, gen):
    inp, values, scores = _rollout_case(gen, padding=padding, layout=layout)
    from helpers.inputs import logits_for
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


# ------------------------------------------------------------------ edge inputs

@pytest.mark.parametrize("be", KERNELS_CPU)
def test_empty_batch_score_rollout_kernels(be):
    """score_rollout on the kernels with B = 0 or T = 0: advantages of shape [B, T]."""
    for B, T in [(0, 3), (2, 0)]:
        d = small_inputs(B, T)
        out = pk.score_rollout(d["logits"], d["tokens"], d["ref"], torch.randn(B, T),
                               torch.randn(B), torch.ones(B, T, dtype=torch.bool),
                               kl_coef=0.1, backend=be.name)
        assert out.advantages.shape == (B, T)


def test_score_rollout_torch_backend_empty_time():
    """score_rollout on the eager composite with T = 0: advantages of shape [B, 0]."""
    d = small_inputs(2, 0)
    out = pk.score_rollout(d["logits"], d["tokens"], d["ref"], torch.randn(2, 0),
                           torch.randn(2), torch.ones(2, 0, dtype=torch.bool), kl_coef=0.1,
                           backend="torch")
    assert out.advantages.shape == (2, 0)


def test_kl_penalized_rewards_empty_time():
    """kl_penalized_rewards with T = 0: rewards of shape [B, 0]."""
    r = pk.kl_penalized_rewards(torch.randn(2), torch.randn(2, 0), torch.randn(2, 0),
                                torch.ones(2, 0, dtype=torch.bool), kl_coef=0.1)
    assert r.shape == (2, 0)


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_whiten_ignores_garbage_on_masked_positions(fill):
    """NaN / inf on masked positions do not change whiten's result."""
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    clean = pk.whiten(x, SMALL_MASK)
    x[~SMALL_MASK] = fill
    torch.testing.assert_close(pk.whiten(x, SMALL_MASK), clean)


def test_whiten_float16_does_not_overflow():
    """float16 values of 1000, whose squares overflow float16: whiten matches the
    float32 result."""
    x = torch.tensor([[0., 1000., 0.], [1000., 0., 1000.]])
    m = torch.ones(2, 3, dtype=torch.bool)
    torch.testing.assert_close(pk.whiten(x.half(), m).float(), pk.whiten(x, m),
                               rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------ bad arguments

ADV_FUNCS = {k: PUBLIC_FUNCS[k] for k in ("gae", "kl_penalized_rewards", "whiten", "score_rollout")}

# (function, argument to replace, new value or f(base dict) -> value, exception, match)
BAD_ROWS = [
    # ---------------- gae
    ("gae", "rewards", torch.randn(BAD_B * BAD_T), ValueError, "rewards"),
    ("gae", "rewards", torch.randn(BAD_B, BAD_T, 1), ValueError, "rewards"),
    ("gae", "rewards", torch.ones(BAD_B, BAD_T, dtype=torch.int32), TypeError, "rewards"),
    ("gae", "rewards", [[0.0] * BAD_T] * BAD_B, TypeError, "rewards"),
    ("gae", "values", torch.randn(BAD_B, BAD_T + 1), ValueError, "values"),
    ("gae", "values", torch.ones(BAD_B, BAD_T, dtype=torch.long), TypeError, "values"),
    ("gae", "values", None, TypeError, "values"),
    ("gae", "values", lambda d: d["values"].to(META), ValueError, "values"),
    ("gae", "response_mask", torch.ones(BAD_B + 1, BAD_T), ValueError, "response_mask"),
    ("gae", "gamma", 1.01, ValueError, "gamma"),
    ("gae", "gamma", -0.01, ValueError, "gamma"),
    ("gae", "lam", 1.5, ValueError, "lam"),
    ("gae", "lam", -1.0, ValueError, "lam"),
    ("gae", "lam", math.nan, ValueError, "lam"),
    ("gae", "lam", "adaptive", ValueError, "lam"),
    ("gae", "lam", "length-adaptive", ValueError, "lam_alpha"),  # without lam_alpha
    ("gae", "lam", None, TypeError, "lam"),
    ("gae", "value_lam", 1.01, ValueError, "value_lam"),
    ("gae", "value_lam", -0.5, ValueError, "value_lam"),
    ("gae", "value_lam", math.nan, ValueError, "value_lam"),
    ("gae", "value_lam", "length-adaptive", TypeError, "value_lam"),
    ("gae", "value_lam", torch.tensor(1.0), TypeError, "value_lam"),
    ("gae", "lam_alpha", 0.05, ValueError, "lam_alpha"),  # with the numeric default lam
    ("gae", "bootstrap_values", torch.zeros(BAD_B, 1), ValueError, "bootstrap_values"),
    ("gae", "bootstrap_values", torch.zeros(BAD_B + 1), ValueError, "bootstrap_values"),
    ("gae", "bootstrap_values", torch.zeros(BAD_B, dtype=torch.long), TypeError,
     "bootstrap_values"),
    ("gae", "bootstrap_values", torch.zeros(BAD_B, device=META), ValueError, "bootstrap_values"),
    ("gae", "backend", "fast", ValueError, "backend"),
    ("gae", "backend", "cuda", ValueError, "backend"),
    # ---------------- kl_penalized_rewards
    ("kl_penalized_rewards", "scores", torch.zeros(BAD_B, 1), ValueError, "scores"),
    ("kl_penalized_rewards", "scores", torch.zeros(BAD_B + 1), ValueError, "scores"),
    ("kl_penalized_rewards", "scores", torch.zeros(BAD_B, dtype=torch.long), TypeError, "scores"),
    ("kl_penalized_rewards", "scores", 1.0, TypeError, "scores"),
    ("kl_penalized_rewards", "logprobs", torch.zeros(BAD_B, BAD_T, 2), ValueError, "logprobs"),
    ("kl_penalized_rewards", "ref_logprobs", torch.zeros(BAD_B, BAD_T + 1), ValueError,
     "ref_logprobs"),
    ("kl_penalized_rewards", "response_mask", torch.ones(BAD_B, BAD_T - 1), ValueError,
     "response_mask"),
    ("kl_penalized_rewards", "kl_coef", -1.0, ValueError, "kl_coef"),
    ("kl_penalized_rewards", "kl_coef", None, TypeError, "kl_coef"),
    ("kl_penalized_rewards", "kl_estimator", "kl", ValueError, "kl_estimator"),
    # ---------------- whiten
    ("whiten", "x", torch.ones(BAD_B, BAD_T, dtype=torch.long), TypeError, "x"),
    ("whiten", "x", [1.0, 2.0], TypeError, "x"),
    ("whiten", "response_mask", torch.ones(BAD_B, BAD_T + 1), ValueError, "response_mask"),
    ("whiten", "response_mask", lambda d: d["response_mask"].to(META), ValueError,
     "response_mask"),
    ("whiten", "eps", -1e-8, ValueError, "eps"),
    # ---------------- score_rollout
    ("score_rollout", "logits", torch.randn(BAD_B * BAD_T, BAD_V), ValueError, "logits"),
    ("score_rollout", "logits", torch.zeros(BAD_B, BAD_T, BAD_V, dtype=torch.int8), TypeError,
     "logits"),
    ("score_rollout", "logits", torch.zeros(BAD_B, BAD_T, 0), ValueError, "logits"),
    ("score_rollout", "tokens", torch.zeros(BAD_B, BAD_T), TypeError, "tokens"),
    ("score_rollout", "tokens", oob(BAD_V), ValueError, "tokens"),
    ("score_rollout", "ref_logprobs", torch.zeros(BAD_B, BAD_T - 1), ValueError, "ref_logprobs"),
    ("score_rollout", "ref_logprobs", None, TypeError, "ref_logprobs"),
    ("score_rollout", "values", torch.zeros(BAD_B, BAD_T + 1), ValueError, "values"),
    ("score_rollout", "scores", torch.zeros(BAD_B, BAD_T), ValueError, "scores"),
    ("score_rollout", "response_mask", torch.ones(1, BAD_T), ValueError, "response_mask"),
    ("score_rollout", "kl_coef", -0.5, ValueError, "kl_coef"),
    ("score_rollout", "kl_estimator", "k0", ValueError, "kl_estimator"),
    ("score_rollout", "gamma", 2.0, ValueError, "gamma"),
    ("score_rollout", "lam", -0.5, ValueError, "lam"),
    ("score_rollout", "lam", "vapo", ValueError, "lam"),
    ("score_rollout", "lam", "length-adaptive", ValueError, "lam_alpha"),
    ("score_rollout", "value_lam", 2.0, ValueError, "value_lam"),
    ("score_rollout", "value_lam", -1e-9, ValueError, "value_lam"),
    ("score_rollout", "lam_alpha", 0.05, ValueError, "lam_alpha"),
    ("score_rollout", "temperature", 0.0, ValueError, "temperature"),
    ("score_rollout", "temperature", 1e-40, ValueError, "temperature"),
    ("score_rollout", "temperature", torch.ones(BAD_B + 1), ValueError, "temperature"),
    ("score_rollout", "temperature", torch.ones(BAD_B, BAD_T + 1), ValueError, "temperature"),
    ("score_rollout", "temperature", torch.tensor([0.5, math.nan]), ValueError, "temperature"),
    ("score_rollout", "temperature", torch.zeros(BAD_B, BAD_T), ValueError, "temperature"),
    ("score_rollout", "whiten", "no", TypeError, "whiten"),
    ("score_rollout", "backend", "cuda", ValueError, "backend"),
    ("score_rollout", "backend", "numpy", ValueError, "backend"),
    ("score_rollout", "values", lambda d: d["values"].to(META), ValueError, "values"),
]


@pytest.mark.parametrize("row", BAD_ROWS, ids=[bad_row_id(r) for r in BAD_ROWS])
def test_bad_input_raises_naming_the_argument(row):
    """Each row: the base call of its function with one argument replaced raises the
    row's exception (before any kernel runs), whose message names the argument and says
    what was expected."""
    assert_bad_input_raises(row, ADV_FUNCS)


def test_every_public_function_has_rows():
    """Every function of the module has rows in the table."""
    assert {r[0] for r in BAD_ROWS} == set(ADV_FUNCS)


def test_base_calls_are_valid():
    """The table's base inputs are valid: each row fails because of its one change."""
    for name, (fn, base) in ADV_FUNCS.items():
        fn(**base())


@pytest.mark.parametrize("gamma,lam", [(0.0, 0.0), (1.0, 1.0), (0, 1)])
def test_gae_boundaries_accepted(gamma, lam):
    """gamma and lam at the ends of [0, 1] are accepted, with the exact values there
    (Schulman et al. 2016, eqs. 17-18): gamma lam = 0 is TD(0), A_t = r_t - V_t (gamma = 0:
    returns r_t); gamma = lam = 1 is Monte Carlo, A_t = sum_{s >= t} r_s - V_t, returns the
    reward-to-go (no bootstrap: V = 0 after the last token)."""
    base = base_gae()
    adv, ret = pk.gae(**base, gamma=gamma, lam=lam)
    assert torch.isfinite(adv).all()
    r, v = base["rewards"].double(), base["values"].double()
    if gamma == 0:
        e_ret = r
    else:  # gamma = lam = 1: the reward-to-go
        e_ret = r.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(adv.double(), e_ret - v, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret.double(), e_ret, rtol=1e-6, atol=1e-6)
