"""The loss menu (docs/LOSSES.md): policy losses vanilla / cispo / sapo (fused kernels) and
gspo / gspo-token (two-phase path), the k1+ / k3+ straight-through estimators, the KL bias
correction, entropy_agg_mode, on-policy old_logprobs=None, per-sequence advantages, the
token-sum mode and the global denominators: the reference's analytic gradients against
finite differences, hand-computed cases from each paper, every backend against the
reference, gradcheck in float64."""

import itertools
import math

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as R

from conftest import (BACKENDS, assert_grad_close, assert_metrics,
                      make_inputs)


def _fd(f, x, eps=1e-6):
    """Central finite differences of the float f at the float64 array x."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        g[idx] = (f(xp) - f(xm)) / (2 * eps)
    return g


def _small_problem(seed, B=3, T=5, V=7):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, V)) * 1.5
    tok = rng.integers(0, V, (B, T))
    m = (rng.random((B, T)) > 0.2).astype(float)
    m[1] = 0.0
    m[1, 2] = 1.0  # a sequence with a single valid token
    lp, _ = R.token_logprobs(x, tok, m)
    old = lp + rng.normal(size=(B, T)) * 0.3
    ref = lp + rng.normal(size=(B, T)) * 0.3
    adv = rng.normal(size=(B, T))
    isw = 0.5 + rng.random((B, T))
    return x, tok, m, old, ref, adv, isw


# ------------------------------------------------------------------ the reference itself

VALUE_DIFFERENTIABLE = ["vanilla", "sapo", "gspo"]  # the value's derivative is the gradient


@pytest.mark.parametrize("policy_loss", VALUE_DIFFERENTIABLE)
@pytest.mark.parametrize("est", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_gradients_are_finite_differences(policy_loss, est, bias):
    x, tok, m, old, ref, adv, isw = _small_problem(1)
    kw = dict(policy_loss=policy_loss, kl_coef=0.3, kl_estimator=est, kl_bias_correction=bias,
              entropy_coef=0.05, entropy_agg_mode="seq-mean-token-mean",
              rollout_is_weights=isw, loss_agg_mode="token-mean",
              sapo_tau_pos=1.3, sapo_tau_neg=0.7,
              dual_clip_c=None if policy_loss == "sapo" else 3.0)
    _, _, g = R.ppo_loss(x, tok, old, adv, m, ref, **kw)
    num = _fd(lambda z: R.ppo_loss(z, tok, old, adv, m, ref, **kw)[0], x)
    assert np.abs(num - g).max() <= 1e-6 * np.abs(g).max()


@pytest.mark.parametrize("est", ["k1+", "k3+"])
def test_reference_straight_through_kl_has_the_k2_gradient(est):
    """k1+ / k3+: the value of k1 / k3, the gradient of k2 (verl): their gradient is the
    finite difference of the same loss with k2."""
    x, tok, m, old, ref, adv, isw = _small_problem(2)
    kw = dict(kl_coef=0.4, entropy_coef=0.02)
    loss, met, g = R.ppo_loss(x, tok, old, adv, m, ref, kl_estimator=est, **kw)
    num = _fd(lambda z: R.ppo_loss(z, tok, old, adv, m, ref, kl_estimator="k2", **kw)[0], x)
    assert np.abs(num - g).max() <= 1e-6 * np.abs(g).max()
    base, base_met, _ = R.ppo_loss(x, tok, old, adv, m, ref, kl_estimator=est[:2], **kw)
    assert loss == pytest.approx(base, rel=1e-12)  # the value is the base estimator's


def test_reference_cispo_gradient_holds_the_weight_constant():
    """CISPO's weight sg(clip(rho)) is a constant: the gradient is the finite difference of
    -sum w_t A_t w0_t logp_t with w0 frozen at the current logits."""
    x, tok, m, old, ref, adv, _ = _small_problem(3)
    kw = dict(policy_loss="cispo", clip_eps_low=0.3, clip_eps_high=0.5)
    _, _, g = R.ppo_loss(x, tok, old, adv, m, **kw)
    lp0, _ = R.token_logprobs(x, tok, m)
    w0 = np.clip(np.exp(np.clip(lp0 - old, -20, 20)), 0.7, 1.5)
    w = R.agg_weights(m, "token-mean")
    num = _fd(lambda z: float((w * -w0 * adv * R.token_logprobs(z, tok, m)[0]).sum()), x)
    assert np.abs(num - g).max() <= 1e-6 * np.abs(g).max()


def test_reference_gspo_token_gradient_holds_the_sequence_ratio_constant():
    """GSPO-token: s_t = sg(s) exp(logp_t - sg(logp_t)); its gradient is the finite
    difference of the clipped surrogate of s0 exp(logp_t - logp0_t) with s0, logp0 frozen."""
    x, tok, m, old, ref, adv, _ = _small_problem(4)
    kw = dict(policy_loss="gspo-token", clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0)
    _, _, g = R.ppo_loss(x, tok, old, adv, m, **kw)
    lp0, _ = R.token_logprobs(x, tok, m)
    s0 = np.exp(R.seq_mean(lp0 - old, m))
    w = R.agg_weights(m, "token-mean")

    def f(z):
        lp, _ = R.token_logprobs(z, tok, m)
        pg = R._clip_surrogate(s0 * np.exp(lp - lp0), adv, 0.2, 0.28, 3.0)[0]
        return float((w * pg * m).sum())

    num = _fd(f, x)
    assert np.abs(num - g).max() <= 1e-6 * np.abs(g).max()


# ------------------------------------------------------------------ hand-computed cases


def _one_token_rows(logp_values):
    """Logits [1, T, 2] whose token 0 has the given log-probabilities."""
    lp = np.asarray(logp_values, dtype=np.float64)
    # log p0 = -log(1 + e^(x1 - x0)) with x0 = 0: x1 = log(e^(-lp) - 1)
    x = np.zeros((1, len(lp), 2))
    x[0, :, 1] = np.log(np.expm1(-lp))
    return x, np.zeros((1, len(lp)), dtype=np.int64)


def test_gspo_hand_case():
    """GSPO (Zheng et al. 2025, eq. 7): s = exp(mean_t(logp - old)). Two tokens with
    log-ratios 0.1 and 0.3: s = e^0.2 = 1.2214; A = 1 and eps 0.2 clip it (loss -1.2,
    no gradient); with eps_high 0.3 it is unclipped (loss -1.2214, d loss / d logp_t =
    -A s / 2 each, seq-mean-token-mean of one sequence)."""
    x, tok = _one_token_rows([-0.4, -1.1])
    lp, _ = R.token_logprobs(x, tok)
    old = lp - np.array([[0.1, 0.3]])
    adv = np.ones((1, 2))
    for backend in ("cpu", "torch"):
        loss, met = pk.ppo_loss(torch.tensor(x), torch.tensor(tok), torch.tensor(old),
                                torch.tensor(adv), policy_loss="gspo",
                                loss_agg_mode="seq-mean-token-mean", backend=backend)
        assert float(loss) == pytest.approx(-1.2, rel=1e-12)
        assert float(met["seq_clip_frac"]) == 1.0
        xg = torch.tensor(x).requires_grad_(True)
        loss, _ = pk.ppo_loss(xg, torch.tensor(tok), torch.tensor(old), torch.tensor(adv),
                              policy_loss="gspo", clip_eps_high=0.3,
                              loss_agg_mode="seq-mean-token-mean", backend=backend)
        assert float(loss.detach()) == pytest.approx(-math.exp(0.2), rel=1e-12)
        loss.backward()
        # d loss / d logit_tok = dlogp (1 - p_tok) for a 2-entry row
        p_tok = np.exp(lp[0])
        dlogp = xg.grad[0, :, 0].numpy() / (1 - p_tok)
        np.testing.assert_allclose(dlogp, -math.exp(0.2) / 2, rtol=1e-10)


def test_cispo_hand_case():
    """CISPO (MiniMax-M1, eq. 4): -sg(clip(rho, 1 - eps_low, 1 + eps_high)) A logp. rho = 1.5
    with eps_high 0.2 gives the weight 1.2: A = 2, logp = -0.7 -> 1.68, d / d logp = -2.4.
    TRL's cap (epsilon_high = 5, no floor) is clip_eps_low = 1, clip_eps_high = 4."""
    x, tok = _one_token_rows([-0.7])
    old = np.array([[-0.7 - math.log(1.5)]])
    for backend in ("cpu", "torch"):
        xg = torch.tensor(x).requires_grad_(True)
        loss, met = pk.ppo_loss(xg, torch.tensor(tok), torch.tensor(old),
                                torch.tensor([[2.0]]), policy_loss="cispo", backend=backend)
        assert float(loss.detach()) == pytest.approx(1.68, rel=1e-12)
        assert float(met["cispo_clip_frac"]) == 1.0
        loss.backward()
        assert float(xg.grad[0, 0, 0]) / (1 - math.exp(-0.7)) == pytest.approx(-2.4, rel=1e-10)
        loss, _ = pk.ppo_loss(torch.tensor(x), torch.tensor(tok), torch.tensor(old),
                              torch.tensor([[2.0]]), policy_loss="cispo", clip_eps_low=1.0,
                              clip_eps_high=4.0, backend=backend)
        assert float(loss) == pytest.approx(-1.5 * 2.0 * -0.7, rel=1e-12)  # min(rho, 5)


