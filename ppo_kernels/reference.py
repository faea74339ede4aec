"""numpy float64 reference of every public op, with analytic gradients: the test oracle.

Written for clarity, not speed: one formula per function, plain numpy, float64 throughout.
Inputs may be numpy arrays or torch tensors (converted with ``as_f64``). The math is that
of DESIGN.md; sources: PPO clipped surrogate, Schulman et al. 2017, eq. 7; dual clip,
Ye et al. 2020, eq. 5; KL estimators k1/k2/k3, Schulman 2020 "Approximating KL
Divergence"; GAE, Schulman et al. 2016, eq. 16, with VAPO's decoupled and length-adaptive
lambda (Yue et al. 2025, arXiv:2504.05118); Dr. GRPO length normalisation,
Liu et al. 2025.
"""

from __future__ import annotations

import numpy as np

# the names only (the formulas here are the oracle's own)
from .spec import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, SEQUENCE_POLICY_LOSSES

LOG_RATIO_CLAMP = 20.0


def as_f64(x):
    """A numpy float64 copy of ``x`` (numpy array, torch tensor or number); None stays None."""
    if x is None:
        return None
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if x.dtype.is_floating_point:
            x = x.double()
        x = x.numpy()
    return np.asarray(x, dtype=np.float64)


def _as_int(x):
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64)


def _mask(mask, shape):
    return np.ones(shape) if mask is None else (as_f64(mask) != 0).astype(np.float64)


def _align(logits, tokens):
    """Logits [B, T(+1), V] -> [B, T, V] aligned with tokens [B, T]."""
    logits = as_f64(logits)
    tokens = _as_int(tokens)
    return logits[:, : tokens.shape[1]], tokens


# ---------------------------------------------------------------- per-row softmax parts

def _row_stats(z):
    """Softmax pieces of rows of z [..., V]: (d, log_sum, ent, p) with d = z - max z,
    log_sum = log sum exp(d) and log p_v = d_v - log_sum. -inf entries have p = 0.

    The top entry's exp(0) = 1 is kept apart: log_sum = log1p(rest), rest = the sum over
    every other entry, and H = log_sum - sum p d, so a confident row (1 - p ~ 1e-12) keeps
    its relative digits even in float64 (log(1 + rest) would lose four of them).
    """
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    d = z - m
    e = np.exp(d)
    top = np.argmax(z, axis=-1)[..., None]
    e_rest = e.copy()  # every entry but one top one (its exp is 1, or NaN for a NaN row)
    np.put_along_axis(e_rest, top, 0.0, -1)
    rest = e_rest.sum(-1) + (np.take_along_axis(e, top, -1)[..., 0] - 1.0)
    log_sum = np.log1p(rest)
    p = e / (1.0 + rest)[..., None]
    ent = log_sum - (p * np.where(p > 0, d, 0.0)).sum(-1)
    return d, log_sum, ent, p


def _temperature(temperature, shape):
    """The temperature as a divisor of z [B, T, V]: a number, or per sequence [B] / per
    token [B, T] (each row of z divided by its own value; the per-row temperature of
    prime-rl's schedules and per-turn temperatures). Positions where it is not positive
    (masked ones) divide by 1: their results are 0 anyway."""
    if np.ndim(temperature) == 0:
        return float(temperature)
    t = as_f64(temperature)
    t = t[:, None] * np.ones(shape) if t.ndim == 1 else t.reshape(shape)
    return np.where(t > 0, t, 1.0)[..., None]


def token_logprobs(logits, tokens, response_mask=None, temperature=1.0):
    """logprobs [B, T] and entropy [B, T] of the sampled tokens; 0 on masked positions.
    temperature: a number, or [B] / [B, T] (_temperature)."""
    z, tokens = _align(logits, tokens)
    m = _mask(response_mask, tokens.shape)
    d, log_sum, ent, _ = _row_stats(z / _temperature(temperature, tokens.shape))
    safe = np.where(m > 0, tokens, 0)
    logp = np.take_along_axis(d, safe[..., None], -1)[..., 0] - log_sum
    return np.where(m > 0, logp, 0.0), np.where(m > 0, ent, 0.0)


def token_logprobs_grad(logits, tokens, response_mask, temperature, grad_logprobs,
                        grad_entropy=None):
    """d/dlogits of sum(grad_logprobs * logp + grad_entropy * H), shaped like ``logits``.

    d logp / d z_v = 1[v = token] - p_v, d H / d z_v = -p_v (log p_v + H); the token's own
    1 - p is taken as -expm1(log p) (no cancellation for confident tokens). With z =
    logits / temperature (a number or per row, [B] / [B, T]), d / dlogits = d / dz divided
    by the row's own temperature."""
    full = as_f64(logits)
    z, tokens = _align(full, tokens)
    m = _mask(response_mask, tokens.shape)
    temp = _temperature(temperature, tokens.shape)
    d, log_sum, ent, p = _row_stats(z / temp)
    glp = as_f64(grad_logprobs) * m
    gh = np.zeros_like(glp) if grad_entropy is None else as_f64(grad_entropy) * m
    logp_v = np.where(p > 0, d - log_sum[..., None], 0.0)
    g = -glp[..., None] * p - gh[..., None] * p * (logp_v + ent[..., None])
    safe = np.where(m > 0, tokens, 0)[..., None]
    lp_tok = np.take_along_axis(d, safe, -1) - log_sum[..., None]  # -inf for a banned token
    p_tok = np.take_along_axis(p, safe, -1)
    ent_part = np.where(p_tok > 0, p_tok * (np.where(p_tok > 0, lp_tok, 0.0) + ent[..., None]),
                        0.0)
    g_tok = -glp[..., None] * np.expm1(lp_tok) - gh[..., None] * ent_part
    np.put_along_axis(g, safe, g_tok, -1)
    out = np.zeros_like(full)
    out[:, : tokens.shape[1]] = g / temp
    return out


