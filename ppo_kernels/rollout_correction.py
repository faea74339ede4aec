"""Train / inference mismatch: importance weights and masks that correct for the inference
engine (vLLM, SGLang) sampling from a slightly different policy than the trainer's (verl's
rollout correction, `algorithm.rollout_correction`; TRL's vLLM importance sampling), and
DeepSeek-V3.2's off-policy sequence mask. All of it is [B, T] work on log-probs: the
kernels only ever see the resulting rollout_is_weights (the off-policy mask, which reads
the current policy's logp, runs in the two-phase path's [B, T] middle).

With l_t = clamp(old_logp_t - rollout_logp_t, -20, 20) (log pi_old / pi_rollout):
  tis       w_t = clamp(exp(l_t), lo, hi)                 truncated IS, per token
  tis-seq   w_i = clamp(exp(clamp(sum_t l_t)), lo, hi)     per sequence (product of ratios)
  mis       w_t = exp(l_t) where lo <= exp(l_t) <= hi, else 0           masked IS (IcePop)
  mis-seq   w_i = exp(sum_t l_t) where inside [lo, hi], else 0 (the whole sequence)
  geo-seq   w_i = 1 where the geometric mean exp(mean_t l_t) is inside [lo, hi], else 0
A NaN in old_logprobs or rollout_logprobs on a valid token gives a NaN weight in every mode
(its token's, or its whole sequence's for the sequence modes): the loss is NaN, never a
silent mask. On masked positions they are never read.
off-policy mask (threshold delta): a sequence with A < 0 whose mean over its tokens of
  (rollout_logp - sg(logp)) (k1 of KL(pi_rollout || pi_theta); old_logp stands in for
  rollout_logp when there is none) exceeds delta gets 0 (TRL off_policy_mask_threshold).
Dropped tokens stay in the denominators (TRL's masks); verl's rejection sampling also
removes them from response_mask (pass the mask it would make to reproduce that).
"""

from __future__ import annotations

import torch

from . import _checks as ck
from ._extension import eager_call
from ._torch_impl import LOG_RATIO_CLAMP, expm1_minus_x, seq_mean
from .context_parallel import seq_sum

# the tis fast path's four ops from C++ (csrc/eager_calls.cpp), None in a build without it
_TIS_WEIGHTS = eager_call("tis_weights")


def bounds(mode, threshold):
    """(lo, hi) of rollout_is_threshold: a number C is (0, C), i.e. an upper bound only
    (TRL's clip_max, verl's TIS threshold), except for geo-seq where it is (1 / C, C); or
    an explicit (lo, hi) pair (verl's "lo_hi" IcePop bounds), 0 <= lo < hi."""
    if isinstance(threshold, (tuple, list)):
        if len(threshold) != 2:
            raise ValueError(f"rollout_is_threshold: expected a number or (lo, hi), got "
                             f"{threshold!r}")
        lo = ck.number("rollout_is_threshold", threshold[0], lo=0.0)
        hi = ck.number("rollout_is_threshold", threshold[1], lo=0.0, lo_open=True)
        if not hi > lo:
            raise ValueError(f"rollout_is_threshold: (lo, hi) needs hi > lo, got {threshold!r}")
        return lo, hi
    hi = ck.number("rollout_is_threshold", threshold, lo=0.0, lo_open=True)
    if mode == "geo-seq":
        if hi <= 1.0:
            raise ValueError(f"rollout_is_threshold: geo-seq's bounds are (1 / C, C), which "
                             f"needs C > 1, got {threshold!r}")
        return 1.0 / hi, hi
    return 0.0, hi


