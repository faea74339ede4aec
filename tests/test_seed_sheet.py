"""Every numeric answer of shared/seed/ppo-for-llms-exercises.txt, through the public API
and every backend.

A single token is built by hand: logits [1, 1, V] whose sampled token has a chosen
probability, and old_logprobs = logp - log(rho) so that the ratio is exactly rho. The
loss is -L^CLIP (token-mean over one token), so the sheet's surrogate values appear with
the opposite sign.
"""

import math

import numpy as np
import pytest
import torch

import ppo_kernels as pk

from helpers.backends import BACKENDS

pytestmark = pytest.mark.parametrize("be", BACKENDS)

V = 7
TOK = 3
ATOL = 2e-5


def logits_with_prob(p, V=V, tok=TOK, dtype=torch.float32):
    """[1, 1, V] logits whose token `tok` has probability p (the rest share 1 - p)."""
    rest = (1.0 - p) / (V - 1)
    z = torch.full((V,), math.log(rest), dtype=torch.float64)
    z[tok] = math.log(p)
    z = z + 0.37  # a shift changes nothing
    return z.reshape(1, 1, V).to(dtype)


def single(be, rho, A, *, p=0.3, ref_p=None, grad=True, **kw):
    """loss, metrics, dlogits, logp for one token with ratio rho and advantage A."""
    logits = be.t(logits_with_prob(p)).requires_grad_(grad)
    tokens = be.t(torch.tensor([[TOK]]))
    logp = math.log(p)
    old = be.t(torch.tensor([[logp - math.log(rho)]]))
    adv = be.t(torch.tensor([[float(A)]]))
    reflp = None if ref_p is None else be.t(torch.tensor([[math.log(ref_p)]]))
    loss, met = pk.ppo_loss(logits, tokens, old, adv, None, reflp, backend=be.name, **kw)
    g = None
    if grad:
        loss.backward()
        g = logits.grad
    return loss.detach(), met, g, logp


def sweep(be, rhos, A, **kw):
    """Per-token losses (loss_agg_mode="none") of one token per ratio in rhos, in one call."""
    n = len(rhos)
    logits = be.t(logits_with_prob(0.3).expand(1, n, V).contiguous())
    tokens = be.t(torch.full((1, n), TOK))
    old = be.t(torch.tensor([[math.log(0.3) - math.log(r) for r in rhos]]))
    adv = be.t(torch.full((1, n), float(A)))
    loss, _ = pk.ppo_loss(logits, tokens, old, adv, loss_agg_mode="none", backend=be.name, **kw)
    assert loss.shape == (1, n)
    return loss[0].detach().cpu().double().numpy()


def gnorm(g):
    return float(g.detach().abs().max())


# ------------------------------------------------------------------ Level 2

def test_2_1_good_token_clipped(be):
    """A = +2, eps = 0.2, rho = 1.6: unclipped 3.2, clipped 2.4, PPO uses min = 2.4."""
    loss, met, g, _ = single(be, 1.6, 2.0)
    assert float(loss) == pytest.approx(-2.4, abs=ATOL)
    # the unclipped value rho * A, from the metrics' ratio
    assert float(met["ratio_mean"]) * 2.0 == pytest.approx(3.2, abs=ATOL)
    assert float(met["clip_frac"]) == 1.0 and float(met["clip_frac_high"]) == 1.0
    assert gnorm(g) == 0.0  # on the flat part of the min
    # with a band wide enough to contain 1.6 the unclipped value 3.2 is the one used
    loss_wide, met_wide, _, _ = single(be, 1.6, 2.0, clip_eps_high=0.9, grad=False)
    assert float(loss_wide) == pytest.approx(-3.2, abs=ATOL)
    assert float(met_wide["clip_frac"]) == 0.0


