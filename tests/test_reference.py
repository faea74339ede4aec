"""Tests of ppo_kernels/reference.py, the numpy float64 oracle itself: its analytic
gradients against central finite differences (the vanilla options, and the loss menu:
policy losses, straight-through KL estimators, the KL bias correction), and its forward
against independent formulas (torch float64 log_softmax, hand-written PPO terms). Everything else in the suite trusts reference.py, so
it is checked first and without any kernel in the loop."""

import itertools

import numpy as np
import pytest
import torch

from ppo_kernels import reference as ref
from ppo_kernels.testing import make_mask


H = 1e-6  # central differences in float64: truncation ~H^2, rounding ~1e-16 / H


def fd_grad(f, x, h=H):
    """Central finite differences of the scalar f at x (numpy float64 array)."""
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        if not np.isfinite(x[i]):
            continue
        xp = x.copy()
        xp[i] += h
        xm = x.copy()
        xm[i] -= h
        g[i] = (f(xp) - f(xm)) / (2 * h)
    return g


def case(seed, B=3, T=4, V=5, tl_extra=0, padding="mixed"):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, T + tl_extra, V)) * 1.5
    tokens = rng.integers(0, V, size=(B, T))
    mask = make_mask(B, T, gen, padding).numpy()
    logp, _ = ref.token_logprobs(logits, tokens, None)
    old = logp + rng.normal(size=(B, T)) * 0.4
    refl = logp + rng.normal(size=(B, T)) * 0.4
    adv = rng.normal(size=(B, T))
    isw = rng.uniform(0.5, 1.5, size=(B, T))
    tokens = np.where(mask, tokens, V + 3)  # garbage on masked positions
    return logits, tokens, mask, old, refl, adv, isw


def assert_fd(analytic, numeric, what):
    scale = max(np.abs(numeric).max(), 1e-3)
    err = np.abs(analytic - numeric).max()
    assert err <= 1e-6 * scale, f"{what}: analytic vs finite differences: {err:.3e} (scale {scale:.3e})"


OPTION_SETS = [
    dict(),
    dict(clip_eps_low=0.1, clip_eps_high=0.28),
    dict(dual_clip_c=1.5),
    dict(entropy_coef=0.05),
    dict(temperature=0.7),
    dict(temperature=1.6, entropy_coef=-0.03, clip_eps_high=0.3),
    dict(rollout_is_weights=True),
    dict(kl_coef=0.3, kl_estimator="k1"),
    dict(kl_coef=0.3, kl_estimator="k2"),
    dict(kl_coef=0.3, kl_estimator="k3"),
    dict(kl_coef=0.3, kl_estimator="abs"),
    dict(kl_coef=0.2, kl_estimator="k3", entropy_coef=0.01, dual_clip_c=2.0,
         rollout_is_weights=True, temperature=0.9, clip_eps_high=0.25),
]
AGG = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
       "none"]


@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize("opts", OPTION_SETS, ids=lambda o: "-".join(
    f"{k}={v}" for k, v in o.items()) or "default")