# ---------------------------------------------------------------- sampling replay

def kept_from_csr(token_ids, offsets, shape):
    """bool [B, T, V]: the CSR kept sets (docs/SAMPLING.md) as a dense mask."""
    b, t, v = shape
    ids, offs = _as_int(token_ids), _as_int(offsets)
    kept = np.zeros((b * t, v), dtype=bool)
    for i in range(b * t):
        kept[i, ids[offs[i]:offs[i + 1]]] = True
    return kept.reshape(b, t, v)


def _per_row_param(x, b, t, default):
    if x is None:
        return np.full((b, t), default, dtype=np.float64)
    x = as_f64(x)
    if x.ndim == 0:
        return np.full((b, t), float(x))
    return np.broadcast_to(x.reshape(b, 1), (b, t)).astype(np.float64)


def sampling_kept(logits, tokens, response_mask=None, temperature=1.0, *, top_k=None,
                  top_p=None, min_p=None):
    """bool [B, T, V]: the re-derived kept set of every row, vLLM v1's sampler as value
    thresholds on z = logits / temperature (docs/SAMPLING.md), one row at a time
    (temperature: a number, or per row [B] / [B, T] as token_logprobs takes it; each row's
    set is taken on its own temperature-scaled logits):

      min-p  keep p_j >= min_p * p_max (exp(z_j - z_max) >= min_p);
      top-k  keep z_j >= the k-th largest z (ties with it kept);
      top-p  over the survivors S of both: keep j iff sum_{i in S, z_i > z_j} p_i is
             < top_p * sum_{i in S} p_i (the top group is always kept).
    top_k / top_p / min_p: a number or one value per sequence [B]; None = off."""
    z, tokens = _align(logits, tokens)
    b, t, v = z.shape
    m = _mask(response_mask, tokens.shape)
    k = _per_row_param(top_k, b, t, v)
    p = _per_row_param(top_p, b, t, 1.0)
    mp = _per_row_param(min_p, b, t, 0.0)
    temp = np.broadcast_to(_temperature(temperature, tokens.shape), (b, t, 1))[..., 0]
    kept = np.zeros(z.shape, dtype=bool)
    for i in range(b):
        for j in range(t):
            if m[i, j] == 0:
                continue
            x = z[i, j]
            d = (x - x.max()) / temp[i, j]
            keep = np.ones(v, dtype=bool)
            if mp[i, j] > 0:
                keep &= np.exp(d) >= mp[i, j]
            kk = int(min(k[i, j], v))
            if kk < v:
                keep &= x >= np.sort(x)[::-1][kk - 1]
            if p[i, j] < 1:
                e = np.where(keep, np.exp(d), 0.0)
                above = np.array([e[x > xv].sum() for xv in x])
                keep &= above < p[i, j] * e.sum()
            kept[i, j] = keep
    return kept


def with_token(kept, tokens, response_mask=None):
    """(kept with the sampled token of every valid row added, missing bool [B, T])."""
    tokens = _as_int(tokens)
    m = _mask(response_mask, tokens.shape) > 0
    kept = np.array(kept, dtype=bool)
    safe = np.where(m, tokens, 0)[..., None]
    missing = ~np.take_along_axis(kept, safe, -1)[..., 0] & m
    np.put_along_axis(kept, safe, True, -1)
    return kept & m[..., None], missing


def _kept_logits(logits, kept):
    full = as_f64(logits).copy()
    t = kept.shape[1]
    full[:, :t] = np.where(kept, full[:, :t], -np.inf)
    full[:, :t] = np.where(kept.any(-1, keepdims=True), full[:, :t], 0.0)  # masked rows
    return full


def kept_logprobs(logits, tokens, response_mask, temperature, kept):
    """(logp_kept, entropy_kept) [B, T]: the log-softmax over the kept set (kept: bool
    [B, T, V] with the sampled tokens in it, with_token), 0 where masked."""
    return token_logprobs(_kept_logits(logits, kept), tokens, response_mask, temperature)


def kept_logprobs_grad(logits, tokens, response_mask, temperature, kept, grad_logprobs,
                       grad_entropy=None):
    """d/dlogits of sum(g * logp_kept + g_H * H_kept): the softmax gradient of the kept set
    (1[v = y] - p_kept_v on the kept entries, 0 elsewhere)."""
    return token_logprobs_grad(_kept_logits(logits, kept), tokens, response_mask, temperature,
                               grad_logprobs, grad_entropy)


def kept_metrics(logits, tokens, response_mask, temperature, kept, missing=None):
    """kept_mass (mean over valid tokens of exp(lse_kept - lse_full)), kept_size_mean and
    mask_missing_token_frac (missing: with_token's; None counts nothing missing)."""
    z, tokens = _align(logits, tokens)
    m = _mask(response_mask, tokens.shape)
    zs = z / _temperature(temperature, tokens.shape)
    lse_full = np.log(np.exp(zs - zs.max(-1, keepdims=True)).sum(-1)) + zs.max(-1)
    zk = np.where(kept, zs, -np.inf)
    mk = np.where(np.isfinite(zk.max(-1)), zk.max(-1), 0.0)
    lse_kept = np.log(np.exp(zk - mk[..., None]).sum(-1)) + mk
    return {"kept_mass": _masked_mean(np.exp(lse_kept - lse_full), m),
            "kept_size_mean": _masked_mean(kept.sum(-1), m),
            "mask_missing_token_frac": 0.0 if missing is None else _masked_mean(missing, m)}


# ---------------------------------------------------------------- per-token PPO terms

