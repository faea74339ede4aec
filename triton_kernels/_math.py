"""Per-token PPO math as @triton.jit helpers: the Triton twin of csrc/ppo_math.h.

Every helper mirrors the C++ function of the same name line by line (same clamps, same
tie-breaking, same guards), so the three backends compute one function; the float64 oracle
is ppo_kernels/reference.py. Sources: clipped surrogate, Schulman et al. 2017, eq. 7; dual
clip, Ye et al. 2020, eq. 5; KL estimators k1/k2/k3, Schulman 2020 "Approximating KL
Divergence"; CISPO, MiniMax-M1 technical report (MiniMax 2025), the CISPO objective; SAPO (TRL loss_type="sapo",
verl loss_mode="sapo"); DPPO, Qi et al. 2026, arXiv 2602.04879 (verl dppo_tv / dppo_kl).

The helpers are scalar-agnostic: they work on 0-d values (one token per program) and on
blocks alike. ``ACC`` is the accumulation dtype, ``tl.float32`` or ``tl.float64``.

The vocabulary-wide helpers (block_stats, stats_merge, row_stats, row_grad) are the twins of
csrc/cpu/row_kernels.h and csrc/cuda/row_reduce.cuh: the row statistics (m, rest, t) of
docs/DESIGN.md ("Row statistics"). tl has no expm1 / log1p in every triton version: expm1,
expm1_minus_x and log1p below are written here (no libdevice). The per-token exps (the
ratio, the KL estimators, expm1 beyond its series) use exp_acc, float32 arithmetic within
1e-7 relative; the vocabulary sweeps run in base 2 (d2 = (x - max) inv2, inv2 = log2(e) /
temperature folded once per row) with exp2_sweep, a GPU's ex2.approx.ftz alone
(docs/DESIGN.md, "Precision"), as csrc/cuda/row_reduce.cuh.
"""

import math

import triton
import triton.language as tl

from . import _config

# |log-ratio| beyond this is clamped (ppo_math.h: kLogRatioClamp).
LOG_RATIO_CLAMP = tl.constexpr(20.0)
# The ids of ppo_kernels/spec.py KL_ESTIMATORS and POLICY_LOSSES (csrc/ppo_math.h
# KlEstimator, PolicyLoss; compared by tests/test_spec.py).
KL_K1 = tl.constexpr(0)
KL_K2 = tl.constexpr(1)
KL_K3 = tl.constexpr(2)
KL_ABS = tl.constexpr(3)
KL_K1_PLUS = tl.constexpr(4)  # value of k1, gradient of k2 (verl's straight-through)
KL_K3_PLUS = tl.constexpr(5)  # value of k3, gradient of k2
PG_VANILLA = tl.constexpr(0)  # the token-level policy losses of the fused kernel
PG_CISPO = tl.constexpr(1)
PG_SAPO = tl.constexpr(2)
PG_DPPO_TV = tl.constexpr(3)
PG_DPPO_KL = tl.constexpr(4)
# The slots of the ops' `float[] scalars` (ppo_kernels/spec.py FLOAT_SLOTS, csrc/ppo_math.h
# ppo::slot::Float; compared by tests/test_spec.py): the kernel takes them as float64
# arguments (annotated), gathers them into a tuple FS and reads FS[F_...].
F_CLIP_EPS_LOW = tl.constexpr(0)
F_CLIP_EPS_HIGH = tl.constexpr(1)
F_DUAL_CLIP_C = tl.constexpr(2)
F_KL_COEF = tl.constexpr(3)
F_ENTROPY_COEF = tl.constexpr(4)
F_TEMPERATURE = tl.constexpr(5)
F_GRAD_SCALE = tl.constexpr(6)
F_SAPO_TAU_POS = tl.constexpr(7)
F_SAPO_TAU_NEG = tl.constexpr(8)
# The slots of `int[] codes` (spec.py INT_SLOTS, ppo::slot::Int): the launcher passes each
# as a constexpr of the kernel (POLICY_LOSS, KL_EST, KL_BIAS), so each specialises it.
I_POLICY_LOSS = tl.constexpr(0)
I_KL_ESTIMATOR = tl.constexpr(1)
I_KL_BIAS_CORRECTION = tl.constexpr(2)
# Running under TRITON_INTERPRET=1 (numpy), decided at import as triton.jit decides it.
INTERPRETED = tl.constexpr(_config.INTERPRET)
# 1 / k! for k = 2..12: the coefficients of the e^u - 1 - u series (expm1_minus_x).
_F2 = tl.constexpr(1.0 / math.factorial(2))
_F3 = tl.constexpr(1.0 / math.factorial(3))
_F4 = tl.constexpr(1.0 / math.factorial(4))
_F5 = tl.constexpr(1.0 / math.factorial(5))
_F6 = tl.constexpr(1.0 / math.factorial(6))
_F7 = tl.constexpr(1.0 / math.factorial(7))
_F8 = tl.constexpr(1.0 / math.factorial(8))
_F9 = tl.constexpr(1.0 / math.factorial(9))
_F10 = tl.constexpr(1.0 / math.factorial(10))
_F11 = tl.constexpr(1.0 / math.factorial(11))
_F12 = tl.constexpr(1.0 / math.factorial(12))
# exp_split (Cody and Waite 1980; the split of Cephes expf, Moshier 1989): ln 2 = _LN2_HI +
# _LN2_LO with _LN2_HI = 355/512, 9 significant bits, so n * _LN2_HI is exact for |n| < 2^15.
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# The floor of a dense gradient entry's log2 p (csrc/cuda/row_reduce.cuh dense_grad): keeps
# a * l2 finite for a banned entry (l2 = -inf, p = 0), whose entry is then 0, never NaN.
_L2_FLOOR = tl.constexpr(-2048.0)
_LN2_HI = tl.constexpr(0.693359375)
_LN2_LO = tl.constexpr(-2.1219444005469057e-04)