def test_sapo_hand_case():
    """SAPO's gate at rho = 1 is sigmoid(0) = 1/2: the loss -(4 / tau) A / 2 and the gradient
    -4 (1/4) A = -A, PPO's own; tau_pos applies for A > 0, tau_neg for A < 0."""
    x, tok = _one_token_rows([-0.5, -0.9])
    lp, _ = R.token_logprobs(x, tok)
    adv = np.array([[1.0, -1.0]])
    for backend in ("cpu", "torch"):
        xg = torch.tensor(x).requires_grad_(True)
        loss, _ = pk.ppo_loss(xg, torch.tensor(tok), torch.tensor(lp), torch.tensor(adv),
                              policy_loss="sapo", sapo_tau_pos=2.0, sapo_tau_neg=0.5,
                              loss_agg_mode="token-sum", backend=backend)
        assert float(loss.detach()) == pytest.approx(-(4 / 2.0) / 2 + (4 / 0.5) / 2, rel=1e-12)
        loss.backward()
        dlogp = xg.grad[0, :, 0].numpy() / (1 - np.exp(lp[0]))
        np.testing.assert_allclose(dlogp, -adv[0], rtol=1e-10)


def test_kl_bias_correction_on_policy_gradient():
    """TRL's use_bias_correction_kl multiplies k3 by rho (not detached): on-policy
    (rho = 1) its gradient is k3 + dk3 = delta = logp - ref_logp."""
    x, tok = _one_token_rows([-0.3, -2.0])
    lp, _ = R.token_logprobs(x, tok)
    ref = lp - np.array([[0.25, -0.4]])
    for backend in ("cpu", "torch"):
        xg = torch.tensor(x).requires_grad_(True)
        loss, _ = pk.ppo_loss(xg, torch.tensor(tok), None, torch.zeros(1, 2),
                              ref_logprobs=torch.tensor(ref), kl_coef=1.0,
                              kl_bias_correction=True, loss_agg_mode="token-sum",
                              backend=backend)
        loss.backward()
        dlogp = xg.grad[0, :, 0].numpy() / (1 - np.exp(lp[0]))
        np.testing.assert_allclose(dlogp, [0.25, -0.4], rtol=1e-10)


