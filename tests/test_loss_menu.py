"""Tests of ppo_loss's loss menu (ppo_kernels/loss.py, docs/LOSSES.md): the policy losses
vanilla / cispo / sapo (fused kernels) and gspo / gspo-token (two-phase path), the k1+ / k3+
straight-through estimators, the KL bias correction, entropy_agg_mode, on-policy
old_logprobs=None, per-sequence advantages, the token-sum mode and the global
denominators: hand-computed cases from each paper, every backend against the reference,
gradcheck in float64; every option at once, odd dtypes and shapes, -inf logits, huge
log-ratios, ties on the clip edges, global counts as numbers and tensors, NaN on masked
positions, torch.compile(fullgraph=True). (The reference's own menu gradients:
test_reference.py; the menu's backward: test_autograd_backward.py; its bad arguments:
test_loss_bad_inputs.py; the rollout correction: test_rollout_correction.py.)"""

import itertools
import math

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as R
from ppo_kernels.testing import one_token_rows

from helpers.asserts import (TOL, assert_active, assert_grad_close, assert_metrics,
                             compare_with_reference, to_np)
from helpers.backends import BACKENDS, BACKENDS_CPU, CPU, NO_DUAL_CLIP, POLICY_LOSSES, TOKEN_LOSSES
from helpers.inputs import make_inputs, seeded_inputs


# ------------------------------------------------------------------ the reference itself


# ------------------------------------------------------------------ hand-computed cases


def test_gspo_hand_case():
    """GSPO (Zheng et al. 2025, eq. 7): s = exp(mean_t(logp - old)). Two tokens with
    log-ratios 0.1 and 0.3: s = e^0.2 = 1.2214; A = 1 and eps 0.2 clip it (loss -1.2,
    no gradient); with eps_high 0.3 it is unclipped (loss -1.2214, d loss / d logp_t =
    -A s / 2 each, seq-mean-token-mean of one sequence)."""
    x, tok = one_token_rows([-0.4, -1.1])
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
    x, tok = one_token_rows([-0.7])
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
    x, tok = one_token_rows([-0.5, -0.9])
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


def test_dppo_tv_hand_case():
    """DPPO binary TV (Qi et al. 2026, eqs. 11-13; verl dppo_tv): p = 0.5, p_old = 0.2, so
    |p - p_old| = 0.3 and the ratio 2.5. A = +1 pushes p further up, beyond eps_high =
    0.2: masked (loss 0, no gradient). A = -1 pushes p down, back towards p_old: kept,
    loss -A rho logp = 2.5 log 0.5, d / d logp = 2.5; the cap dual_clip_c = 2 (verl's
    clip_ratio_c) makes the weight 2. eps_high = 0.35 keeps the A = +1 token too."""
    x, tok = one_token_rows([math.log(0.5)])
    old = np.array([[math.log(0.2)]])
    for backend in ("cpu", "torch"):
        for adv, kw, e_loss, e_dlogp, masked in (
                (1.0, {}, 0.0, 0.0, 1.0),
                (-1.0, {}, 2.5 * math.log(0.5), 2.5, 0.0),
                (-1.0, dict(dual_clip_c=2.0), 2.0 * math.log(0.5), 2.0, 0.0),
                (1.0, dict(clip_eps_high=0.35), -2.5 * math.log(0.5), -2.5, 0.0)):
            xg = torch.tensor(x).requires_grad_(True)
            loss, met = pk.ppo_loss(xg, torch.tensor(tok), torch.tensor(old),
                                    torch.tensor([[adv]]), policy_loss="dppo-tv",
                                    backend=backend, **kw)
            assert float(loss.detach()) == pytest.approx(e_loss, rel=1e-12, abs=1e-15)
            assert float(met["clip_frac"]) == masked
            assert float(met["clip_frac_high"]) == masked
            loss.backward()
            # d loss / d logit_tok = dlogp (1 - p) for the two-entry row
            assert float(xg.grad[0, 0, 0]) / 0.5 == pytest.approx(e_dlogp, rel=1e-10,
                                                                  abs=1e-15)