def _clip_surrogate(r, a, eps_low, eps_high, dual_clip_c):
    """PPO's clipped surrogate of a ratio r (Schulman et al. 2017, eq. 7) with the dual clip
    (Ye et al. 2020, eq. 5): (pg, d pg / d r, clip_high, clip_low, dual)."""
    unclipped = -r * a
    clipped = -np.clip(r, 1.0 - eps_low, 1.0 + eps_high) * a
    unclipped_active = unclipped >= clipped
    pg = np.where(unclipped_active, unclipped, clipped)
    dpg_dr = np.where(unclipped_active, -a, 0.0)
    dual = np.zeros_like(pg, dtype=bool)
    if dual_clip_c is not None:
        cap = -dual_clip_c * a
        dual = (a < 0) & (pg > cap)
        pg = np.where(dual, cap, pg)
        dpg_dr = np.where(dual, 0.0, dpg_dr)
    return pg, dpg_dr, (r > 1.0 + eps_high) & (a > 0), (r < 1.0 - eps_low) & (a < 0), dual


def seq_mean(x, m):
    """Per-sequence mean of x over the valid tokens (0 for an empty sequence), [B, 1]."""
    return (x * m).sum(-1, keepdims=True) / np.maximum(m.sum(-1, keepdims=True), 1.0)


