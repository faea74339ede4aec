"""Tests of ppo_kernels/rollout_correction.py: ppo_loss's rollout_logprobs (the inference
engine's log-probs) with rollout_correction (tis, tis-seq, mis, mis-seq, geo-seq) and the
off-policy mask, on every backend against the numpy float64 reference (loss, dlogits and
the rollout metrics), hand-computed cases, logits of shape [N, V] and [B, T + 1, V], NaN
rollout log-probs on masked positions, torch.compile(fullgraph=True), and bad arguments.
"""

import math

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as R
from ppo_kernels import rollout_correction as rc
from ppo_kernels.testing import one_token_rows

from helpers.asserts import assert_active, assert_grad_close, compare_with_reference, to_np
from helpers.backends import BACKENDS, BACKENDS_CPU, POLICY_LOSSES
from helpers.bad_inputs import base_ppo
from helpers.inputs import make_inputs, seeded_inputs

# VESPO folds the train / inference ratio into its own sequence weight (TRL): it refuses
# rollout_correction (test_vespo_refuses_rollout_correction)
RC_LOSSES = [p for p in POLICY_LOSSES if p != "vespo"]


# thresholds that bite on test_rollout_correction_matches_reference's inputs (per-token
# log-ratios log(pi_old / pi_rollout) of about +0.6, -0.6, 0 and 0.05 by row): tis truncates
# row 0; tis-seq hits both bounds (rows 0 and 1); mis masks rows 0 and 1; mis-seq and geo-seq
# drop some sequences and keep others; the off-policy mask drops row 1 (A < 0, KL 0.6)
ROLLOUT_CASES = [("tis", 1.2, None), ("tis-seq", (0.7, 1.4), None), ("mis", (0.8, 1.25), None),
                 ("mis-seq", 1.4, None), ("geo-seq", 1.2, None), (None, 2.0, 0.02),
                 ("tis", 1.5, 0.02)]
ROW_LOG_RATIO = torch.tensor([0.6, -0.6, 0.0, 0.05])


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("mode,threshold,off_policy", ROLLOUT_CASES,
                         ids=[f"{m}-{t}-{o}" for m, t, o in ROLLOUT_CASES])
def test_rollout_correction_matches_reference(be, mode, threshold, off_policy, gen):
    B, T, V = (3, 4, 37) if be.small else (4, 6, 50)
    inp = make_inputs(B, T, V, gen)
    ell = ROW_LOG_RATIO[:B, None] + 0.05 * torch.randn(B, T, generator=gen)
    roll = inp["old"] - ell.to(inp["old"].dtype)
    # row 0 A > 0 (kept by the off-policy mask), row 1 A < 0 (dropped: its KL is 0.6)
    inp["adv"][0] = inp["adv"][0].abs()
    inp["adv"][1] = -inp["adv"][1].abs()
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
    assert_active(met, kw)
    w = R.rollout_correction_weights(inp["old"], roll, inp["mask"], mode, threshold) \
        if mode else inp["mask"].double().numpy()
    m = inp["mask"].double().numpy()
    if mode is not None:
        # the product's weights themselves, and (tis-seq) the lower bound bites too
        lo, hi = rc.bounds(mode, threshold)
        got = rc.weights(inp["old"].double(), roll.double(), inp["mask"], mode, lo, hi)
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-12, atol=0)
        if mode == "tis-seq":
            assert (w[m > 0] == lo).any() and (w[m > 0] == hi).any()
    assert float(met["rollout_is_mean"]) == pytest.approx((w * m).sum() / m.sum(), rel=1e-5)
    ell = np.clip(inp["old"].double().numpy() - roll.double().numpy(), -20, 20) * m
    assert float(met["rollout_kl_k3"]) == pytest.approx(
        (R.expm1_minus_x(ell) * m).sum() / m.sum(), rel=1e-5)
    assert float(met["rollout_chi2"]) == pytest.approx(
        (np.exp(2 * ell) * m).sum() / m.sum() - 1, rel=1e-4, abs=1e-6)
    # every metric the reference has, the new raw-ratio ones included, agrees
    for k in ("rollout_ratio_mean", "rollout_ratio_max", "rollout_ratio_min",
              "rollout_ratio_outside_frac", "off_policy_masked_frac", "rollout_is_max",
              "rollout_masked_frac"):
        if k in e_met:
            assert float(met[k]) == pytest.approx(e_met[k], rel=2e-5, abs=2e-6), k


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