def test_dppo_kl_hand_case():
    """DPPO binary KL: KL(Bern(0.2) || Bern(0.5)) = 0.2 log(0.2 / 0.5) + 0.8 log(0.8 /
    0.5) = 0.19274; eps_high 0.05 (TRL's binary_kl default scale) masks the A > 0 token,
    0.2 keeps it; a token whose probability fell (p < p_old) with A > 0 is never masked,
    however far it moved (p = 0.01, p_old = 0.9)."""
    kl = 0.2 * math.log(0.2 / 0.5) + 0.8 * math.log(0.8 / 0.5)
    assert kl == pytest.approx(0.19274, abs=1e-5)
    x, tok = one_token_rows([math.log(0.5), math.log(0.01)])
    old = np.array([[math.log(0.2), math.log(0.9)]])
    for backend in ("cpu", "torch"):
        for eps, e_masked in ((0.05, 0.5), (0.2, 0.0)):
            loss, met = pk.ppo_loss(torch.tensor(x), torch.tensor(tok), torch.tensor(old),
                                    torch.ones(1, 2, dtype=torch.float64),
                                    policy_loss="dppo-kl", clip_eps_low=eps,
                                    clip_eps_high=eps, loss_agg_mode="token-sum",
                                    backend=backend)
            assert float(met["clip_frac_high"]) == e_masked
            kept = (0.0 if e_masked else -2.5 * math.log(0.5)) - (0.01 / 0.9) * math.log(0.01)
            assert float(loss) == pytest.approx(kept, rel=1e-12)
    # the reference's binary KL is the closed form, also at p -> 1 and p_old -> 1
    lp = np.log(np.array([0.5, 1.0 - 1e-12, 0.3, 0.999999]))
    lo = np.log(np.array([0.2, 0.5, 1.0, 0.999]))
    # KL(Bern(0.5) || Bern(1 - 1e-12)) = 0.5 log(0.5) + 0.5 log(0.5 / 1e-12) ~ 13.1;
    # KL(Bern(0.999) || Bern(0.999999)) = 0.999 log(0.999 / 0.999999) + 0.001 log(1000)
    # ~ 0.00591; p_old = 1 with p < p_old: never masked for A > 0
    kl4 = 0.999 * math.log(0.999 / 0.999999) + 0.001 * math.log(1000.0)
    assert R.dppo_masked(lp, lo, np.ones(4), 0.0, 0.2, True).tolist() == [
        False, True, False, False]
    assert R.dppo_masked(lp, lo, np.ones(4), 0.0, kl4 * 0.999, True).tolist() == [
        True, True, False, True]
    assert R.dppo_masked(lp, lo, np.ones(4), 0.0, kl4 * 1.001, True).tolist() == [
        True, True, False, False]


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss,eps", [("dppo-tv", (0.1, 0.2)), ("dppo-kl", (0.03, 0.06))])
@pytest.mark.parametrize("swap", [False, True], ids=["low-high", "swapped"])
def test_dppo_low_and_high_thresholds_hand_case(be, policy_loss, eps, swap):
    """DPPO's two thresholds (Qi et al. 2026, eqs. 12-14; verl dppo_tv / dppo_kl): the
    A <= 0 side is masked past clip_eps_low, the A > 0 side past clip_eps_high. Token 0:
    A = -1, p falls 0.45 -> 0.3 (TV 0.15, binary KL 0.0498); token 1: A = +1, p rises
    0.35 -> 0.5 (TV 0.15, binary KL 0.0457). With (low, high) = (0.1, 0.2) (KL: (0.03,
    0.06)) token 0 is masked and token 1 kept: loss -(0.5 / 0.35) log 0.5; swapped, token 0
    is kept and token 1 masked: loss (0.3 / 0.45) log 0.3. d loss / d logp = -M rho A."""
    p, p_old = np.array([0.3, 0.5]), np.array([0.45, 0.35])
    tv = np.abs(p - p_old)
    kl = p_old * np.log(p_old / p) + (1 - p_old) * np.log((1 - p_old) / (1 - p))
    div = kl if policy_loss == "dppo-kl" else tv
    lo, hi = eps[::-1] if swap else eps
    assert div[0] > min(eps) and div[0] < max(eps) and div[1] > min(eps) and div[1] < max(eps)
    masked = np.array([div[0] > lo, div[1] > hi])  # token 0: A < 0 side, token 1: A > 0
    assert masked.tolist() == ([False, True] if swap else [True, False])
    adv = np.array([[-1.0, 1.0]])
    rho = p / p_old
    e_dlogp = np.where(masked, 0.0, -rho * adv[0])
    e_loss = float((e_dlogp * np.log(p)).sum())
    x, tok = one_token_rows(np.log(p))
    old = np.log(p_old)[None]
    kw = dict(policy_loss=policy_loss, clip_eps_low=lo, clip_eps_high=hi,
              loss_agg_mode="token-sum")
    xg = torch.tensor(x).requires_grad_(True)
    loss, met = pk.ppo_loss(xg, torch.tensor(tok), torch.tensor(old), torch.tensor(adv),
                            backend=be.name, **kw)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(e_loss, rel=1e-12)
    assert float(met["clip_frac_low"]) == (0.0 if swap else 0.5)
    assert float(met["clip_frac_high"]) == (0.5 if swap else 0.0)
    # d loss / d logit_tok = dlogp (1 - p) for the two-entry rows
    np.testing.assert_allclose(xg.grad[0, :, 0].numpy() / (1 - p), e_dlogp, rtol=1e-10,
                               atol=1e-15)
    r_loss, r_met, r_grad = R.ppo_loss(x, tok, old, adv, **kw)
    assert r_loss == pytest.approx(e_loss, rel=1e-12)
    assert (r_met["clip_frac_low"], r_met["clip_frac_high"]) == (
        (0.0, 0.5) if swap else (0.5, 0.0))
    np.testing.assert_allclose(xg.grad.numpy(), r_grad, rtol=1e-10, atol=1e-15)


