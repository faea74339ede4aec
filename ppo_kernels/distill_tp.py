"""distill_loss over a tensor-parallel vocabulary (tp_group= / vocab_start= / a Shard(-1)
DTensor of logits): each rank of the group holds a contiguous shard [start, start + V_r) of
the vocabulary; the teacher's ids are global.

Per row i, each rank r reduces its shard of z = logits / temperature (torch ops; this first
version composes torch ops, not a fused kernel) to its max m_r and, relative to it,

    rest_r = sum_{v in shard, v != top} exp(z_v - m_r)  (the shard's denominator less the
                                                       top entry's 1; -1: a -inf shard)
    s_r = sum_{j in S, owned} exp(z_j - m_r)           (student mass of the owned set entries)
    c_r = sum_{v in shard, v not in S} exp(z_v - m_r)  (the complement, summed, never 1 - PS)
    d_r = sum_{j in S, owned, pT_j > 0} pT_j (lT_j - (z_j - m_r))
    PT_r = sum_{j owned} pT_j,   k_r = how many entries it owns

plus the row's entry count and the sum of its ids (for the check that every rank has the
same sets; ranks whose sets differ with the same count and id sum are not caught). ONE
all-gather of these nine numbers per row (and one row of the shard's [start, V_r]) gives
every rank every shard's (the scheme of Megatron-LM's vocab_parallel_cross_entropy,
https://github.com/NVIDIA/Megatron-LM, extended to the teacher's sets), merged locally into
the formulas of ppo_kernels/distill.py (GKD, arXiv:2306.13649):

    M = max_r m_r,  a_r = m_r - M,  1 + more = sum_r exp(a_r) (1 + rest_r)
      (the top shard adds rest_top: its 1 never enters a sum, as in vocab_parallel.py)
    L = log1p(more)                                                  (log-sum of the row)
    PS = sum_r exp(a_r) s_r / exp(L),   log(1 - PS) = log sum_r exp(a_r) c_r - L
    kl_set = sum_r (d_r - PT_r a_r) + PT L       (log pS_j = z_j - m_r + a_r - L)
    kl = kl_set + [tail] (1 - PT) (log1p(-PT) - log(1 - PS))

The merge is differentiable in the gathered partials: the loss is the same on every rank,
so the gradient of an all-gather's output in this rank's block is already the whole
gradient of this rank's partials (no collective in the backward), and autograd through the
shard's torch ops writes this rank's shard of dlogits (m_r is the top entry's z, with its
gradient).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import vocab_parallel as _vp
from ._checks import host_readable
from .distill import check_call, finish_loss, logits_of, metrics_of, placeholder_tokens
from .head_chunks import head_options, head_shard, hidden_and_tokens, materialised_logits
from .rank_agreement import checks_together, groups

N_PARTS = 9  # numbers per row and rank in the all-gather


class _GatherRows(torch.autograd.Function):
    """[tp, *x.shape] every rank's x (one all-gather). The backward returns this rank's
    block of the incoming gradient: every rank computes the same loss from the same
    gathered tensor, so that block is the loss's whole gradient in this rank's x."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.rank = dist.get_rank(group)
        return _vp.all_gather(x, group)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.rank], None


def _group_of(logits, tp_group):
    """The group whose ranks decide validity together: tp_group, or a 1-D DTensor's mesh's."""
    if tp_group is not None:
        return tp_group
    mesh = getattr(logits, "device_mesh", None)
    if mesh is not None and mesh.ndim == 1:
        return mesh.get_group()
    return None


def shard_partials(z, shard, ids, row_of, lt, valid):
    """The per-row partials [n, N_PARTS] of this rank's shard z [n, V_r] (differentiable in
    z; module docstring): m, rest, s, c, d, PT_r, k_r, the row's entry count and id sum (-1
    if masked)."""
    n, v_r = z.shape
    loc = ids - shard.start
    own = valid[row_of] & (loc >= 0) & (loc < v_r)
    loc = torch.where(own, loc, 0)
    # (differentiable: with the top entry's 1 taken out of the sum, m_r = z_top carries
    # that entry's gradient)
    mx = z.max(dim=-1)
    m, top = mx.values, mx.indices
    live = m > -math.inf
    ms = torch.where(live, m, 0.0)
    # exp(z - m_r) with the shard's top entry (its exp is 1) left out: the rest's sum keeps
    # its digits next to that 1 (log1p in the merge, as every kernel of the package)
    ez = torch.exp(z - ms[:, None]).scatter(1, top[:, None], 0.0)  # [n, V_r]
    # the owned set entries of each row (no boolean indexing: no host read on a device)
    in_set = torch.zeros(n, v_r, dtype=torch.int32, device=z.device).index_put_(
        (row_of, loc), own.to(torch.int32), accumulate=True) > 0
    top_out = live & ~in_set.gather(1, top[:, None])[:, 0]
    rest = torch.where(live, ez.sum(dim=-1), -1.0)  # -1: a whole -inf shard
    c = ez.masked_fill(in_set, 0.0).sum(dim=-1) + top_out.to(z.dtype)
    zj = z[row_of, loc] - ms[row_of]  # [nnz], z_j - m_r on the owned entries
    pt = lt.exp()
    on = own & (pt > 0)
    zero = torch.zeros(n, dtype=z.dtype, device=z.device)
    s = zero.index_add(0, row_of, torch.where(own, torch.exp(zj), 0.0))
    d = zero.index_add(0, row_of, torch.where(
        on, pt * (lt.where(on, 0.0) - zj.where(on, 0.0)), 0.0))
    ptr = zero.index_add(0, row_of, torch.where(own, pt, 0.0))
    k = zero.index_add(0, row_of, own.to(z.dtype))
    cnt = torch.where(valid, zero.index_add(0, row_of, torch.ones_like(pt)), -1.0)
    # the sum of the row's (global) ids: ranks whose sets differ mostly differ there too
    # (summed in int64, so the same sets give the same float on every rank, in any order)
    idsum = torch.zeros(n, dtype=torch.long, device=z.device).index_add_(0, row_of, ids)
    idsum = torch.where(valid, idsum.to(z.dtype), -1.0)
    return torch.stack([ms, rest, s, c, d, ptr, k, cnt.detach(), idsum.detach()], dim=-1)


