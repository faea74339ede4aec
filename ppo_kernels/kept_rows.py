"""The kept-set statistics of sampling replay on the kernel backends (docs/SAMPLING.md),
for one block of rows: the kept_logprobs kernels on one shard of the vocabulary, and over
a vocabulary split over tp_group the shard's partials of a given kept set (merged by the
one all-gather of vocab_parallel.VocabShard.merge) and its part of the gradient.
ppo_kernels/rows.py drives them, for logits and LM-head chunks alike."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from . import _backends
from . import _checks as ck
from .kept import at_rows, flat_rows, kept_mass


class KeptStats(NamedTuple):
    """The kept-set statistics of the kernels' rows ([B, T], accumulation dtype but
    kept_size int64, missing bool). Over a split vocabulary: the whole vocabulary's kept
    set, merged (merge_kept)."""

    logp: Any
    entropy: Any
    kept_max: Any
    kept_log_sum: Any
    kept_size: Any
    missing: Any
    threshold: Any = None  # float64 [B, T] for re-derived sets, else None


class KeptEntries(NamedTuple):
    """A vocabulary shard's kept entries of one block of rows: flat row, local column,
    logit (accumulation dtype)."""

    row: Any
    col: Any
    x: Any


def require_ops(be):
    """The kept-set kernel ops of a backend, or a NotImplementedError naming what is
    missing (docs/SAMPLING.md lists where replay runs)."""
    if not be.has_op("kept_logprobs_fwd"):
        name = "cpu/cuda" if be.name in ("cpu", "cuda") else be.name
        raise NotImplementedError(
            f"backend: sampling replay (sampling_mask, top_k, top_p, min_p) has no {name} "
            f"kernels in this build; use backend='cpu' (CPU tensors) or backend='torch'")


def threshold_op(be, logits3):
    """The re-derived sets' threshold op. The cuda backend with bfloat16 / float16 logits:
    its own op, one block per row counting the row's 16-bit values in shared memory
    (csrc/cuda/threshold_select.cuh; on a device with less than 153 KiB of shared memory a
    block, the same op sorts chunks of rows with ATen ops). Else on the device path
    (_backends.device_eager: a CUDA device, eager mode, triton importable) the Triton radix
    select (triton_kernels/threshold.py, one launch), for the cuda backend's float32 /
    float64 logits too; else the backend's op."""
    if be.name == "cuda" and logits3.dtype in (torch.bfloat16, torch.float16):
        return be.op("sampling_threshold")
    if _backends.device_eager(be, logits3):
        from .triton_kernels import threshold
        return threshold.sampling_threshold
    return be.op("sampling_threshold")


def threshold_kept_op(be, logits3):
    """The op that re-derives the sets and takes their statistics in one call
    (threshold_kept_fwd: the row read again while in cache; on the cuda backend with
    bfloat16 / float16 logits one kernel, csrc/cuda/sampling.cu threshold_kept_kernel), or
    None where threshold_op's choice runs beside the backend's kept_logprobs_fwd (the device
    path's Triton threshold)."""
    if be.name == "cuda" and logits3.dtype in (torch.bfloat16, torch.float16):
        return be.op("threshold_kept_fwd")
    if _backends.device_eager(be, logits3) or not be.has_op("threshold_kept_fwd"):
        return None
    return be.op("threshold_kept_fwd")


def kept_mass_op(be, like):
    """kept.kept_mass, or on the device path (_backends.device_eager) its one-launch Triton
    twin (triton_kernels/kept_mass.py) in place of seven eager ops."""
    if _backends.device_eager(be, like):
        from .triton_kernels import kept_mass as km
        return km.kept_mass
    return kept_mass


def kernel_stats(be, logits3, tokens, mask, temperature, rp):
    """One pass (for re-derived sets the threshold's and the kept statistics', one op where
    threshold_kept_op has one) of the kept-set kernels.
    temperature: a number or the per-row [B, T] tensor (the ops' `temperatures`)."""
    require_ops(be)  # (the CUDA kernels, csrc/cuda/sampling.cu, are unrun)
    t, temps = ck.split_temperature(temperature)
    thr = None
    if not rp.given:
        fused = threshold_kept_op(be, logits3)
        if fused is not None:
            return KeptStats(*fused(logits3, tokens, mask, t, rp.top_k, rp.top_p, rp.min_p,
                                    temps))
        thr = threshold_op(be, logits3)(logits3, mask, t, rp.top_k, rp.top_p, rp.min_p,
                                        temps)
    out = be.op("kept_logprobs_fwd")(logits3, tokens, mask, t, rp.ids, rp.offsets, thr, temps)
    return KeptStats(*out, thr)


def kernel_grad(be, dlogits, g_kept, g_ent, logits3, tokens, mask, ks, temperature, rp):
    """d/dlogits of sum(g_kept * logp_kept + g_ent * H_kept): added into dlogits in place
    (kept_logprobs_bwd_), or where dlogits is None (no dense part) written whole into a new
    tensor (kept_logprobs_bwd: 0 off the kept sets, with no zero fill first). Returns the
    gradient."""
    t, temps = ck.split_temperature(temperature)
    args = (g_kept, g_ent, logits3, tokens, mask, ks.kept_max, ks.kept_log_sum, ks.entropy, t,
            rp.ids, rp.offsets, ks.threshold)
    if dlogits is None:
        return be.op("kept_logprobs_bwd")(*args, temps)
    be.op("kept_logprobs_bwd_")(*args, dlogits, temps)
    return dlogits