def test_vespo_hand_case():
    """VESPO (TRL get_gamma_weights): w = exp(sum_t (logp - old)); two tokens with
    log-ratios 0.1 and 0.3: w = e^0.4; A = 1: phi = e^(3 + 2 * 0.4 - 3 e^0.4) (k_pos 2,
    lambda_pos 3); the loss -phi A logp per token, d / d logp = -phi A (phi a constant).
    On-policy w = 1 and phi(1) = 1: the plain policy gradient -A logp."""
    x, tok = one_token_rows([-0.4, -1.1])
    lp, _ = R.token_logprobs(x, tok)
    old = lp - np.array([[0.1, 0.3]])
    phi = math.exp(3 + 2 * 0.4 - 3 * math.exp(0.4))
    for backend in ("cpu", "torch"):
        xg = torch.tensor(x).requires_grad_(True)
        loss, met = pk.ppo_loss(xg, torch.tensor(tok), torch.tensor(old),
                                torch.ones(1, 2, dtype=torch.float64), policy_loss="vespo",
                                loss_agg_mode="token-sum", backend=backend)
        assert float(loss.detach()) == pytest.approx(-phi * (-0.4 - 1.1), rel=1e-12)
        assert float(met["seq_ratio_mean"]) == pytest.approx(math.exp(0.4), rel=1e-6)
        assert float(met["ratio_max"]) == pytest.approx(math.exp(0.3), rel=1e-6)
        loss.backward()
        dlogp = xg.grad[0, :, 0].numpy() / (1 - np.exp(lp[0]))
        np.testing.assert_allclose(dlogp, -phi, rtol=1e-10)
        loss, _ = pk.ppo_loss(torch.tensor(x), torch.tensor(tok), None,
                              -torch.ones(1, 2, dtype=torch.float64), policy_loss="vespo",
                              loss_agg_mode="token-sum", backend=backend)
        assert float(loss) == pytest.approx(-0.4 - 1.1, rel=1e-12)


def test_kl_bias_correction_on_policy_gradient():
    """TRL's use_bias_correction_kl multiplies k3 by rho (not detached): on-policy
    (rho = 1) its gradient is k3 + dk3 = delta = logp - ref_logp."""
    x, tok = one_token_rows([-0.3, -2.0])
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
    # (dual clip caps low enough that the random ratios, spread 0.35 in log, reach them)
    dict(policy_loss="vanilla", clip_eps_low=0.1, dual_clip_c=1.15, kl_estimator="k3+",
         kl_coef=0.1),
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
    dict(policy_loss="gspo-token", clip_eps_low=0.02, dual_clip_c=1.05, loss_agg_mode="token-sum",
         entropy_coef=0.01, entropy_agg_mode="token-mean"),
    dict(policy_loss="gspo-token", kl_coef=0.05, kl_estimator="k3", old=None),
    # DPPO: thresholds small enough that the random batch has masked tokens both ways
    dict(policy_loss="dppo-tv", clip_eps_low=0.004, clip_eps_high=0.006, kl_coef=0.1,
         kl_bias_correction=True, entropy_coef=0.01),
    # (off-policy: on-policy rho = 1, which neither trips a trust region nor reaches a cap)
    dict(policy_loss="dppo-tv", dual_clip_c=1.2, clip_eps_low=0.002,
         loss_agg_mode="seq-mean-token-mean"),
    dict(policy_loss="dppo-kl", clip_eps_low=2e-4, clip_eps_high=5e-4, dual_clip_c=1.05,
         isw=True, kl_estimator="k3+", kl_coef=0.1),
    dict(policy_loss="dppo-kl", clip_eps_low=1e-4, seq_adv=True, loss_agg_mode="token-sum"),
    dict(policy_loss="vespo", kl_coef=0.1, kl_bias_correction=True, entropy_coef=0.01),
    dict(policy_loss="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
         vespo_lambda_neg=5.0, seq_adv=True, loss_agg_mode="seq-mean-token-mean", isw=True),
    dict(policy_loss="vanilla", loss_agg_mode="seq-mean-token-mean", global_num_seqs=7,
         global_num_tokens=40.0),
    dict(policy_loss="vanilla", loss_agg_mode="token-mean", global_num_tokens="tensor",
         entropy_coef=0.01),
]


def _case_id(c):
    return "-".join(f"{k}={v}" for k, v in c.items() if k != "policy_loss").replace(
        " ", "") or "default"


def _run_option_case(be, case, gen):
    """One OPTION_CASES case on backend ``be``: (loss, metrics, dlogits, the reference's
    (loss, metrics, dlogits), the ppo_loss keywords with old)."""
    case = dict(case)
    # one shape for every backend (the interpreter's too: 18 rows of 50 are cheap), so the
    # inputs that make each case's option act are the same everywhere
    B, T, V = 3, 6, 50
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
    return loss, met, leaf.grad, (e_loss, e_met, e_grad), dict(kw, old=inp["old"] if use_old
                                                                else None)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("case", OPTION_CASES, ids=[f"{c['policy_loss']}-{_case_id(c)}"
                                                    for c in OPTION_CASES])