def log1m_exp(x):
    """log(1 - e^x) for x <= 0 in float64 (Maechler 2012): log(-expm1(x)) near 0,
    log1p(-e^x) below -log 2; -inf at 0."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x > -np.log(2.0), np.log(-np.expm1(x)), np.log1p(-np.exp(x)))


def dppo_masked(lp, old, a, eps_low, eps_high, kl):
    """DPPO's mask (Qi et al. 2026, arXiv 2602.04879, eqs. 12-14; verl dppo_tv / dppo_kl,
    TRL DPPOTrainer._compute_divergence_mask): True where the token left the trust region
    in the direction its advantage pushes: A > 0, p > p_old and D > eps_high, or A <= 0,
    p < p_old and D > eps_low; D = |p - p_old| or KL(Bernoulli(p_old) || Bernoulli(p))."""
    pn, po = np.exp(lp), np.exp(old)
    if kl:  # log-probs above 0 (rounding) count as 0: p, p_old <= 1
        lo, ln = np.minimum(old, 0.0), np.minimum(lp, 0.0)
        q_old = -np.expm1(lo)
        with np.errstate(invalid="ignore"):  # (1 - p_old) log(...) is 0 where p_old = 1
            tail = np.where(q_old == 0, 0.0, q_old * (log1m_exp(lo) - log1m_exp(ln)))
        div = np.exp(lo) * (lo - ln) + tail
    else:
        div = np.abs(pn - po)
    return np.where(a > 0, (pn > po) & (div > eps_high), (pn < po) & (div > eps_low))


VESPO_LOG_W_MIN = np.log(1e-8)


def pg_terms(logp, old_logprobs, advantages, clip_eps_low=0.2, clip_eps_high=None,
             dual_clip_c=None, *, policy_loss="vanilla", sapo_tau_pos=1.0, sapo_tau_neg=1.05,
             response_mask=None, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
             vespo_lambda_neg=2.0):
    """Policy-gradient term per token: dict of pg, dpg (d pg / d logp of the token itself),
    ratio (the ratio the loss uses), dratio (d ratio / d logp of the token itself), the
    log-ratio d and the clip flags.

    vanilla      PPO clip of rho = exp(clamp(logp - old, -20, 20)) (+ dual clip)
    cispo        -sg(clip(rho, 1 - eps_low, 1 + eps_high)) A logp (MiniMax-M1 report, 2025)
    sapo         -(4 / tau) sigmoid(tau (rho - 1)) A, tau = tau_pos if A > 0 else tau_neg
    gspo         PPO clip of the sequence ratio s = exp(clamp(mean_t (logp - old))) (Zheng
                 et al. 2025, Group Sequence Policy Optimization), differentiable through the mean: its gradient is not
                 local (ppo_loss adds it); dpg here is d pg / d s ("dpg_ds")
    gspo-token   s_t = sg(s) exp(logp_t - sg(logp_t)): the value of s, gradient s on the own
                 token only (the GSPO paper's token form (GSPO-token); verl's "gspo")
    dppo-tv/kl   -M sg(min(rho, c)) A logp, M = 0 where dppo_masked (Qi et al. 2026,
                 "Rethinking the Trust Region in LLM Reinforcement Learning"; verl's
                 dppo_tv / dppo_kl), c = dual_clip_c (None: no cap)
    vespo        -sg(phi(w)) A logp, w = exp(clamp(sum_t clamp(logp - old), log 1e-8, 20)),
                 phi(w) = exp(lambda + k log w - lambda w) with (k, lambda) by the sign of A
                 (TRL loss_type="vespo", get_gamma_weights; VESPO, arXiv 2602.10693)
    """
    eh = clip_eps_low if clip_eps_high is None else clip_eps_high
    a = as_f64(advantages)
    lp = as_f64(logp)
    d_raw = lp - as_f64(old_logprobs)
    d = np.clip(d_raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    clamped = np.abs(d_raw) > LOG_RATIO_CLAMP
    rho = np.exp(d)
    out = {"log_ratio": d, "dual_clip": np.zeros_like(rho, dtype=bool)}
    if policy_loss == "vanilla":
        pg, dpg_dr, ch, cl, dual = _clip_surrogate(rho, a, clip_eps_low, eh, dual_clip_c)
        dr = np.where(clamped, 0.0, rho)
        out.update(pg=pg, dpg=dpg_dr * dr, ratio=rho, dratio=dr, clip_high=ch, clip_low=cl,
                   dual_clip=dual)
    elif policy_loss == "cispo":
        w = np.clip(rho, 1.0 - clip_eps_low, 1.0 + eh)
        out.update(pg=-w * a * lp, dpg=-w * a, ratio=rho, dratio=np.where(clamped, 0.0, rho),
                   clip_high=(rho > 1.0 + eh) & (a > 0), clip_low=(rho < 1.0 - clip_eps_low)
                   & (a < 0), cispo_clip=(rho > 1.0 + eh) | (rho < 1.0 - clip_eps_low))
    elif policy_loss == "sapo":
        tau = np.where(a > 0, sapo_tau_pos, sapo_tau_neg)
        gate = 1.0 / (1.0 + np.exp(-tau * (rho - 1.0)))
        dr = np.where(clamped, 0.0, rho)
        out.update(pg=-(4.0 / tau) * gate * a, dpg=-4.0 * gate * (1.0 - gate) * dr * a,
                   ratio=rho, dratio=dr, clip_high=np.zeros_like(rho, dtype=bool),
                   clip_low=np.zeros_like(rho, dtype=bool))
    elif policy_loss in ("dppo-tv", "dppo-kl"):
        masked = dppo_masked(lp, as_f64(old_logprobs), a, clip_eps_low, eh,
                             policy_loss == "dppo-kl")
        w = rho if dual_clip_c is None else np.minimum(rho, dual_clip_c)
        w = np.where(masked, 0.0, w)
        out.update(pg=-w * a * lp, dpg=-w * a, ratio=rho, dratio=np.where(clamped, 0.0, rho),
                   clip_high=masked & (a > 0), clip_low=masked & (a < 0),
                   dual_clip=np.zeros_like(masked) if dual_clip_c is None else
                   (rho > dual_clip_c) & ~masked)
    elif policy_loss == "vespo":
        m = np.ones_like(rho) if response_mask is None else as_f64(response_mask)
        log_w = np.clip((d * m).sum(-1, keepdims=True), VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
        nonneg = a >= 0
        k = np.where(nonneg, vespo_k_pos, vespo_k_neg)
        lam = np.where(nonneg, vespo_lambda_pos, vespo_lambda_neg)
        with np.errstate(over="ignore", invalid="ignore"):
            phi = np.exp(lam + k * log_w - lam * np.exp(log_w))
        phi = np.where(np.isfinite(phi), phi, 0.0)
        out.update(pg=-phi * a * lp, dpg=-phi * a, ratio=rho,
                   dratio=np.where(clamped, 0.0, rho), clip_high=np.zeros_like(rho, dtype=bool),
                   clip_low=np.zeros_like(rho, dtype=bool), seq_log_ratio=log_w[..., 0],
                   vespo_phi=phi)
    elif policy_loss in SEQUENCE_POLICY_LOSSES:
        m = np.ones_like(rho) if response_mask is None else as_f64(response_mask)
        ls_raw = seq_mean(lp - as_f64(old_logprobs), m)
        ls = np.clip(ls_raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        s = np.broadcast_to(np.exp(ls), rho.shape)
        s_clamped = np.broadcast_to(np.abs(ls_raw) > LOG_RATIO_CLAMP, rho.shape)
        pg, dpg_ds, ch, cl, dual = _clip_surrogate(s, a, clip_eps_low, eh, dual_clip_c)
        ds = np.where(s_clamped, 0.0, s)
        out.update(pg=pg, ratio=s, seq_log_ratio=ls[..., 0], clip_high=ch, clip_low=cl,
                   dual_clip=dual, dpg_ds=dpg_ds, ds=ds,
                   dratio=ds if policy_loss == "gspo-token" else np.zeros_like(s))
        out["dpg"] = dpg_ds * ds if policy_loss == "gspo-token" else np.zeros_like(s)
    else:
        raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {policy_loss!r}")
    return out


def expm1_minus_x(u):
    """e^u - 1 - u in float64 without cancellation: a Taylor series below |u| = 1e-2
    (truncation < 1e-19 relative), expm1(u) - u above (relative error < 5e-14)."""
    u = np.asarray(u, dtype=np.float64)
    series = u * u * (1 / 2 + u * (1 / 6 + u * (1 / 24 + u * (1 / 120 + u * (1 / 720 + u * (
        1 / 5040 + u / 40320))))))
    return np.where(np.abs(u) < 1e-2, series, np.expm1(u) - u)


def kl_terms(logp, ref_logprobs, kl_estimator="k3"):
    """Per-token KL estimate against the reference and its derivative in logp."""
    delta = as_f64(logp) - as_f64(ref_logprobs)
    if kl_estimator == "k1":
        return delta, np.ones_like(delta)
    if kl_estimator == "k2":
        return 0.5 * delta**2, delta
    if kl_estimator == "abs":
        return np.abs(delta), np.sign(delta)
    if kl_estimator == "k3":
        c = np.clip(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return expm1_minus_x(-c), np.where(np.abs(delta) > LOG_RATIO_CLAMP, 0.0, -np.expm1(-c))
    if kl_estimator in ("k1+", "k3+"):  # verl's straight-through: value of k1 / k3, grad of k2
        return kl_terms(logp, ref_logprobs, kl_estimator[:2])[0], delta
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")


def agg_weights(response_mask, loss_agg_mode="token-mean", global_num_tokens=None,
                norm_length=None, global_num_seqs=None):
    """w [B, T] with loss = sum(w * loss_tok) for the given aggregation."""
    m = as_f64(response_mask)
    m = (m != 0).astype(np.float64)
    b, t = m.shape
    gnt = None if global_num_tokens is None else float(as_f64(global_num_tokens))
    gns = None if global_num_seqs is None else float(as_f64(global_num_seqs))
    if loss_agg_mode == "token-mean":
        return m / (gnt if gnt is not None else max(m.sum(), 1.0))
    if loss_agg_mode == "token-sum":
        return m
    if loss_agg_mode == "seq-mean-token-sum":
        return m / (b if gns is None else gns)
    if loss_agg_mode == "seq-mean-token-mean":
        lens = m.sum(1, keepdims=True)
        n = max((lens > 0).sum(), 1) if gns is None else gns
        return m / (np.maximum(lens, 1.0) * n)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return m / ((b if gns is None else gns) * (t if norm_length is None else norm_length))
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


def _per_token(x, m):
    """x [B, T], or per sequence [B] / [B, 1], as [B, T] float64."""
    x = as_f64(x)
    if x.ndim == 1 and m.shape[0] == x.shape[0] and x.shape != m.shape:
        x = x[:, None]
    return np.broadcast_to(x, m.shape).astype(np.float64)


def _masked_mean(x, m):
    n = m.sum()
    return float((x * m).sum() / n) if n > 0 else 0.0


def ppo_loss(logits, tokens, old_logprobs, advantages, response_mask=None, ref_logprobs=None,
             *, clip_eps_low=0.2, clip_eps_high=None, dual_clip_c=None, kl_coef=0.0,
             kl_estimator="k3", entropy_coef=0.0, temperature=1.0,
             loss_agg_mode="token-mean", global_num_tokens=None, norm_length=None,
             rollout_is_weights=None, global_num_seqs=None, policy_loss="vanilla",
             sapo_tau_pos=1.0, sapo_tau_neg=1.05, kl_bias_correction=False,
             entropy_agg_mode=None, rollout_logprobs=None, rollout_correction=None,
             rollout_is_threshold=2.0, off_policy_mask_threshold=None, vespo_k_pos=2.0,
             vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, kept=None,
             kl_logprobs="full", entropy_over="full", kept_missing=None):
    """Returns (loss, metrics, dlogits).

    kept (sampling replay, docs/SAMPLING.md): bool [B, T, V], the kept sets with the sampled
    tokens in them (with_token); the ratio (every policy loss, GSPO's sequence ratio, the
    off-policy mask) then uses logp_kept, the KL logp_kept for kl_logprobs="kept" (else the
    full logp), the entropy H_kept for entropy_over="kept" (else the full H). kept_missing:
    with_token's missing flags [B, T], for the metric mask_missing_token_frac (None: 0).

    loss = sum_t w_t (is_w_t pg_t + kl_coef kl_t [* r_t]) - entropy_coef sum_t w'_t H_t with
    w from loss_agg_mode and w' from entropy_agg_mode (default: loss_agg_mode), r the ratio
    of the policy loss (kl_bias_correction: DeepSeek-V3.2's KL times pi / pi_old).
    old_logprobs=None is on-policy: rho = exp(logp - sg(logp)) = 1 with d rho / d logp = 1.
    advantages and rollout_is_weights may be per sequence, [B] or [B, 1].

    loss is a float (or the per-token loss [B, T] for loss_agg_mode="none", whose
    dlogits is then that of sum(loss_tok)); dlogits is shaped like ``logits``.
    """
    tokens = _as_int(tokens)
    m = _mask(response_mask, tokens.shape)
    logp_full, ent_full = token_logprobs(logits, tokens, m, temperature)
    if kept is None:
        logp, ent, logp_kl = logp_full, ent_full, logp_full
    else:  # the ratio over the kept set; the KL and the entropy as asked
        logp, ent_kept = kept_logprobs(logits, tokens, m, temperature, kept)
        logp_kl = logp if kl_logprobs == "kept" else logp_full
        ent = ent_kept if entropy_over == "kept" else ent_full
    old = logp if old_logprobs is None else as_f64(old_logprobs)
    g = pg_terms(logp, old, _per_token(advantages, m), clip_eps_low, clip_eps_high,
                 dual_clip_c, policy_loss=policy_loss, sapo_tau_pos=sapo_tau_pos,
                 sapo_tau_neg=sapo_tau_neg, response_mask=m, vespo_k_pos=vespo_k_pos,
                 vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                 vespo_lambda_neg=vespo_lambda_neg)
    isw = np.ones_like(logp) if rollout_is_weights is None else _per_token(rollout_is_weights, m)
    rc_w = None
    if rollout_correction is not None:
        rc_w = rollout_correction_weights(old, rollout_logprobs, m, rollout_correction,
                                          rollout_is_threshold)
        isw = isw * rc_w
    keep = None
    if off_policy_mask_threshold is not None and (old_logprobs is not None
                                                   or rollout_logprobs is not None):
        behaviour = old if rollout_logprobs is None else as_f64(rollout_logprobs)
        # one decision per sequence: its mean advantage and its mean k1 of
        # KL(pi_behaviour || pi) over the valid tokens (DeepSeek-V3.2, eq. 9)
        kl_seq = seq_mean(behaviour - logp, m)
        a_seq = seq_mean(_per_token(advantages, m), m)
        keep = np.broadcast_to((a_seq >= 0) | (kl_seq <= off_policy_mask_threshold), m.shape)
        isw = isw * keep
    if loss_agg_mode == "none":
        w = w_ent = m
    else:
        w = agg_weights(m, loss_agg_mode, global_num_tokens, norm_length, global_num_seqs)
        w_ent = w if entropy_agg_mode is None else agg_weights(
            m, entropy_agg_mode, global_num_tokens, norm_length, global_num_seqs)
    r = g["ratio"]
    kl, dkl = np.zeros_like(logp), np.zeros_like(logp)
    if ref_logprobs is not None:
        kl, dkl = kl_terms(logp_kl, ref_logprobs, kl_estimator)
    kl_tok = kl * r if kl_bias_correction else kl
    loss_tok = (isw * g["pg"] + kl_coef * kl_tok - entropy_coef * ent) * m
    # d (sum_t w_t loss_t) / d logp_u (the ratio's log-prob) and d / d logp_kl_u: the
    # token's own terms ...
    dlogp = w * (isw * g["dpg"] + (kl_coef * kl * g["dratio"] if kl_bias_correction else 0.0))
    dlogp_kl = w * kl_coef * (dkl * r if kl_bias_correction else dkl)
    if policy_loss == "gspo":
        # ... plus the sequence ratio's: d s_i / d logp_u = s_i m_u / L_i for every valid
        # token u of sequence i (0 where the sequence's log-ratio was clamped)
        coef = (w * isw * g["dpg_ds"]).sum(-1, keepdims=True)
        if kl_bias_correction:
            coef = coef + kl_coef * (w * kl).sum(-1, keepdims=True)
        dlogp = dlogp + m * coef * g["ds"] / np.maximum(m.sum(-1, keepdims=True), 1.0)
    loss = loss_tok if loss_agg_mode == "none" else float(
        (w * (loss_tok + entropy_coef * ent * m)).sum() - entropy_coef * (w_ent * ent * m).sum())
    dent = -w_ent * entropy_coef
    if kept is None:
        dlogits = token_logprobs_grad(logits, tokens, m, temperature, dlogp + dlogp_kl, dent)
    else:
        kl_kept, ent_kept_ = kl_logprobs == "kept", entropy_over == "kept"
        dlogits = token_logprobs_grad(
            logits, tokens, m, temperature, 0.0 * dlogp if kl_kept else dlogp_kl,
            None if ent_kept_ else dent) + kept_logprobs_grad(
            logits, tokens, m, temperature, kept, dlogp + dlogp_kl if kl_kept else dlogp,
            dent if ent_kept_ else None)
    rho = np.exp(g["log_ratio"])  # the token ratio under every loss
    metrics = {
        "num_tokens": float(m.sum()),
        "num_seqs": float((m.sum(1) > 0).sum()),
        "clip_frac": _masked_mean(g["clip_high"] | g["clip_low"], m),
        "clip_frac_high": _masked_mean(g["clip_high"], m),
        "clip_frac_low": _masked_mean(g["clip_low"], m),
        "dual_clip_frac": _masked_mean(g["dual_clip"], m),
        "approx_kl": _masked_mean(expm1_minus_x(g["log_ratio"]), m),
        "kl_ref": _masked_mean(kl, m),
        "entropy": _masked_mean(ent, m),
        "ratio_mean": _masked_mean(rho, m),
        "ratio_max": float(np.max(np.where(m > 0, rho, -np.inf))) if m.sum() > 0 else 0.0,
    }
    if policy_loss in SEQUENCE_POLICY_LOSSES:
        nonempty = m.sum(1) > 0
        s_seq = np.exp(g["seq_log_ratio"])
        metrics["seq_ratio_mean"] = float(s_seq[nonempty].mean()) if nonempty.any() else 0.0
        metrics["seq_ratio_max"] = float(s_seq[nonempty].max()) if nonempty.any() else 0.0
    if policy_loss == "cispo":
        metrics["cispo_clip_frac"] = _masked_mean(g["cispo_clip"], m)
    if kept is not None:
        metrics.update(kept_metrics(logits, tokens, m, temperature, kept, kept_missing))
    if rollout_logprobs is not None and old_logprobs is not None:
        ell = np.clip(old - as_f64(rollout_logprobs), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * m
        w_all = m if rc_w is None else rc_w
        raw = np.exp(ell)  # pi_old / pi_rollout before any cap or mask
        any_tok = m.sum() > 0
        metrics.update(
            rollout_ratio_mean=_masked_mean(raw, m),
            rollout_ratio_max=float(np.max(np.where(m > 0, raw, -np.inf))) if any_tok else 0.0,
            rollout_ratio_min=float(np.min(np.where(m > 0, raw, np.inf))) if any_tok else 0.0,
            rollout_ratio_outside_frac=_masked_mean((raw < 0.9) | (raw > 1.1), m),
            rollout_kl_k3=_masked_mean(expm1_minus_x(ell), m),
            rollout_chi2=_masked_mean(np.exp(2 * ell), m) - (1.0 if m.sum() > 0 else 0.0),
            rollout_is_mean=_masked_mean(w_all, m),
            rollout_is_max=float(np.max(np.where(m > 0, w_all, -np.inf))) if m.sum() else 0.0,
            rollout_masked_frac=_masked_mean(w_all == 0, m))
    if keep is not None:
        nonempty = m.sum(1) > 0
        dropped = ((~keep) & (m > 0)).any(1)
        metrics["off_policy_masked_frac"] = (float((dropped & nonempty).sum() / nonempty.sum())
                                             if nonempty.any() else 0.0)
    if policy_loss in ("gspo", "gspo-token"):
        nonempty = m.sum(1) > 0
        eh = clip_eps_low if clip_eps_high is None else clip_eps_high
        s = np.exp(g["seq_log_ratio"])
        out = (s > 1.0 + eh) | (s < 1.0 - clip_eps_low)
        metrics["seq_clip_frac"] = float(out[nonempty].mean()) if nonempty.any() else 0.0
    return loss, metrics, dlogits


def rollout_correction_weights(old_logprobs, rollout_logprobs, response_mask, mode,
                               threshold=2.0):
    """Rollout-correction weights [B, T] (0 where masked); see
    ppo_kernels/rollout_correction.py for the formulas and the threshold's meaning."""
    m = _mask(response_mask, as_f64(old_logprobs).shape)
    ell = np.clip(as_f64(old_logprobs) - as_f64(rollout_logprobs), -LOG_RATIO_CLAMP,
                  LOG_RATIO_CLAMP) * m
    if isinstance(threshold, (tuple, list)):
        lo, hi = threshold
    else:
        lo, hi = (1.0 / threshold, threshold) if mode == "geo-seq" else (0.0, threshold)
    if mode in ("tis", "mis"):
        r = np.exp(ell)
    elif mode in ("tis-seq", "mis-seq"):
        r = np.broadcast_to(np.exp(np.clip(ell.sum(-1, keepdims=True), -LOG_RATIO_CLAMP,
                                           LOG_RATIO_CLAMP)), m.shape)
    else:
        r = np.broadcast_to(np.exp(seq_mean(ell, m)), m.shape)
    inside = (r >= lo) & (r <= hi)
    if mode in ("tis", "tis-seq"):
        w = np.clip(r, lo, hi)
    elif mode == "geo-seq":
        w = inside.astype(np.float64)
    else:
        w = np.where(inside, r, 0.0)
    return w * m


def value_loss(values, old_values, returns, response_mask=None, *, clip_range=None,
               loss_agg_mode="token-mean"):
    """Returns (loss, metrics, dvalues): clipped value loss, PPO2 baselines style."""
    v, vo, r = as_f64(values), as_f64(old_values), as_f64(returns)
    m = _mask(response_mask, v.shape)
    err = (v - r) ** 2
    if clip_range is None:
        loss_tok, dtok, clipped_larger = 0.5 * err, v - r, np.zeros_like(v, dtype=bool)
    else:
        vc = np.clip(v, vo - clip_range, vo + clip_range)
        err_c = (vc - r) ** 2
        clipped_larger = err_c > err
        loss_tok = 0.5 * np.maximum(err, err_c)
        # the clipped branch moves with v only strictly inside the band
        inside = (v > vo - clip_range) & (v < vo + clip_range)
        dtok = np.where(clipped_larger, np.where(inside, vc - r, 0.0), v - r)
    loss_tok = loss_tok * m
    if loss_agg_mode == "none":
        w, loss = m, loss_tok
    else:
        w = agg_weights(m, loss_agg_mode)
        loss = float((w * loss_tok).sum())
    return loss, {"vf_clip_frac": _masked_mean(clipped_larger, m)}, w * dtok


# ---------------------------------------------------------------- rollout side

def length_adaptive_lam(response_mask, lam_alpha):
    """VAPO's length-adaptive lambda (Yue et al. 2025, arXiv:2504.05118,
    Length-Adaptive GAE):
    lambda_b = 1 - 1 / (alpha * l_b), l_b = the number of valid tokens of sequence b,
    clamped at 0 (l_b < 1 / alpha gives TD(0)); an empty sequence (l_b = 0) gets 0. [B]."""
    m = as_f64(response_mask) != 0
    n = m.sum(axis=1).astype(np.float64)
    lam = np.zeros(n.shape)
    for i, n_i in enumerate(n):
        if n_i > 0:
            lam[i] = max(0.0, 1.0 - 1.0 / (lam_alpha * n_i))
    return lam


def _gae_scan(r, v, m, gamma, lam_per_seq, boot):
    """The GAE advantages of eq. 16 with lambda lam_per_seq[b] for sequence b."""
    b, t = r.shape
    adv = np.zeros_like(r)
    for i in range(b):
        v_next, a_next = boot[i], 0.0
        for j in reversed(range(t)):
            if m[i, j] == 0:
                continue
            delta = r[i, j] + gamma * v_next - v[i, j]
            a_next = delta + gamma * lam_per_seq[i] * a_next
            v_next = v[i, j]
            adv[i, j] = a_next
    return adv


def gae(rewards, values, response_mask=None, *, gamma=1.0, lam=0.95, bootstrap_values=None,
        value_lam=None, lam_alpha=None):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), masked positions
    transparent. Returns (advantages, returns), 0 where the mask is 0.

    lam: a number, or "length-adaptive" (with lam_alpha: length_adaptive_lam per sequence).
    returns = the GAE advantages computed with value_lam (None: the advantages' lambda)
    + values: the lambda-return that VAPO's decoupled GAE trains the critic on (VAPO,
    Decoupled-GAE; VC-PPO, Yuan et al. 2025, arXiv:2503.01491), Monte-Carlo for value_lam = 1."""
    r, v = as_f64(rewards), as_f64(values)
    m = _mask(response_mask, r.shape)
    b, _ = r.shape
    boot = np.zeros(b) if bootstrap_values is None else as_f64(bootstrap_values)
    if isinstance(lam, str):
        assert lam == "length-adaptive" and lam_alpha is not None and lam_alpha > 0
        lams = length_adaptive_lam(m, lam_alpha)
    else:
        lams = np.full(b, float(lam))
    adv = _gae_scan(r, v, m, gamma, lams, boot)
    g = adv if value_lam is None else _gae_scan(r, v, m, gamma, np.full(b, float(value_lam)),
                                                boot)
    return adv, np.where(m != 0, g + v, 0.0)


def kl_penalized_rewards(scores, logprobs, ref_logprobs, response_mask, *, kl_coef,
                         kl_estimator="k1"):
    """r_t = -kl_coef * kl_t, plus scores[b] on the last valid token of sequence b."""
    m = _mask(response_mask, as_f64(logprobs).shape)
    kl, _ = kl_terms(logprobs, ref_logprobs, kl_estimator)
    r = -kl_coef * kl * m
    s = as_f64(scores)
    for i in range(m.shape[0]):
        valid = np.nonzero(m[i])[0]
        if len(valid):
            r[i, valid[-1]] += s[i]
    return r


def whiten(x, response_mask, *, shift_mean=True, eps=1e-8):
    """Normalise x over the valid tokens (unbiased variance); masked positions give 0."""
    x = as_f64(x)
    m = _mask(response_mask, x.shape)
    n = m.sum()
    if n == 0:
        return np.zeros_like(x)
    mean = (x * m).sum() / n
    if n < 2:
        out = x - mean  # one valid token: only centred (no variance to divide by)
    else:
        var = (((x - mean) * m) ** 2).sum() / (n - 1)
        out = (x - mean) / np.sqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def score_rollout(logits, tokens, ref_logprobs, values, scores, response_mask, *, kl_coef,
                  kl_estimator="k1", gamma=1.0, lam=0.95, temperature=1.0, whiten_advantages=True,
                  value_lam=None, lam_alpha=None):
    """dict of logprobs, kl, rewards, advantages, returns (returns before whitening)."""
    logp, _ = token_logprobs(logits, tokens, response_mask, temperature)
    m = _mask(response_mask, logp.shape)
    kl, _ = kl_terms(logp, ref_logprobs, kl_estimator)
    rewards = kl_penalized_rewards(scores, logp, ref_logprobs, m, kl_coef=kl_coef,
                                   kl_estimator=kl_estimator)
    adv, ret = gae(rewards, values, m, gamma=gamma, lam=lam, value_lam=value_lam,
                   lam_alpha=lam_alpha)
    if whiten_advantages:
        adv = whiten(adv, m)
    return {"logprobs": logp, "kl": kl * m, "rewards": rewards, "advantages": adv,
            "returns": ret}


# ---------------------------------------------------------------- top-k distillation

def _csr_rows(offsets, token_ids, logprobs, n):
    off = _as_int(offsets)
    ids = _as_int(token_ids)
    lt = as_f64(logprobs)
    return [(ids[off[i]:off[i + 1]], lt[off[i]:off[i + 1]]) for i in range(n)]


def distill_terms(logits, offsets, token_ids, teacher_logprobs, *, tail=True, temperature=1.0):
    """Per-position top-k distillation terms of logits [N, V] (float64): (kl [N],
    student_mass [N], teacher_tail [N], dkl_dlogits [N, V]).

    kl_i = sum_{j in S_i} pT_j (log pT_j - log pS_j)
           + [tail] (1 - PT) (log(1 - PT) - log(1 - PS)),  PT = sum_S pT, PS = sum_S pS,
    the forward KL of the teacher's top-k distribution (plus its tail bucket) to the
    student's (GKD, Agarwal et al. 2023, arXiv:2306.13649; the top-k form of verl's and
    Thinking Machines' on-policy distillation). pS = softmax(logits / temperature). A set
    holding the whole vocabulary, or one whose teacher mass reaches 1, has no tail.
    d kl_i / d z_v = alpha pS_v + [v in S] (beta pS_v - pT_v) with z = logits / temperature:
    tail: alpha = 1 - r, beta = r, r = (1 - PT) / (1 - PS); no tail: alpha = PT, beta = 0.
    The student's complement 1 - PS is summed over the entries outside S (no cancellation).
    """
    z = as_f64(logits) / temperature
    n, v = z.shape
    d, log_sum, _, p = _row_stats(z)
    kl = np.zeros(n)
    ps_out = np.zeros(n)
    tt_out = np.zeros(n)
    g = np.zeros((n, v))
    for i, (ids, lt) in enumerate(_csr_rows(offsets, token_ids, teacher_logprobs, n)):
        lps = d[i, ids] - log_sum[i]
        pt = np.exp(lt)
        ps = p[i, ids]
        outside = np.ones(v, dtype=bool)
        outside[ids] = False
        # relative to the row's own sum of p (1 up to rounding): exactly 1 for an empty set
        comp = p[i, outside].sum() / p[i].sum()
        pt_sum = pt.sum()
        k = float(np.where(pt > 0, pt * (lt - np.where(pt > 0, lps, 0.0)), 0.0).sum())
        whole = len(ids) == v
        tail_t = 0.0 if whole else max(1.0 - pt_sum, 0.0)
        alpha, beta = pt_sum, 0.0
        if tail:
            r = 0.0
            if tail_t > 0:
                log_tt = np.log1p(-pt_sum)
                k += tail_t * (log_tt - np.log(comp))
                r = np.exp(log_tt - np.log(comp))
            alpha, beta = 1.0 - r, r
        kl[i], ps_out[i], tt_out[i] = k, ps.sum(), tail_t
        g[i] = alpha * p[i]
        g[i, ids] = (alpha + beta) * ps - pt
    return kl, ps_out, tt_out, g / temperature


def distill_loss(logits, offsets, token_ids, teacher_logprobs, response_mask=None, *,
                 tail=True, temperature=1.0, loss_agg_mode="token-mean",
                 global_num_tokens=None, global_num_seqs=None, norm_length=None):
    """(loss, dloss_dlogits, metrics) of pk.distill_loss, logits [B, T, V] (or [B, T + 1,
    V]: the last position ignored, zero gradient) and the teacher's CSR over the B * T
    positions. loss_agg_mode="none": loss is the per-token kl [B, T] (0 where masked) and
    the gradient that of its sum."""
    full = as_f64(logits)
    b = full.shape[0]
    n = len(_as_int(offsets)) - 1
    t = n // b
    z = full[:, :t]
    m = _mask(response_mask, (b, t))
    kl, ps, tt, g = distill_terms(z.reshape(b * t, -1), offsets, token_ids, teacher_logprobs,
                                  tail=tail, temperature=temperature)
    kl, ps, tt = (x.reshape(b, t) * m for x in (kl, ps, tt))
    if loss_agg_mode == "none":
        w = m
        loss = kl
    else:
        w = agg_weights(m, loss_agg_mode, global_num_tokens, norm_length, global_num_seqs)
        loss = float((w * kl).sum())
    grad = np.zeros_like(full)
    grad[:, :t] = g.reshape(b, t, -1) * w[..., None]
    metrics = {"kl": _masked_mean(kl, m), "student_mass": _masked_mean(ps, m),
               "teacher_tail_mass": _masked_mean(tt, m), "num_tokens": float(m.sum()),
               "num_seqs": float((m.sum(1) > 0).sum())}
    return loss, grad, metrics
