"""Plain eager PyTorch composite of every op: the `backend="torch"` fallback and the
benchmark baseline. It is what RLHF code runs today (log_softmax -> gather -> ratio ->
clip -> kl -> masked mean) and materialises several [N, V] float32 tensors.

The per-token functions here (pg_terms, kl_terms, agg_weights, metrics) are also used by
every backend for the [B, T]-sized parts (metrics, the loss_agg_mode="none" path), so
each formula has one Python-torch home. Conventions are those of csrc/ops.cpp.
"""

from __future__ import annotations

import torch

from ._checks import acc_dtype
from .context_parallel import group_sum, length, seq_any, seq_sum

LOG_RATIO_CLAMP = 20.0


def shifted_z(logits, t, mask, temperature):
    """z = (x - max x) / temperature [B, t, V] in the accumulation dtype, of logits [B, Tl, V]
    (0 on masked rows, whatever they hold: NaN stays out of value and grad). temperature: a
    number or the per-row [B, t] tensor. The row max comes off before the division, as in
    the kernels: at a temperature the checks accept (down to ~2.9e-39 in float32) x / T
    overflows to inf where the differences x - max x stay finite. Every use is invariant to
    the shift (log-softmax, ratios of sums); the max is detached, so the gradient is that of
    x / T at every order."""
    x = torch.where(mask.unsqueeze(-1), logits[:, :t].to(acc_dtype(logits)), 0.0)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.unsqueeze(-1)
    return (x - x.detach().amax(-1, keepdim=True)) / temperature


def token_logprobs(logits, tokens, mask, temperature, return_entropy):
    """logprobs [B, T] (and entropy [B, T] or None) of logits [B, Tl, V]; 0 where masked.
    temperature: a number, or the per-row [B, T] tensor of the accumulation dtype (checked:
    1 on masked positions)."""
    z = shifted_z(logits, tokens.shape[1], mask, temperature)
    logp_all = torch.log_softmax(z, dim=-1)
    safe = torch.where(mask, tokens, 0)
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(mask, logp, 0.0)
    if not return_entropy:
        return logp, None
    p = logp_all.exp()
    # -inf logits: p = 0 and log p = -inf; the where keeps 0 * inf out of value and grad
    ent = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    return logp, torch.where(mask, ent, 0.0)