def weights(old_logprobs, rollout_logprobs, mask, mode, lo, hi, group=None, valid_only=False):
    """w [B, T] (0 where masked) of a rollout_correction mode (module docstring); group: a
    context-parallel group (the sequence modes reduce over the whole sequences).
    valid_only: the caller reads the valid positions alone (the fused single pass and the
    CPU metrics op): "tis" then leaves the masked ones unset (anything, NaN included) and
    costs four element-wise ops (in one C++ call in eager mode: csrc/eager_calls.cpp); the
    valid ones are the same bits."""
    if valid_only and mode == "tis":
        # (clamp propagates a NaN ratio, as the where below does for the other modes)
        if _TIS_WEIGHTS is not None and not (torch.compiler.is_compiling()
                                             or torch.jit.is_tracing()):
            return _TIS_WEIGHTS(old_logprobs, rollout_logprobs, LOG_RATIO_CLAMP, lo, hi)
        with torch.no_grad():
            return torch.clamp(torch.exp(torch.clamp(old_logprobs - rollout_logprobs,
                                                     -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)),
                               lo, hi)
    with torch.no_grad():
        return _weights(old_logprobs, rollout_logprobs, mask, mode, lo, hi, group)


def _weights(old_logprobs, rollout_logprobs, mask, mode, lo, hi, group):
    l_tok = torch.where(mask, torch.clamp(old_logprobs - rollout_logprobs, -LOG_RATIO_CLAMP,
                                          LOG_RATIO_CLAMP), 0.0)
    if mode in ("tis", "mis"):
        r = torch.exp(l_tok)
    elif mode in ("tis-seq", "mis-seq"):
        r = torch.exp(torch.clamp(seq_sum(l_tok, group), -LOG_RATIO_CLAMP,
                                  LOG_RATIO_CLAMP)).expand_as(l_tok)
    else:  # geo-seq
        r = torch.exp(seq_mean(l_tok, mask, group)).expand_as(l_tok)
    inside = (r >= lo) & (r <= hi)
    if mode in ("tis", "tis-seq"):
        w = torch.clamp(r, lo, hi)
    elif mode == "geo-seq":
        w = inside.to(r.dtype)
    else:
        w = torch.where(inside, r, 0.0)
    # a NaN log-prob on a valid token is bad data, not a ratio outside the bounds: its
    # weight stays NaN in every mode, so the loss and that token's gradient row are NaN
    # (DESIGN.md, "A NaN on a valid token"), as truncation (tis) and old_logprobs give;
    # a comparison with NaN is False, which the masking modes would turn into a silent 0
    w = torch.where(torch.isnan(r), r, w)
    return torch.where(mask, w, 0.0)


@torch.no_grad()
def metrics(old_logprobs, rollout_logprobs, mask, w):
    """The mismatch metrics: the raw ratio pi_old / pi_rollout's mean, max, min and the
    fraction of valid tokens outside [0.9, 1.1] (before any cap or mask), k3 estimate of KL(pi_rollout || pi_old) from the rollout's
    samples, token chi-square E[ratio^2] - 1, the weights' mean and max and the fraction of
    valid tokens they drop (w = 0); means over valid tokens."""
    m = mask.to(w.dtype)
    n = m.sum().clamp(min=1.0)
    l_tok = torch.where(mask, torch.clamp(old_logprobs - rollout_logprobs, -LOG_RATIO_CLAMP,
                                          LOG_RATIO_CLAMP), 0.0)

    def mean(x):
        return (torch.where(mask, x, 0.0).sum() / n).float()

    zero = torch.zeros((), dtype=torch.float32, device=w.device)
    raw = torch.exp(l_tok)  # pi_old / pi_rollout before any cap or mask
    any_tok = w.numel() > 0
    return {
        # the raw mismatch (TRL's is_ratio mean / min / max, NeMo-RL's token_mult_prob_error
        # family): before rollout_correction's cap or mask; outside_frac: the tokens whose
        # ratio leaves [0.9, 1.1]
        "rollout_ratio_mean": mean(raw),
        "rollout_ratio_max": torch.where(mask, raw, 0.0).max().float() if any_tok else zero,
        "rollout_ratio_min": (torch.where(mask, raw, float("inf")).min().nan_to_num(
            posinf=0.0).float() if any_tok else zero),
        "rollout_ratio_outside_frac": mean(((raw < 0.9) | (raw > 1.1)).to(w.dtype)),
        "rollout_kl_k3": mean(expm1_minus_x(l_tok)),
        "rollout_chi2": mean(torch.exp(2.0 * l_tok)) - mask.any().float(),
        "rollout_is_mean": mean(w),
        "rollout_is_max": torch.where(mask, w, 0.0).max().float() if w.numel() else zero,
        "rollout_masked_frac": mean((w == 0).to(w.dtype)),
    }


