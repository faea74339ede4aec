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

LOG_RATIO_CLAMP = 20.0


def token_logprobs(logits, tokens, mask, temperature, return_entropy):
    """logprobs [B, T] (and entropy [B, T] or None) of logits [B, Tl, V]; 0 where masked."""
    t = tokens.shape[1]
    acc = acc_dtype(logits)
    # masked rows are zeroed first: whatever they hold (NaN) stays out of value and grad
    z = torch.where(mask.unsqueeze(-1), logits[:, :t].to(acc), 0.0) / temperature
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


def pg_terms(logp, old_logprobs, advantages, clip_eps_low, clip_eps_high, dual_clip_c):
    """Clipped surrogate per token (Schulman et al. 2017, eq. 7; dual clip: Ye et al. 2020).

    Returns (pg, ratio, log_ratio, clip_high, clip_low, dual) as [B, T] tensors; pg keeps
    the autograd graph of logp, the rest are for metrics.
    """
    d = torch.clamp(logp - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(d)
    unclipped = -rho * advantages
    clipped = -torch.clamp(rho, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    # the unclipped branch is the active one on ties, as in ppo_math.h
    pg = torch.where(unclipped >= clipped, unclipped, clipped)
    dual = torch.zeros_like(pg, dtype=torch.bool)
    if dual_clip_c is not None:
        cap = -dual_clip_c * advantages
        dual = (advantages < 0) & (pg > cap)
        pg = torch.where(dual, cap, pg)
    clip_high = (rho > 1.0 + clip_eps_high) & (advantages > 0)
    clip_low = (rho < 1.0 - clip_eps_low) & (advantages < 0)
    return pg, rho, d, clip_high, clip_low, dual


# 1/2!, 1/3!, ..., 1/12!: the Horner coefficients of expm1_minus_x (csrc/ppo_math.h)
_EXPM1_MINUS_X = [1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320,
                  1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5]


def expm1_minus_x(u):
    """e^u - 1 - u without cancellation (ppo_math.h expm1_minus_x): a Horner series below
    |u| = 1, expm1(u) - u beyond; differentiable (autograd of either branch keeps its
    digits too)."""
    small = u.abs() < 1.0
    us = torch.where(small, u, 0.0)  # keeps the unused branch finite for autograd
    p = torch.full_like(u, _EXPM1_MINUS_X[0])
    for c in _EXPM1_MINUS_X[1:]:
        p = p * us + c
    return torch.where(small, us * us * p, torch.expm1(u) - u)


def kl_terms(logp, ref_logprobs, kl_estimator):
    """Per-token KL estimate of pi_theta against pi_ref (Schulman 2020, k1/k2/k3)."""
    delta = logp - ref_logprobs
    if kl_estimator == "k1":
        return delta
    if kl_estimator == "k2":
        return 0.5 * delta * delta
    if kl_estimator == "abs":
        return delta.abs()
    c = torch.clamp(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return expm1_minus_x(-c)  # exp(-c) - 1 + c, keeping its digits at small c


def agg_weights(mask, loss_agg_mode, global_num_tokens=None, norm_length=None, dtype=None):
    """w [B, T] such that the aggregated loss is sum(w * loss_tok); 0 where masked."""
    m = mask.to(dtype or torch.float32)
    b, t = m.shape
    if loss_agg_mode == "token-mean":
        denom = global_num_tokens if global_num_tokens is not None else m.sum().clamp(min=1.0)
        return m / denom
    if loss_agg_mode == "seq-mean-token-sum":
        return m / b
    if loss_agg_mode == "seq-mean-token-mean":
        lens = m.sum(1, keepdim=True)
        n = (lens > 0).sum().clamp(min=1)
        return m / (lens.clamp(min=1.0) * n)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return m / (b * (t if norm_length is None else norm_length))
    raise AssertionError(loss_agg_mode)  # validated by the caller


def token_loss(logp, entropy, old_logprobs, advantages, ref_logprobs, rollout_is_weights, p):
    """Per-token loss is_w * pg + kl_coef * kl - entropy_coef * H (DESIGN.md).
    p: dict of the ppo_loss options."""
    pg = pg_terms(logp, old_logprobs, advantages, p["clip_eps_low"], p["clip_eps_high"],
                  p["dual_clip_c"])[0]
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    loss = pg
    if ref_logprobs is not None:
        kl = kl_terms(logp, ref_logprobs, p["kl_estimator"])
        loss = loss + p["kl_coef"] * kl
    if p["entropy_coef"] != 0.0:
        loss = loss - p["entropy_coef"] * entropy
    return loss


def ppo_loss(logits, tokens, mask, old_logprobs, advantages, weights, ref_logprobs,
             rollout_is_weights, p):
    """Eager composite: returns (loss, loss_tok, logp, entropy), loss differentiable."""
    logp, ent = token_logprobs(logits, tokens, mask, p["temperature"], True)
    loss_tok = token_loss(logp, ent, old_logprobs, advantages, ref_logprobs,
                             rollout_is_weights, p)
    loss_tok = torch.where(mask, loss_tok, 0.0)
    return (weights * loss_tok).sum(), loss_tok, logp, ent


@torch.no_grad()
def metrics(logp, entropy, old_logprobs, advantages, ref_logprobs, mask, p):
    """The metrics dict of ppo_loss (DESIGN.md): means over valid tokens, 0 if none."""
    logp, entropy = logp.detach(), entropy.detach()
    _, rho, d, ch, cl, dual = pg_terms(logp, old_logprobs, advantages, p["clip_eps_low"],
                                       p["clip_eps_high"], p["dual_clip_c"])
    kl = None if ref_logprobs is None else kl_terms(logp, ref_logprobs, p["kl_estimator"])
    m = mask.to(logp.dtype)
    n = m.sum().clamp(min=1.0)

    def mean(x):  # where, not x * m: a NaN on a masked position must stay out
        return (torch.where(mask, x.to(m.dtype), 0.0).sum() / n).float()

    zero = torch.zeros((), device=logp.device)
    return {
        "clip_frac": mean(ch | cl),
        "clip_frac_high": mean(ch),
        "clip_frac_low": mean(cl),
        "dual_clip_frac": mean(dual),
        "approx_kl": mean(expm1_minus_x(d)),  # (rho - 1) - log rho
        "kl_ref": mean(kl) if kl is not None else zero,
        "entropy": mean(entropy),
        "ratio_mean": mean(rho),
        "ratio_max": torch.where(mask, rho, 0.0).max().float() if rho.numel() else zero,
    }


def gae(rewards, values, mask, bootstrap_values, gamma, lam):
    """Reverse GAE scan (Schulman et al. 2016, eq. 16), masked positions transparent."""
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    v_next = (torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
              if bootstrap_values is None else bootstrap_values.to(rewards.dtype))
    a_next = torch.zeros_like(v_next)
    for j in reversed(range(t)):
        m = mask[:, j]
        a = rewards[:, j] + gamma * v_next - values[:, j] + gamma * lam * a_next
        a_next = torch.where(m, a, a_next)
        v_next = torch.where(m, values[:, j], v_next)
        adv[:, j] = torch.where(m, a, 0.0)
    return adv, torch.where(mask, adv + values, 0.0)


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
                  gamma, lam, temperature):
    """(logprobs, kl, rewards, advantages, returns), advantages not yet whitened."""
    logp, _ = token_logprobs(logits, tokens, mask, temperature, False)
    rewards, kl = kl_penalized_rewards(scores, logp, ref_logprobs, mask, kl_coef, kl_estimator)
    adv, ret = gae(rewards, values, mask, None, gamma, lam)
    return logp, kl, rewards, adv, ret