def test_ppo_loss_dlogits_vs_finite_differences(opts, agg, seed):
    logits, tokens, mask, old, refl, adv, isw = case(seed % 10007, tl_extra=seed % 2)
    opts = dict(opts)
    if opts.pop("rollout_is_weights", False):
        opts["rollout_is_weights"] = isw
    if "kl_coef" in opts:
        opts["ref_logprobs"] = refl
    if agg == "seq-mean-token-sum-norm":
        opts["norm_length"] = 3.0
    # dual clip only bites with A < 0 and rho large: push one negative-advantage token there
    if "dual_clip_c" in opts:
        b, t = np.argwhere(mask)[0]
        adv[b, t] = -1.0
        logp, _ = ref.token_logprobs(logits, tokens, mask, opts.get("temperature", 1.0))
        old[b, t] = logp[b, t] - np.log(3.0)

    def loss_of(x):
        loss, _, _ = ref.ppo_loss(x, tokens, old, adv, mask, loss_agg_mode=agg, **opts)
        return float(np.sum(loss))

    _, metrics, analytic = ref.ppo_loss(logits, tokens, old, adv, mask, loss_agg_mode=agg,
                                        **opts)
    numeric = fd_grad(loss_of, logits)
    assert np.abs(analytic).max() > 1e-4  # the case actually has a gradient
    assert_fd(analytic, numeric, f"ppo_loss {opts} {agg}")
    # masked positions and the extra (raw) position carry no gradient
    T = tokens.shape[1]
    assert np.all(analytic[:, :T][~mask] == 0)
    assert np.all(analytic[:, T:] == 0)
    if "dual_clip_c" in opts:
        assert metrics["dual_clip_frac"] > 0


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_token_logprobs_grad_vs_finite_differences(temperature, with_entropy, seed):
    logits, tokens, mask, *_ = case(seed % 10007, tl_extra=1, V=6)
    rng = np.random.default_rng(seed)
    glp = rng.normal(size=tokens.shape)
    gh = rng.normal(size=tokens.shape) if with_entropy else None

    def f(x):
        lp, h = ref.token_logprobs(x, tokens, mask, temperature)
        return float((glp * lp).sum() + (0.0 if gh is None else (gh * h).sum()))

    analytic = ref.token_logprobs_grad(logits, tokens, mask, temperature, glp, gh)
    assert_fd(analytic, fd_grad(f, logits), "token_logprobs_grad")


def test_token_logprobs_grad_with_neg_inf():
    """-inf logits: p = 0, no NaN, and the finite entries still match finite differences."""
    logits, tokens, mask, *_ = case(3, V=6)
    logits[0, :, 2] = -np.inf
    tokens[0] = np.where(tokens[0] == 2, 1, tokens[0])
    glp = np.ones(tokens.shape)
    gh = np.full(tokens.shape, 0.5)
    analytic = ref.token_logprobs_grad(logits, tokens, mask, 1.0, glp, gh)
    assert np.isfinite(analytic).all()
    assert np.all(analytic[0, :, 2] == 0)

    def f(x):
        lp, h = ref.token_logprobs(x, tokens, mask, 1.0)
        return float(lp.sum() + 0.5 * h.sum())

    assert_fd(analytic, fd_grad(f, logits), "token_logprobs_grad -inf")