# Hand cases of every mode, on the product (rollout_correction.weights) and the reference
# alike. Per-token log-ratios l = log(pi_old / pi_rollout): row 0 (0.5, 0.5, -0.2), sum 0.8,
# mean 0.8 / 3; row 1 (-0.4, -0.4, 0.1), sum -0.7, mean -0.7 / 3; row 2 (0, 0, 0), ratios
# exactly 1 (on a bound: the bounds are inclusive, lo <= r <= hi); the last column is
# masked (l = 5 there must not count).
_L = [[0.5, 0.5, -0.2, 5.0], [-0.4, -0.4, 0.1, 5.0], [0.0, 0.0, 0.0, 5.0]]
_MASK = [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]]
_e = math.exp
RC_HAND_CASES = [
    # tis (0.8, 1.5): e^0.5 -> 1.5 (hi), e^-0.4 -> 0.8 (lo), the rest as they are
    ("tis", (0.8, 1.5), [[1.5, 1.5, _e(-0.2)], [0.8, 0.8, _e(0.1)], [1.0, 1.0, 1.0]]),
    # tis-seq (0.6, 2.0): e^0.8 = 2.23 -> 2.0, e^-0.7 = 0.497 -> 0.6, 1 kept
    ("tis-seq", (0.6, 2.0), [[2.0] * 3, [0.6] * 3, [1.0] * 3]),
    # mis (0.8, 1.0): outside -> 0; ratio 1 sits on hi and is kept
    ("mis", (0.8, 1.0), [[0.0, 0.0, _e(-0.2)], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]),
    # mis (1.0, 1.2): ratio 1 sits on lo and is kept
    ("mis", (1.0, 1.2), [[0.0, 0.0, 0.0], [0.0, 0.0, _e(0.1)], [1.0, 1.0, 1.0]]),
    # mis-seq (0.45, 2.0): row 0 (2.23) dropped whole, row 1 (0.497) kept at its ratio
    ("mis-seq", (0.45, 2.0), [[0.0] * 3, [_e(-0.7)] * 3, [1.0] * 3]),
    # mis-seq C = 2 (upper bound only): row 0 dropped, the others kept
    ("mis-seq", 2.0, [[0.0] * 3, [_e(-0.7)] * 3, [1.0] * 3]),
    # geo-seq C = 1.28, bounds (1 / 1.28, 1.28): e^(0.8 / 3) = 1.306 out, e^(-0.7 / 3) =
    # 0.792 in (weight 1), 1 in
    ("geo-seq", 1.28, [[0.0] * 3, [1.0] * 3, [1.0] * 3]),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("mode,threshold,want", RC_HAND_CASES,
                         ids=[f"{m}-{t}" for m, t, _ in RC_HAND_CASES])
def test_rollout_correction_weights_hand_cases(mode, threshold, want, dtype):
    """rollout_correction.weights (the product's [B, T] weights every backend multiplies
    in) and the reference's, for every mode, against values worked out by hand (above):
    truncation at both bounds, masking per token and per sequence, the geometric mean."""
    roll = -torch.tensor(_L, dtype=torch.float64)  # old = 0: l = -roll
    old = torch.zeros_like(roll)
    mask = torch.tensor(_MASK, dtype=torch.bool)
    expected = np.concatenate([np.asarray(want), np.zeros((3, 1))], axis=1)
    lo, hi = rc.bounds(mode, threshold)
    got = rc.weights(old.to(dtype), roll.to(dtype), mask, mode, lo, hi)
    assert got.dtype == dtype
    rtol = 1e-12 if dtype == torch.float64 else 1e-6
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=rtol, atol=0)
    np.testing.assert_allclose(R.rollout_correction_weights(old, roll, mask, mode, threshold),
                               expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_rollout_masked_frac_and_is_max_hand_case(backend):
    """ppo_loss's rollout metrics on the hand case: mis-seq (0.45, 2.0) drops row 0 (3 of 9
    valid tokens: rollout_masked_frac 1/3), tis-seq (0.6, 2.0) caps row 0 at 2.0
    (rollout_is_max 2)."""
    x, tok = one_token_rows([-0.5] * 4)
    x, tok = np.repeat(x, 3, axis=0), np.zeros((3, 4), dtype=np.int64)
    lp, _ = R.token_logprobs(x, tok)
    kw = dict(rollout_logprobs=torch.tensor(lp) - torch.tensor(_L), backend=backend)
    args = (torch.tensor(x), torch.tensor(tok), torch.tensor(lp), torch.ones(3, 4),
            torch.tensor(_MASK, dtype=torch.bool))
    _, met = pk.ppo_loss(*args, rollout_correction="mis-seq", rollout_is_threshold=(0.45, 2.0),
                         **kw)
    assert float(met["rollout_masked_frac"]) == pytest.approx(1 / 3, rel=1e-6)
    assert float(met["rollout_is_mean"]) == pytest.approx((3 * math.exp(-0.7) + 3) / 9,
                                                          rel=1e-6)
    _, met = pk.ppo_loss(*args, rollout_correction="tis-seq", rollout_is_threshold=(0.6, 2.0),
                         **kw)
    assert float(met["rollout_is_max"]) == pytest.approx(2.0, rel=1e-6)
    assert float(met["rollout_is_mean"]) == pytest.approx((6.0 + 1.8 + 3.0) / 9, rel=1e-6)
    assert float(met["rollout_masked_frac"]) == 0.0


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_off_policy_masked_frac_counts_non_empty_sequences(backend):
    """off_policy_masked_frac = dropped / NON-EMPTY sequences (an empty row is neither),
    and a sequence whose mean advantage is exactly 0 is kept (the rule drops A < 0 only,
    DeepSeek-V3.2 eq. 9; TRL get_off_policy_mask keeps A >= 0). Rows: 0 A < 0 and KL 0.3 >
    0.2: dropped; 1 empty; 2 A > 0: kept; 3 A = (+1, -1), mean 0: kept (its tokens keep
    their gradient -A); so 1 of 3."""
    x, tok = one_token_rows([-0.5, -0.5])
    x, tok = np.repeat(x, 4, axis=0), np.zeros((4, 2), dtype=np.int64)
    lp, _ = R.token_logprobs(x, tok)
    roll = lp + 0.3
    adv = np.array([[-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], [1.0, -1.0]])
    mask = np.array([[1, 1], [0, 0], [1, 1], [1, 1]], dtype=bool)
    e_loss, e_met, _ = R.ppo_loss(x, tok, lp, adv, mask, rollout_logprobs=roll,
                                  off_policy_mask_threshold=0.2, loss_agg_mode="token-sum")
    assert e_met["off_policy_masked_frac"] == pytest.approx(1 / 3, rel=1e-12)
    xg = torch.tensor(x).requires_grad_(True)
    loss, met = pk.ppo_loss(xg, torch.tensor(tok), torch.tensor(lp), torch.tensor(adv),
                            torch.tensor(mask), rollout_logprobs=torch.tensor(roll),
                            off_policy_mask_threshold=0.2, loss_agg_mode="token-sum",
                            backend=backend)
    assert float(met["off_policy_masked_frac"]) == pytest.approx(1 / 3, rel=1e-6)
    # rho = 1: row 2 gives -2, row 3 gives -(1 - 1) = 0, row 0 is dropped
    assert float(loss.detach()) == pytest.approx(-2.0, rel=1e-12) == e_loss
    loss.backward()
    g = xg.grad[..., 0] / (1 - math.exp(-0.5))  # d loss / d logp of token 0
    np.testing.assert_allclose(g.numpy(), [[0, 0], [0, 0], [-1, -1], [-1, 1]], atol=1e-12)


def test_off_policy_mask_hand_case():
    """DeepSeek-V3.2: a sequence with A < 0 whose mean (rollout_logp - logp) exceeds the
    threshold loses its policy term; A >= 0 sequences and the KL term are kept."""
    x, tok = one_token_rows([-0.5, -0.5])
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


def test_off_policy_mask_decides_per_sequence():
    """Per-token advantages of mixed sign: the mask is one decision per sequence (its mean
    advantage < 0 and its mean KL > threshold, DeepSeek-V3.2 eq. 9), so a dropped sequence
    loses every token, its positive ones included, and off_policy_masked_frac counts
    exactly the sequences whose policy term is gone. Sequence 0: A = (+1, -3), mean -1,
    dropped; sequence 1: A = (-1, +3), mean +1, kept whole (its negative token too)."""
    x, tok = one_token_rows([-0.5, -0.5])
    x = np.repeat(x, 2, axis=0)
    tok = np.zeros((2, 2), dtype=np.int64)
    lp, _ = R.token_logprobs(x, tok)
    roll = lp + 0.3
    adv = np.array([[1.0, -3.0], [-1.0, 3.0]])
    kw = dict(rollout_logprobs=torch.tensor(roll), off_policy_mask_threshold=0.2,
              loss_agg_mode="token-sum")
    e_loss, e_met, _ = R.ppo_loss(x, tok, lp, adv, rollout_logprobs=roll,
                                  off_policy_mask_threshold=0.2, loss_agg_mode="token-sum")
    assert e_loss == pytest.approx(-2.0, rel=1e-12)  # only sequence 1: -(-1 + 3)
    assert e_met["off_policy_masked_frac"] == 0.5
    for backend in ("cpu", "torch"):
        xg = torch.tensor(x).requires_grad_(True)
        loss, met = pk.ppo_loss(xg, torch.tensor(tok), torch.tensor(lp), torch.tensor(adv),
                                backend=backend, **kw)
        assert float(loss.detach()) == pytest.approx(-2.0, rel=1e-12)
        assert float(met["off_policy_masked_frac"]) == 0.5
        loss.backward()
        # the dropped sequence has no policy gradient on any of its tokens
        assert torch.all(xg.grad[0] == 0) and torch.all(xg.grad[1, :, 0] != 0)
        # the per-token loss agrees with the metric: sequence 0 is all zeros
        per_tok, _ = pk.ppo_loss(torch.tensor(x), torch.tensor(tok), torch.tensor(lp),
                                 torch.tensor(adv), backend=backend,
                                 **dict(kw, loss_agg_mode="none"))
        assert torch.all(per_tok[0] == 0) and torch.all(per_tok[1] != 0)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", ["vanilla", "dppo-tv", "gspo", "vespo"])
def test_off_policy_mask_mixed_signs_every_backend(be, policy_loss):
    """Random per-token advantages (mixed signs within sequences) with the off-policy mask
    and no rollout log-probs (old_logprobs stand in): every backend agrees with the
    reference, the masked fraction included."""
    inp = seeded_inputs(4, 5, 13, 31, ratio_spread=0.6)
    compare_with_reference(be, inp["full"][:, :5], inp["tokens"], inp["old"], inp["adv"],
                           inp["mask"], inp["ref"], policy_loss=policy_loss,
                           off_policy_mask_threshold=0.0, kl_coef=0.1,
                           clip_eps_low=0.01 if policy_loss == "dppo-tv" else 0.2)


def test_raw_ratio_metrics_hand_case():
    """rollout_ratio_* are of pi_old / pi_rollout before any cap or mask: ratios e^1, 1,
    e^-0.05, e^-1 (one more, e^3, on a masked position) with tis at C = 2: the mean
    (e + 1 + e^-0.05 + e^-1) / 4, max e, min e^-1, outside [0.9, 1.1]: 2 of 4; the
    truncated rollout_is_max is 2."""
    x, tok = one_token_rows([-0.5, -0.6, -0.7, -0.8, -0.9])
    lp, _ = R.token_logprobs(x, tok)
    old = torch.tensor(lp)
    roll = old - torch.tensor([[1.0, 0.0, -0.05, -1.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    r = np.exp([1.0, 0.0, -0.05, -1.0])
    for backend in ("cpu", "torch"):
        _, met = pk.ppo_loss(torch.tensor(x), torch.tensor(tok), old, torch.ones(1, 5),
                             mask, rollout_logprobs=roll, rollout_correction="tis",
                             rollout_is_threshold=2.0, backend=backend)
        assert float(met["rollout_ratio_mean"]) == pytest.approx(r.mean(), rel=1e-6)
        assert float(met["rollout_ratio_max"]) == pytest.approx(math.e, rel=1e-6)
        assert float(met["rollout_ratio_min"]) == pytest.approx(math.exp(-1), rel=1e-6)
        assert float(met["rollout_ratio_outside_frac"]) == 0.5
        assert float(met["rollout_is_max"]) == 2.0
    # no valid token: every metric 0, none NaN / inf
    _, met = pk.ppo_loss(torch.tensor(x), torch.tensor(tok), old, torch.ones(1, 5),
                         torch.zeros(1, 5, dtype=torch.bool), rollout_logprobs=roll,
                         backend="cpu")
    assert all(float(met[k]) == 0.0 for k in ("rollout_ratio_mean", "rollout_ratio_max",
                                              "rollout_ratio_min",
                                              "rollout_ratio_outside_frac"))


def test_vespo_refuses_rollout_correction():
    d = base_ppo()
    with pytest.raises(ValueError, match="rollout_correction"):
        pk.ppo_loss(**d, policy_loss="vespo", rollout_logprobs=d["old_logprobs"] - 0.1,
                    rollout_correction="tis")
    # the raw mismatch metrics stay available (no correction asked for)
    _, met = pk.ppo_loss(**d, policy_loss="vespo", rollout_logprobs=d["old_logprobs"] - 0.1)
    assert float(met["rollout_ratio_mean"]) == pytest.approx(math.exp(0.1), rel=1e-6)


def _m2po_areal(old, roll, mask, thr):
    """AReaL's _apply_m2po_masking, written out on Python lists (sorted descending, drop
    the k largest where k is the first suffix whose mean is below the threshold, else all
    but one)."""
    vals = [((r - o) ** 2, i) for i, (o, r, m) in enumerate(zip(old, roll, mask)) if m]
    vals.sort(key=lambda t: -t[0])
    n = len(vals)
    k = n - 1
    for i in range(n):
        rest = [v for v, _ in vals[i:]]
        if sum(rest) / len(rest) < thr:
            k = i
            break
    keep = [bool(m) for m in mask]
    for _, i in vals[:k]:
        keep[i] = False
    return keep


def test_m2po_mask_hand_case_and_areal_rule():
    """M2PO (AReaL m2_threshold): m2 = (0.1, 0.5, 1.0, 0.2)^2 = (0.01, 0.25, 1, 0.04),
    mean 0.325; threshold 0.09: drop 1 (rest mean 0.1, not below), then 0.25 (rest 0.025
    < 0.09): two dropped. A tiny threshold keeps exactly one token (AReaL's rule)."""
    from ppo_kernels import rollout_correction as rc

    old = torch.zeros(1, 4, dtype=torch.float64)
    roll = torch.tensor([[0.1, -0.5, 1.0, 0.2]], dtype=torch.float64)
    got = rc.m2po_mask(old, roll, m2_threshold=0.09)
    assert got.tolist() == [[True, False, False, True]]
    assert rc.m2po_mask(old, roll, m2_threshold=1e-9).sum() == 1
    assert rc.m2po_mask(old, roll, m2_threshold=10.0).all()
    # random batches with padding against the rule written out
    g = torch.Generator().manual_seed(5)
    for thr in (0.01, 0.05, 0.3):
        o = -torch.rand(3, 7, generator=g, dtype=torch.float64)
        r = o + 0.3 * torch.randn(3, 7, generator=g, dtype=torch.float64)
        m = torch.rand(3, 7, generator=g) > 0.2
        got = rc.m2po_mask(o, r, m, m2_threshold=thr)
        exp = _m2po_areal(o.flatten().tolist(), r.flatten().tolist(), m.flatten().tolist(),
                          thr)
        assert got.flatten().tolist() == exp
        assert not (got & ~m).any()
    assert not rc.m2po_mask(old, roll, torch.zeros(1, 4, dtype=torch.bool),
                            m2_threshold=0.1).any()


@pytest.mark.parametrize("kw,match", [
    (dict(m2_threshold=0.0), "m2_threshold"),
    (dict(m2_threshold="0.1"), "m2_threshold"),
    (dict(old_logprobs=torch.zeros(2, 3).long()), "old_logprobs"),
    (dict(old_logprobs=torch.zeros(6)), "old_logprobs"),
    (dict(rollout_logprobs=torch.zeros(2, 4)), "rollout_logprobs"),
    (dict(rollout_logprobs=[[0.0] * 3] * 2), "rollout_logprobs"),
    (dict(response_mask=torch.ones(3, 2)), "response_mask"),
])
def test_m2po_mask_bad_inputs(kw, match):
    from ppo_kernels import rollout_correction as rc

    args = dict(old_logprobs=torch.zeros(2, 3), rollout_logprobs=torch.zeros(2, 3),
                response_mask=None, m2_threshold=0.1)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        rc.m2po_mask(args.pop("old_logprobs"), args.pop("rollout_logprobs"), **args)


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


# ------------------------------------------------------------------ odd inputs
# (CPU tensors: cpu, torch and the Triton interpreter)

@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", RC_LOSSES)
def test_flat_logits_with_rollout_correction(be, policy_loss):
    """[N, V] logits: one sequence; rollout_logprobs [N] with tis-seq and the off-policy
    mask."""
    g = torch.Generator().manual_seed(13)
    N, V = 6, 13
    x = torch.randn(N, V, generator=g) * 2
    tok = torch.randint(0, V, (N,), generator=g)
    lp = torch.log_softmax(x.double(), -1).gather(-1, tok[:, None])[:, 0]
    old = (lp + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)).float()
    ref = (lp + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)).float()
    roll = old + 0.1 * torch.randn(N, generator=g)
    adv = torch.randn(N, generator=g)
    mask = torch.tensor([1, 1, 0, 1, 1, 0], dtype=torch.bool)
    kw = dict(policy_loss=policy_loss, kl_coef=0.1, kl_bias_correction=True, entropy_coef=0.01,
              entropy_agg_mode="token-mean", loss_agg_mode="seq-mean-token-mean",
              rollout_logprobs=roll, rollout_correction="tis-seq",
              rollout_is_threshold=(0.5, 1.5), off_policy_mask_threshold=0.01)
    ref_kw = dict(logits=x[None].double(), tokens=tok[None], old=old[None], adv=adv[None],
                  mask=mask[None], ref=ref[None], kw=dict(kw, rollout_logprobs=roll[None]))
    compare_with_reference(be, x, tok, old, adv, mask, ref, ref_kw=ref_kw, **kw)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", RC_LOSSES)
@pytest.mark.parametrize("mode,threshold", [("geo-seq", 1.5), ("mis", (0.7, 1.4))])
def test_raw_t_plus_one_logits_with_rollout_correction(be, policy_loss, mode, threshold):
    """[B, T + 1, V] logits (the last position gets a zero gradient)."""
    inp = seeded_inputs(2, 4, 9, 14, layout="raw")
    roll = inp["old"] + 0.2 * torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    _, _, grad = compare_with_reference(be, inp["full"], inp["tokens"], inp["old"],
                                        inp["adv"][:, 0], inp["mask"], inp["ref"],
                                        policy_loss=policy_loss, kl_coef=0.2, kl_estimator="k1+",
                                        entropy_coef=0.02, rollout_logprobs=roll,
                                        rollout_correction=mode, rollout_is_threshold=threshold,
                                        off_policy_mask_threshold=0.0)
    assert (grad[:, -1] == 0).all()


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", RC_LOSSES)
@pytest.mark.parametrize("mode", ["tis", "tis-seq", "mis", "mis-seq", "geo-seq"])
def test_nan_rollout_logprobs_on_masked_positions(be, policy_loss, mode):
    """NaN rollout_logprobs on masked positions reach neither the loss, the metrics nor
    the gradient, for every correction mode and policy loss. Both sequences have mean
    A < 0; per-token log(pi_old / pi_rollout) of -0.2 in row 0 (off-policy KL about 0.2 >
    0.05: dropped) and +0.15 in row 1 (KL < 0: kept, its weight 1.16 per token, 1.35 per
    sequence, inside (0.5, 1.5)): the loss and gradient are row 1's, with the mode's
    weight."""
    inp = seeded_inputs(2, 4, 11, 26)
    m = inp["mask"]
    roll = inp["old"] - torch.tensor([[-0.2], [0.15]])
    kw = dict(policy_loss=policy_loss, rollout_correction=mode, rollout_is_threshold=(0.5, 1.5),
              off_policy_mask_threshold=0.05)
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, met = pk.ppo_loss(x, inp["tokens"], inp["old"], inp["adv"], m,
                            rollout_logprobs=torch.where(m, roll, float("nan")),
                            backend=be.name, **kw)
    loss.backward()
    e_loss, e_met, e_grad = R.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"], m,
                                       rollout_logprobs=roll, **kw)
    assert e_met["off_policy_masked_frac"] == 0.5 and e_loss != 0.0
    assert np.abs(e_grad[1]).max() > 0 and np.abs(e_grad[0]).max() == 0
    assert float(loss.detach()) == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert np.abs(to_np(x.grad) - e_grad).max() <= 3e-6 * np.abs(e_grad).max()
    # the metrics: those of the call without NaN, and the reference's
    _, clean = pk.ppo_loss(inp["full"][:, :4], inp["tokens"], inp["old"], inp["adv"], m,
                           rollout_logprobs=roll, backend=be.name, **kw)
    assert set(met) == set(clean)
    for k, v in met.items():
        assert float(v) == pytest.approx(float(clean[k]), rel=1e-6, abs=1e-7), k
        if k in e_met:
            assert float(v) == pytest.approx(e_met[k], rel=2e-5, abs=2e-6), k


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kw", [dict(rollout_correction="tis"),
                                dict(policy_loss="gspo", rollout_correction="geo-seq",
                                     rollout_is_threshold=1.5),
                                dict()], ids=["tis", "gspo-geo", "metrics-only"])