@triton.jit
def as_acc(x, ACC: tl.constexpr):
    """A float kernel argument (annotated tl.float64) as a 0-d value of dtype ACC.

    Why not ``tl.cast(x, ACC)``: under TRITON_INTERPRET=1 a float argument stays a Python
    float and ``tl.cast`` rounds it through float32 first, which would cost float64 runs
    their precision. Adding it to an ACC zero keeps all 53 bits in both modes, and the final
    cast rounds once (float64 -> float32) when ACC is float32, as the C++ ``T(p.x)`` does.
    """
    return (tl.zeros([], ACC) + x).to(ACC)


@triton.jit
def div_rn(a, b, ACC: tl.constexpr):
    """a / b correctly rounded in ACC: float32 `/` lowers on a GPU to an approximate
    (2-ulp) division, so float32 takes tl.math.div_rn; float64 `/` is IEEE already."""
    if ACC == tl.float64:
        return a / b
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def clampv(x, lo, hi):
    """ppo_math.h clampv: x < lo ? lo : (x > hi ? hi : x); NaN passes through."""
    return tl.where(x < lo, lo, tl.where(x > hi, hi, x))


@triton.jit
def pg_vanilla(rho, clamped, adv, eps_low, eps_high, dual_c, HAS_DUAL: tl.constexpr):
    """ppo_math.h pg_vanilla: the clipped surrogate (Schulman et al. 2017, eq. 7) with the
    dual clip (Ye et al. 2020, eq. 5). Returns (pg, d pg / d logp, rho, d rho / d logp).

    pg = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A); the unclipped branch is the
    active one on ties; dual clip pg = min(pg, -c A) where A < 0 (HAS_DUAL: c > 0 given);
    the gradient is 0 where the clip, the dual clip or the log-ratio clamp is active.
    """
    unclipped = -rho * adv
    clipped = -clampv(rho, 1.0 - eps_low, 1.0 + eps_high) * adv
    unclipped_active = unclipped >= clipped
    pg = tl.where(unclipped_active, unclipped, clipped)
    grad = tl.where(unclipped_active, -rho * adv, 0.0)
    if HAS_DUAL:
        cap = -dual_c * adv
        dual = (adv < 0.0) & (pg > cap)
        pg = tl.where(dual, cap, pg)
        grad = tl.where(dual, 0.0, grad)
    grad = tl.where(clamped, 0.0, grad)
    return pg, grad, rho, tl.where(clamped, 0.0, rho)


@triton.jit
def pg_cispo(logp, rho, clamped, adv, eps_low, eps_high):
    """ppo_math.h pg_cispo (MiniMax-M1 report, 2025): -sg(clip(rho, 1 - eps_low, 1 + eps_high))
    A logp. The clipped ratio is a constant weight, so every token keeps the gradient -w A
    (the log-ratio clamp only bounds w). Returns (pg, d pg / d logp, rho, d rho / d logp)."""
    w = clampv(rho, 1.0 - eps_low, 1.0 + eps_high)
    return -w * adv * logp, -w * adv, rho, tl.where(clamped, 0.0, rho)


@triton.jit
def pg_sapo(rho, clamped, adv, tau_pos, tau_neg):
    """ppo_math.h pg_sapo: the hard clip replaced by a sigmoid gate,
    pg = -(4 / tau) s A, s = 1 / (1 + exp(-tau (rho - 1))), tau = tau_pos where A > 0,
    else tau_neg; d pg / d logp = -4 s (1 - s) rho A, 0 where the log-ratio was clamped;
    1 - s is sigmoid(-z) of its own exp (as 1 - s it cancels where the gate saturates).
    Returns (pg, d pg / d logp, rho, d rho / d logp)."""
    tau = tl.where(adv > 0.0, tau_pos, tau_neg)
    z = tau * (rho - 1.0)
    s = 1.0 / (1.0 + exp_acc(-z))
    s_minus = 1.0 / (1.0 + exp_acc(z))
    grad = tl.where(clamped, 0.0, -4.0 * s * s_minus * rho * adv)
    return -(4.0 / tau) * s * adv, grad, rho, tl.where(clamped, 0.0, rho)


@triton.jit
def log1m_exp(x):
    """ppo_math.h log1m_exp: log(1 - e^x) for x <= 0 (Maechler 2012): log(-expm1(x)) near
    0, log1p(-e^x) below -log 2; -inf at x = 0."""
    near = x > -0.6931471805599453
    # each branch's argument kept finite in the lane the other branch takes
    a = tl.where(near, x, -1.0)
    b = tl.where(near, -1.0, x)
    return tl.where(near, tl.log(0.0 - expm1(a)), log1p(0.0 - exp_acc(b)))