def test_token_logprobs_vs_torch_log_softmax():
    logits, tokens, mask, *_ = case(11, V=9, tl_extra=1)
    t = torch.from_numpy(logits[:, :tokens.shape[1]]) / 0.8
    lsm = torch.log_softmax(t, -1)
    safe = torch.from_numpy(np.where(mask, tokens, 0))
    exp_lp = lsm.gather(-1, safe[..., None])[..., 0].numpy() * mask
    exp_h = -(lsm.exp() * lsm).sum(-1).numpy() * mask
    lp, h = ref.token_logprobs(logits, tokens, mask, 0.8)
    np.testing.assert_allclose(lp, exp_lp, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(h, exp_h, rtol=1e-13, atol=1e-13)


def test_ppo_loss_forward_vs_hand_formula():
    """Loss and metrics of the reference against a per-token loop written from DESIGN.md."""
    logits, tokens, mask, old, refl, adv, isw = case(5, B=4, T=6, V=7)
    opts = dict(clip_eps_low=0.15, clip_eps_high=0.25, dual_clip_c=2.5, kl_coef=0.1,
                kl_estimator="k3", entropy_coef=0.02, temperature=1.3)
    loss, met, _ = ref.ppo_loss(logits, tokens, old, adv, mask, refl, rollout_is_weights=isw,
                                loss_agg_mode="seq-mean-token-mean", **opts)
    lp, h = ref.token_logprobs(logits, tokens, mask, 1.3)
    seq_means, n_clip, rhos = [], 0, []
    for b in range(tokens.shape[0]):
        toks = []
        for t in range(tokens.shape[1]):
            if not mask[b, t]:
                continue
            rho = np.exp(lp[b, t] - old[b, t])
            a = adv[b, t]
            pg = -min(rho * a, min(max(rho, 0.85), 1.25) * a)
            if a < 0:
                pg = min(pg, -2.5 * a)
            dlt = lp[b, t] - refl[b, t]
            k3 = np.exp(-dlt) - 1 + dlt
            toks.append(isw[b, t] * pg + 0.1 * k3 - 0.02 * h[b, t])
            n_clip += (rho > 1.25 and a > 0) or (rho < 0.85 and a < 0)
            rhos.append(rho)
        if toks:
            seq_means.append(np.mean(toks))
    assert loss == pytest.approx(np.mean(seq_means), rel=1e-12)
    assert met["clip_frac"] == pytest.approx(n_clip / mask.sum(), rel=1e-12)
    assert met["ratio_max"] == pytest.approx(max(rhos), rel=1e-12)
    assert met["ratio_mean"] == pytest.approx(np.mean(rhos), rel=1e-12)


@pytest.mark.parametrize("agg", AGG[:4])
def test_agg_weights_definitions(agg):
    m = np.array([[1, 1, 0, 1], [0, 0, 0, 0], [0, 1, 1, 0]], dtype=float)
    w = ref.agg_weights(m, agg, norm_length=None)
    x = np.arange(12.0).reshape(3, 4) + 1
    got = (w * x).sum()
    if agg == "token-mean":
        exp = (x * m).sum() / 5
    elif agg == "seq-mean-token-sum":
        exp = (x * m).sum() / 3  # all sequences, the empty one counts
    elif agg == "seq-mean-token-mean":
        exp = ((1 + 2 + 4) / 3 + (10 + 11) / 2) / 2  # non-empty sequences only
    else:
        exp = (x * m).sum() / (3 * 4)
    assert got == pytest.approx(exp, rel=1e-14)


@pytest.mark.parametrize("clip_range", [None, 0.0, 0.2, 1.0])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "none"])
def test_value_loss_dvalues_vs_finite_differences(clip_range, agg, seed):
    rng = np.random.default_rng(seed)
    B, T = 3, 5
    v = rng.normal(size=(B, T))
    vo = v + rng.normal(size=(B, T)) * 0.5
    r = rng.normal(size=(B, T))
    m = make_mask(B, T, torch.Generator().manual_seed(seed)).numpy()

    def f(x):
        return float(np.sum(ref.value_loss(x, vo, r, m, clip_range=clip_range,
                                           loss_agg_mode=agg)[0]))

    _, met, analytic = ref.value_loss(v, vo, r, m, clip_range=clip_range, loss_agg_mode=agg)
    assert_fd(analytic, fd_grad(f, v), "value_loss dvalues")
    if clip_range == 0.0:
        assert met["vf_clip_frac"] > 0


def test_gae_reference_by_hand():
    """One sequence with an interior gap, by hand: the gap is transparent (no decay)."""
    r = np.array([[1.0, 9.0, 2.0, 3.0]])
    v = np.array([[0.5, 9.0, 0.25, 1.0]])
    m = np.array([[1, 0, 1, 1]])
    g, lam = 0.9, 0.8
    a3 = 3.0 + g * 0.0 - 1.0
    a2 = 2.0 + g * 1.0 - 0.25 + g * lam * a3
    a0 = 1.0 + g * 0.25 - 0.5 + g * lam * a2
    adv, ret = ref.gae(r, v, m, gamma=g, lam=lam)
    np.testing.assert_allclose(adv, [[a0, 0, a2, a3]], rtol=1e-14)
    np.testing.assert_allclose(ret, [[a0 + 0.5, 0, a2 + 0.25, a3 + 1.0]], rtol=1e-14)


@pytest.mark.parametrize("est", ["k1", "k2", "k3", "abs"])
def test_kl_terms_derivative(est):
    d = np.array([-3.0, -0.4, 0.3, 2.0])
    lp = d + 0.1
    kl, dkl = ref.kl_terms(lp, np.full(4, 0.1), est)
    klp, _ = ref.kl_terms(lp + H, np.full(4, 0.1), est)
    klm, _ = ref.kl_terms(lp - H, np.full(4, 0.1), est)
    np.testing.assert_allclose(dkl, (klp - klm) / (2 * H), rtol=1e-6, atol=1e-8)
    assert np.all(kl >= 0) or est == "k1"