def test_compile_fullgraph_with_rollout_logprobs(backend, kw):
    """torch.compile(fullgraph=True) with rollout_logprobs (a correction, a
    sequence-level one with gspo, or the rollout metrics alone): no data-dependent control
    flow in the rollout metrics; the gradient of eager."""
    torch._dynamo.reset()
    inp = seeded_inputs(2, 4, 11, 29)
    roll = inp["old"] + 0.2

    def f(x, tok, old, adv, mask, roll):
        return pk.ppo_loss(x, tok, old, adv, mask, rollout_logprobs=roll, backend=backend, **kw)

    x = inp["full"][:, :4].clone().requires_grad_(True)
    args = (inp["tokens"], inp["old"], inp["adv"], inp["mask"], roll)
    loss, _ = torch.compile(f, fullgraph=True, backend="aot_eager")(x, *args)
    loss.backward()
    y = inp["full"][:, :4].clone().requires_grad_(True)
    f(y, *args)[0].backward()
    torch.testing.assert_close(x.grad, y.grad)


def test_rollout_threshold_order_message():
    """rollout_is_threshold (hi, lo) in the wrong order: the ValueError says hi > lo."""
    d = base_ppo()
    with pytest.raises(ValueError, match="hi > lo"):
        pk.ppo_loss(**d, rollout_logprobs=d["old_logprobs"], rollout_correction="mis",
                    rollout_is_threshold=(2.0, 0.5))