def shard_partials(logits3, tokens, mask, temperature, rp, shard):
    """This shard's part of the kept sets (CSR): the entries with ids in [start, start +
    V_r), plus the token on its owner where the set lacks it (every rank sees the whole
    CSR, so every rank knows which sets lack their token); per row (max, log1p(non-top
    mass), entropy, the token's shifted logit on its owner, count, ids held) as
    [B, T, 6]. Returns (partials, missing [B, T], KeptEntries)."""
    b, t = tokens.shape
    n, v_r, dev = b * t, logits3.shape[2], tokens.device
    acc = ck.acc_dtype(logits3)
    inf = math.inf
    tok, msk = tokens.reshape(-1), mask.reshape(-1)
    row = torch.repeat_interleave(torch.arange(n, device=dev), rp.offsets[1:] - rp.offsets[:-1],
                                  output_size=rp.ids.shape[0])
    found = torch.zeros(n, dtype=torch.long, device=dev).index_add_(
        0, row, (rp.ids == tok[row]).long()) > 0
    missing = msk & ~found
    local_tok = tok - shard.start
    own = (local_tok >= 0) & (local_tok < v_r)
    sel = (rp.ids >= shard.start) & (rp.ids < shard.start + v_r) & msk[row]
    add = (missing & own).nonzero()[:, 0]
    e_row = torch.cat([row[sel], add])
    e_col = torch.cat([rp.ids[sel] - shard.start, local_tok[add]])
    e_x = logits3[e_row // t, e_row % t, e_col].to(acc)
    top = torch.full((n,), -inf, dtype=acc, device=dev).scatter_reduce(
        0, e_row, e_x, "amax", include_self=True)
    d = (e_x - top[e_row]) / at_rows(temperature, e_row)
    e = torch.exp(d)
    at_top = d == 0

    def seg(v):
        return torch.zeros(n, dtype=acc, device=dev).index_add_(0, e_row, v)

    ties = seg(at_top.to(acc))
    rest = seg(torch.where(at_top, 0.0, e)) + (ties - 1.0).clamp(min=0.0)
    size = seg(torch.ones_like(e_x))
    has = size > 0
    l_r = torch.log1p(rest)
    h_r = torch.where(has, l_r - seg(e * d) / (1.0 + rest), 0.0)
    safe_tok = torch.where(own, local_tok, 0)
    x_tok = logits3[:, :t].reshape(n, v_r).gather(1, safe_tok[:, None])[:, 0].to(acc)
    d_tok = torch.where(own & msk, (x_tok - top) / flat_rows(temperature), -inf)
    # the given ids this shard holds, per row: over the group they must add up to the row's
    # set (an id outside the whole vocabulary lies in no shard)
    held = torch.zeros(n, dtype=acc, device=dev).index_add_(0, row, (
        (rp.ids >= shard.start) & (rp.ids < shard.start + v_r)).to(acc))
    extra = torch.stack([torch.where(has, top, -inf), torch.where(has, l_r, 0.0), h_r, d_tok,
                         size, held], -1).view(b, t, 6)
    return extra, missing.view(b, t), KeptEntries(e_row, e_col, e_x)


def merge_kept(ext, mask, temperature, offsets, missing):
    """The whole kept set's KeptStats from every rank's partials ext [tp, B, T, 6] (as
    VocabShard.merge does for the full row), after checking that the shards' held ids add
    up to every row's set (offsets: the CSR's, of these rows)."""
    lens = (offsets[1:] - offsets[:-1]).view(mask.shape).to(ext.dtype)
    bad = ext[..., 5].sum(0) != lens
    msg = ("sampling_mask.token_ids: with tp_group every id must lie in one rank's shard of "
           "the vocabulary [0, sum of the local V)")
    if ext.device.type == "cpu":
        if bool(bad.any()):
            raise ValueError(msg)
    else:
        torch._assert_async(~bad.any(), msg)
    km, kl, kh, kd, ksz, held = ext.unbind(-1)
    big = km.max(0).values
    big = torch.where(mask, big, 0.0)
    live = km > -math.inf
    a = torch.where(live, (km - big) / temperature, -math.inf)
    top = torch.zeros_like(km, dtype=torch.bool).scatter_(0, km.argmax(0, keepdim=True), True)
    rest = torch.where(top, torch.expm1(kl), torch.where(live, torch.exp(a + kl), 0.0)).sum(0)
    ls = torch.log1p(rest)
    log_w = torch.where(live, a + kl - ls, -math.inf)
    w = torch.exp(log_w)
    ent = (w * kh).sum(0) - torch.where(w > 0, w * log_w, 0.0).sum(0)
    logp = torch.where(live, kd + a, -math.inf).max(0).values - ls
    return KeptStats(torch.where(mask, logp, 0.0), torch.where(mask, ent, 0.0), big,
                     torch.where(mask, ls, 0.0), torch.where(mask, ksz.sum(0), 0.0).long(),
                     missing)


def shard_grad_(dz, g_kept, g_ent, tokens, mask, kept, entries, temperature, shard):
    """dz [B, Tl, V_r] += the kept part of the gradient on this shard's kept entries."""
    b, t = tokens.shape
    r, c, x = entries
    temp_r = at_rows(temperature, r)
    lp = (x - kept.kept_max.reshape(-1)[r]) / temp_r - kept.kept_log_sum.reshape(-1)[r]
    p = torch.exp(lp)
    g = g_kept.reshape(-1)[r]
    is_tok = (tokens.reshape(-1)[r] - shard.start) == c
    val = torch.where(is_tok, -g * torch.expm1(lp), -g * p)
    if g_ent is not None:
        h = kept.entropy.reshape(-1)[r]
        val = val - torch.where(p > 0, g_ent.reshape(-1)[r] * p * (lp + h), 0.0)
    val = val / temp_r
    bb, tt = r // t, r % t
    dz.index_put_((bb, tt, c), (dz[bb, tt, c].to(val.dtype) + val).to(dz.dtype))
    return dz