def test_backend_matches_reference(be, case):
    # the inputs of test_menu_cases_cover_every_option (seed 0, on every backend alike):
    # each case's option is shown to act on them there, and asserted to act here
    loss, met, grad, (e_loss, e_met, e_grad), kw = _run_option_case(
        be, case, torch.Generator().manual_seed(0))
    assert float(loss.detach()) == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert_metrics(met, e_met, rtol=2e-5, atol=2e-6)
    assert_grad_close(grad, e_grad, 3e-6)
    # the options the case names acted on its inputs (dual clip, DPPO trust region)
    assert_active(met, kw)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
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


# The sets whose loss value is differentiable with its gradient as derivative: vanilla,
# sapo and gspo with k3 and the bias correction (rho k3, rho not detached), old_logprobs
# given. Every other set is not: cispo, dppo-tv / dppo-kl, vespo and gspo-token detach a
# weight (stop-gradient); k1+ has k1's value and k2's gradient (straight-through, verl);
# old_logprobs=None has rho = exp(logp - sg(logp)), 1 in value with d rho / d logp = 1.
GRADCHECK_VALUE = ("vanilla", "sapo", "gspo")
FD_H = 1e-6  # central differences in float64: truncation ~H^2, rounding ~1e-16 / H


def _fd_grad(f, x, h=FD_H):
    """Central finite differences of the scalar f at x (numpy float64 array)."""
    g = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        g[i] = (f(xp) - f(xm)) / (2 * h)
    return g


def _frozen_surrogate(x0, tok, m, old, adv, refl, *, policy_loss, kl_coef, kl_estimator,
                      kl_bias_correction=False, entropy_coef=0.0, loss_agg_mode="token-mean",
                      entropy_agg_mode=None):
    """f(z): the loss with every stop-gradient quantity frozen at the logits x0 (numpy,
    from the reference's primitives), whose derivative at x0 is the loss's gradient
    (test_reference.py builds the same per policy loss). Default clip band 0.2, no dual
    clip, no IS weights."""
    m = np.asarray(m, dtype=np.float64)
    a = np.broadcast_to(np.asarray(adv, dtype=np.float64), m.shape)
    lp0, _ = R.token_logprobs(x0, tok, m)
    o = lp0 if old is None else np.asarray(old, dtype=np.float64)  # on-policy: sg(logp)
    clamp = R.LOG_RATIO_CLAMP
    rho0 = np.exp(np.clip(lp0 - o, -clamp, clamp))
    s0 = np.exp(np.clip(R.seq_mean(lp0 - o, m), -clamp, clamp))
    if policy_loss == "cispo":
        c0 = np.clip(rho0, 0.8, 1.2)
    elif policy_loss in ("dppo-tv", "dppo-kl"):
        c0 = np.where(R.dppo_masked(lp0, o, a, 0.2, 0.2, policy_loss == "dppo-kl"), 0.0, rho0)
    elif policy_loss == "vespo":
        c0 = R.pg_terms(lp0, o, a, policy_loss="vespo", response_mask=m)["vespo_phi"]
    w = R.agg_weights(m, loss_agg_mode)
    w_ent = w if entropy_agg_mode is None else R.agg_weights(m, entropy_agg_mode)

    def pg_and_ratio(lp):
        if policy_loss in ("vanilla", "sapo", "gspo"):
            g = R.pg_terms(lp, o, a, policy_loss=policy_loss, response_mask=m)
            return g["pg"], g["ratio"]
        if policy_loss == "gspo-token":  # s_t = sg(s) exp(logp_t - sg(logp_t))
            r = s0 * np.exp(lp - lp0)
            return R._clip_surrogate(r, a, 0.2, 0.2, None)[0], r
        return -c0 * a * lp, np.exp(np.clip(lp - o, -clamp, clamp))  # -sg(c) A logp

    _, r0 = pg_and_ratio(lp0)
    kl_val0 = R.kl_terms(lp0, refl, kl_estimator)[0]

    def f(z):
        lp, ent = R.token_logprobs(z, tok, m)
        pg, r = pg_and_ratio(lp)
        if kl_estimator in ("k1+", "k3+"):  # the value of k1 / k3, the gradient of k2
            k2 = 0.5 * (lp - refl) ** 2
            kl = kl_val0 * r + k2 * r0 if kl_bias_correction else k2
        else:
            kl = R.kl_terms(lp, refl, kl_estimator)[0]
            kl = kl * r if kl_bias_correction else kl
        return float((w * m * (pg + kl_coef * kl)).sum() - entropy_coef * (w_ent * m * ent).sum())

    return f


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("old", ["given", None], ids=["off-policy", "on-policy"])
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.parametrize("opts", [dict(kl_estimator="k3", kl_bias_correction=True),
                                  dict(kl_estimator="k1+", entropy_agg_mode="token-mean")],
                         ids=["k3-bias", "k1plus-entropy-agg"])