# ------------------------------------------------------------------ every backend

OPTION_CASES = [
    dict(policy_loss="vanilla", dual_clip_c=3.0, kl_estimator="k3+", kl_coef=0.1),
    dict(policy_loss="vanilla", kl_estimator="k1+", kl_coef=0.2, kl_bias_correction=True,
         old=None),
    dict(policy_loss="cispo", clip_eps_low=1.0, clip_eps_high=4.0, kl_coef=0.1,
         kl_bias_correction=True),
    dict(policy_loss="cispo", clip_eps_high=0.28, entropy_coef=0.01,
         entropy_agg_mode="token-mean", loss_agg_mode="seq-mean-token-mean"),
    dict(policy_loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, entropy_coef=0.02,
         loss_agg_mode="seq-mean-token-mean"),
    dict(policy_loss="sapo", sapo_tau_pos=3.0, sapo_tau_neg=0.5, old=None, seq_adv=True),
    dict(policy_loss="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4,
         loss_agg_mode="seq-mean-token-mean", seq_adv=True),
    dict(policy_loss="gspo", clip_eps_high=0.3, kl_coef=0.1, kl_bias_correction=True,
         entropy_coef=0.01, isw=True),
    dict(policy_loss="gspo-token", dual_clip_c=2.0, loss_agg_mode="token-sum",
         entropy_coef=0.01, entropy_agg_mode="token-mean"),
    dict(policy_loss="gspo-token", kl_coef=0.05, kl_estimator="k3", old=None),
    dict(policy_loss="vanilla", loss_agg_mode="seq-mean-token-mean", global_num_seqs=7,
         global_num_tokens=40.0),
    dict(policy_loss="vanilla", loss_agg_mode="token-mean", global_num_tokens="tensor",
         entropy_coef=0.01),
]