def test_2_2_bad_token_clipped(be):
    """A = -3, rho = 0.5: unclipped -1.5, clipped -2.4, min = -2.4 (the pessimistic one)."""
    loss, met, g, _ = single(be, 0.5, -3.0)
    assert float(loss) == pytest.approx(2.4, abs=ATOL)
    assert float(met["ratio_mean"]) * -3.0 == pytest.approx(-1.5, abs=ATOL)
    assert float(met["clip_frac_low"]) == 1.0 and float(met["clip_frac_high"]) == 0.0
    assert gnorm(g) == 0.0
    loss_wide, _, _, _ = single(be, 0.5, -3.0, clip_eps_low=0.6, grad=False)
    assert float(loss_wide) == pytest.approx(1.5, abs=ATOL)  # unclipped -1.5, negated


def test_2_3_kl_penalty_and_effective_reward(be):
    """r_phi = 1.0, pi = 0.9, pi_ref = 0.3, beta = 0.2: penalty 0.2 log 3 = 0.2197,
    effective end-of-sequence reward 0.7803."""
    penalty = 0.2 * math.log(3.0)
    assert penalty == pytest.approx(0.2197, abs=5e-5)
    # kl_penalized_rewards: a 4-token response, KL only on its last token (the others match
    # the reference), the score lands on that last valid token
    lp = torch.log(torch.tensor([[0.5, 0.4, 0.7, 0.9]]))
    rl = torch.log(torch.tensor([[0.5, 0.4, 0.7, 0.3]]))
    mask = torch.ones(1, 4, dtype=torch.bool)
    r = pk.kl_penalized_rewards(torch.tensor([1.0]), lp, rl, mask, kl_coef=0.2,
                                kl_estimator="k1")
    np.testing.assert_allclose(r.numpy(), [[0, 0, 0, 0.7803]], atol=5e-5)
    assert float(r[0, 3]) == pytest.approx(1.0 - penalty, abs=1e-6)
    # the same through score_rollout: logits whose sampled token has p = 0.9
    logits = be.t(logits_with_prob(0.9))
    out = pk.score_rollout(logits, be.t(torch.tensor([[TOK]])), be.t(torch.log(torch.tensor([[0.3]]))),
                           be.t(torch.zeros(1, 1)), be.t(torch.tensor([1.0])),
                           be.t(torch.ones(1, 1, dtype=torch.bool)), kl_coef=0.2,
                           kl_estimator="k1", gamma=1.0, lam=1.0, whiten=False,
                           backend=be.name)
    assert float(out.kl[0, 0]) == pytest.approx(math.log(3.0), abs=1e-5)
    assert float(out.rewards[0, 0]) == pytest.approx(0.7803, abs=5e-5)
    assert float(out.returns[0, 0]) == pytest.approx(0.7803, abs=5e-5)
    # and as the KL term of the loss (A = 0 isolates it): kl_coef * k1 = 0.2197
    loss, met, _, _ = single(be, 1.0, 0.0, p=0.9, ref_p=0.3, kl_coef=0.2, kl_estimator="k1",
                             grad=False)
    assert float(loss) == pytest.approx(penalty, abs=ATOL)
    assert float(met["kl_ref"]) == pytest.approx(math.log(3.0), abs=ATOL)


def test_2_4_surrogate_stops_increasing_at_1_plus_eps(be):
    """eps = 0.2, A = +2: the clipped surrogate is frozen at 2.4 from rho = 1.2 on."""
    below = single(be, 1.19, 2.0)
    above = single(be, 1.21, 2.0)
    at = single(be, 1.2, 2.0, grad=False)
    assert float(at[0]) == pytest.approx(-2.4, abs=ATOL)
    assert float(below[0]) == pytest.approx(-2.38, abs=ATOL)
    assert float(above[0]) == pytest.approx(-2.4, abs=ATOL)
    assert gnorm(below[2]) > 0.1
    assert gnorm(above[2]) == 0.0
    # surrogate (= -loss) increases strictly up to 1.2, then stays at 2.4
    s = -sweep(be, [0.5, 0.8, 1.0, 1.1, 1.15, 1.19], 2.0)
    assert np.all(np.diff(s) > 0)
    np.testing.assert_allclose(-sweep(be, [1.2, 1.25, 1.6, 3.0, 50.0], 2.0), 2.4, atol=ATOL)