def _check_sets(k_all, sets, valid, v_total, start, v_local):
    """Every rank must hold the same rows' entry counts and id sums (sets [tp, n, 2]), and
    every entry of a valid row must lie in exactly one shard (the union of the shards is
    [0, v_total)). k_all [tp, n]: the entries each rank owns."""
    same = (sets != sets[:1]).any(-1).any(0)
    cnt_all = sets[..., 0]
    missing = valid & (k_all.sum(0) != cnt_all[0])
    msg_same = ("teacher: the ranks of tp_group must hold the same teacher sets and "
                "response_mask (each has its own slice of the vocabulary, not of the batch)")
    msg_ids = (f"teacher.token_ids: with a vocabulary split over tp_group every id of a valid "
               f"position must lie in exactly one rank's shard, i.e. in [0, {int(v_total)})")
    if not host_readable(k_all):
        torch._assert_async(~same.any(), msg_same)
        torch._assert_async(~missing.any(), msg_ids)
        return
    if bool(same.any()):
        i = int(same.nonzero()[0, 0])
        got = [tuple(int(x) for x in row) for row in sets[:, i].tolist()]
        raise ValueError(f"{msg_same}; at position {i} the ranks hold (entries, sum of the "
                         f"ids) {got} (-1: masked)")
    if bool(missing.any()):
        i = int(missing.nonzero()[0, 0])
        raise ValueError(f"{msg_ids}; at position {i}, {int(cnt_all[0, i] - k_all[:, i].sum())}"
                         f" of its {int(cnt_all[0, i])} ids lie in no shard (this rank: "
                         f"[{start}, {start + v_local}))")


def merge(parts, valid, tail, v_total):
    """(kl, student_mass, teacher_tail) [n] from every rank's partials [tp, n, N_PARTS]
    (differentiable in them; module docstring); 0 on invalid rows. v_total: the whole
    vocabulary's size (a set of that many ids has no tail)."""
    mx, rest, s, c, d, ptr, k = parts[..., :7].unbind(-1)
    live = rest >= 0
    mxl = torch.where(live, mx, -math.inf)
    big = mxl.max(dim=0).values
    ok = valid & (big > -math.inf)
    big = torch.where(big > -math.inf, big, 0.0)
    a = torch.where(live, mx - big, 0.0)
    w = torch.where(live, torch.exp(a), 0.0)
    # 1 + more = sum_r w_r (1 + rest_r): the top shard's 1 never enters the sum
    top = torch.zeros_like(live).scatter_(0, mxl.argmax(0, keepdim=True), True)
    more = torch.where(top, rest, w * (1.0 + rest)).sum(0)
    log_sum = torch.log1p(torch.where(ok, more, 0.0))
    ps = (w * s).sum(0) * torch.exp(-log_sum)
    pt_sum = ptr.sum(0)
    kl = (d - ptr * a).sum(0) + pt_sum * log_sum
    whole = k.sum(0) == v_total
    tail_t = torch.where(whole, 0.0, (1.0 - pt_sum).clamp(min=0.0))
    if tail:
        has = ok & (tail_t > 0)
        comp = (w * c).sum(0)
        log_comp = torch.log(torch.where(has, comp, 1.0)) - log_sum
        term = tail_t * (torch.log1p(-pt_sum.where(has, 0.0)) - log_comp.where(has, 0.0))
        kl = kl + torch.where(has, term, 0.0)
    z = torch.zeros_like(kl)
    return (torch.where(valid, kl, z), torch.where(valid, ps, z).detach(),
            torch.where(valid, tail_t, z).detach())