def _case_id(c):
    return "-".join(f"{k}={v}" for k, v in c.items() if k != "policy_loss").replace(
        " ", "") or "default"


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("case", OPTION_CASES, ids=[f"{c['policy_loss']}-{_case_id(c)}"
                                                    for c in OPTION_CASES])
def test_backend_matches_reference(be, case, gen):
    case = dict(case)
    B, T, V = (2, 4, 37) if be.small else (3, 6, 50)
    inp = make_inputs(B, T, V, gen, padding="mixed")
    use_old = case.pop("old", "given") is not None
    seq_adv = case.pop("seq_adv", False)
    use_isw = case.pop("isw", False)
    adv = inp["adv"][:, 0] if seq_adv else inp["adv"]
    if case.get("global_num_tokens") == "tensor":
        case["global_num_tokens"] = torch.tensor(float(inp["mask"].sum()) + 3.0)
    kw = dict(case)
    leaf = be.t(inp["full"][:, :T]).detach().clone().requires_grad_(True)
    loss, met = pk.ppo_loss(leaf, be.t(inp["tokens"]), be.t(inp["old"]) if use_old else None,
                            be.t(adv), be.t(inp["mask"]), be.t(inp["ref"]),
                            rollout_is_weights=be.t(inp["isw"]) if use_isw else None,
                            backend=be.name,
                            **{k: (be.t(v) if torch.is_tensor(v) else v) for k, v in kw.items()})
    loss.backward()
    e_loss, e_met, e_grad = R.ppo_loss(inp["base"], inp["tokens"],
                                       inp["old"] if use_old else None, adv, inp["mask"],
                                       inp["ref"], rollout_is_weights=inp["isw"] if use_isw
                                       else None, **kw)
    assert float(loss.detach()) == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert_metrics(met, e_met, rtol=2e-5, atol=2e-6)
    assert_grad_close(leaf.grad, e_grad, 3e-6)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("policy_loss", ["vanilla", "cispo", "sapo", "gspo", "gspo-token"])
def test_on_policy_equals_old_logprobs_as_data(be, policy_loss, gen):
    """old_logprobs=None is rho = exp(logp - sg(logp)): the same loss and gradient as
    passing the current logp, detached, as old_logprobs (computed in the kernel: no extra
    pass)."""
    B, T, V = 2, 4, 31
    inp = make_inputs(B, T, V, gen)
    logits = be.t(inp["full"][:, :T])
    lp = pk.token_logprobs(logits, be.t(inp["tokens"]), be.t(inp["mask"]), backend=be.name)
    grads, losses = [], []
    for old in (None, lp):
        x = logits.detach().clone().requires_grad_(True)
        loss, _ = pk.ppo_loss(x, be.t(inp["tokens"]), old, be.t(inp["adv"]), be.t(inp["mask"]),
                              be.t(inp["ref"]), policy_loss=policy_loss, kl_coef=0.1,
                              backend=be.name)
        loss.backward()
        grads.append(x.grad)
        losses.append(float(loss.detach()))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-7)
    assert_grad_close(grads[0], grads[1].double().cpu().numpy(), 1e-6)


@pytest.mark.parametrize("policy_loss", ["vanilla", "cispo", "sapo", "gspo", "gspo-token"])
@pytest.mark.parametrize("opts", [dict(kl_estimator="k3", kl_bias_correction=True),
                                  dict(kl_estimator="k1+", entropy_agg_mode="token-mean")],
                         ids=["k3-bias", "k1plus-entropy-agg"])
