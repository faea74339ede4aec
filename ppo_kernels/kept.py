"""The kept sets of sampling replay in plain torch (docs/SAMPLING.md): the re-derived sets'
thresholds (vLLM v1's sampler rules), the kept-set log-probs and entropy of the eager
composite, and the kept mass. The kernels compute the same (csrc/cpu/sampling.cpp,
triton_kernels/sampling.py); ppo_kernels/sampling.py is the public face and its checks."""

from __future__ import annotations

import math

import torch

from ._torch_impl import shifted_z, token_logprobs


def col(temperature):
    """A number, or the per-row [B, T] temperature as [B, T, 1] (a divisor of [B, T, V])."""
    return temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature


def at_rows(temperature, idx):
    """A number, or the per-row temperature at the flat rows idx (a divisor of per-entry
    values of those rows)."""
    if isinstance(temperature, torch.Tensor):
        return temperature.reshape(-1)[idx]
    return temperature


def flat_rows(temperature):
    """A number, or the per-row temperature as [N] (the flat rows)."""
    return temperature.reshape(-1) if isinstance(temperature, torch.Tensor) else temperature


def threshold_torch(logits3, mask, temperature, rp):
    """The per-row kept threshold (float64 [B, T], raw logit units, -inf = keep all) of the
    re-derived sets, in plain torch (the eager backend; the kernels' sampling_threshold
    computes the same). temperature: a number or the per-row [B, T] tensor (each row's set
    on its own z = x / temperature). docs/SAMPLING.md gives the rules:
      min-p: keep exp(z_j - z_max) >= min_p; top-k: keep x_j >= the k-th largest x (ties
      kept); top-p over the survivors S of both: keep j iff the mass of S strictly above
      x_j is < top_p * mass(S). The threshold is the smallest kept value."""
    b, t = mask.shape
    v = logits3.shape[2]
    x = torch.where(mask.unsqueeze(-1), logits3[:, :t].double(), 0.0)
    xs = x.sort(dim=-1, descending=True).values  # [B, T, V]
    mx = xs[..., :1]
    d = (xs - mx) / (col(temperature.double()) if isinstance(temperature, torch.Tensor)
                     else temperature)
    keep = torch.ones_like(xs, dtype=torch.bool)
    if rp.min_p is not None:
        keep &= d >= torch.log(rp.min_p).unsqueeze(-1)
    if rp.top_k is not None:
        kth = xs.gather(-1, (rp.top_k.clamp(1, v) - 1).unsqueeze(-1))
        keep &= xs >= kth
    if rp.top_p is not None:
        e = torch.where(keep, torch.exp(d), 0.0)
        z = e.sum(-1, keepdim=True)
        # mass strictly above each value: the exclusive cumulative sum at the first entry of
        # its group of equal values (xs is descending)
        excl = torch.cumsum(e, -1) - e
        first = torch.searchsorted(-xs.contiguous(), -xs.contiguous(), right=False)
        above = excl.gather(-1, first)
        p = rp.top_p.unsqueeze(-1)
        keep &= (above < p * z) | (p >= 1.0)
    thr = torch.where(keep, xs, math.inf).amin(-1)
    thr = torch.where(keep.all(-1), -math.inf, thr)
    return torch.where(mask, thr, -math.inf)


def kept_mask_torch(logits3, tokens, mask, temperature, rp):
    """bool [B, T, V]: the kept set of every row (the sampled token included), and
    missing bool [B, T] (the set lacked the token)."""
    b, t = mask.shape
    v = logits3.shape[2]
    if rp.given:
        n = b * t
        lens = rp.offsets[1:] - rp.offsets[:-1]
        row = torch.repeat_interleave(torch.arange(n, device=tokens.device), lens,
                                      output_size=rp.ids.shape[0])
        kept = torch.zeros(n * v, dtype=torch.bool, device=tokens.device)
        kept[row * v + rp.ids] = True
        kept = kept.view(b, t, v)
    else:
        thr = threshold_torch(logits3, mask, temperature, rp)
        kept = logits3[:, :t].double() >= thr.unsqueeze(-1)
    safe = torch.where(mask, tokens, 0).unsqueeze(-1)
    missing = ~kept.gather(-1, safe)[..., 0] & mask
    kept = kept.scatter(-1, safe, True) & mask.unsqueeze(-1)
    return kept, missing


def kept_logprobs_torch(logits3, tokens, mask, temperature, rp):
    """(logp_kept, entropy_kept, lse_kept, kept_size, missing) [B, T] of the eager
    composite, differentiable in logits3; lse_kept (detached) is in units of
    _torch_impl.shifted_z (z less the row's max z). temperature: a number or the per-row
    [B, T] tensor of the accumulation dtype."""
    kept, missing = kept_mask_torch(logits3, tokens, mask, temperature, rp)
    z = shifted_z(logits3, tokens.shape[1], mask, temperature)
    zk = torch.where(kept, z, -math.inf)
    zk = torch.where(mask.unsqueeze(-1), zk, 0.0)
    logp_all = torch.log_softmax(zk, dim=-1)
    safe = torch.where(mask, tokens, 0)
    logp = torch.where(mask, logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1), 0.0)
    p = logp_all.exp()
    ent = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    lse = torch.where(mask, torch.logsumexp(zk.detach(), -1), 0.0)
    return (logp, torch.where(mask, ent, 0.0), lse, kept.sum(-1), missing)


def kept_mass(kept_max, kept_log_sum, row_max, log_sum, temperature, mask):
    """exp(lse_kept - lse_full) per token (0 where masked), lse_kept = kept_max /
    temperature + kept_log_sum (the kept set's log sum_{j in K} exp(z_j), in units of z)
    and lse_full the same of the row's full statistics (token_logprobs_fwd's row_max and
    log_sum). temperature: a number or [B, T]. The device path's one launch:
    triton_kernels/kept_mass.py (kept_rows.kept_mass_op)."""
    lse_kept = kept_max / temperature + kept_log_sum
    lse_full = row_max / temperature + log_sum
    return torch.where(mask, torch.exp(lse_kept - lse_full), 0.0)


def replay_logprobs_torch(logits3, tokens, mask, temperature, rp):
    """(logp_kept, H_kept, logp, H, kept_mass, kept_size, missing) [B, T] of the eager
    composite, the first four differentiable in logits3 (0 where masked)."""
    logp, ent = token_logprobs(logits3, tokens, mask, temperature, True)
    lp_k, ent_k, lse_k, size, missing = kept_logprobs_torch(logits3, tokens, mask, temperature,
                                                            rp)
    with torch.no_grad():  # (lse_k's units: the same shift)
        z = shifted_z(logits3, tokens.shape[1], mask, temperature)
        mass = torch.where(mask, torch.exp(lse_k - torch.logsumexp(z, -1)), 0.0)
    return lp_k, ent_k, logp, ent, mass, size, missing
