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
off-policy mask (threshold delta): a sequence with A < 0 whose mean over its tokens of
  (rollout_logp - sg(logp)) (k1 of KL(pi_rollout || pi_theta); old_logp stands in for
  rollout_logp when there is none) exceeds delta gets 0 (TRL off_policy_mask_threshold).
Dropped tokens stay in the denominators (TRL's masks); verl's rejection sampling also
removes them from response_mask (pass the mask it would make to reproduce that).
"""

from __future__ import annotations

import torch

from . import _checks as ck
from ._torch_impl import LOG_RATIO_CLAMP, expm1_minus_x, seq_mean
from .context_parallel import seq_sum


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


@torch.no_grad()
def weights(old_logprobs, rollout_logprobs, mask, mode, lo, hi, group=None):
    """w [B, T] (0 where masked) of a rollout_correction mode (module docstring); group: a
    context-parallel group (the sequence modes reduce over the whole sequences)."""
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
    return torch.where(mask, w, 0.0)


@torch.no_grad()
def metrics(old_logprobs, rollout_logprobs, mask, w):
    """The mismatch metrics: k3 estimate of KL(pi_rollout || pi_old) from the rollout's
    samples, token chi-square E[ratio^2] - 1, the weights' mean and max and the fraction of
    valid tokens they drop (w = 0); means over valid tokens."""
    m = mask.to(w.dtype)
    n = m.sum().clamp(min=1.0)
    l_tok = torch.where(mask, torch.clamp(old_logprobs - rollout_logprobs, -LOG_RATIO_CLAMP,
                                          LOG_RATIO_CLAMP), 0.0)

    def mean(x):
        return (torch.where(mask, x, 0.0).sum() / n).float()

    zero = torch.zeros((), dtype=torch.float32, device=w.device)
    return {
        "rollout_kl_k3": mean(expm1_minus_x(l_tok)),
        "rollout_chi2": mean(torch.exp(2.0 * l_tok)) - mask.any().float(),
        "rollout_is_mean": mean(w),
        "rollout_is_max": torch.where(mask, w, 0.0).max().float() if w.numel() else zero,
        "rollout_masked_frac": mean((w == 0).to(w.dtype)),
    }