def _clip_surrogate(r, advantages, clip_eps_low, clip_eps_high, dual_clip_c, flags=True):
    """PPO's clipped surrogate of a ratio r (Schulman et al. 2017, eq. 7) with the dual clip
    (Ye et al. 2020, eq. 5). Returns (pg, clip_high, clip_low, dual); flags=False: (pg,
    None, None, None), the same pg without the metrics' masks."""
    unclipped = -r * advantages
    clipped = -torch.clamp(r, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    # the unclipped branch is the active one on ties, as in ppo_math.h
    pg = torch.where(unclipped >= clipped, unclipped, clipped)
    if not flags:
        if dual_clip_c is not None:
            cap = -dual_clip_c * advantages
            pg = torch.where((advantages < 0) & (pg > cap), cap, pg)
        return pg, None, None, None
    neg = advantages < 0  # (once: the dual clip and clip_low read it)
    dual = torch.zeros_like(pg, dtype=torch.bool)
    if dual_clip_c is not None:
        cap = -dual_clip_c * advantages
        dual = neg & (pg > cap)
        pg = torch.where(dual, cap, pg)
    rd = r.detach()
    return (pg, (rd > 1.0 + clip_eps_high) & (advantages > 0),
            (rd < 1.0 - clip_eps_low) & neg, dual)


def seq_mean(x, mask, group=None):
    """Per-sequence mean of x over the valid tokens (0 for an empty sequence), [B, 1]; the
    whole sequence's across a context-parallel group (context_parallel.py)."""
    m = mask.to(x.dtype)
    return seq_sum(torch.where(mask, x, 0.0), group) / seq_sum(m, group).clamp(min=1)


def pg_terms(logp, old_logprobs, advantages, mask, spec, flags=True):
    """Policy-gradient term per token for spec.policy_loss (reference.pg_terms documents
    each formula and its source). Returns a dict: pg (keeps logp's autograd graph), ratio
    (the ratio the loss uses, with its graph: the KL bias correction multiplies by it),
    log_ratio (clamped token log-ratio), clip_high, clip_low, dual (bool [B, T]) and, for
    the sequence losses, seq_ratio [B] (no graph). flags=False: for the loss alone (the
    same pg and ratio): vanilla, gspo and gspo-token leave out the metrics' masks and
    seq_ratio (None)."""
    old = logp.detach() if old_logprobs is None else old_logprobs  # on-policy: rho = 1
    d = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(d)
    kind = spec.policy_loss
    eps_low, eps_high = spec.clip_eps_low, spec.clip_eps_high
    out = {"log_ratio": d.detach()}
    if kind == "vanilla":
        pg, ch, cl, dual = _clip_surrogate(rho, advantages, eps_low, eps_high, spec.dual_clip_c,
                                           flags)
        out.update(pg=pg, ratio=rho, clip_high=ch, clip_low=cl, dual=dual)
    elif kind == "cispo":
        w = torch.clamp(rho, 1.0 - eps_low, 1.0 + eps_high).detach()
        rd = rho.detach()
        above, below = rd > 1.0 + eps_high, rd < 1.0 - eps_low  # (each compared once)
        out.update(pg=-w * advantages * logp, ratio=rho,
                   clip_high=above & (advantages > 0), clip_low=below & (advantages < 0),
                   dual=torch.zeros_like(mask), cispo_clip=above | below)
    elif kind == "sapo":
        # tau_pos where A > 0, else tau_neg, exactly (pos is 1 or 0, so each value is one
        # product by 1 plus an exact 0, in advantages' dtype: no float32 rounding of a
        # float64 tau), in float arithmetic: a bool-tensor masked_fill / where costs several
        # float passes on CPU
        pos = (advantages > 0).to(advantages.dtype)
        tau = pos * spec.sapo_tau_pos + (1.0 - pos) * spec.sapo_tau_neg
        # exp(logsigmoid(z)) = sigmoid(z), differentiated as s * sigmoid(-z): sigmoid's own
        # backward forms s * (1 - s), which cancels where the gate saturates (float32)
        gate = torch.exp(torch.nn.functional.logsigmoid(tau * (rho - 1.0)))
        out.update(pg=-(4.0 / tau) * gate * advantages, ratio=rho,
                   clip_high=torch.zeros_like(mask), clip_low=torch.zeros_like(mask),
                   dual=torch.zeros_like(mask))
    elif kind in ("dppo-tv", "dppo-kl"):
        # the divergence trust region (ppo_math.h pg_dppo): the mask and the capped ratio
        # are constants; the gradient flows through logp only
        masked = dppo_masked(logp.detach(), old, advantages, eps_low, eps_high,
                             kind == "dppo-kl")
        rd = rho.detach()
        c = spec.dual_clip_c
        w = rd if c is None else torch.clamp(rd, max=c)
        w = torch.where(masked, 0.0, w)
        out.update(pg=-w * advantages * logp, ratio=rho,
                   clip_high=masked & (advantages > 0), clip_low=masked & (advantages < 0),
                   dual=torch.zeros_like(mask) if c is None else (rd > c) & ~masked,
                   dppo_masked=masked)
    elif kind == "vespo":
        # VESPO (TRL loss_type="vespo"): the detached gamma weight phi(w) of the sequence
        # ratio w = exp(clamp(sum_t clamp(logp - old), log 1e-8, 20)) weighs -A logp
        d_seq = seq_sum(torch.where(mask, d, 0.0), spec.cp_group)
        log_w = torch.clamp(d_seq.detach(), VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
        phi = vespo_phi(log_w, advantages, spec)
        out.update(pg=-phi * advantages * logp, ratio=rho, clip_high=torch.zeros_like(mask),
                   clip_low=torch.zeros_like(mask), dual=torch.zeros_like(mask),
                   seq_ratio=torch.exp(log_w)[:, 0], vespo_phi=phi)
    else:  # gspo, gspo-token: the sequence ratio s = exp(clamp(mean_t (logp - old)))
        ls_raw = seq_mean(logp - old, mask, spec.cp_group)
        ls = torch.clamp(ls_raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if kind == "gspo":
            s = torch.exp(ls).expand_as(logp)
        else:  # gspo-token: the value of s, the gradient s on the own token only (none
            # where the sequence's log-ratio was clamped, as for every clamped ratio; a
            # select, not a product with 0: a -inf log-prob's logp - sg(logp) is NaN)
            live = ls_raw.detach().abs() <= LOG_RATIO_CLAMP
            s = torch.exp(torch.where(live, logp - logp.detach(), 0.0) + ls.detach())
        pg, ch, cl, dual = _clip_surrogate(s, advantages, eps_low, eps_high, spec.dual_clip_c,
                                           flags)
        out.update(pg=pg, ratio=s, clip_high=ch, clip_low=cl, dual=dual,
                   seq_ratio=torch.exp(ls.detach())[:, 0] if flags else None)
    return out


# VESPO's lower clamp of log w (TRL's get_gamma_weights: log 1e-8)
VESPO_LOG_W_MIN = -18.420680743952367


def log1m_exp(x):
    """log(1 - e^x) for x <= 0 without cancellation (ppo_math.h log1m_exp; Maechler 2012)."""
    near = x > -0.6931471805599453
    if not (x.requires_grad and torch.is_grad_enabled()):
        # no gradient: for x <= 0 neither branch is NaN (at worst -inf), so one select of
        # the two is the same value; the masked arguments below only keep the unused
        # branch finite for autograd
        return torch.where(near, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
    a = torch.where(near, x, -1.0)
    b = torch.where(near, -1.0, x)
    return torch.where(near, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(b)))


def dppo_masked(logp, old, advantages, eps_low, eps_high, kl):
    """DPPO's mask (ppo_math.h pg_dppo), bool [B, T]: the token left the trust region in
    the direction its advantage pushes: A > 0, p > p_old and D > eps_high, or A <= 0,
    p < p_old and D > eps_low, with D = |p - p_old| (binary TV) or the Bernoulli
    KL(p_old || p) (kl=True); p = e^logp, p_old = e^old."""
    pn, po = torch.exp(logp), torch.exp(old)
    if kl:  # log-probs above 0 (rounding) count as 0
        lo, ln = torch.clamp(old, max=0.0), torch.clamp(logp, max=0.0)
        q_old = -torch.expm1(lo)
        tail = torch.where(q_old == 0, 0.0, q_old * (log1m_exp(lo) - log1m_exp(ln)))
        div = torch.exp(lo) * (lo - ln) + tail
    else:
        div = (pn - po).abs()
    # (bool & / | rather than a where over bool tensors: the same mask, a fraction of the
    # cost on CPU; a NaN advantage takes the A <= 0 side in both)
    up = advantages > 0
    return (up & (pn > po) & (div > eps_high)) | (~up & (pn < po) & (div > eps_low))


def vespo_phi(log_w, advantages, spec):
    """VESPO's gamma weight phi(w) = exp(lambda + k log w - lambda w), (k, lambda) =
    (vespo_k_pos, vespo_lambda_pos) where A >= 0, else the _neg pair (TRL
    get_gamma_weights); phi(1) = 1, and a non-finite phi is 0, as TRL's nan_to_num."""
    nonneg = advantages >= 0
    k = torch.full_like(advantages, spec.vespo_k_neg).masked_fill(nonneg, spec.vespo_k_pos)
    lam = torch.full_like(advantages, spec.vespo_lambda_neg).masked_fill(
        nonneg, spec.vespo_lambda_pos)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


# 1/2!, 1/3!, ..., 1/12!: the Horner coefficients of expm1_minus_x (csrc/ppo_math.h)
_EXPM1_MINUS_X = [1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320,
                  1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5]


def expm1_minus_x(u):
    """e^u - 1 - u without cancellation (ppo_math.h expm1_minus_x): a Horner series below
    |u| = 1 (0.1 in float64), expm1(u) - u beyond; differentiable (autograd of either
    branch keeps its digits too)."""
    small = u.abs() < (0.1 if u.dtype == torch.float64 else 1.0)
    us = torch.where(small, u, 0.0)  # keeps the unused branch finite for autograd
    p = torch.full_like(u, _EXPM1_MINUS_X[0])
    for c in _EXPM1_MINUS_X[1:]:
        p = p * us + c
    return torch.where(small, us * us * p, torch.expm1(u) - u)


def kl_terms(logp, ref_logprobs, kl_estimator):
    """Per-token KL estimate of pi_theta against pi_ref (Schulman 2020, k1/k2/k3); "k1+" and
    "k3+" are verl's straight-through estimators: the value of k1 / k3, the gradient of k2."""
    delta = logp - ref_logprobs
    if kl_estimator in ("k1+", "k3+"):
        # the value of k1 / k3 exactly plus a term whose value is 0 and whose gradient is
        # k2's (a where keeps inf - inf out when the reference gives the token p = 0)
        k2 = 0.5 * delta * delta
        zero_with_k2_grad = torch.where(torch.isfinite(k2.detach()), k2 - k2.detach(), 0.0)
        return kl_terms(logp, ref_logprobs, kl_estimator[:2]).detach() + zero_with_k2_grad
    if kl_estimator == "k1":
        return delta
    if kl_estimator == "k2":
        return 0.5 * delta * delta
    if kl_estimator == "abs":
        return delta.abs()
    c = torch.clamp(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return expm1_minus_x(-c)  # exp(-c) - 1 + c, keeping its digits at small c


def agg_weights(mask, loss_agg_mode, global_num_tokens=None, norm_length=None, dtype=None,
                global_num_seqs=None, group=None):
    """w [B, T] such that the aggregated loss is sum(w * loss_tok); 0 where masked.
    global_num_tokens / global_num_seqs (numbers or 0-d tensors) replace the local counts
    as the denominators of the token-mean / seq-mean modes (data-parallel ranks; TRL's grpo
    counts empty completions: global_num_seqs = B). group: a context-parallel group, over
    which the counts and lengths are the whole sequences'."""
    m = mask.to(dtype or torch.float32)
    b, t = m.shape
    if loss_agg_mode == "token-mean":
        denom = global_num_tokens if global_num_tokens is not None else \
            group_sum(m.sum(), group).clamp(min=1.0)
        return m / denom
    if loss_agg_mode == "token-sum":
        return m
    if loss_agg_mode == "seq-mean-token-sum":
        return m / (b if global_num_seqs is None else global_num_seqs)
    if loss_agg_mode == "seq-mean-token-mean":
        lens = seq_sum(m, group)
        n = (lens > 0).sum().clamp(min=1) if global_num_seqs is None else global_num_seqs
        return m / (lens.clamp(min=1.0) * n)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        n = b if global_num_seqs is None else global_num_seqs
        return m / (n * (length(t, m, group) if norm_length is None else norm_length))
    raise AssertionError(loss_agg_mode)  # validated by the caller


def off_policy_keep(logp, behaviour_logprobs, advantages, mask, threshold, group=None):
    """1 / 0 [B, T], one decision per sequence: 0 on every token of a sequence whose mean
    advantage over its valid tokens is negative and whose mean of (behaviour_logp - sg(logp))
    (k1 of KL(pi_behaviour || pi)) exceeds the threshold (DeepSeek-V3.2, eq. 9; with
    per-sequence advantages this is TRL's get_off_policy_mask; rollout_correction.py)."""
    kl = seq_mean(torch.where(mask, behaviour_logprobs - logp.detach(), 0.0), mask, group)
    a_seq = seq_mean(torch.where(mask, advantages, 0.0), mask, group)
    return ((a_seq >= 0) | (kl <= threshold)).to(logp.dtype).expand_as(logp)


def token_losses(logp, entropy, x, spec, behaviour=None, terms=None, logp_kl=None):
    """(policy part is_w * pg + kl_coef * kl [* ratio], entropy part H) per token; the
    per-token loss is the first minus entropy_coef times the second. x: the call's per-token
    tensors as one record, read by name (loss.LossInputs or loss.KernelInputs: old, adv,
    ref, isw, mask, each [B, T] of the accumulation dtype or None where optional); spec: the
    LossSpec; behaviour: the log-probs the off-policy mask compares with
    (spec.off_policy_mask_threshold; None: no mask). terms: pg_terms(logp, x.old, x.adv,
    x.mask, spec) when the caller has it already (its metrics read the same terms). logp is
    the ratio's log-prob; logp_kl the KL's (sampling replay: logp over the kept set, logp_kl
    over the full vocabulary unless kl_logprobs="kept"; None: logp)."""
    pt = pg_terms(logp, x.old, x.adv, x.mask, spec, flags=False) if terms is None else terms
    loss = pt["pg"]
    if x.isw is not None:
        loss = loss * x.isw
    if behaviour is not None:  # the off-policy mask: reads the (detached) logp
        loss = loss * off_policy_keep(logp, behaviour, x.adv, x.mask,
                                      spec.off_policy_mask_threshold, spec.cp_group)
    if x.ref is not None:
        kl = kl_terms(logp if logp_kl is None else logp_kl, x.ref, spec.kl_estimator)
        if spec.kl_bias_correction:
            kl = kl * pt["ratio"]
        loss = loss + spec.kl_coef * kl
    # a NaN loss (a NaN logit or input on a valid token) must reach the gradient too:
    # clamp's and where's backward would hand out a finite 0 for it (ppo_math.h does same)
    # (both factors are 0 off the NaN tokens, so no 0 * NaN reaches any other gradient)
    bad = torch.isnan(loss.detach())
    loss = loss + torch.where(bad, float("nan"), 0.0) * torch.where(bad, logp, 0.0)
    return loss, entropy


def token_loss(logp, entropy, x, spec, behaviour=None, logp_kl=None):
    """Per-token loss is_w * pg + kl_coef * kl - entropy_coef * H (DESIGN.md); x as in
    token_losses."""
    pol, ent = token_losses(logp, entropy, x, spec, behaviour, logp_kl=logp_kl)
    return pol - spec.entropy_coef * ent if spec.entropy_coef != 0.0 else pol


def aggregate(pol, ent, mask, weights, entropy_weights, spec):
    """sum(w * policy part) - entropy_coef * sum(w_ent * H) over valid tokens."""
    loss = (weights * torch.where(mask, pol, 0.0)).sum()
    if spec.entropy_coef != 0.0:
        w_ent = weights if entropy_weights is None else entropy_weights
        loss = loss - spec.entropy_coef * (w_ent * torch.where(mask, ent, 0.0)).sum()
    return loss


def ppo_loss(logits, kin, spec):
    """Eager composite: returns (loss, loss_tok, logp, entropy), loss differentiable.
    kin: the call's loss.KernelInputs (the per-token tensors, read by name; kin.temperatures
    the per-row [B, T] temperature, or None for spec.temperature)."""
    logp, ent = token_logprobs(logits, kin.tokens, kin.mask, kin.temperature(spec), True)
    pol, _ = token_losses(logp, ent, kin, spec)
    loss = aggregate(pol, ent, kin.mask, kin.weights, kin.w_ent, spec)
    loss_tok = torch.where(kin.mask, pol - spec.entropy_coef * ent, 0.0)
    return loss, loss_tok, logp, ent


@torch.no_grad()
def metrics(logp, entropy, old_logprobs, advantages, ref_logprobs, mask, spec, logp_kl=None):
    """The metrics dict of ppo_loss (DESIGN.md): means over valid tokens, 0 if none, and the
    counts num_tokens / num_seqs that make means combine exactly across micro-batches and
    ranks. logp_kl: the KL's log-probs where they are not logp (sampling replay)."""
    logp, entropy = logp.detach(), entropy.detach()
    pt = pg_terms(logp, old_logprobs, advantages, mask, spec)
    d, rho = pt["log_ratio"], pt["ratio"]
    tok_rho = torch.exp(d)
    kl = None if ref_logprobs is None else kl_terms(
        logp if logp_kl is None else logp_kl.detach(), ref_logprobs, spec.kl_estimator)
    m = mask.to(logp.dtype)
    n = m.sum().clamp(min=1.0)

    def mean(x):  # where, not x * m: a NaN on a masked position must stay out
        return (torch.where(mask, x.to(m.dtype), 0.0).sum() / n).float()

    zero = torch.zeros((), device=logp.device)
    out = {
        "num_tokens": m.sum().float(),
        "num_seqs": seq_any(mask, spec.cp_group).sum().float(),
        "clip_frac": mean(pt["clip_high"] | pt["clip_low"]),
        "clip_frac_high": mean(pt["clip_high"]),
        "clip_frac_low": mean(pt["clip_low"]),
        "dual_clip_frac": mean(pt["dual"]),
        "approx_kl": mean(expm1_minus_x(d)),  # (rho - 1) - log rho
        "kl_ref": mean(kl) if kl is not None else zero,
        "entropy": mean(entropy),
        # the token ratio rho = exp(clamp(logp - old)) under every loss (the sequence
        # losses report their sequence ratio as seq_ratio_mean / seq_ratio_max)
        "ratio_mean": mean(tok_rho),
        "ratio_max": torch.where(mask, tok_rho, 0.0).max().float() if rho.numel() else zero,
    }
    if "cispo_clip" in pt:
        out["cispo_clip_frac"] = mean(pt["cispo_clip"])
    if "seq_ratio" in pt:
        s, nonempty = pt["seq_ratio"], seq_any(mask, spec.cp_group)
        n_seq = nonempty.sum().clamp(min=1)
        if spec.policy_loss != "vespo":
            clipped = (s > 1.0 + spec.clip_eps_high) | (s < 1.0 - spec.clip_eps_low)
            out["seq_clip_frac"] = ((clipped & nonempty).sum() / n_seq).float()
        out["seq_ratio_mean"] = (torch.where(nonempty, s, 0.0).sum() / n_seq).float()
        out["seq_ratio_max"] = (torch.where(nonempty, s, 0.0).max().float() if s.numel()
                                else zero)
    return out


def gae(rewards, values, mask, bootstrap_values, gamma, lam, lam_per_seq=None, value_lam=None):
    """Reverse GAE scan (Schulman et al. 2016, eq. 16), masked positions transparent.
    lam_per_seq [B] replaces lam (VAPO's length-adaptive lambda); value_lam given: returns
    from a second scan of the same deltas with value_lam (VAPO's decoupled GAE), else
    advantages + values."""
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    ret_adv = adv if value_lam is None else torch.zeros_like(rewards)
    v_next = (torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
              if bootstrap_values is None else bootstrap_values.to(rewards.dtype))
    a_next = torch.zeros_like(v_next)
    g_next = torch.zeros_like(v_next)
    gl = gamma * lam if lam_per_seq is None else gamma * lam_per_seq.to(rewards.dtype)
    for j in reversed(range(t)):
        m = mask[:, j]
        delta = rewards[:, j] + gamma * v_next - values[:, j]
        a = delta + gl * a_next
        a_next = torch.where(m, a, a_next)
        adv[:, j] = torch.where(m, a, 0.0)
        if value_lam is not None:
            g = delta + gamma * value_lam * g_next
            g_next = torch.where(m, g, g_next)
            ret_adv[:, j] = torch.where(m, g, 0.0)
        v_next = torch.where(m, values[:, j], v_next)
    return adv, torch.where(mask, ret_adv + values, 0.0)


def kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator):
    """r_t = -kl_coef * kl_t, plus scores[b] on the last valid token of sequence b.
    No host read (no boolean indexing): the last valid position is found with a max."""
    kl = torch.where(mask, kl_terms(logprobs, ref_logprobs, kl_estimator), 0.0)
    r = -kl_coef * kl
    t = mask.shape[1]
    if t == 0:
        return r, kl
    pos = torch.arange(t, device=mask.device)
    last = torch.where(mask, pos, -1).max(1, keepdim=True).values  # -1: no valid token
    is_last = mask & (pos == last)
    return r + torch.where(is_last, scores.to(r.dtype)[:, None], 0.0), kl


def score_rollout(logits, tokens, mask, ref_logprobs, values, scores, kl_coef, kl_estimator,
                  gamma, lam, temperature, lam_per_seq=None, value_lam=None):
    """(logprobs, kl, rewards, advantages, returns), advantages not yet whitened."""
    logp, _ = token_logprobs(logits, tokens, mask, temperature, False)
    rewards, kl = kl_penalized_rewards(scores, logp, ref_logprobs, mask, kl_coef, kl_estimator)
    adv, ret = gae(rewards, values, mask, None, gamma, lam, lam_per_seq, value_lam)
    return logp, kl, rewards, adv, ret