def test_gradcheck_float64(backend, old, policy_loss, opts, gen):
    """float64 gradients of every policy loss, off- and on-policy, with a KL term (k3 with
    the bias correction, or k1+) and an entropy term: torch.autograd.gradcheck where the
    loss value is differentiable (GRADCHECK_VALUE, off-policy, k3-bias: 3 of the 32 sets);
    for the others, whose gradient is not the value's derivative (stop-gradient weights,
    the straight-through k1+, on-policy's sg(logp): see GRADCHECK_VALUE), the gradient is
    the central finite difference of the loss with those quantities frozen at the current
    logits, built from the reference (_frozen_surrogate), not another backend."""
    B, T, V = 2, 3, 5
    inp = make_inputs(B, T, V, gen, dtype=torch.float64)
    x = inp["full"][:, :T].clone().requires_grad_(True)
    old_lp = inp["old"] if old == "given" else None
    kw = dict(policy_loss=policy_loss, kl_coef=0.2, entropy_coef=0.05,
              loss_agg_mode="seq-mean-token-mean", **opts)

    def f(z):
        return pk.ppo_loss(z, inp["tokens"], old_lp, inp["adv"], inp["mask"], inp["ref"],
                           backend=backend, **kw)[0]

    value_differentiable = (policy_loss in GRADCHECK_VALUE and old_lp is not None
                            and opts["kl_estimator"] == "k3")
    if value_differentiable:
        assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-8, rtol=1e-6)
        return
    f(x).backward()
    x0 = inp["full"][:, :T].numpy()
    sur = _frozen_surrogate(x0, inp["tokens"].numpy(), inp["mask"].numpy(),
                            None if old_lp is None else old_lp.numpy(), inp["adv"].numpy(),
                            inp["ref"].numpy(), **kw)
    num = _fd_grad(sur, x0)
    assert np.abs(num).max() > 0
    assert np.abs(to_np(x.grad) - num).max() <= 1e-6 * np.abs(num).max()


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
    """OPTION_CASES name every option of the menu and every policy loss, and each case's
    options act on its inputs (assert_active: the dual clip reaches its cap, the DPPO trust
    region trips), here on inputs of a fixed seed, on the cpu backend."""
    seen = set(itertools.chain.from_iterable(c.keys() for c in OPTION_CASES))
    assert {"policy_loss", "dual_clip_c", "kl_estimator", "kl_bias_correction",
            "entropy_agg_mode", "old", "seq_adv", "isw", "global_num_seqs",
            "global_num_tokens", "sapo_tau_pos"} <= seen
    assert {c["policy_loss"] for c in OPTION_CASES} == set(R.POLICY_LOSSES)
    checked = set()
    for case in OPTION_CASES:
        _, met, _, _, kw = _run_option_case(CPU, case, torch.Generator().manual_seed(0))
        assert_active(met, kw)
        if kw.get("dual_clip_c") is not None:
            checked.add("dual_clip_c")
        if kw["policy_loss"].startswith("dppo") and kw["old"] is not None:
            checked.add("dppo")
    assert checked == {"dual_clip_c", "dppo"}


# ------------------------------------------------------------------ odd inputs
# (CPU tensors: cpu, torch and the Triton interpreter)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.parametrize("agg", ["token-sum", "seq-mean-token-sum-norm", "none"])
def test_every_loss_with_every_option_at_once(be, policy_loss, agg):
    """k3+ with the bias correction, a separate entropy aggregation, per-sequence
    advantages [B, 1] and IS weights [B, 1]: all at once, per aggregation. The inputs make
    the options bite: sequence 0 has A < 0 and every ratio (and its sequence ratio) e^1.5 >
    3, so the dual clip caps all its tokens and none of sequence 1's (A > 0); there, the
    first token's p rose by e^0.5, past DPPO's small thresholds: its trust region trips on
    that token only (assert_active)."""
    inp = seeded_inputs(2, 4, 19, 11)
    lp, _ = R.token_logprobs(inp["base"], inp["tokens"], inp["mask"])
    old = inp["old"].clone()
    old[0] = torch.from_numpy(lp[0]).float() - 1.5
    t1 = int(torch.nonzero(inp["mask"][1])[0])
    old[1, t1] = float(lp[1, t1]) - 0.5
    adv = inp["adv"][:, :1].abs() + 0.3
    adv[0] = -adv[0]
    eps = {"dppo-tv": dict(clip_eps_low=0.001, clip_eps_high=0.002),
           "dppo-kl": dict(clip_eps_low=2e-4, clip_eps_high=5e-4)}.get(policy_loss, {})
    kw = dict(policy_loss=policy_loss, loss_agg_mode=agg, kl_coef=0.15, kl_estimator="k3+",
              kl_bias_correction=True, entropy_coef=0.03,
              entropy_agg_mode=None if agg == "none" else "token-mean",
              rollout_is_weights=inp["isw"][:, :1], sapo_tau_pos=2.0, sapo_tau_neg=0.5,
              dual_clip_c=3.0 if policy_loss not in NO_DUAL_CLIP else None, **eps)
    _, met, _ = compare_with_reference(be, inp["full"][:, :4], inp["tokens"], old, adv,
                                       inp["mask"], inp["ref"], active=(), **kw)
    if kw["dual_clip_c"] is not None:  # exactly sequence 0's tokens are capped
        m = inp["mask"]
        assert float(met["dual_clip_frac"]) == pytest.approx(float(m[0].sum() / m.sum()))


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_on_policy_with_k1plus_and_per_sequence_advantages(be, policy_loss):
    """On-policy (old_logprobs=None) with k1+, the KL bias correction, per-sequence
    advantages [B] and seq-mean-token-mean, for every policy loss."""
    inp = seeded_inputs(2, 4, 17, 12)
    compare_with_reference(be, inp["full"][:, :4], inp["tokens"], None, inp["adv"][:, 0],
                           inp["mask"], inp["ref"], policy_loss=policy_loss, kl_coef=0.3,
                           kl_estimator="k1+", kl_bias_correction=True,
                           loss_agg_mode="seq-mean-token-mean")


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", ["cispo", "gspo", "gspo-token"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16],
                         ids=["f64", "bf16", "f16"])
