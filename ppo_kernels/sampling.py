"""Sampling replay: train on the distribution the inference engine sampled from.

Inference engines sample from a truncated distribution (min-p, top-k, top-p after the
temperature) and report log-probs renormalised over the kept set (vLLM's
``logprobs_mode="processed_logprobs"``; ``--return-sampling-mask`` gives the kept set of
every token as CSR ids + offsets). A trainer that recomputes log-probs over the full
vocabulary carries log(kept mass) into every ratio against those numbers. With a kept set
the ops compute, from the same pass over the logits, both

    logp_kept_t = z_y - logsumexp_{j in K_t} z_j      and     logp_t = z_y - logsumexp_v z_v

(z = logits / temperature). The policy ratio uses logp_kept; the KL to the reference and
the entropy use the full distribution unless ``kl_logprobs="kept"`` / ``entropy_over="kept"``
(docs/SAMPLING.md). The kept set K_t is

- given: ``SamplingMask(token_ids, offsets)``, CSR over the N = B * T positions in row-major
  order, global vocabulary ids; or
- re-derived from ``top_k`` / ``top_p`` / ``min_p`` (numbers or per-sequence [B] tensors)
  with vLLM v1's sampler rules as value thresholds on the row (sampling_threshold below).

The sampled token is always in K_t (a given set that lacks it gets it added, counted in
the metric ``mask_missing_token_frac``), so no log-prob is -inf.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from . import _checks as ck
from ._autograd import wants_grad


class SamplingMask(NamedTuple):
    """The kept set of every position, CSR over the N = B * T positions (row-major; with
    cu_seqlens the packed positions in order).

    token_ids: integer [nnz], global vocabulary ids in [0, V), unique within a row.
    offsets: integer [N + 1], offsets[0] = 0, non-decreasing, offsets[N] = nnz; row i keeps
        token_ids[offsets[i]:offsets[i + 1]] (masked positions may keep nothing).
    """

    token_ids: Any
    offsets: Any


class Replay(NamedTuple):
    """The checked kept-set inputs of a call, in the kernels' row layout [B, T] (packed
    [1, total] with cu_seqlens). Either ids + offsets (int64 CSR) or the re-derivation's
    per-row parameters (top_k int64 [B, T], V = off; top_p float64 [B, T], 1 = off; min_p
    float64 [B, T], 0 = off; each None when not asked for)."""

    ids: Any = None
    offsets: Any = None
    top_k: Any = None
    top_p: Any = None
    min_p: Any = None

    @property
    def given(self):
        return self.ids is not None


KL_LOGPROBS = ("full", "kept")
ENTROPY_OVER = ("full", "kept")


def _per_row(name, value, tokens2, dtype, check, per_seq=None):
    """A number or a per-sequence [B] tensor as [B, T] of dtype; check(v) -> ok for numbers,
    applied to every entry of a tensor (a host read on CPU; on a device an asynchronous
    assertion)."""
    b, t = tokens2.shape
    if isinstance(value, torch.Tensor):
        ck.same_device(name, value, "tokens", tokens2)
        if value.dtype == torch.bool or value.dtype.is_complex:
            raise TypeError(f"{name}: expected a real tensor, got dtype {value.dtype}")
        if dtype == torch.int64 and value.dtype.is_floating_point:
            raise TypeError(f"{name}: expected an integer tensor, got dtype {value.dtype}")
        v = value.reshape(-1)
        if per_seq is not None:
            if v.shape[0] != per_seq.num_seqs:
                raise ValueError(f"{name}: expected one value per sequence, [{per_seq.num_seqs}]"
                                 f" (the sequences of cu_seqlens), got {list(value.shape)}")
            out = per_seq.per_seq(v.to(dtype))
        else:
            if tuple(value.shape) not in ((b,), (b, 1)):
                raise ValueError(f"{name}: expected a number or one value per sequence, [{b}],"
                                 f" got shape {list(value.shape)}")
            out = v.to(dtype)[:, None].expand(b, t)
        ok, what = check(v.to(torch.float64))
        if v.device.type == "cpu":
            if v.numel() and not bool(ok.all()):
                bad = v[~ok][0].item()
                raise ValueError(f"{name}: every entry must be {what}, got {bad!r}")
        else:
            torch._assert_async(ok.all(), f"{name}: every entry must be {what}")
        return out.contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number or a [B] tensor, got "
                        f"{type(value).__name__}")
    ok, what = check(torch.tensor([float(value)], dtype=torch.float64))
    if not bool(ok.all()):
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return torch.full((b, t), value, dtype=dtype, device=tokens2.device)


def _top_k_ok(v):
    return (v >= 1) & (v == v.floor()), "an integer >= 1"


def _top_p_ok(v):
    return (v > 0) & (v <= 1), "in (0, 1]"


def _min_p_ok(v):
    return (v >= 0) & (v < 1), "in [0, 1)"


def _col(temperature):
    """A number, or the per-row [B, T] temperature as [B, T, 1] (a divisor of [B, T, V])."""
    return temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature


def _at(temperature, idx):
    """A number, or the per-row temperature at the flat rows idx (a divisor of per-entry
    values of those rows)."""
    if isinstance(temperature, torch.Tensor):
        return temperature.reshape(-1)[idx]
    return temperature


def _flat(temperature):
    """A number, or the per-row temperature as [N] (the flat rows)."""
    return temperature.reshape(-1) if isinstance(temperature, torch.Tensor) else temperature


def check_outputs(rp, return_full, entropy_over):
    """token_logprobs(_from_hidden)'s replay switches, against the kept sets rp (None: no
    kept set): return_full a bool that needs a kept set, entropy_over in ENTROPY_OVER."""
    ck.flag("return_full", return_full)
    ck.choice("entropy_over", entropy_over, ENTROPY_OVER)
    if rp is None and return_full:
        raise ValueError("return_full: only with a kept set (sampling_mask, top_k, top_p "
                         "or min_p)")


def outputs(lp_k, ent_k, logp, ent, return_full, return_entropy, entropy_over, shape=None):
    """What token_logprobs(_from_hidden) return with a kept set: logp_kept, then the full
    logp (return_full), then the entropy (return_entropy; over the kept set with
    entropy_over="kept"), each through shape (the caller's output layout) when given."""
    out = (lp_k, logp) if return_full else (lp_k,)
    if return_entropy:
        out = out + (ent_k if entropy_over == "kept" else ent,)
    if shape is not None:
        out = tuple(shape(v) for v in out)
    return out if len(out) > 1 else out[0]


def check_replay(sampling_mask, top_k, top_p, min_p, tokens2, vocab, packing=None):
    """The Replay of a call (None without a kept set). tokens2: the kernels' [B, T] (packed
    [1, total]); vocab: the global V (None: not checked here, a split vocabulary checks the
    ids against its global size itself). Every bad value a ValueError / TypeError naming
    the argument (on a device the checks that read device memory are asynchronous
    assertions)."""
    derived = (top_k, top_p, min_p) != (None, None, None)
    if sampling_mask is None and not derived:
        return None
    if sampling_mask is not None and derived:
        raise ValueError("sampling_mask: give the kept sets (sampling_mask) or the sampling "
                         "parameters to re-derive them (top_k / top_p / min_p), not both")
    n = tokens2.numel()
    if sampling_mask is not None:
        if not (isinstance(sampling_mask, tuple) and len(sampling_mask) == 2):
            raise TypeError(f"sampling_mask: expected a pk.SamplingMask(token_ids, offsets), "
                            f"got {type(sampling_mask).__name__}")
        ids, offs = sampling_mask
        ck.tensor("sampling_mask.token_ids", ids, integer=True)
        ck.tensor("sampling_mask.offsets", offs, integer=True)
        ck.same_device("sampling_mask.token_ids", ids, "tokens", tokens2)
        ck.same_device("sampling_mask.offsets", offs, "tokens", tokens2)
        if ids.dim() != 1:
            raise ValueError(f"sampling_mask.token_ids: expected a 1-D tensor [nnz], got shape "
                             f"{list(ids.shape)}")
        if offs.dim() != 1 or offs.shape[0] != n + 1:
            raise ValueError(f"sampling_mask.offsets: expected [N + 1] = [{n + 1}] for the "
                             f"N = {n} positions of tokens, got shape {list(offs.shape)} (a "
                             f"mask for the wrong number of positions)")
        ids, offs = ids.long().contiguous(), offs.long().contiguous()
        nnz = ids.shape[0]
        conds = [((offs[:1] == 0).all() & (offs[-1:] == nnz).all(),
                  "sampling_mask.offsets: must start at 0 and end at nnz = len(token_ids)"),
                 ((offs[1:] >= offs[:-1]).all(), "sampling_mask.offsets: must be non-decreasing")]
        if vocab is not None:
            conds.append((((ids >= 0) & (ids < vocab)).all(),
                          f"sampling_mask.token_ids: ids must lie in [0, V) = [0, {vocab})"))
        on_host = ids.device.type == "cpu"
        if on_host:
            for ok, msg in conds:
                if not bool(ok):
                    raise ValueError(msg)
        else:
            for ok, msg in conds:
                torch._assert_async(ok, msg)
        # unique within a row: sorted by (row, id), no two neighbours equal
        row = torch.repeat_interleave(torch.arange(n, device=ids.device),
                                      (offs[1:] - offs[:-1]).clamp(min=0), output_size=nnz)
        if nnz > 1:
            width = int(vocab) if vocab is not None else int(ids.max()) + 1
            srt = (row * width + ids).sort().values
            dup = (srt[1:] == srt[:-1]).any()
            msg = "sampling_mask.token_ids: an id repeats within a row (the sets must be sets)"
            if on_host:
                if bool(dup):
                    raise ValueError(msg)
            else:
                torch._assert_async(~dup, msg)
        return Replay(ids=ids, offsets=offs)
    k = p = mp = None
    if top_k is not None:
        k = _per_row("top_k", top_k, tokens2, torch.int64, _top_k_ok, packing)
        if vocab is not None:
            k = k.clamp(max=vocab)
    if top_p is not None:
        p = _per_row("top_p", top_p, tokens2, torch.float64, _top_p_ok, packing)
    if min_p is not None:
        mp = _per_row("min_p", min_p, tokens2, torch.float64, _min_p_ok, packing)
    return Replay(top_k=k, top_p=p, min_p=mp)


# ------------------------------------------------------------------ the eager composite

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
    d = (xs - mx) / (_col(temperature.double()) if isinstance(temperature, torch.Tensor)
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
    composite, differentiable in logits3; lse_kept (detached) is in units of z.
    temperature: a number or the per-row [B, T] tensor of the accumulation dtype."""
    t = tokens.shape[1]
    acc = ck.acc_dtype(logits3)
    kept, missing = kept_mask_torch(logits3, tokens, mask, temperature, rp)
    z = torch.where(mask.unsqueeze(-1), logits3[:, :t].to(acc), 0.0) / _col(temperature)
    zk = torch.where(kept, z, -math.inf)
    zk = torch.where(mask.unsqueeze(-1), zk, 0.0)
    logp_all = torch.log_softmax(zk, dim=-1)
    safe = torch.where(mask, tokens, 0)
    logp = torch.where(mask, logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1), 0.0)
    p = logp_all.exp()
    ent = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    lse = torch.where(mask, torch.logsumexp(zk.detach(), -1), 0.0)
    return (logp, torch.where(mask, ent, 0.0), lse, kept.sum(-1), missing)


# ------------------------------------------------------------------ the kernel ops

class KeptStats(NamedTuple):
    """The kept-set statistics of the kernels' rows ([B, T], accumulation dtype but
    kept_size int64, missing bool): kernel_stats' result."""

    logp: Any
    entropy: Any
    kept_max: Any
    kept_log_sum: Any
    kept_size: Any
    missing: Any
    threshold: Any  # float64 [B, T] for re-derived sets, else None

    def lse(self, temperature):
        """log sum_{j in K} exp(z_j), in units of z (temperature: a number or [B, T])."""
        return self.kept_max / temperature + self.kept_log_sum


def require_ops(prefix):
    """The kept-set kernel ops of a backend, or a NotImplementedError naming what is
    missing (docs/SAMPLING.md lists where replay runs)."""
    if not hasattr(torch.ops.ppo_kernels, prefix + "kept_logprobs_fwd"):
        name = {"": "cpu/cuda", "triton_": "triton"}.get(prefix, prefix)
        raise NotImplementedError(
            f"backend: sampling replay (sampling_mask, top_k, top_p, min_p) has no {name} "
            f"kernels in this build; use backend='cpu' (CPU tensors) or backend='torch'")


def kernel_stats(prefix, logits3, tokens, mask, temperature, rp):
    """One pass (two for re-derived sets: the threshold pre-pass) of the kept-set kernels.
    temperature: a number or the per-row [B, T] tensor (the ops' `temperatures`)."""
    require_ops(prefix)  # (the CUDA kernels, csrc/cuda/sampling.cu, are unrun)
    ops = torch.ops.ppo_kernels
    t, temps = ck.split_temperature(temperature)
    thr = None
    if not rp.given:
        thr = getattr(ops, prefix + "sampling_threshold")(logits3, mask, t, rp.top_k,
                                                          rp.top_p, rp.min_p, temps)
    out = getattr(ops, prefix + "kept_logprobs_fwd")(logits3, tokens, mask, t, rp.ids,
                                                     rp.offsets, thr, temps)
    return KeptStats(*out, thr)


def kernel_grad_(prefix, dlogits, g_kept, g_ent, logits3, tokens, mask, ks, temperature, rp):
    """dlogits += d/dlogits of sum(g_kept * logp_kept + g_ent * H_kept), in place."""
    t, temps = ck.split_temperature(temperature)
    getattr(torch.ops.ppo_kernels, prefix + "kept_logprobs_bwd_")(
        g_kept, g_ent, logits3, tokens, mask, ks.kept_max, ks.kept_log_sum, ks.entropy,
        t, rp.ids, rp.offsets, ks.threshold, dlogits, temps)


def kept_mass(lse_kept, row_max, log_sum, temperature, mask):
    """exp(lse_kept - lse_full) per token (0 where masked); row_max / log_sum: the full
    statistics of token_logprobs_fwd."""
    lse_full = row_max / temperature + log_sum
    return torch.where(mask, torch.exp(lse_kept - lse_full), 0.0)


def replay_metrics(mass, size, missing, mask):
    """kept_mass, kept_size_mean, mask_missing_token_frac: means over the valid tokens (0
    where there are none), float32 0-d tensors."""
    with torch.no_grad():
        m = mask
        n = m.sum().clamp(min=1)

        def mean(x):
            return (torch.where(m, x.double(), 0.0).sum() / n).float()

        return {"kept_mass": mean(mass), "kept_size_mean": mean(size),
                "mask_missing_token_frac": mean(missing)}


class KernelReplayLogprobs(torch.autograd.Function):
    """(logp_kept, H_kept, logp, H, kept_mass, kept_size, missing) of the kernel backends,
    differentiable in the logits through the first four (the backward: token_logprobs_bwd
    for the full part, kept_logprobs_bwd_ added in place for the kept part)."""

    @staticmethod
    def forward(ctx, logits3, tokens, mask, temperature, rp, prefix):
        fwd = getattr(torch.ops.ppo_kernels, prefix + "token_logprobs_fwd")
        t, temps = ck.split_temperature(temperature)
        logp, ent, row_max, log_sum = fwd(logits3, tokens, mask, t, True, temps)
        ks = kernel_stats(prefix, logits3, tokens, mask, temperature, rp)
        mass = kept_mass(ks.lse(temperature), row_max, log_sum, temperature, mask)
        ctx.prefix, ctx.temperature, ctx.rp = prefix, temperature, rp
        ctx.ks_fields = (ks.threshold is not None)
        ctx.save_for_backward(logits3, tokens, mask, row_max, log_sum, ent, ks.kept_max,
                              ks.kept_log_sum, ks.entropy,
                              ks.threshold if ks.threshold is not None else torch.empty(0))
        ctx.mark_non_differentiable(mass, ks.kept_size, ks.missing)
        return ks.logp, ks.entropy, logp, ent, mass, ks.kept_size, ks.missing

    @staticmethod
    def backward(ctx, g_kept, g_ent_kept, g_lp, g_ent, *_):
        from ._autograd import first_order_only
        first_order_only("token_logprobs")
        (logits3, tokens, mask, row_max, log_sum, ent, kmax, kls, kent,
         thr) = ctx.saved_tensors
        acc = row_max.dtype

        def z(g):
            return torch.zeros_like(row_max) if g is None else g.to(acc).contiguous()

        bwd = getattr(torch.ops.ppo_kernels, ctx.prefix + "token_logprobs_bwd")
        t, temps = ck.split_temperature(ctx.temperature)
        dlogits = bwd(z(g_lp), None if g_ent is None else z(g_ent), logits3, tokens, mask,
                      row_max, log_sum, ent, t, temps)
        ks = KeptStats(None, kent, kmax, kls, None, None, thr if ctx.ks_fields else None)
        if g_kept is not None or g_ent_kept is not None:
            kernel_grad_(ctx.prefix, dlogits, z(g_kept),
                         None if g_ent_kept is None else z(g_ent_kept), logits3, tokens, mask,
                         ks, ctx.temperature, ctx.rp)
        return dlogits, None, None, None, None, None


def replay_logprobs(be, logits3, tokens, mask, temperature, rp):
    """(logp_kept, H_kept, logp, H, kept_mass, kept_size, missing) [B, T] on backend be,
    the first four differentiable in logits3 (0 where masked)."""
    if be.is_kernel:
        if wants_grad(logits3):
            return KernelReplayLogprobs.apply(logits3, tokens, mask, temperature, rp, be.prefix)
        with torch.no_grad():
            return KernelReplayLogprobs.forward(_NoCtx(), logits3, tokens, mask, temperature,
                                                rp, be.prefix)
    from . import _torch_impl
    logp, ent = _torch_impl.token_logprobs(logits3, tokens, mask, temperature, True)
    lp_k, ent_k, lse_k, size, missing = kept_logprobs_torch(logits3, tokens, mask, temperature,
                                                            rp)
    t = tokens.shape[1]
    with torch.no_grad():
        z = torch.where(mask.unsqueeze(-1), logits3[:, :t].to(lse_k.dtype), 0.0) / _col(
            temperature)
        mass = torch.where(mask, torch.exp(lse_k - torch.logsumexp(z, -1)), 0.0)
    return lp_k, ent_k, logp, ent, mass, size, missing


class _NoCtx:
    """A stand-in ctx for running KernelReplayLogprobs.forward without autograd."""

    def save_for_backward(self, *a):
        pass

    def mark_non_differentiable(self, *a):
        pass


class _VpKept(NamedTuple):
    """A vocabulary shard's kept-set statistics, merged over tp_group (vp_stats)."""

    logp: Any       # logp_kept [B, T], the whole vocabulary's kept set
    entropy: Any    # H_kept
    kept_max: Any   # the kept set's raw max over every shard
    log_sum: Any    # log sum_K exp((x - kept_max) / T), as log1p of the non-top mass
    size: Any       # int64
    missing: Any
    e_row: Any      # this shard's kept entries: flat row, local column, logit (acc)
    e_col: Any
    e_x: Any


def _vp_partials(logits3, tokens, mask, temperature, rp, shard):
    """This shard's part of the kept sets (CSR): the entries with ids in [start, start +
    V_r), plus the token on its owner where the set lacks it (every rank sees the whole
    CSR, so every rank knows which sets lack their token); per row (max, log1p(non-top
    mass), entropy, the token's shifted logit on its owner, count) as [B, T, 5]."""
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
    d = (e_x - top[e_row]) / _at(temperature, e_row)
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
    d_tok = torch.where(own & msk, (x_tok - top) / _flat(temperature), -inf)
    # the given ids this shard holds, per row: over the group they must add up to the row's
    # set (an id outside the whole vocabulary lies in no shard)
    held = torch.zeros(n, dtype=acc, device=dev).index_add_(0, row, (
        (rp.ids >= shard.start) & (rp.ids < shard.start + v_r)).to(acc))
    extra = torch.stack([torch.where(has, top, -inf), torch.where(has, l_r, 0.0), h_r, d_tok,
                         size, held], -1).view(b, t, 6)
    return extra, missing.view(b, t), e_row, e_col, e_x


def _vp_merge_kept(ext, mask, temperature):
    """The whole kept set's (logp_kept, H_kept, kept max, log_sum, size) from every rank's
    partials ext [tp, B, T, 5] (as VocabShard.merge does for the full row)."""
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
    return (torch.where(mask, logp, 0.0), torch.where(mask, ent, 0.0), big,
            torch.where(mask, ls, 0.0), torch.where(mask, ksz.sum(0), 0.0).long())


def vp_stats(prefix, logits3, tokens, mask, temperature, rp, shard):
    """The full statistics and the kept set's of a vocabulary shard, merged with ONE
    all-gather (the kept partials ride along the full statistics). Given kept sets only:
    re-derived sets over a split vocabulary need a global selection (not implemented).
    Returns (logp, H, row max, log_sum, local tokens, own, _VpKept)."""
    if not rp.given:
        raise NotImplementedError("top_k / top_p / min_p with tp_group: re-deriving the kept "
                                  "sets over a split vocabulary is not implemented; pass the "
                                  "engine's sampling_mask")
    require_ops(prefix)
    local, own = shard.local_tokens(tokens)
    fwd = getattr(torch.ops.ppo_kernels, prefix + "token_logprobs_fwd")
    t_num, temps = ck.split_temperature(temperature)
    lp, ent, mx, ls = fwd(logits3, local, mask, t_num, True, temps)
    extra, missing, e_row, e_col, e_x = _vp_partials(logits3, tokens, mask, temperature, rp,
                                                     shard)
    logp, ent, big, ls_all, ext = shard.merge(lp, ent, mx, ls, own, mask, temperature, tokens,
                                              extra=extra)
    lens = (rp.offsets[1:] - rp.offsets[:-1]).view(tokens.shape).to(ext.dtype)
    bad = ext[..., 5].sum(0) != lens
    msg = ("sampling_mask.token_ids: with tp_group every id must lie in one rank's shard of "
           "the vocabulary [0, sum of the local V)")
    if ext.device.type == "cpu":
        if bool(bad.any()):
            raise ValueError(msg)
    else:
        torch._assert_async(~bad.any(), msg)
    lp_k, ent_k, kmax, kls, size = _vp_merge_kept(ext, mask, temperature)
    return logp, ent, big, ls_all, local, own, _VpKept(lp_k, ent_k, kmax, kls, size, missing,
                                                       e_row, e_col, e_x)


def vp_kept_grad_(dz, g_kept, g_ent, tokens, mask, kept, temperature, shard):
    """dz [B, Tl, V_r] += the kept part of the gradient on this shard's kept entries."""
    b, t = tokens.shape
    r, c, x = kept.e_row, kept.e_col, kept.e_x
    temp_r = _at(temperature, r)
    lp = (x - kept.kept_max.reshape(-1)[r]) / temp_r - kept.log_sum.reshape(-1)[r]
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


class _VpReplayLogprobs(torch.autograd.Function):
    """(logp_kept, H_kept, logp, H, kept_mass, kept_size, missing) of a vocabulary shard,
    the same on every rank; the backward writes this shard's dlogits (no collective)."""

    @staticmethod
    def forward(ctx, logits3, tokens, mask, temperature, rp, shard, prefix):
        logp, ent, big, ls, local, own, kept = vp_stats(prefix, logits3, tokens, mask,
                                                        temperature, rp, shard)
        mass = kept_mass(kept.kept_max / temperature + kept.log_sum, big, ls, temperature,
                         mask)
        ctx.save_for_backward(logits3, tokens, local, own, mask, big, ls, ent)
        ctx.kept, ctx.temperature, ctx.shard, ctx.prefix = kept, temperature, shard, prefix
        ctx.mark_non_differentiable(mass, kept.size, kept.missing)
        return kept.logp, kept.entropy, logp, ent, mass, kept.size, kept.missing

    @staticmethod
    def backward(ctx, g_kept, g_ent_kept, g_lp, g_ent, *_):
        from ._autograd import first_order_only
        from .vocab_parallel import logits_grad
        first_order_only("token_logprobs (a split vocabulary)")
        logits3, tokens, local, own, mask, big, ls, ent = ctx.saved_tensors
        acc = big.dtype

        def z(g):
            return torch.zeros_like(big) if g is None else g.to(acc).contiguous()

        dz = logits_grad(ctx.prefix, z(g_lp), None if g_ent is None else z(g_ent), logits3,
                         local, mask, big, ls, ent, ctx.temperature, ctx.shard, own)
        if g_kept is not None or g_ent_kept is not None:
            vp_kept_grad_(dz, z(g_kept), None if g_ent_kept is None else z(g_ent_kept),
                          tokens, mask, ctx.kept, ctx.temperature, ctx.shard)
        return dz, None, None, None, None, None, None


def vp_replay_logprobs(be, logits3, tokens, mask, temperature, rp, shard):
    """replay_logprobs over a vocabulary split over tp_group (tokens global)."""
    if wants_grad(logits3):
        return _VpReplayLogprobs.apply(logits3, tokens, mask, temperature, rp, shard, be.prefix)
    with torch.no_grad():
        return _VpReplayLogprobs.forward(_NoCtx(), logits3, tokens, mask, temperature, rp,
                                         shard, be.prefix)


def vp_replay_passes(logits, spec, x, prefix, need_grad, shard):
    """_two_phase's three steps with a kept set over a split vocabulary (the kept partials
    ride along the one all-gather of the statistics)."""
    from ._two_phase import middle_grad
    from .vocab_parallel import logits_grad
    tok, msk, temp = x.kernel(x.tokens), x.kernel(x.mask), x.kernel_temperature(spec)
    logp, ent, big, ls, local, own, kept = vp_stats(prefix, logits, tok, msk, temp, x.replay,
                                                    shard)
    kl_kept, ent_kept = spec.kl_logprobs == "kept", spec.entropy_over == "kept"
    ent_sel = kept.entropy if ent_kept else ent
    out = middle_grad(x.padded(kept.logp), x.padded(ent_sel), spec, x,
                      None if kl_kept else x.padded(logp))
    dlk, dent, loss, pol = out[:4]
    gs = spec.effective_grad_scale(logits.dtype)
    dlogits = None
    if need_grad:
        g_full = torch.zeros_like(logp) if kl_kept else x.kernel(out[4] * gs).contiguous()
        g_ent = x.kernel(dent * gs).contiguous() if spec.entropy_coef != 0.0 else None
        dlogits = logits_grad(prefix, g_full, None if ent_kept else g_ent, logits, local, msk,
                              big, ls, ent, temp, shard, own)
        vp_kept_grad_(dlogits, x.kernel(dlk * gs).contiguous(), g_ent if ent_kept else None,
                      tok, msk, kept, temp, shard)
    ent_p = x.padded(ent_sel)
    loss_tok = torch.where(x.mask, pol - spec.entropy_coef * ent_p, 0.0)
    mass = kept_mass(kept.kept_max / temp + kept.log_sum, big, ls, temp, msk)
    aux = (x.padded(logp), x.padded(mass), x.padded(kept.size), x.padded(kept.missing))
    return loss.detach(), loss_tok, x.padded(kept.logp), ent_p, dlogits, gs, aux


def chunk_replay(rp, r0, r1):
    """The Replay of rows r0:r1 of the flat [N] rows, as a [1, r1 - r0] layout (the CSR ids
    rebased: a host read of two offsets on a device)."""
    c = r1 - r0
    if rp.given:
        o0, o1 = int(rp.offsets[r0]), int(rp.offsets[r1])
        return Replay(ids=rp.ids[o0:o1], offsets=(rp.offsets[r0:r1 + 1] - o0).contiguous())

    def rows(v):
        return None if v is None else v.reshape(-1)[r0:r1].view(1, c).contiguous()

    return Replay(top_k=rows(rp.top_k), top_p=rows(rp.top_p), min_p=rows(rp.min_p))