@triton.jit
def dppo_masked(logp, old_logp, adv, eps_low, eps_high, KL: tl.constexpr):
    """DPPO's trust-region mask (Qi et al. 2026, arXiv 2602.04879; verl dppo_tv /
    dppo_kl; csrc/cpu/metrics.cpp dppo_masked, the mask of ppo_math.h pg_dppo): the binary
    TV |p - p_old| (KL: the Bernoulli KL(p_old || p)) beyond its threshold in the direction
    of the advantage: A > 0, p > p_old and D > eps_high, or A <= 0, p < p_old and
    D > eps_low. pg_dppo's mask and the metrics'."""
    pn = exp_acc(logp)
    po = exp_acc(old_logp)
    if KL:  # log-probs above 0 (rounding) count as 0
        lo = tl.where(old_logp < 0.0, old_logp, 0.0)
        ln = tl.where(logp < 0.0, logp, 0.0)
        q_old = 0.0 - expm1(lo)
        tail = tl.where(q_old == 0.0, 0.0, q_old * (log1m_exp(lo) - log1m_exp(ln)))
        div = exp_acc(lo) * (lo - ln) + tail
    else:
        div = tl.where(pn > po, pn - po, po - pn)
    return tl.where(adv > 0.0, (pn > po) & (div > eps_high), (pn < po) & (div > eps_low))


@triton.jit
def pg_dppo(logp, old_logp, rho, clamped, adv, eps_low, eps_high, dual_c,
            HAS_DUAL: tl.constexpr, KL: tl.constexpr):
    """ppo_math.h pg_dppo (DPPO; verl dppo_tv / dppo_kl): the tokens dppo_masked marks get
    no gradient; pg = -M sg(min(rho, c)) A logp, d pg / d logp = -M min(rho, c) A (no cap
    without HAS_DUAL). Returns (pg, d pg / d logp, rho, d rho / d logp)."""
    masked = dppo_masked(logp, old_logp, adv, eps_low, eps_high, KL)
    w = rho
    if HAS_DUAL:
        w = tl.where(rho > dual_c, dual_c, rho)
    w = tl.where(masked, 0.0, w)
    return -w * adv * logp, -w * adv, rho, tl.where(clamped, 0.0, rho)