def test_logits_dtypes(be, policy_loss, dtype):
    """float64 / bfloat16 / float16 logits with cispo, gspo and gspo-token and the menu's
    options (k3+, the bias correction, an entropy aggregation of its own, mis)."""
    inp = seeded_inputs(2, 4, 19, 15, dtype=dtype)
    rtol, _, grel = TOL[dtype]
    roll = inp["old"] + 0.1
    compare_with_reference(be, inp["full"][:, :4], inp["tokens"], inp["old"], inp["adv"][:, :1],
                           inp["mask"], inp["ref"], grad_rel=grel, loss_rel=max(rtol, 2e-6),
                           policy_loss=policy_loss, kl_coef=0.1, kl_bias_correction=True,
                           kl_estimator="k3+", entropy_coef=0.02,
                           entropy_agg_mode="seq-mean-token-sum", loss_agg_mode="token-sum",
                           rollout_logprobs=roll, rollout_correction="mis",
                           rollout_is_threshold=(0.7, 1.4))


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.parametrize("shape", [(3, 4, 7, "empty_row"), (2, 3, 7, "all"), (4, 1, 7, "none"),
                                   (2, 3, 1, "mixed")], ids=["empty-row", "all-masked", "T1", "V1"])
def test_degenerate_shapes(be, policy_loss, shape):
    """An empty row, an all-masked batch, T = 1 and V = 1, for every policy loss with
    the menu's options and a global_num_seqs. The options act: the rollout log-probs are
    the current ones plus 0.5 on sequences 0 and 1 (their k1 KL, 0.5, passes the off-policy
    threshold 0.1) and plus 0 elsewhere; A < 0 on even sequences, A > 0 on odd ones: the
    off-policy mask drops sequence 0 only (DeepSeek-V3.2, eq. 9: A < 0 and KL > threshold),
    and off_policy_masked_frac is 1 over the non-empty sequences (the empty row does not
    count); one token's pi_old / pi_rollout is e > 2, so tis truncates it."""
    B, T, V, padding = shape
    inp = seeded_inputs(B, T, V, 16, padding=padding)
    m = inp["mask"]
    lp = torch.from_numpy(R.token_logprobs(inp["base"], inp["tokens"], m)[0]).float()
    shift = torch.tensor([0.5 if b < 2 else 0.0 for b in range(B)])[:, None]
    roll = lp + shift
    old = inp["old"] + shift  # old - roll = the inputs' noise
    if m.any():
        b0, t0 = torch.nonzero(m)[0].tolist()
        old[b0, t0] = roll[b0, t0] + 1.0
    adv = inp["adv"][:, 0].abs() + 0.3
    adv[0::2] = -adv[0::2]
    # (VESPO refuses a rollout correction: TRL folds it into phi)
    rc = None if policy_loss == "vespo" else "tis"
    _, met, _ = compare_with_reference(
        be, inp["full"][:, :T], inp["tokens"], old, adv, m, inp["ref"],
        policy_loss=policy_loss, kl_coef=0.1, kl_bias_correction=True, entropy_coef=0.01,
        entropy_agg_mode="token-sum", loss_agg_mode="seq-mean-token-mean",
        rollout_logprobs=roll, rollout_correction=rc, off_policy_mask_threshold=0.1,
        global_num_seqs=torch.tensor(5))
    nonempty = int((m.sum(1) > 0).sum())
    if nonempty:
        assert bool(m[0].any())
        assert_active(met, dict(off_policy_mask_threshold=0.1, rollout_correction=rc))
        assert float(met["off_policy_masked_frac"]) == pytest.approx(1.0 / nonempty)
    else:
        assert float(met["off_policy_masked_frac"]) == 0.0


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_banned_neginf_logits(be, policy_loss):
    """-inf (banned) logits, for every policy loss with the KL bias correction and an
    entropy term aggregated on its own."""
    inp = seeded_inputs(2, 4, 23, 17, neginf=True)
    compare_with_reference(be, inp["full"][:, :4], inp["tokens"], inp["old"], inp["adv"],
                           inp["mask"], inp["ref"], policy_loss=policy_loss, kl_coef=0.1,
                           kl_bias_correction=True, entropy_coef=0.05,
                           entropy_agg_mode="token-mean")


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", ["vanilla", "cispo", "sapo", "gspo"])
@pytest.mark.parametrize("est", ["k1+", "k3+", "k3"])
def test_huge_log_ratios(be, policy_loss, est):
    """|logp - old| of 25-40 nats (clamped at 20), also as the KL's reference."""
    inp = seeded_inputs(2, 4, 23, 18, padding="none")
    old = inp["old"].clone()
    old[0, 0] -= 25
    old[0, 1] += 30
    old[1] -= 40
    compare_with_reference(be, inp["full"][:, :4], inp["tokens"], old, inp["adv"], inp["mask"], old,
                           policy_loss=policy_loss, kl_coef=0.1, kl_estimator=est,
                           kl_bias_correction=True,
                           dual_clip_c=None if policy_loss in NO_DUAL_CLIP else 3.0)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_ties_on_policy_with_a_zero_width_band(be, policy_loss):
    """On-policy rho = 1 exactly with clip_eps 0: every token sits on both clip edges (the
    unclipped branch is the active one on ties)."""
    inp = seeded_inputs(2, 4, 23, 19, padding="none")
    compare_with_reference(be, inp["full"][:, :4], inp["tokens"], None, inp["adv"], None,
                           inp["ref"], policy_loss=policy_loss, kl_coef=0.1,
                           kl_bias_correction=True, clip_eps_low=0.0, clip_eps_high=0.0)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("count", [7, 7.5, torch.tensor(7), torch.tensor(7.5),
                                   torch.tensor(7.5, dtype=torch.float64),
                                   torch.tensor(3, dtype=torch.int8)],
                         ids=["int", "float", "t-int", "t-f32", "t-f64", "t-int8"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_global_counts_numbers_and_tensors(be, count, agg):
    """global_num_tokens / global_num_seqs as Python ints and floats and as 0-d tensors
    (int64, float32, float64, int8)."""
    inp = seeded_inputs(2, 4, 13, 20)
    compare_with_reference(be, inp["full"][:, :4], inp["tokens"], inp["old"], inp["adv"],
                           inp["mask"], inp["ref"],
                           policy_loss="gspo" if agg == "token-mean" else "cispo",
                           loss_agg_mode=agg, global_num_tokens=count, global_num_seqs=count,
                           entropy_coef=0.1, entropy_agg_mode="token-mean")


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", TOKEN_LOSSES + ["gspo-token"])
@pytest.mark.parametrize("field", ["adv", "old", "ref", "isw"])
def test_nan_on_masked_positions_token_losses(be, policy_loss, field):
    """NaN in old / ref / advantages / IS weights on masked positions reaches neither
    loss nor gradient (gspo: test_gspo_nan_on_masked_positions)."""
    inp = seeded_inputs(2, 4, 11, 25)
    m = inp["mask"]
    clean = dict(old=inp["old"], ref=inp["ref"], adv=inp["adv"], isw=inp["isw"])
    dirty = dict(clean)
    dirty[field] = torch.where(m, clean[field], float("nan"))
    kw = dict(policy_loss=policy_loss, kl_coef=0.1, kl_bias_correction=True, entropy_coef=0.01)
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, met = pk.ppo_loss(x, inp["tokens"], dirty["old"], dirty["adv"], m, dirty["ref"],
                            rollout_is_weights=dirty["isw"], backend=be.name, **kw)
    loss.backward()
    e_loss, e_met, e_grad = R.ppo_loss(inp["base"], inp["tokens"], clean["old"], clean["adv"],
                                       m, clean["ref"], rollout_is_weights=clean["isw"], **kw)
    assert float(loss.detach()) == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert all(math.isfinite(float(v)) for v in met.values())
    assert np.abs(to_np(x.grad) - e_grad).max() <= 3e-6 * np.abs(e_grad).max()
    # the metrics are the clean call's (same backend) and the reference's
    _, c_met = pk.ppo_loss(inp["full"][:, :4], inp["tokens"], clean["old"], clean["adv"], m,
                           clean["ref"], rollout_is_weights=clean["isw"], backend=be.name, **kw)
    assert set(met) == set(c_met)
    for k in met:
        assert float(met[k]) == pytest.approx(float(c_met[k]), rel=1e-6, abs=1e-7), k
    assert_metrics(met, e_met, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("field", ["adv", "ref", "isw"])
def test_gspo_nan_on_masked_positions(be, field):
    """gspo: NaN advantages, IS weights or ref logprobs (with the KL bias correction) on
    masked positions reach neither the loss nor the gradient (the sequence ratio is spread
    over the sequence's tokens: a 0 * NaN there would make the whole sequence's gradient
    NaN)."""
    inp = seeded_inputs(2, 4, 11, 25)
    m = inp["mask"]
    clean = dict(ref=inp["ref"], adv=inp["adv"], isw=inp["isw"])
    dirty = dict(clean)
    dirty[field] = torch.where(m, clean[field], float("nan"))
    kw = dict(policy_loss="gspo", kl_coef=0.1, kl_bias_correction=True)
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, _ = pk.ppo_loss(x, inp["tokens"], inp["old"], dirty["adv"], m, dirty["ref"],
                          rollout_is_weights=dirty["isw"], backend=be.name, **kw)
    loss.backward()
    _, _, e_grad = R.ppo_loss(inp["base"], inp["tokens"], inp["old"], clean["adv"], m,
                              clean["ref"], rollout_is_weights=clean["isw"], **kw)
    assert torch.isfinite(x.grad).all()
    assert np.abs(to_np(x.grad) - e_grad).max() <= 3e-6 * np.abs(e_grad).max()


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("bias", [False, True], ids=["pg", "kl-bias"])
def test_gspo_token_clamped_sequence_ratio_has_no_gradient(be, bias):
    """gspo-token: where the sequence log-ratio is clamped (|mean| > 20) the policy
    term and the bias-corrected KL term have no gradient, as in the reference (not -A s,
    ~1e8)."""
    inp = seeded_inputs(1, 2, 5, 28, padding="none")
    old = inp["old"] - 25.0  # mean log-ratio ~ +25: clamped at 20
    adv = torch.zeros(1, 2) if bias else -torch.ones(1, 2)
    kw = dict(kl_coef=0.1, kl_bias_correction=True) if bias else {}
    compare_with_reference(be, inp["full"][:, :2], inp["tokens"], old, adv, None, old + 1.0,
                           policy_loss="gspo-token", **kw)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("est,delta", [("k1+", 1000.37), ("k1+", -1000.37),
                                       ("k3+", math.inf)], ids=["k1p-pos", "k1p-neg", "k3p-inf"])
def test_straight_through_kl_value_keeps_its_digits(be, est, delta):
    """k1+ / k3+ are valued as k1 / k3 themselves, not as k2 + (k - k2).detach(): the
    kl_ref metric and the loss keep their digits at |delta| = 1000 and are finite for
    ref_logprobs = -inf."""
    x = torch.zeros(1, 1, 3)
    tok = torch.zeros(1, 1, dtype=torch.long)
    ref = torch.tensor([[-math.log(3) - delta]])
    loss, met = pk.ppo_loss(x, tok, None, torch.zeros(1, 1), None, ref, kl_coef=1.0,
                            kl_estimator=est, loss_agg_mode="token-sum", backend=be.name)
    e_loss, e_met, _ = R.ppo_loss(x.double(), tok, None, torch.zeros(1, 1), None, ref,
                                  kl_coef=1.0, kl_estimator=est, loss_agg_mode="token-sum")
    assert float(met["kl_ref"]) == pytest.approx(e_met["kl_ref"], rel=2e-6)
    assert float(loss) == pytest.approx(e_loss, rel=2e-6)


@pytest.mark.parametrize("backend", ["cpu"])
@pytest.mark.parametrize("kw", [dict(policy_loss="gspo", off_policy_mask_threshold=0.05),
                                dict(policy_loss="gspo-token", entropy_coef=0.01,
                                     entropy_agg_mode="token-mean", global_num_tokens="t"),
                                dict(policy_loss="sapo", kl_coef=0.1, kl_estimator="k3+",
                                     kl_bias_correction=True)],
                         ids=["gspo-offpolicy", "gspo-token-global", "sapo-k3plus-bias"])
def test_compile_fullgraph(backend, kw):
    """torch.compile(fullgraph=True) of the menu's options (gspo with the off-policy mask,
    gspo-token with a tensor global_num_tokens, sapo with k3+ and the bias correction): the
    loss and gradient of eager."""
    torch._dynamo.reset()
    inp = seeded_inputs(2, 4, 11, 24)
    kw = dict(kw)
    if kw.get("global_num_tokens") == "t":
        kw["global_num_tokens"] = torch.tensor(9.0)

    def f(x, tok, old, adv, mask, ref):
        return pk.ppo_loss(x, tok, old, adv, mask, ref, backend=backend, **kw)

    args = (inp["tokens"], inp["old"], inp["adv"][:, 0], inp["mask"], inp["ref"])
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, met = torch.compile(f, fullgraph=True, backend="aot_eager")(x, *args)
    loss.backward()
    y = inp["full"][:, :4].clone().requires_grad_(True)
    loss2, met2 = f(y, *args)
    loss2.backward()
    torch.testing.assert_close(loss.detach(), loss2.detach())
    torch.testing.assert_close(x.grad, y.grad)