def test_gradcheck_float64(policy_loss, opts, gen):
    B, T, V = 2, 3, 5
    inp = make_inputs(B, T, V, gen, dtype=torch.float64)
    x = inp["full"][:, :T].clone().requires_grad_(True)

    def f(z):
        return pk.ppo_loss(z, inp["tokens"], inp["old"], inp["adv"], inp["mask"], inp["ref"],
                           policy_loss=policy_loss, kl_coef=0.2, entropy_coef=0.05,
                           loss_agg_mode="seq-mean-token-mean", backend="cpu", **opts)[0]

    if policy_loss in ("cispo", "gspo-token") or opts["kl_estimator"] == "k1+":
        # stop-gradient losses: their gradient is not the value's derivative; compare with
        # the eager composite's autograd (explicit detach) instead
        f(x).backward()
        y = inp["full"][:, :T].clone().requires_grad_(True)
        pk.ppo_loss(y, inp["tokens"], inp["old"], inp["adv"], inp["mask"], inp["ref"],
                    policy_loss=policy_loss, kl_coef=0.2, entropy_coef=0.05,
                    loss_agg_mode="seq-mean-token-mean", backend="torch", **opts)[0].backward()
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)
    else:
        assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_trl_grpo_counts_empty_completions():
    """TRL's grpo: per-sequence token means, averaged over ALL B sequences (an empty
    completion counts as 0): seq-mean-token-mean with global_num_seqs = B."""
    gen = torch.Generator().manual_seed(0)
    inp = make_inputs(4, 5, 11, gen, padding="empty_row")
    x = inp["full"][:, :5]
    loss, _ = pk.ppo_loss(x, inp["tokens"], inp["old"], inp["adv"], inp["mask"],
                          loss_agg_mode="seq-mean-token-mean", global_num_seqs=4, backend="cpu")
    lp, _ = R.token_logprobs(inp["base"], inp["tokens"], inp["mask"])
    pg = R.pg_terms(lp, inp["old"], inp["adv"])["pg"]
    m = inp["mask"].double().numpy()
    per_seq = (pg * m).sum(1) / np.maximum(m.sum(1), 1)
    assert float(loss) == pytest.approx(per_seq.sum() / 4, rel=1e-6)


@pytest.mark.parametrize("be", BACKENDS)
def test_token_sum_and_per_sequence_weights(be, gen):
    inp = make_inputs(2, 4, 23, gen)
    isw_seq = torch.tensor([0.5, 1.5])
    loss, _ = pk.ppo_loss(be.t(inp["full"][:, :4]), be.t(inp["tokens"]), be.t(inp["old"]),
                          be.t(inp["adv"][:, :1]), be.t(inp["mask"]),
                          rollout_is_weights=be.t(isw_seq[:, None]), loss_agg_mode="token-sum",
                          backend=be.name)
    e_loss, _, _ = R.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"][:, :1],
                              inp["mask"], rollout_is_weights=isw_seq,
                              loss_agg_mode="token-sum")
    # a sum over the valid tokens: float32 rounding of each token's term adds up
    assert float(loss) == pytest.approx(e_loss, rel=2e-6, abs=2e-6 * float(inp["mask"].sum()))


def test_menu_cases_cover_every_option():
    seen = set(itertools.chain.from_iterable(c.keys() for c in OPTION_CASES))
    assert {"policy_loss", "dual_clip_c", "kl_estimator", "kl_bias_correction",
            "entropy_agg_mode", "old", "seq_adv", "isw", "global_num_seqs",
            "global_num_tokens", "sapo_tau_pos"} <= seen
    assert {c["policy_loss"] for c in OPTION_CASES} == set(R.POLICY_LOSSES)


# ------------------------------------------------------------------ rollout correction

ROLLOUT_CASES = [("tis", 2.0, None), ("tis-seq", (0.5, 1.5), None), ("mis", (0.8, 1.25), None),
                 ("mis-seq", 3.0, None), ("geo-seq", 1.05, None), (None, 2.0, 0.02),
                 ("tis", 2.0, 0.02)]


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("mode,threshold,off_policy", ROLLOUT_CASES,
                         ids=[f"{m}-{t}-{o}" for m, t, o in ROLLOUT_CASES])
def test_rollout_correction_matches_reference(be, mode, threshold, off_policy, gen):
    B, T, V = (2, 4, 37) if be.small else (4, 6, 50)
    inp = make_inputs(B, T, V, gen)
    roll = inp["old"] + 0.25 * torch.randn(B, T, generator=gen).to(inp["old"].dtype)
    kw = dict(rollout_correction=mode, rollout_is_threshold=threshold,
              off_policy_mask_threshold=off_policy, kl_coef=0.05)
    x = be.t(inp["full"][:, :T]).detach().clone().requires_grad_(True)
    loss, met = pk.ppo_loss(x, be.t(inp["tokens"]), be.t(inp["old"]), be.t(inp["adv"]),
                            be.t(inp["mask"]), be.t(inp["ref"]), rollout_logprobs=be.t(roll),
                            backend=be.name, **kw)
    loss.backward()
    e_loss, e_met, e_grad = R.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"],
                                       inp["mask"], inp["ref"], rollout_logprobs=roll, **kw)
    assert float(loss.detach()) == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert_grad_close(x.grad, e_grad, 3e-6)
    w = R.rollout_correction_weights(inp["old"], roll, inp["mask"], mode, threshold) \
        if mode else inp["mask"].double().numpy()
    m = inp["mask"].double().numpy()
    assert float(met["rollout_is_mean"]) == pytest.approx((w * m).sum() / m.sum(), rel=1e-5)
    ell = np.clip(inp["old"].double().numpy() - roll.double().numpy(), -20, 20) * m
    assert float(met["rollout_kl_k3"]) == pytest.approx(
        (R.expm1_minus_x(ell) * m).sum() / m.sum(), rel=1e-5)
    assert float(met["rollout_chi2"]) == pytest.approx(
        (np.exp(2 * ell) * m).sum() / m.sum() - 1, rel=1e-4, abs=1e-6)