@triton.jit
def pg_term(logp, old_logp, adv, eps_low, eps_high, dual_c, tau_pos, tau_neg,
            HAS_DUAL: tl.constexpr, POLICY_LOSS: tl.constexpr):
    """Policy-gradient term of one token: (pg, d pg / d logp, rho, d rho / d logp).
    ppo_math.h pg_term.

    d = clamp(logp - old_logp, -20, 20), rho = exp(d), then the formula of POLICY_LOSS
    (PG_VANILLA, PG_CISPO, PG_SAPO, PG_DPPO_TV, PG_DPPO_KL); d rho / d logp is rho, or 0 where the log-ratio was
    clamped. All inputs are of the accumulation dtype.
    """
    d_raw = logp - old_logp
    clamped = (d_raw < -LOG_RATIO_CLAMP) | (d_raw > LOG_RATIO_CLAMP)
    rho = exp_acc(clampv(d_raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if POLICY_LOSS == PG_CISPO:
        pg, grad, rho, dratio = pg_cispo(logp, rho, clamped, adv, eps_low, eps_high)
    elif POLICY_LOSS == PG_SAPO:
        pg, grad, rho, dratio = pg_sapo(rho, clamped, adv, tau_pos, tau_neg)
    elif POLICY_LOSS == PG_DPPO_TV:
        pg, grad, rho, dratio = pg_dppo(logp, old_logp, rho, clamped, adv, eps_low, eps_high,
                                        dual_c, HAS_DUAL, False)
    elif POLICY_LOSS == PG_DPPO_KL:
        pg, grad, rho, dratio = pg_dppo(logp, old_logp, rho, clamped, adv, eps_low, eps_high,
                                        dual_c, HAS_DUAL, True)
    else:
        pg, grad, rho, dratio = pg_vanilla(rho, clamped, adv, eps_low, eps_high, dual_c,
                                           HAS_DUAL)
    return pg, grad, rho, dratio


@triton.jit
def exp_split(x):
    """float32 x as e^x = (2^a 2^b)(1 + q): the Cody-Waite reduction x = n ln 2 + r,
    n = floor(x log2(e) + 1/2), |r| <= ln(2) / 2 (r = (x - n _LN2_HI) - n _LN2_LO: the first
    difference is exact), q = e^r - 1 by its Taylor series to r^7 / 7! (truncation below
    1e-8 relative), and 2^n = 2^a 2^b (a = n >> 1, b = n - a) as two normal powers of two
    built from their exponent bits, so that neither over- nor underflows on its own. x is
    clamped to [-105, 89], where e^x rounds to 0 and overflows; a NaN lane computes on 0
    (the callers return the NaN). Returns (2^a, 2^b, q).

    Why: fp32 tl.exp lowers on NVIDIA GPUs to ex2.approx.f32 of the rounded product
    x log2(e), whose rounding alone is up to 2^-24 |x log2(e)| ln 2 relative (9e-7 at
    |x| = 20, 4e-6 at 80). The per-token terms the contract bounds to 5e-7 (the ratio,
    the KL estimators, expm1) use this instead: only exact float32 products and sums, the
    same on a GPU (where fused multiply-adds only remove roundings) and in the interpreter.
    """
    xc = tl.where(x != x, 0.0, clampv(x, -105.0, 89.0))
    n = tl.floor(xc * _LOG2E + 0.5)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = _F6 + r * _F7
    p = _F5 + r * p
    p = _F4 + r * p
    p = _F3 + r * p
    p = _F2 + r * p
    q = r + (r * r) * p
    ni = n.to(tl.int32)
    a = ni >> 1
    sa = ((a + 127) << 23).to(tl.float32, bitcast=True)
    sb = ((ni - a + 127) << 23).to(tl.float32, bitcast=True)
    return sa, sb, q


@triton.jit
def exp_acc(x):
    """e^x for the once-per-token terms: float32 within 1e-7 relative over |x| <= 88
    (exp_split; tl.exp's ex2.approx is for the vocabulary sweeps), float64 tl.exp (libdevice
    __nv_exp on a GPU). NaN stays NaN, -inf gives 0, +inf gives inf."""
    if x.dtype == tl.float64:
        return tl.exp(x)
    else:
        sa, sb, q = exp_split(x)
        return tl.where(x != x, x, ((1.0 + q) * sa) * sb)


@triton.jit
def _expm1_big(u):
    """(e^u - 1, e^u - 1 - u) for |u| >= 1, without tl.exp's approximation in float32:
    with e^u = s (1 + q) (exp_split), e^u - 1 = (s - 1) + s q and e^u - 1 - u =
    ((s - 1) - u) + s q, s - 1 exact for the s = 2^n a float32 |u| <= 16 gives. Beyond
    u = 88, where s may overflow, e^u - 1 rounds to e^u."""
    if u.dtype == tl.float64:
        e = tl.exp(u) - 1.0
        return e, e - u
    else:
        sa, sb, q = exp_split(u)
        s = sa * sb
        sq = s * q
        em1 = (s - 1.0) + sq
        em1_u = ((s - 1.0) - u) + sq
        huge = u > 88.0
        e = exp_acc(u)
        em1 = tl.where(huge, e, em1)
        em1_u = tl.where(huge, e - u, em1_u)
        return tl.where(u != u, u, em1), tl.where(u != u, u, em1_u)


@triton.jit
def expm1_minus_x(u):
    """ppo_math.h expm1_minus_x: e^u - 1 - u without cancellation.

    |u| < cut: the Taylor series u^2 (1/2! + u (1/3! + ... + u / 12!)) by Horner (11
    coefficients, as ppo_math.h; cut = 1 in float32, where the truncation stays below
    5e-10 relative, and 0.1 in float64, below 1e-20); beyond, (e^u - 1) - u, where nothing
    cancels badly (_expm1_big: in float32 without tl.exp). Works on 0-d values and blocks.
    """
    p = _F11 + u * _F12
    p = _F10 + u * p
    p = _F9 + u * p
    p = _F8 + u * p
    p = _F7 + u * p
    p = _F6 + u * p
    p = _F5 + u * p
    p = _F4 + u * p
    p = _F3 + u * p
    p = _F2 + u * p
    if u.dtype == tl.float64:
        small = (u > -0.1) & (u < 0.1)
    else:
        small = (u > -1.0) & (u < 1.0)
    _, big = _expm1_big(u)
    return tl.where(small, u * u * p, big)


@triton.jit
def expm1(u):
    """e^u - 1 (ppo_math.h ppo_expm1; tl has no expm1 in every triton version).

    |u| < 1: u + expm1_minus_x(u), a few ulp: the two terms have the same sign for u > 0,
    and for u < 0 the second is below |u| / 2, so the sum keeps at least half of |u|;
    beyond, e^u - 1 (_expm1_big: in float32 without tl.exp).
    """
    small = (u > -1.0) & (u < 1.0)
    big, _ = _expm1_big(u)
    return tl.where(small, u + expm1_minus_x(u), big)


@triton.jit
def log1p(r):
    """log(1 + r) for r >= -1 (the row's log_sum, spec section 2), without libdevice.

    Kahan's formula (Goldberg 1991, "What every computer scientist should know about
    floating-point arithmetic", Theorem 4): with u = fl(1 + r), log1p(r) = r where u == 1,
    else log(u) * (r / (u - 1)); the ratio corrects the rounding of 1 + r, so the result
    keeps r's relative digits (a few ulp) for every r, e.g. rest = 1e-12 in float32.
    tl.log lowers to libdevice's accurate __nv_logf / __nv_log. Why not
    tl.extra.libdevice.log1p: its import path moved between triton releases, and this
    formula is exact enough everywhere. r = -1 (an all -inf row) gives -inf, as log1p.
    """
    u = 1.0 + r
    tiny = u == 1.0
    # the select on the divisor keeps the discarded lane free of 0 / 0 as well
    return tl.where(tiny, r, tl.log(u) * (r / tl.where(tiny, 1.0, u - 1.0)))


@triton.jit
def kl_k3(delta):
    """k3 = e^-c - 1 + c = expm1_minus_x(-c), c = clamp(delta, -20, 20), and its derivative
    1 - e^-c = -expm1(-c) (0 where clamped): both without the cancellation of
    exp(-c) - 1 + c at small c (5% off at 1e-3, 0 below 1e-4 in float32)."""
    clamped = (delta < -LOG_RATIO_CLAMP) | (delta > LOG_RATIO_CLAMP)
    c = clampv(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return expm1_minus_x(-c), tl.where(clamped, 0.0, 0.0 - expm1(-c))


@triton.jit
def kl_term(delta, KL_EST: tl.constexpr):
    """KL estimate from one sample, delta = logp - ref_logp, and d kl / d delta.

    ppo_math.h kl_term: k1 delta | k2 delta^2 / 2 | abs |delta| (derivative sign(delta))
    | k3 (kl_k3; the only estimator with an exp to guard) | k1+ the value of k1 with the
    derivative of k2 (delta) | k3+ the value of k3 with the derivative delta.
    """
    if KL_EST == KL_K1:
        kl = delta
        dkl = tl.full(delta.shape, 1.0, delta.dtype)
    elif KL_EST == KL_K2:
        kl = 0.5 * delta * delta
        dkl = delta
    elif KL_EST == KL_ABS:
        kl = tl.where(delta < 0.0, -delta, delta)
        dkl = tl.where(delta > 0.0, 1.0, tl.where(delta < 0.0, -1.0, 0.0)).to(delta.dtype)
    elif KL_EST == KL_K1_PLUS:
        kl = delta
        dkl = delta
    elif KL_EST == KL_K3_PLUS:
        kl, _ = kl_k3(delta)
        dkl = delta
    else:  # KL_K3
        kl, dkl = kl_k3(delta)
    return kl, dkl


@triton.jit
def token_loss(logp, ent, old_logp, adv, ref_logp, is_w, w, w_ent, FS, ACC: tl.constexpr,
               KL_EST: tl.constexpr, HAS_REF: tl.constexpr, HAS_DUAL: tl.constexpr,
               POLICY_LOSS: tl.constexpr, KL_BIAS: tl.constexpr):
    """ppo_math.h token_loss: (loss, dlogp, dent) of one token.

    loss  = is_w * pg + kl_coef * kl (* rho) - entropy_coef * H   (kl only with HAS_REF)
    dlogp = w * (is_w * d pg / d logp + kl_coef * d kl (rho) / d logp)   d loss_agg / d logp
    dent  = -w_ent * entropy_coef                                          d loss_agg / d H
    w is the token's loss_agg_mode weight, w_ent its entropy_agg_mode weight. KL_BIAS
    (kl_bias_correction): the KL term is kl * rho with rho differentiable,
    d / d logp = rho d kl / d delta + kl d rho / d logp. FS: the options' scalars in slot
    order (F_*), float64 kernel arguments, each rounded once to ACC here.
    """
    eps_low, eps_high = as_acc(FS[F_CLIP_EPS_LOW], ACC), as_acc(FS[F_CLIP_EPS_HIGH], ACC)
    dual_c, kl_coef = as_acc(FS[F_DUAL_CLIP_C], ACC), as_acc(FS[F_KL_COEF], ACC)
    entropy_coef = as_acc(FS[F_ENTROPY_COEF], ACC)
    tau_pos, tau_neg = as_acc(FS[F_SAPO_TAU_POS], ACC), as_acc(FS[F_SAPO_TAU_NEG], ACC)
    pg, dpg, rho, dratio = pg_term(logp, old_logp, adv, eps_low, eps_high, dual_c, tau_pos,
                                   tau_neg, HAS_DUAL, POLICY_LOSS)
    loss = is_w * pg - entropy_coef * ent
    dlogp = is_w * dpg
    if HAS_REF:
        kl, dkl = kl_term(logp - ref_logp, KL_EST)
        if KL_BIAS:
            loss += kl_coef * kl * rho
            dlogp += kl_coef * (rho * dkl + kl * dratio)
        else:
            loss += kl_coef * kl
            dlogp += kl_coef * dkl
    # a NaN loss must reach the gradient too (ppo_math.h: the selects would hide it)
    dlogp = tl.where(loss != loss, loss, dlogp)
    return loss, w * dlogp, -w_ent * entropy_coef


@triton.jit
def exp2_sweep(x, ACC: tl.constexpr):
    """2^x per vocabulary entry. float32 on a GPU: the PTX ex2.approx.ftz.f32, MUFU.EX2
    alone (2 ulp; a result below 2^-126 is 0: no probability that small changes a float32
    sum whose largest term is 1), without the denormal fix-up (3 instructions) that
    tl.exp2 puts around it; csrc/cuda/row_reduce.cuh vexp2 is the same instruction.
    float64, and the interpreter (numpy, which has no PTX): tl.exp2."""
    if INTERPRETED or ACC == tl.float64:
        return tl.exp2(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def sweep_scale(inv_temp):
    """inv2 = log2(e) / temperature, the base-2 scale of the sweeps (d2 = (x - max) inv2,
    2^d2 = e^d), rounded once and capped at the dtype's largest finite value (a temperature
    near 0 must not make 0 * inf = NaN on the top entry)."""
    if inv_temp.dtype == tl.float64:
        return tl.minimum(inv_temp * _LOG2E, 1.7976931348623157e308)
    else:
        return tl.minimum(inv_temp * _LOG2E, 3.4028234663852886e38)


@triton.jit
def dense_coef(entropy, dlogp, dent, inv_temp):
    """The row constants (a, b) of a dense gradient entry, d loss / d logits_v =
    p_v (a l2_v + b) with l2_v = log2 p_v: ppo_math.h dlogit_dense, -p_v (dlogp + dent
    (log p_v + H)) inv_temp, with log p_v = ln2 l2_v folded in once per row
    (csrc/cuda/row_reduce.cuh dense_coef)."""
    return 0.0 - (dent * _LN2) * inv_temp, 0.0 - (dlogp + dent * entropy) * inv_temp


@triton.jit
def dlogit_token(logp, p, entropy, dlogp, dent):
    """ppo_math.h dlogit_token: the token's own entry, dlogp (1 - p) - dent p (log p + H),
    with 1 - p = -expm1(log p): a confident token (p -> 1) keeps its digits and V = 1
    gives exactly 0; a token whose logit is -inf (p = 0) gets dlogp, never NaN."""
    ent_part = tl.where(p == 0.0, 0.0, p * dent * (logp + entropy))
    return 0.0 - dlogp * expm1(logp) - ent_part


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def block_stats(x, inv2, NEED_ENT: tl.constexpr):
    """Partial row statistics (m, rest, t) of one block of raw logits x (ACC; lanes past V
    hold -inf), spec section 2:

    m = max x (raw units), d2 = (x - m) inv2 (base 2, sweep_scale; exactly 0 on the
    entries equal to m), rest = sum 2^d2 - 1 computed without adding the top entries' 1s
    (their 2^0 is 1 exactly: they are counted instead), t = ln2 sum 2^d2 d2 = sum e^d d
    in natural units (0 unless NEED_ENT), the term as one multiply-add of max(d2, lowest)
    (a banned entry's d2 = -inf has 2^d2 = 0: 0 * lowest, never 0 * -inf = NaN).
    An all -inf block is the empty state (-inf, -1, 0): its shift is 0, not -inf - -inf.
    A NaN entry makes rest NaN (tl.max skips NaN, the sums do not): loud, never dropped.

    Two block reductions: the max, then the three sums at once (one tl.reduce of a tuple:
    one exchange through shared memory, where three tl.sum would take three).
    """
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    d2 = (x - m_safe) * inv2
    e = exp2_sweep(d2, x.dtype)
    top = d2 == 0.0
    if NEED_ENT:
        tt = e * tl.maximum(d2, -3.4028234663852886e38)
    else:
        tt = tl.zeros_like(e)
    r, ties, t2 = tl.reduce((tl.where(top, 0.0, e), top.to(x.dtype), tt), 0, _add3)
    # (ties - 1) first: an exact small integer, so the tiny sum is never added to a 1
    return m, r + (ties - 1.0), t2 * _LN2


@triton.jit
def stats_merge(m_a, r_a, t_a, m_b, r_b, t_b, inv_temp):
    """(m, rest, t) of the union of two disjoint sets of entries (spec section 2).

    With hi the side of the larger max and lo the other: dm = (m_lo - m_hi) inv_temp <= 0,
    al = exp(dm) <= 1, s_lo = 1 + r_lo (no cancellation issue: al * s_lo <= al);
    rest = r_hi + al s_lo, t = t_hi + al (t_lo + dm s_lo); equal maxes add the rests
    directly, r_a + r_b + 1, so that a tiny rest is never rounded into 1 + rest.
    al == 0 (a side at finfo.min, or empty, under a normal max: dm is then huge
    or -inf and dm * s_lo = -inf) contributes exactly 0 to t, never 0 * inf = NaN. An
    empty side (m = -inf, rest = -1) gets dm = -inf without forming -inf - -inf, so merging
    it changes nothing, and two empty sides stay empty.

    The shift is exact before it is rounded: dm is formed in float64 and al = exp_acc(dm)
    (1 + dm_err), dm_err the float32 rounding error of dm. A float32 dm is off by up to
    2^-24 |dm| (9.5e-7 at |dm| = 16), one error shared by every entry of the low side, so
    a confident row (the mass in blocks 16-30 below the top) had logp and H 3x less
    accurate than its entries' own exps allow (tests/test_triton_precision.py): the
    entries' d = x - (block max) are small, and nearly exact, for the entries that carry
    the mass. exp_acc, not tl.exp: a GPU's ex2.approx of the rounded dm log2(e) would add
    the same kind of error (9e-7 at |dm| = 20). Once per merge (per BLOCK_V entries): no
    cost in the sweep.
    """
    a_hi = m_a >= m_b
    m_hi = tl.where(a_hi, m_a, m_b)
    m_lo = tl.where(a_hi, m_b, m_a)
    r_hi = tl.where(a_hi, r_a, r_b)
    r_lo = tl.where(a_hi, r_b, r_a)
    t_hi = tl.where(a_hi, t_a, t_b)
    t_lo = tl.where(a_hi, t_b, t_a)
    # an empty low side: -inf - 0 = -inf, never -inf - -inf
    sub = tl.where(m_lo == float("-inf"), 0.0, m_hi)
    # the shift in float64 (exact for the difference of two float32 maxes a float32 al can
    # see), then rounded to ACC with its rounding error kept: al = e^dm (1 + dm_err)
    dm64 = (m_lo.to(tl.float64) - sub.to(tl.float64)) * inv_temp.to(tl.float64)
    dm = dm64.to(m_hi.dtype)
    # 0 where the rounded shift is not finite (an empty side, an inf or NaN max, or a shift
    # past the float32 range, as finfo.min - m at temperature 0.7): al is 0, 1 or NaN alone
    dm_err = tl.where(dm - dm == 0.0, (dm64 - dm.to(tl.float64)).to(m_hi.dtype), 0.0)
    al = exp_acc(dm) * (1.0 + dm_err)
    s_lo = 1.0 + r_lo
    rest = tl.where(dm == 0.0, r_hi + r_lo + 1.0, r_hi + al * s_lo)
    # the C1 guard; selecting the shift too keeps even the discarded lane finite
    shift = tl.where(al > 0.0, dm, 0.0)
    t = t_hi + tl.where(al > 0.0, al * (t_lo + shift * s_lo), 0.0)
    return m_hi, rest, t


@triton.jit
def row_stats(in_row, V, inv_temp, ACC: tl.constexpr, NEED_ENT: tl.constexpr,
              BLOCK_V: tl.constexpr):
    """One pass over a row of V raw logits x: (row_max, log_sum, H) in ACC (spec 2).

    row_max = max x (0 for an all -inf row), d_v = (x_v - row_max) inv_temp,
    log_sum = log sum exp(d) = log1p(rest), H = log_sum - t / (1 + rest) (0 unless
    NEED_ENT), with (m, rest, t) merged block by block (block_stats, stats_merge).
    Keeping the non-top mass `rest` apart keeps the digits of a confident row: when
    1 - p is below float32 epsilon, log(1 + rest) would round rest away (logp = 0,
    entropy off by percents); log1p(rest) keeps them down to 1 - p ~ 1e-12. The max is
    kept in raw units and subtracted BEFORE scaling, so the max entry has d = 0 exactly at
    any temperature and logp = d_token - log_sum loses nothing at large |x| (as
    csrc/cpu/row_kernels.h). All -inf rows give rest = -1 and NaN logp / H (as before).

    The blocks are merged in a fixed order set by V and BLOCK_V alone: a row's bits never
    depend on the other rows of the batch.
    """
    offs = tl.arange(0, BLOCK_V)
    inv2 = sweep_scale(inv_temp)
    m = tl.full([], float("-inf"), ACC)
    rest = tl.full([], -1.0, ACC)
    t = tl.zeros([], ACC)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(in_row + cols, mask=cols < V, other=float("-inf")).to(ACC)
        m_b, r_b, t_b = block_stats(x, inv2, NEED_ENT)
        m, rest, t = stats_merge(m, rest, t, m_b, r_b, t_b, inv_temp)
    return stats_final(m, rest, t, NEED_ENT)


@triton.jit
def stats_final(m, rest, t, NEED_ENT: tl.constexpr):
    """(row_max, log_sum, H) of a row's merged (m, rest, t) (row_stats)."""
    row_max = tl.where(m == float("-inf"), 0.0, m)
    log_sum = log1p(rest)
    if NEED_ENT:
        ent = log_sum - t / (1.0 + rest)
    else:
        ent = tl.zeros_like(rest)
    return row_max, log_sum, ent


@triton.jit
def row_load(in_row, V, ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    """A whole row (V <= BLOCK_V) as ACC, -inf past V: the one tile that tile_stats and
    tile_grad share, so the row is read from memory once for both."""
    cols = tl.arange(0, BLOCK_V)
    return tl.load(in_row + cols, mask=cols < V, other=float("-inf")).to(ACC)


@triton.jit
def tile_stats(x, inv_temp, NEED_ENT: tl.constexpr):
    """row_stats of a row held whole in x (row_load): its one block merged into the empty
    state, as row_stats merges its first block, so the bits are those of row_stats with
    the same BLOCK_V."""
    m_b, r_b, t_b = block_stats(x, sweep_scale(inv_temp), NEED_ENT)
    empty_m = tl.full([], float("-inf"), x.dtype)
    empty_r = tl.full([], -1.0, x.dtype)
    m, rest, t = stats_merge(empty_m, empty_r, tl.zeros([], x.dtype), m_b, r_b, t_b,
                             inv_temp)
    return stats_final(m, rest, t, NEED_ENT)


@triton.jit
def token_logit(in_row, tok, V, ACC: tl.constexpr):
    """x[token] of a row, in ACC. An out-of-range id (the Python layer rejects those on
    valid positions) is never read out of bounds: it gives NaN, never garbage from memory.
    Loaded before the row's first sweep, so its latency hides behind that sweep."""
    ok = (tok >= 0) & (tok < V)
    return tl.load(in_row + tok, mask=ok, other=float("nan")).to(ACC)


@triton.jit
def token_logp(x_tok, row_max, log_sum, inv_temp):
    """logp of the row's token, (x[token] - row_max) * inv_temp - log_sum (row_stats)."""
    return (x_tok - row_max) * inv_temp - log_sum


@triton.jit
def token_col(tok, V):
    """The token id as the int32 column the gradient sweep compares against (cast once,
    not per lane); -1 (no column) for an out-of-range id."""
    return tl.where((tok >= 0) & (tok < V), tok, -1).to(tl.int32)


@triton.jit
def row_grad(in_row, out_row, V, tok_col, logp_tok, row_max, log_sum, ent, dlogp, dent,
             inv_temp, ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    """Second sweep over a row: out_row[v] = d loss / d logits_v in out_row's dtype, from
    log p_v = (x_v - row_max) inv_temp - log_sum (row_stats), dlogp = d loss / d logp and
    dent = d loss / d H of the row's token (column tok_col, logp logp_tok).

    Dense entries are grad_block's p_v (a l2_v + b); the token's entry is computed once, as
    a scalar, by dlogit_token and put in its lane by a select. A banned entry (p_v = 0,
    also the lanes past V) gets exactly 0, never 0 * inf. dlogp == dent == 0 (a clipped
    token without KL/entropy terms, or weight 0) skips the sweep: the row is all zeros.

    The blocks go from the last to the first: the first sweep ended on the last blocks,
    so they are the likeliest still to be in L1/L2. in_row and out_row may be the same
    row (in-place backward): each block is read before it is written, by the same lanes,
    and the token's logit was read before the first sweep.
    """
    if (dlogp == 0.0) & (dent == 0.0):
        row_zero(out_row, V, BLOCK_V)
    else:
        k = grad_consts(logp_tok, row_max, log_sum, ent, dlogp, dent, inv_temp)
        offs = tl.arange(0, BLOCK_V)
        nblk = tl.cdiv(V, BLOCK_V)
        for i in range(0, nblk):
            cols = (nblk - 1 - i) * BLOCK_V + offs
            inb = cols < V
            x = tl.load(in_row + cols, mask=inb, other=float("-inf")).to(ACC)
            g = grad_block(x, cols, tok_col, k)
            tl.store(out_row + cols, round_to(g, out_row.dtype.element_ty), mask=inb)


@triton.jit
def tile_grad(x, out_row, V, tok_col, logp_tok, row_max, log_sum, ent, dlogp, dent,
              inv_temp, BLOCK_V: tl.constexpr):
    """row_grad of a row held whole in x (row_load): no second read of the row, the same
    bits as row_grad with the same BLOCK_V."""
    cols = tl.arange(0, BLOCK_V)
    inb = cols < V
    if (dlogp == 0.0) & (dent == 0.0):
        tl.store(out_row + cols, tl.zeros([BLOCK_V], out_row.dtype.element_ty), mask=inb)
    else:
        k = grad_consts(logp_tok, row_max, log_sum, ent, dlogp, dent, inv_temp)
        g = grad_block(x, cols, tok_col, k)
        tl.store(out_row + cols, round_to(g, out_row.dtype.element_ty), mask=inb)


@triton.jit
def grad_consts(logp_tok, row_max, log_sum, ent, dlogp, dent, inv_temp):
    """The per-row constants of grad_block: (row_max, inv2, log2 sum, a, b, the token's
    entry times inv_temp), computed once per row."""
    a, b = dense_coef(ent, dlogp, dent, inv_temp)
    g_tok = dlogit_token(logp_tok, exp_acc(logp_tok), ent, dlogp, dent) * inv_temp
    return row_max, sweep_scale(inv_temp), log_sum * _LOG2E, a, b, g_tok


@triton.jit
def grad_block(x, cols, tok_col, k):
    """d loss / d logits of a block of raw logits x (ACC) at columns cols: p_v (a l2 + b)
    with l2 = (x - row_max) inv2 - log2 sum = log2 p_v (csrc/cuda/row_reduce.cuh
    dense_grad; l2 floored at -2048 so that a banned entry's p_v = 0 gives 0, never NaN),
    the token's column the precomputed scalar. k: grad_consts."""
    row_max, inv2, ls2, a, b, g_tok = k
    l2 = (x - row_max) * inv2 - ls2
    g = exp2_sweep(l2, x.dtype) * (a * tl.maximum(l2, _L2_FLOOR) + b)
    return tl.where(cols == tok_col, g_tok, g)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """x (ACC) rounded to nearest-even into DTYPE, the dtype of a gradient store.

    A GPU rounds float32 -> bfloat16 to nearest (cvt.rn.bf16.f32). The triton interpreter
    truncates instead (a -0.3% mean bias over a gradient, which
    tests/test_autograd_backward.py sees), so there the bits are rounded by hand: add
    0x7FFF plus the lowest kept bit, keep the high half (NaN passes through the plain cast).
    """
    if INTERPRETED and DTYPE == tl.bfloat16:
        x32 = x.to(tl.float32)
        bits = x32.to(tl.uint32, bitcast=True)
        high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        y = high.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x32 != x32, x32.to(tl.bfloat16), y)
    else:
        return x.to(DTYPE)


@triton.jit
def row_zero(out_row, V, BLOCK_V: tl.constexpr):
    """Zero one gradient row (masked positions and positions t >= T)."""
    offs = tl.arange(0, BLOCK_V)
    zero = tl.zeros([BLOCK_V], out_row.dtype.element_ty)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        tl.store(out_row + cols, zero, mask=cols < V)