def test_pg_terms_grid():
    """d pg / d logp against finite differences over a grid of ratios and both signs of A,
    with the dual clip and asymmetric eps."""
    rhos = np.array([0.1, 0.5, 0.79, 0.85, 1.0, 1.1, 1.25, 1.35, 2.0, 5.0])
    for a, (lo, hi, c) in itertools.product([-1.3, 0.7], [(0.2, 0.2, None), (0.2, 0.3, 3.0)]):
        old = np.zeros_like(rhos)
        lp = np.log(rhos)
        adv = np.full_like(rhos, a)
        g = ref.pg_terms(lp, old, adv, lo, hi, c)
        gp = ref.pg_terms(lp + H, old, adv, lo, hi, c)["pg"]
        gm = ref.pg_terms(lp - H, old, adv, lo, hi, c)["pg"]
        np.testing.assert_allclose(g["dpg"], (gp - gm) / (2 * H), rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------ the loss menu
# (policy losses, straight-through KL estimators, the KL bias correction)

def _small_problem(seed, B=3, T=5, V=7):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, V)) * 1.5
    tok = rng.integers(0, V, (B, T))
    m = (rng.random((B, T)) > 0.2).astype(float)
    m[1] = 0.0
    m[1, 2] = 1.0  # a sequence with a single valid token
    lp, _ = ref.token_logprobs(x, tok, m)
    old = lp + rng.normal(size=(B, T)) * 0.3
    refl = lp + rng.normal(size=(B, T)) * 0.3
    adv = rng.normal(size=(B, T))
    isw = 0.5 + rng.random((B, T))
    return x, tok, m, old, refl, adv, isw


VALUE_DIFFERENTIABLE = ["vanilla", "sapo", "gspo"]  # the value's derivative is the gradient