def test_truncated_is_hand_case():
    """tis: w = min(pi_old / pi_rollout, C); ratios e^1, 1, e^-1 with C = 2 give 2, 1, e^-1."""
    old = torch.zeros(1, 3)
    roll = torch.tensor([[-1.0, 0.0, 1.0]])
    w = R.rollout_correction_weights(old, roll, None, "tis", 2.0)
    np.testing.assert_allclose(w, [[2.0, 1.0, math.exp(-1)]], rtol=1e-12)
    from ppo_kernels import rollout_correction as rc

    got = rc.weights(old, roll, torch.ones(1, 3, dtype=torch.bool), "tis", 0.0, 2.0)
    np.testing.assert_allclose(got.numpy(), w, rtol=1e-6)
    # masked IS drops the first token, the sequence version the whole sequence (e^0 = 1
    # inside [0.5, 1.5]: kept)
    np.testing.assert_allclose(R.rollout_correction_weights(old, roll, None, "mis", 2.0),
                               [[0.0, 1.0, math.exp(-1)]], rtol=1e-12)
    np.testing.assert_allclose(R.rollout_correction_weights(old, roll, None, "mis-seq",
                                                            (0.5, 1.5)), [[1.0, 1.0, 1.0]])


def test_off_policy_mask_hand_case():
    """DeepSeek-V3.2: a sequence with A < 0 whose mean (rollout_logp - logp) exceeds the
    threshold loses its policy term; A >= 0 sequences and the KL term are kept."""
    x, tok = _one_token_rows([-0.5, -0.5])
    x = np.repeat(x, 2, axis=0)  # two sequences of two tokens
    tok = np.zeros((2, 2), dtype=np.int64)
    lp, _ = R.token_logprobs(x, tok)
    roll = lp + 0.3  # mean KL 0.3 in both
    adv = np.array([[-1.0, -1.0], [1.0, 1.0]])
    loss, met = pk.ppo_loss(torch.tensor(x), torch.tensor(tok), torch.tensor(lp),
                            torch.tensor(adv), rollout_logprobs=torch.tensor(roll),
                            off_policy_mask_threshold=0.2, loss_agg_mode="token-sum",
                            backend="cpu")
    assert float(loss) == pytest.approx(-2.0, rel=1e-12)  # only the A > 0 sequence: -rho A
    assert float(met["off_policy_masked_frac"]) == 0.5


@pytest.mark.parametrize("kw,match", [
    (dict(rollout_correction="tis"), "rollout_correction"),
    (dict(rollout_correction="is", rollout_logprobs=True), "rollout_correction"),
    (dict(rollout_correction="tis", rollout_logprobs=True, rollout_is_threshold=0.0),
     "rollout_is_threshold"),
    (dict(rollout_correction="mis", rollout_logprobs=True, rollout_is_threshold=(2.0, 1.0)),
     "rollout_is_threshold"),
    (dict(rollout_correction="geo-seq", rollout_logprobs=True, rollout_is_threshold=0.9),
     "rollout_is_threshold"),
    (dict(off_policy_mask_threshold=math.nan), "off_policy_mask_threshold"),
    (dict(rollout_logprobs=torch.zeros(2, 2)), "rollout_logprobs"),
])
def test_rollout_correction_bad_inputs(kw, match):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    if kw.get("rollout_logprobs") is True:
        kw = dict(kw, rollout_logprobs=-torch.rand(2, 3, generator=g))
    with pytest.raises(ValueError, match=match):
        pk.ppo_loss(logits, tokens, -torch.rand(2, 3, generator=g), torch.randn(2, 3), **kw)