@pytest.mark.parametrize("cap", [None, 1.3])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_areal_decoupled_ppo_is_old_plus_rollout_correction(cap, backend):
    """AReaL's decoupled PPO (ppo_actor_loss_fn with proximal_logprobs): the clip of
    pi_theta / pi_prox times the behaviour weight pi_prox / pi_behave, zeroed where above
    behav_imp_weight_cap, summed over the loss mask / its count. It is ppo_loss with
    old_logprobs = prox, rollout_logprobs = behave and rollout_correction "mis" at the cap
    (no cap: rollout_is_weights = pi_prox / pi_behave), docs/LOSSES.md."""
    g = torch.Generator().manual_seed(9)
    b, t, v = 3, 6, 11
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    tok = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    lp0 = torch.log_softmax(logits, -1).gather(-1, tok[..., None])[..., 0]
    prox = lp0 + 0.2 * torch.randn(b, t, generator=g, dtype=torch.float64)
    behave = prox + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    eps, eps_hi, c = 0.2, 0.28, 3.0
    # AReaL's formula, written out
    x = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1).gather(-1, tok[..., None])[..., 0]
    ratio = torch.where(mask, torch.exp(lp - prox), 0)
    pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps, 1 + eps_hi))
    pg = torch.min(pg, torch.sign(adv) * c * adv)  # the dual clip (c_clip)
    w = torch.exp(prox - behave)
    keep = mask if cap is None else (w <= cap) & mask
    pg = pg * torch.where(keep, w, 0.0)
    want = torch.where(mask, pg, 0).sum() / mask.sum()
    want.backward()
    y = logits.clone().requires_grad_(True)
    kw = dict(clip_eps_low=eps, clip_eps_high=eps_hi, dual_clip_c=c, backend=backend)
    if cap is None:
        kw["rollout_is_weights"] = torch.exp(prox - behave)
    else:
        kw.update(rollout_logprobs=behave, rollout_correction="mis", rollout_is_threshold=cap)
    loss, met = pk.ppo_loss(y, tok, prox, adv, mask, **kw)
    loss.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-12)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-10, atol=1e-14)
    if cap is not None:  # AReaL's behave mask is the kept fraction of the weights
        assert float(met["rollout_masked_frac"]) == pytest.approx(
            float((~keep & mask).sum() / mask.sum()), rel=1e-6)
