"""Per-token PPO math as @triton.jit helpers: the Triton twin of csrc/ppo_math.h.

Every helper mirrors the C++ function of the same name line by line (same clamps, same
tie-breaking, same guards), so the three backends compute one function; the float64 oracle
is ppo_kernels/reference.py. Sources: clipped surrogate, Schulman et al. 2017, eq. 7; dual
clip, Ye et al. 2020, eq. 5; KL estimators k1/k2/k3, Schulman 2020 "Approximating KL
Divergence".

The helpers are scalar-agnostic: they work on 0-d values (one token per program) and on
blocks alike. ``ACC`` is the accumulation dtype, ``tl.float32`` or ``tl.float64``.
"""

import triton
import triton.language as tl

# |log-ratio| beyond this is clamped (ppo_math.h: kLogRatioClamp).
LOG_RATIO_CLAMP = tl.constexpr(20.0)
# Matches csrc/ppo_math.h KlEstimator and the integer the Python layer passes.
KL_K1 = tl.constexpr(0)
KL_K2 = tl.constexpr(1)
KL_K3 = tl.constexpr(2)
KL_ABS = tl.constexpr(3)


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
def clampv(x, lo, hi):
    """ppo_math.h clampv: x < lo ? lo : (x > hi ? hi : x); NaN passes through."""
    return tl.where(x < lo, lo, tl.where(x > hi, hi, x))