# ------------------------------------------------------------------ Level 3

@pytest.mark.parametrize("rho,zero", [(0.3, False), (0.79, False), (1.0, False), (1.19, False),
                                      (1.21, True), (1.6, True), (2.0, True), (10.0, True)])
def test_3_1_good_token_zero_gradient_region(be, rho, zero):
    """A > 0: gradient nonzero for rho < 1.2, exactly zero for rho > 1.2."""
    loss, _, g, _ = single(be, rho, 1.5)
    if zero:
        assert gnorm(g) == 0.0
        assert float(loss) == pytest.approx(-1.2 * 1.5, abs=ATOL)
    else:
        assert gnorm(g) > 1e-3
        assert float(loss) == pytest.approx(-rho * 1.5, abs=ATOL)
        # d loss / d logit[token] = -rho A (1 - p) for the unclipped branch
        assert float(g[0, 0, TOK]) == pytest.approx(-rho * 1.5 * (1 - 0.3), rel=1e-4)


@pytest.mark.parametrize("rho,zero", [(0.1, True), (0.5, True), (0.79, True), (0.81, False),
                                      (1.0, False), (1.21, False), (2.0, False), (8.0, False)])
def test_3_2_bad_token_zero_gradient_region(be, rho, zero):
    """A < 0: gradient exactly zero for rho < 0.8, nonzero for rho > 0.8."""
    loss, _, g, _ = single(be, rho, -1.5)
    if zero:
        assert gnorm(g) == 0.0
        assert float(loss) == pytest.approx(0.8 * 1.5, abs=ATOL)
    else:
        assert gnorm(g) > 1e-3
        assert float(loss) == pytest.approx(rho * 1.5, abs=1e-5 * max(rho, 1.0))
        # gradient descent lowers the bad token's logit: d loss / d logit[token] > 0
        assert float(g[0, 0, TOK]) > 0


def test_3_3_clipping_does_not_clamp_the_probability(be):
    """The ratio itself is never clamped: ratio_max reports 1.6 (> 1.2), logprobs are the
    true ones, and a clipped token still moves through the gradient of other tokens that
    share parameters with it."""
    _, met, _, logp = single(be, 1.6, 2.0, grad=False)
    assert float(met["ratio_max"]) == pytest.approx(1.6, rel=1e-5)
    assert float(met["ratio_max"]) > 1.2
    lp = pk.token_logprobs(be.t(logits_with_prob(0.3)), be.t(torch.tensor([[TOK]])),
                           backend=be.name)
    assert float(lp[0, 0]) == pytest.approx(logp, abs=1e-6)
    # two positions sharing one set of logits (a shared parameter): the first is clipped
    # (rho = 1.6, zero gradient of its own), the second is inside the band; one step of
    # gradient descent on the shared logits still raises the clipped token's probability
    base = be.t(logits_with_prob(0.3)[0, 0]).requires_grad_(True)
    logits = torch.stack([base, base]).unsqueeze(0)  # [1, 2, V]
    tokens = be.t(torch.tensor([[TOK, TOK]]))
    old = be.t(torch.tensor([[logp - math.log(1.6), logp]]))
    adv = be.t(torch.tensor([[2.0, 2.0]]))
    loss, met = pk.ppo_loss(logits, tokens, old, adv, backend=be.name)
    assert float(met["clip_frac"]) == 0.5
    loss.backward()
    with torch.no_grad():
        stepped = base - 1.0 * base.grad
    _, met2 = pk.ppo_loss(torch.stack([stepped, stepped]).unsqueeze(0), tokens, old, adv,
                          backend=be.name)
    assert float(met2["ratio_max"]) > 1.6 + 1e-3


# ------------------------------------------------------------------ Level 4