@torch.no_grad()
def m2po_mask(old_logprobs, rollout_logprobs, response_mask=None, *, m2_threshold):
    """M2PO's second-moment mask (Zheng et al. 2025, "Prosperity before Collapse: How Far
    Can Off-Policy RL Reach with Stale Data on LLMs?"; AReaL's actor.m2_threshold): with
    m2_t = (rollout_logp_t - old_logp_t)^2 over the valid tokens of the whole batch, the
    tokens of the largest m2 are dropped, largest first, until the mean m2 of the rest is
    below m2_threshold (AReaL: at least one token is kept). Ties are dropped in the
    tokens' row-major order (a stable sort; AReaL's sort leaves that order unspecified).

    A mask of the data, not of the current policy: pass the result as ppo_loss's
    response_mask (AReaL replaces its loss mask with it, so dropped tokens also leave the
    token-mean denominator). One batch's decision: call it on the batch whose mean AReaL
    takes (its micro-batch), not per sequence.

    Args:
        old_logprobs: float [B, T], the proximal policy's log-probs (AReaL's prox_logp).
        rollout_logprobs: float [B, T], the behaviour policy's (the inference engine's).
        response_mask: [B, T], nonzero = valid; None = all valid.
        m2_threshold: > 0.

    Returns:
        bool [B, T]: the response mask with the dropped tokens False.

    Raises:
        TypeError / ValueError naming the argument.
    """
    ck.tensor("old_logprobs", old_logprobs, floating=True)
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs: expected [B, T], got shape "
                         f"{list(old_logprobs.shape)}")
    ck.tensor("rollout_logprobs", rollout_logprobs, floating=True)
    if rollout_logprobs.shape != old_logprobs.shape:
        raise ValueError(f"rollout_logprobs: expected shape {list(old_logprobs.shape)} like "
                         f"old_logprobs, got {list(rollout_logprobs.shape)}")
    if rollout_logprobs.device != old_logprobs.device:
        raise ValueError(f"rollout_logprobs: expected device {old_logprobs.device}, got "
                         f"{rollout_logprobs.device}")
    thr = ck.number("m2_threshold", m2_threshold, lo=0.0, lo_open=True)
    mask = ck.response_mask(response_mask, old_logprobs, False, like_name="old_logprobs")
    delta = torch.where(mask, rollout_logprobs.double() - old_logprobs.double(), 0.0)
    m2 = (delta * delta).reshape(-1)
    valid = mask.reshape(-1)
    n = int(valid.sum())
    if n == 0:
        return mask.clone()
    idx = torch.nonzero(valid).reshape(-1)
    vals = m2[idx]
    order = torch.sort(vals, descending=True, stable=True).indices
    sorted_m2 = vals[order]
    # the mean of every suffix sorted_m2[i:]; drop the first i where it is below threshold
    suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(
        n, 0, -1, dtype=sorted_m2.dtype, device=sorted_m2.device)
    below = torch.nonzero(suffix_mean < thr).reshape(-1)
    k = int(below[0]) if below.numel() else n - 1
    keep = torch.ones(n, dtype=torch.bool, device=m2.device)
    keep[order[:k]] = False
    out = torch.zeros_like(valid)
    out[idx] = keep
    return out.reshape(mask.shape)