def distill_loss_tp(logits, teacher, response_mask, opts):
    """pk.distill_loss with tp_group / vocab_start / a Shard(-1) DTensor of logits (opts:
    distill_loss's keyword arguments). Returns (loss, metrics) as distill_loss, the same on
    every rank; the gradient is this rank's shard's."""
    tp_group, vocab_start = opts["tp_group"], opts["vocab_start"]

    def checks():  # no collective: the ranks decide validity together
        local, shard = _vp.shard_of(logits, tp_group, vocab_start, -1, "logits")
        if shard is None:  # (shard_of raised for vocab_start without tp_group)
            raise ValueError("tp_group: expected a process group with vocab_start")
        logits3, flat = logits_of(local)
        o = dict(opts, flat=flat)
        c, tail, temperature, gs = check_call(logits3, None, teacher, response_mask, o,
                                              sharded=True)
        return logits3, shard, c, tail, temperature

    logits3, shard, c, tail, temperature = checks_together(
        groups(tp_group=_group_of(logits, tp_group)), checks,
        lambda r: {"tp_group": tuple(r[2].mask.shape)})
    return sharded_distill(logits3, shard, c, tail, temperature)


def sharded_distill(logits3, shard, c, tail, temperature):
    """(loss, metrics) of distill_loss from this rank's checked shard logits3 [B, Tl, V_r]
    (differentiable) and the checked call c: the partials, the all-gather, the checks of
    the gathered layout and sets, the merge."""
    b, t = c.mask.shape
    n = b * t
    valid = c.mask.reshape(n)
    z = logits3[:, :t].to(c.acc).reshape(n, -1) / temperature
    part = shard_partials(z, shard, c.ids, c.row_of, c.lt, valid)
    layout = part.new_zeros((1, N_PARTS))
    layout[0, 0], layout[0, 1] = shard.start, shard.v_local
    parts = _GatherRows.apply(torch.cat([part, layout]), shard.group)  # [tp, n + 1, 9]
    starts, sizes = parts[:, -1, 0].detach(), parts[:, -1, 1].detach()
    _vp.check_layout(starts, sizes)
    rows = parts[:, :-1]
    v_total = sizes.sum()
    _check_sets(rows[..., 6].detach(), rows[..., 7:].detach(), valid, v_total, shard.start,
                shard.v_local)
    kl, ps, tt = (x.view(b, t) for x in merge(rows, valid, tail, v_total))
    loss = None if c.weights is None else (c.weights * kl).sum()
    return finish_loss(c, loss, kl), metrics_of(c, kl if loss is None else kl.detach(), ps, tt)


class _CopyToGroup(torch.autograd.Function):
    """The identity forward; the backward sums the gradient over the group (the hidden
    states are the same on every rank, each rank's logits shard depends on them: Megatron's
    copy_to_tensor_model_parallel_region), in float32 at least."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _vp.all_reduce_sum_(g.contiguous().clone(), ctx.group), None


def distill_loss_from_hidden_tp(hidden, lm_head_weight, lm_head_bias, teacher, response_mask,
                                opts, logit_softcap, chunk_size, accum_dtype=None):
    """pk.distill_loss_from_hidden with tp_group / vocab_start: the LM head's rows
    [V_r, H] (bias [V_r]) of this rank, hidden [B, T, H] the same on every rank. This first
    version materialises the shard's logits [B, T, V_r] (differentiably, torch ops) and runs
    sharded_distill on them; d hidden is summed over the group in the backward (one
    all-reduce of B T H numbers)."""

    def checks():  # no collective: the ranks decide validity together
        tokens = placeholder_tokens(hidden, teacher)
        h, w, bias, shard = head_shard(hidden, lm_head_weight, lm_head_bias,
                                        opts["tp_group"], opts["vocab_start"])
        if shard is None:
            raise ValueError("tp_group: expected a process group with vocab_start")
        hidden3, _, flat = hidden_and_tokens(h, w, bias, tokens)
        c, tail, temperature, _ = check_call(hidden3, None, teacher, response_mask,
                                             dict(opts, flat=flat), name="hidden",
                                             sharded=True)
        cap = head_options(hidden3, w, logit_softcap, chunk_size,
                           accum_dtype=accum_dtype).cap
        return hidden3, w, bias, shard, c, tail, temperature, cap

    hidden3, w, bias, shard, c, tail, temperature, cap = checks_together(
        groups(tp_group=opts["tp_group"]), checks,
        lambda r: {"tp_group": tuple(r[4].mask.shape)})
    h = _CopyToGroup.apply(hidden3, shard.group) if hidden3.requires_grad else hidden3
    logits = materialised_logits(h, w, bias, cap, c.mask)
    return sharded_distill(logits, shard, c, tail, temperature)


__all__ = ["distill_loss_tp", "distill_loss_from_hidden_tp", "sharded_distill",
           "shard_partials", "merge"]