@triton.jit
def pg_term(logp, old_logp, adv, eps_low, eps_high, dual_c, HAS_DUAL: tl.constexpr):
    """Clipped surrogate of one token: (pg, d pg / d logp, rho). ppo_math.h pg_term.

    d = clamp(logp - old_logp, -20, 20), rho = exp(d);
    pg = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A); the unclipped branch is the
    active one on ties; dual clip pg = min(pg, -c A) where A < 0 (HAS_DUAL: c > 0 given);
    the gradient is 0 where the clip, the dual clip or the log-ratio clamp is active.
    All inputs are of the accumulation dtype.
    """
    d_raw = logp - old_logp
    clamped = (d_raw < -LOG_RATIO_CLAMP) | (d_raw > LOG_RATIO_CLAMP)
    rho = tl.exp(clampv(d_raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
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
    return pg, grad, rho


@triton.jit
def kl_term(delta, KL_EST: tl.constexpr):
    """KL estimate from one sample, delta = logp - ref_logp, and d kl / d delta.

    ppo_math.h kl_term: k1 delta | k2 delta^2 / 2 | abs |delta| (derivative sign(delta))
    | k3 exp(-c) - 1 + c with c = clamp(delta, -20, 20) (derivative 0 where clamped).
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
    else:  # KL_K3: the only estimator with an exp to guard
        clamped = (delta < -LOG_RATIO_CLAMP) | (delta > LOG_RATIO_CLAMP)
        c = clampv(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        e = tl.exp(-c)
        kl = e - 1.0 + c
        dkl = tl.where(clamped, 0.0, 1.0 - e)
    return kl, dkl


@triton.jit
def token_loss(logp, ent, old_logp, adv, ref_logp, is_w, w, eps_low, eps_high, dual_c,
               kl_coef, entropy_coef, KL_EST: tl.constexpr, HAS_REF: tl.constexpr,
               HAS_DUAL: tl.constexpr):
    """ppo_math.h token_loss: (loss, dlogp, dent) of one token.

    loss  = is_w * pg + kl_coef * kl - entropy_coef * H   (kl only with HAS_REF)
    dlogp = w * (is_w * d pg / d logp + kl_coef * d kl / d delta)   d loss_agg / d logp
    dent  = -w * entropy_coef                                          d loss_agg / d H
    """
    pg, dpg, rho = pg_term(logp, old_logp, adv, eps_low, eps_high, dual_c, HAS_DUAL)
    loss = is_w * pg - entropy_coef * ent
    dlogp = is_w * dpg
    if HAS_REF:
        kl, dkl = kl_term(logp - ref_logp, KL_EST)
        loss += kl_coef * kl
        dlogp += kl_coef * dkl
    return loss, w * dlogp, -w * entropy_coef


@triton.jit
def dlogit(z, lse, ent, dlogp, dent, inv_temp, is_token):
    """ppo_math.h dlogit, on a block of z = logits / temperature:

    (onehot_v * dlogp - p_v * (dlogp + dent * (log p_v + H))) / temperature, the token's
    own entry computed as in dlogit_token,
    p_v = exp(z_v - lse). A banned entry (z_v = -inf) has p_v = 0 and gets exactly 0,
    never 0 * inf = NaN; so do the out-of-range lanes, which load as -inf.
    """
    logp_raw = z - lse
    pv = tl.exp(logp_raw)
    # log p_v is -inf where p_v == 0: zero it first so no lane ever forms 0 * inf
    logp_v = tl.where(pv == 0.0, 0.0, logp_raw)
    g = -pv * (dlogp + dent * (logp_v + ent))
    # the token's entry, ppo_math.h dlogit_token: dlogp (1 - p) with 1 - p = -expm1(log p)
    # (a Taylor series near 0, where 1 - exp would cancel; exact 0 for V = 1)
    x = logp_raw
    series = -x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))))
    one_minus_p = tl.where(x > -0.1, series, 1.0 - pv)
    g_tok = dlogp * one_minus_p - pv * dent * (logp_v + ent)
    g = tl.where(is_token, g_tok, g)
    return g * inv_temp


@triton.jit
def row_stats(in_row, V, inv_temp, ACC: tl.constexpr, NEED_ENT: tl.constexpr,
              BLOCK_V: tl.constexpr):
    """One pass over a row of V logits x: (xmax, log_s, lse, H), in ACC, of
    z = x * inv_temp, with d_v = (x_v - xmax) * inv_temp, s = sum exp(d_v),
    log_s = log s, lse = xmax * inv_temp + log_s.

    Online over blocks of BLOCK_V (V need not be a multiple): the running max is kept in
    raw logit units and subtracted BEFORE scaling, so the max entry gets d = 0 exactly at
    any temperature and logp = d_token - log_s keeps the digits that z - lse would lose
    when |z| is large (as csrc/cpu/row_kernels.h). For the entropy,
    t = sum exp(d) d <= 0, H = log s - t / s with no cancellation between large numbers.
    When the max moves from m to m', the old sums are rescaled by
    alpha = exp((m - m') inv_temp), and t also picks up s (m - m') inv_temp.
    -inf entries (banned tokens; also the lanes past V) have exp = 0 and add nothing;
    while every entry so far is -inf, a shift of 0 keeps exp() away from -inf - -inf.
    """
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), ACC)
    s = tl.zeros([], ACC)
    t = tl.zeros([], ACC)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(in_row + cols, mask=cols < V, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        shift = (m - m_safe) * inv_temp
        alpha = tl.exp(shift)
        d = (x - m_safe) * inv_temp
        e = tl.exp(d)
        if NEED_ENT:
            dz = tl.where(e > 0.0, d, 0.0)
            t = alpha * (t + s * tl.where(s > 0.0, shift, 0.0)) + tl.sum(e * dz, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s)
    xmax = tl.where(m == float("-inf"), 0.0, m)
    lse = xmax * inv_temp + log_s
    if NEED_ENT:
        ent = log_s - t / s
    else:
        ent = tl.zeros([], ACC)
    return xmax, log_s, lse, ent


@triton.jit
def token_logp(in_row, tok, V, inv_temp, xmax, log_s, ACC: tl.constexpr):
    """logp of the row's token, (x[token] - xmax) * inv_temp - log_s (see row_stats). An
    out-of-range id (the Python layer rejects those on valid positions) is never read out
    of bounds: it gives NaN, never garbage from memory."""
    ok = (tok >= 0) & (tok < V)
    x = tl.load(in_row + tok, mask=ok, other=float("nan")).to(ACC)
    return (x - xmax) * inv_temp - log_s


@triton.jit
def row_grad(in_row, out_row, V, tok, xmax, log_s, ent, dlogp, dent, inv_temp,
             ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    """Second sweep over a row: out_row[v] = dlogit of d_v = (x_v - xmax) * inv_temp with
    log_s (row_stats; log p_v = d_v - log_s keeps its digits at large |z|; a caller that
    only has the lse passes xmax = 0, log_s = lse), in out_row's dtype.

    The blocks go from the last to the first: the first sweep ended on the last blocks,
    so they are the likeliest still to be in L1/L2. in_row and out_row may be the same
    row (in-place backward): each block is read before it is written, by the same lanes.
    """
    offs = tl.arange(0, BLOCK_V)
    nblk = tl.cdiv(V, BLOCK_V)
    for i in range(0, nblk):
        cols = (nblk - 1 - i) * BLOCK_V + offs
        inb = cols < V
        d = (tl.load(in_row + cols, mask=inb, other=float("-inf")).to(ACC) - xmax) * inv_temp
        g = dlogit(d, log_s, ent, dlogp, dent, inv_temp, cols == tok)
        tl.store(out_row + cols, g.to(out_row.dtype.element_ty), mask=inb)


@triton.jit
def row_zero(out_row, V, BLOCK_V: tl.constexpr):
    """Zero one gradient row (masked positions and positions t >= T)."""
    offs = tl.arange(0, BLOCK_V)
    zero = tl.zeros([BLOCK_V], out_row.dtype.element_ty)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        tl.store(out_row + cols, zero, mask=cols < V)