@pytest.mark.parametrize("policy_loss", VALUE_DIFFERENTIABLE)
@pytest.mark.parametrize("est", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_gradients_are_finite_differences(policy_loss, est, bias):
    """The analytic dlogits of the policy losses whose value's derivative is their gradient
    (vanilla with the dual clip, sapo, gspo), with every KL estimator with and without the
    bias correction, an entropy term aggregated on its own and IS weights: central finite
    differences of the loss."""
    x, tok, m, old, refl, adv, isw = _small_problem(1)
    kw = dict(policy_loss=policy_loss, kl_coef=0.3, kl_estimator=est, kl_bias_correction=bias,
              entropy_coef=0.05, entropy_agg_mode="seq-mean-token-mean",
              rollout_is_weights=isw, loss_agg_mode="token-mean",
              sapo_tau_pos=1.3, sapo_tau_neg=0.7,
              dual_clip_c=None if policy_loss == "sapo" else 3.0)
    _, _, g = ref.ppo_loss(x, tok, old, adv, m, refl, **kw)
    num = fd_grad(lambda z: ref.ppo_loss(z, tok, old, adv, m, refl, **kw)[0], x)
    assert np.abs(num - g).max() <= 1e-6 * np.abs(g).max()


@pytest.mark.parametrize("est", ["k1+", "k3+"])
def test_reference_straight_through_kl_has_the_k2_gradient(est):
    """k1+ / k3+: the value of k1 / k3, the gradient of k2 (verl): their gradient is the
    finite difference of the same loss with k2."""
    x, tok, m, old, refl, adv, isw = _small_problem(2)
    kw = dict(kl_coef=0.4, entropy_coef=0.02)
    loss, met, g = ref.ppo_loss(x, tok, old, adv, m, refl, kl_estimator=est, **kw)
    num = fd_grad(lambda z: ref.ppo_loss(z, tok, old, adv, m, refl, kl_estimator="k2",
                                         **kw)[0], x)
    assert np.abs(num - g).max() <= 1e-6 * np.abs(g).max()
    base, base_met, _ = ref.ppo_loss(x, tok, old, adv, m, refl, kl_estimator=est[:2], **kw)
    assert loss == pytest.approx(base, rel=1e-12)  # the value is the base estimator's


def test_reference_cispo_gradient_holds_the_weight_constant():
    """CISPO's weight sg(clip(rho)) is a constant: the gradient is the finite difference of
    -sum w_t A_t w0_t logp_t with w0 frozen at the current logits."""
    x, tok, m, old, refl, adv, _ = _small_problem(3)
    kw = dict(policy_loss="cispo", clip_eps_low=0.3, clip_eps_high=0.5)
    _, _, g = ref.ppo_loss(x, tok, old, adv, m, **kw)
    lp0, _ = ref.token_logprobs(x, tok, m)
    w0 = np.clip(np.exp(np.clip(lp0 - old, -20, 20)), 0.7, 1.5)
    w = ref.agg_weights(m, "token-mean")
    num = fd_grad(lambda z: float((w * -w0 * adv * ref.token_logprobs(z, tok, m)[0]).sum()), x)
    assert np.abs(num - g).max() <= 1e-6 * np.abs(g).max()


def test_reference_gspo_token_gradient_holds_the_sequence_ratio_constant():
    """GSPO-token: s_t = sg(s) exp(logp_t - sg(logp_t)); its gradient is the finite
    difference of the clipped surrogate of s0 exp(logp_t - logp0_t) with s0, logp0 frozen."""
    x, tok, m, old, refl, adv, _ = _small_problem(4)
    kw = dict(policy_loss="gspo-token", clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0)
    _, _, g = ref.ppo_loss(x, tok, old, adv, m, **kw)
    lp0, _ = ref.token_logprobs(x, tok, m)
    s0 = np.exp(ref.seq_mean(lp0 - old, m))
    w = ref.agg_weights(m, "token-mean")

    def f(z):
        lp, _ = ref.token_logprobs(z, tok, m)
        pg = ref._clip_surrogate(s0 * np.exp(lp - lp0), adv, 0.2, 0.28, 3.0)[0]
        return float((w * pg * m).sum())

    num = fd_grad(f, x)
    assert np.abs(num - g).max() <= 1e-6 * np.abs(g).max()


@pytest.mark.parametrize("policy_loss", ["dppo-tv", "dppo-kl"])
def test_reference_dppo_gradient_holds_mask_and_weight_constant(policy_loss):
    """DPPO: -M sg(min(rho, c)) A logp with the mask M and the capped ratio constants; the
    gradient is the finite difference of -sum w_t M0_t min(rho0_t, c) A_t logp_t with M0,
    rho0 frozen at the current logits (thresholds small enough that M0 has zeros)."""
    x, tok, m, old, refl, adv, _ = _small_problem(5)
    eps = (0.01, 0.02) if policy_loss == "dppo-tv" else (0.002, 0.004)
    kw = dict(policy_loss=policy_loss, clip_eps_low=eps[0], clip_eps_high=eps[1],
              dual_clip_c=1.2)
    _, _, g = ref.ppo_loss(x, tok, old, adv, m, **kw)
    lp0, _ = ref.token_logprobs(x, tok, m)
    masked = ref.dppo_masked(lp0, old, adv, eps[0], eps[1], policy_loss == "dppo-kl")
    assert (masked & (m > 0)).any() and (~masked & (m > 0)).any()
    w0 = np.where(masked, 0.0, np.minimum(np.exp(np.clip(lp0 - old, -20, 20)), 1.2))
    w = ref.agg_weights(m, "token-mean")
    num = fd_grad(lambda z: float((w * -w0 * adv * ref.token_logprobs(z, tok, m)[0]).sum()), x)
    assert np.abs(num - g).max() <= 1e-6 * np.abs(g).max()


def test_reference_vespo_gradient_holds_phi_constant():
    """VESPO: -sg(phi(w)) A logp; the gradient is the finite difference of
    -sum w_t phi0_t A_t logp_t with phi0 frozen (TRL's get_gamma_weights is no_grad)."""
    x, tok, m, old, refl, adv, _ = _small_problem(6)
    kw = dict(policy_loss="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.0)
    _, _, g = ref.ppo_loss(x, tok, old, adv, m, **kw)
    lp0, _ = ref.token_logprobs(x, tok, m)
    phi0 = ref.pg_terms(lp0, old, adv, policy_loss="vespo", response_mask=m,
                        vespo_k_pos=1.5, vespo_lambda_pos=2.0)["vespo_phi"]
    w = ref.agg_weights(m, "token-mean")
    num = fd_grad(lambda z: float((w * -phi0 * adv * ref.token_logprobs(z, tok, m)[0]).sum()),
                  x)
    assert np.abs(num - g).max() <= 1e-6 * np.abs(g).max()
