"""Hypothesis property tests: random small shapes and random options, the compiled CPU
kernels against the float64 reference, and invariances of the loss."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ppo_kernels as pk
from ppo_kernels import reference as ref

from helpers.asserts import assert_close_np, assert_grad_close
from helpers.inputs import make_inputs

SETTINGS = settings(max_examples=int(__import__("os").environ.get("PPO_HYPOTHESIS_EXAMPLES", 60)),
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

AGG = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
       "seq-mean-token-sum-norm"]


@st.composite
def problems(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    V = draw(st.sampled_from([1, 2, 3, 7, 33, 129, 513]))
    seed = draw(st.integers(0, 2**31 - 1))
    padding = draw(st.sampled_from(["mixed", "random", "none", "empty_row", "left", "right",
                                    "interior"]))
    neginf = draw(st.booleans()) and V > 1
    policy_loss = draw(st.sampled_from(["vanilla", "vanilla", "cispo", "sapo", "gspo",
                                        "gspo-token", "dppo-tv", "dppo-kl", "vespo"]))
    opts = dict(
        policy_loss=policy_loss,
        clip_eps_low=draw(st.sampled_from([0.0, 0.1, 0.2, 0.3])),
        clip_eps_high=draw(st.sampled_from([None, 0.28, 0.5])),
        dual_clip_c=(None if policy_loss in ("cispo", "sapo", "vespo")
                     else draw(st.sampled_from([None, 1.6, 3.0]))),
        kl_coef=draw(st.sampled_from([0.0, 0.05, 0.5])),
        kl_estimator=draw(st.sampled_from(["k1", "k2", "k3", "abs", "k1+", "k3+"])),
        kl_bias_correction=draw(st.booleans()),
        entropy_coef=draw(st.sampled_from([0.0, 0.01, -0.1])),
        entropy_agg_mode=draw(st.sampled_from([None, "token-mean"])),
        temperature=draw(st.sampled_from([1.0, 0.6, 1.7])),
        loss_agg_mode=draw(st.sampled_from(AGG)),
    )
    if policy_loss == "sapo":
        opts.update(sapo_tau_pos=draw(st.sampled_from([1.0, 2.0])),
                    sapo_tau_neg=draw(st.sampled_from([1.05, 0.5])))
    rc = draw(st.sampled_from([None, None, "tis", "mis", "tis-seq", "mis-seq", "geo-seq"]))
    if rc is not None and policy_loss != "vespo":  # (vespo refuses a rollout correction)
        opts.update(rollout_correction=rc,
                    rollout_is_threshold=draw(st.sampled_from([2.0, 1.1, (0.7, 1.4)])))
    if draw(st.booleans()):
        opts["off_policy_mask_threshold"] = draw(st.sampled_from([0.0, 0.05]))
    use_isw = draw(st.booleans())
    scale = draw(st.sampled_from([0.1, 2.0, 8.0]))
    return B, T, V, seed, padding, neginf, opts, use_isw, scale


def _with_rollout(opts, inp):
    """opts plus the inference engine's log-probs (old ones, shifted by a fixed pattern of
    both signs) whenever a rollout option is drawn."""
    if "rollout_correction" not in opts and "off_policy_mask_threshold" not in opts:
        return opts
    T = inp["old"].shape[1]
    shift = 0.3 * torch.cos(1.7 * torch.arange(T, dtype=inp["old"].dtype))
    return dict(opts, rollout_logprobs=inp["old"] + shift)


def _call(inp, opts, use_isw, logits, backend="cpu"):
    return pk.ppo_loss(logits, inp["tokens"], inp["old"], inp["adv"], inp["mask"],
                       inp["ref"],
                       rollout_is_weights=inp["isw"] if use_isw else None, backend=backend,
                       **_with_rollout(opts, inp))


def _check_reference(problem, backend):
    """pk.ppo_loss on ``backend`` against the float64 reference: loss, every metric and
    dlogits. Returns (loss, metrics, dlogits)."""
    B, T, V, seed, padding, neginf, opts, use_isw, scale = problem
    gen = torch.Generator().manual_seed(seed)
    inp = make_inputs(B, T, V, gen, padding=padding, neginf=neginf, scale=scale)
    logits = inp["full"][:, :T].contiguous().requires_grad_(True)
    loss, met = _call(inp, opts, use_isw, logits, backend)
    loss.backward()
    e_loss, e_met, e_grad = ref.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"],
                                         inp["mask"], inp["ref"],
                                         rollout_is_weights=inp["isw"] if use_isw else None,
                                         **_with_rollout(opts, inp))
    assert_close_np(loss, e_loss, rtol=1e-5, atol=1e-5)
    for k, v in met.items():
        assert_close_np(v, e_met[k], rtol=1e-5, atol=1e-5, what=k)
    # The gradient sums the policy term and the KL / entropy terms; where they cancel (a KL
    # pull against the advantage on an unlikely token), float32 rounding is relative to the
    # terms, not to their sum: the bound takes the larger term's scale as well.
    term = 0.0
    if opts.get("kl_coef", 0.0) or opts.get("entropy_coef", 0.0):
        _, _, g_pol = ref.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"],
                                   inp["mask"], inp["ref"],
                                   rollout_is_weights=inp["isw"] if use_isw else None,
                                   **_with_rollout(dict(opts, kl_coef=0.0, entropy_coef=0.0),
                                                   inp))
        term = max(float(np.abs(g_pol).max()), float(np.abs(e_grad - g_pol).max()))
    assert_grad_close(logits.grad, e_grad, 2e-5, floor=1e-7 + 2e-5 * term)
    return loss, met, logits.grad


@SETTINGS
@given(problems())
def test_cpu_matches_reference(problem):
    _check_reference(problem, "cpu")


@SETTINGS
@given(problems(), st.floats(-50, 50))
def test_loss_invariant_to_per_row_logit_shift(problem, c):
    """Adding a constant to a row of logits changes no probability: same loss and grad."""
    B, T, V, seed, padding, neginf, opts, use_isw, scale = problem
    gen = torch.Generator().manual_seed(seed)
    inp = make_inputs(B, T, V, gen, padding=padding, neginf=neginf, scale=scale)
    shift = c * torch.rand(B, T, 1, generator=gen)
    x1 = inp["full"][:, :T].contiguous().requires_grad_(True)
    x2 = (inp["full"][:, :T] + shift).contiguous().requires_grad_(True)
    l1, m1 = _call(inp, opts, use_isw, x1)
    l2, m2 = _call(inp, opts, use_isw, x2)
    l1.backward()
    l2.backward()
    # float32: a shift of |c| moves logits by ~|c| * 6e-8 (one ulp) before the softmax
    tol = 1e-5 * (1 + abs(c)) * max(1.0, scale / opts["temperature"])
    assert float(l2.detach()) == pytest.approx(float(l1.detach()), rel=tol, abs=tol)
    assert_grad_close(x2.grad, x1.grad.double().numpy(), max(tol, 1e-4), floor=1e-7)


@SETTINGS
@given(problems(), st.data())
def test_masking_a_token_removes_its_contribution(problem, data):
    """With token-sum aggregation (weights independent of the mask count), masking one
    token removes exactly its per-token loss and zeroes its gradient row (token-level
    losses: a sequence loss's ratio moves with its other tokens)."""
    B, T, V, seed, padding, neginf, opts, use_isw, scale = problem
    opts = dict(opts, loss_agg_mode="seq-mean-token-sum", entropy_agg_mode=None)
    if opts["policy_loss"] in ("gspo", "gspo-token", "vespo"):
        opts["policy_loss"] = "vanilla"
    # the sequence-level weights and the off-policy mask read the other tokens too
    if opts.get("rollout_correction", "tis") not in ("tis", "mis"):
        del opts["rollout_correction"]
    opts.pop("off_policy_mask_threshold", None)
    gen = torch.Generator().manual_seed(seed)
    inp = make_inputs(B, T, V, gen, padding="none", neginf=neginf, scale=scale)
    b = data.draw(st.integers(0, B - 1))
    t = data.draw(st.integers(0, T - 1))
    logits = inp["full"][:, :T].contiguous()
    per_tok, _ = pk.ppo_loss(logits, inp["tokens"], inp["old"], inp["adv"], inp["mask"],
                             inp["ref"], rollout_is_weights=inp["isw"] if use_isw else None,
                             backend="cpu",
                             **_with_rollout(dict(opts, loss_agg_mode="none"), inp))
    x = logits.clone().requires_grad_(True)
    full_loss, _ = _call(inp, opts, use_isw, x)
    full_loss.backward()
    masked = dict(inp, mask=inp["mask"].clone())
    masked["mask"][b, t] = False
    masked["tokens"] = inp["tokens"].clone()
    masked["tokens"][b, t] = V + 99  # and its token id is never read
    y = logits.clone().requires_grad_(True)
    m_loss, _ = _call(masked, opts, use_isw, y)
    m_loss.backward()
    expected = float(full_loss.detach()) - float(per_tok[b, t]) / B
    # float32 sums: the rounding is relative to the terms, not to their difference
    scale = max(1.0, abs(float(full_loss.detach())), abs(float(per_tok[b, t])))
    assert float(m_loss.detach()) == pytest.approx(expected, rel=1e-5, abs=1e-5 * scale)
    assert torch.all(y.grad[b, t] == 0)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[b, t] = False
    torch.testing.assert_close(y.grad[keep], x.grad[keep], rtol=1e-5, atol=1e-7)


@SETTINGS
@given(problems())
def test_torch_backend_matches_reference_and_cpu(problem):
    """The torch backend against the float64 reference (the cpu backend shares its Python
    path for the sequence losses and the off-policy mask: agreeing with it alone would not
    check those), then against the cpu backend."""
    l2, m2, g2 = _check_reference(problem, "torch")
    l1, m1, g1 = _check_reference(problem, "cpu")
    assert float(l1.detach()) == pytest.approx(float(l2.detach()), rel=1e-5, abs=1e-5)
    assert_grad_close(g1, g2.double().numpy(), 2e-5, floor=1e-7)
    for k in m1:
        assert float(m1[k]) == pytest.approx(float(m2[k]), rel=1e-5, abs=1e-5), k


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 12), st.integers(0, 2**31 - 1),
       st.floats(0, 1), st.floats(0, 1), st.booleans())
def test_gae_matches_reference(B, T, seed, gamma, lam, boot):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=gen)
    v = torch.randn(B, T, generator=gen)
    m = torch.rand(B, T, generator=gen) > 0.3
    bv = torch.randn(B, generator=gen) if boot else None
    adv, ret = pk.gae(r, v, m, gamma=gamma, lam=lam, bootstrap_values=bv, backend="cpu")
    e_adv, e_ret = ref.gae(r, v, m, gamma=gamma, lam=lam, bootstrap_values=bv)
    np.testing.assert_allclose(adv.numpy(), e_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret.numpy(), e_ret, rtol=1e-5, atol=1e-5)