def test_4_1_clip_and_kl_combined(be):
    """A = 1.5, rho = 1.4, eps = 0.2, pi = 0.8, pi_ref = 0.5, beta = 0.1:
    clipped surrogate 1.8, KL penalty 0.1 log 1.6 = 0.04700, net 1.7530."""
    kl = 0.1 * math.log(1.6)
    assert kl == pytest.approx(0.04700, abs=5e-6)
    loss, met, g, _ = single(be, 1.4, 1.5, p=0.8, ref_p=0.5, kl_coef=0.1, kl_estimator="k1")
    assert -float(loss) == pytest.approx(1.7530, abs=5e-5)
    assert -float(loss) == pytest.approx(1.8 - kl, abs=ATOL)
    assert float(met["kl_ref"]) == pytest.approx(math.log(1.6), abs=ATOL)
    assert float(met["clip_frac"]) == 1.0
    # the clip is flat here, so the gradient is the KL term's alone: beta * (onehot - p)
    expected = -0.1 * (torch.nn.functional.one_hot(torch.tensor(TOK), V).double() -
                       torch.softmax(logits_with_prob(0.8).double()[0, 0], -1))
    np.testing.assert_allclose(g[0, 0].detach().cpu().double().numpy(), -expected.numpy(),
                               atol=1e-6)
    # unclipped value 2.1 would be used with a band that contains 1.4
    loss_wide, _, _, _ = single(be, 1.4, 1.5, p=0.8, ref_p=0.5, kl_coef=0.1,
                                kl_estimator="k1", clip_eps_high=0.5, grad=False)
    assert -float(loss_wide) == pytest.approx(2.1 - kl, abs=ATOL)


# ------------------------------------------------------------------ Level 5

def test_5_2_clip_is_one_sided(be):
    """A > 0: surrogate <= (1 + eps) A (loss >= -(1 + eps) A) for every rho, but no
    protection below: for rho < 1 - eps it keeps falling as rho A. A < 0 mirrors it:
    capped at (1 - eps) A for small rho, unbounded (rho A) as rho grows."""
    eps = 0.2
    rhos = np.geomspace(1e-3, 1e3, 25)
    for A in (2.0, 0.5):
        losses = sweep(be, rhos, A)
        assert np.all(losses >= -(1 + eps) * A - ATOL)
        hi = rhos >= 1 + eps
        np.testing.assert_allclose(losses[hi], -(1 + eps) * A, atol=ATOL)
        lo = rhos < 1 - eps
        np.testing.assert_allclose(losses[lo], -rhos[lo] * A, rtol=1e-5, atol=1e-6)
        assert np.all(losses[lo] > -(1 - eps) * A)  # not floored at the clip value
        assert losses[0] > -0.01 * A  # -> 0 as rho -> 0: the surrogate keeps falling
    for A in (-2.0, -0.5):
        losses = sweep(be, rhos, A)
        lo = rhos <= 1 - eps
        np.testing.assert_allclose(losses[lo], -(1 - eps) * A, atol=ATOL)
        hi = rhos > 1 + eps
        np.testing.assert_allclose(losses[hi], -rhos[hi] * A, rtol=1e-5)
        assert losses[-1] == pytest.approx(1e3 * -A, rel=1e-4)  # unbounded above
        _, _, g, _ = single(be, 1e3, A)
        assert gnorm(g) > 1.0  # the correction stays alive


@pytest.mark.parametrize("rho", [1e-4, 0.5, 0.8, 1.0, 1.2, 1.7, 1e4])
def test_5_3_zero_advantage(be, rho):
    """A = 0: L^CLIP = 0 and the gradient is exactly 0, whatever rho (also with the dual clip
    and asymmetric eps)."""
    for kw in ({}, {"dual_clip_c": 3.0, "clip_eps_high": 0.28}):
        loss, met, g, _ = single(be, rho, 0.0, **kw)
        assert float(loss) == 0.0
        assert torch.all(g == 0)
        assert float(met["clip_frac"]) == 0.0
        assert float(met["ratio_mean"]) == pytest.approx(rho, rel=1e-5)
