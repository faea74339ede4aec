"""Tensor-parallel vocabulary: each rank of ``tp_group`` holds a contiguous shard of the
vocabulary (logits [.., V_r], or LM-head rows [V_r, H]); token ids are global.

Per row, each rank reduces its own shard with the existing kernels (token_logprobs_fwd: the
shard's max m_r, log_sum l_r = log(sum_v exp((x_v - m_r) / T)), entropy H_r and, on the one
rank that holds the sampled token, its log-prob in the shard; and the token id itself, for
the check that every rank has the same ones). One all-gather of these six numbers per row
(24 bytes in float32) gives every rank the whole row's statistics, merged locally:

    M = max_r m_r,  a_r = (m_r - M) / T,  1 + rest = sum_r exp(a_r + l_r)
      (the top shard contributes expm1(l_top): the top entry's 1 never enters a sum, so a
       confident token keeps its digits, as in the single-shard kernels)
    log_sum = log1p(rest),  w_r = exp(a_r + l_r - log_sum)   (the shard's probability mass)
    H = sum_r w_r H_r - sum_r w_r log w_r                    (entropy of a mixture of shards)
    logp = (x_tok - m_own) / T + a_own - log_sum

Each rank then writes its own shard of dlogits with token_logprobs_bwd and the merged
(M, log_sum, H): log p_v = (x_v - M) / T - log_sum is the whole row's softmax. A rank that
does not hold the token hands the kernel a placeholder id 0 and then rewrites that one entry
with the dense (non-token) formula, d_v = -p_v (dlogp + dH (log p_v + H)) / T (ppo_math.h
dlogit_dense), from the logit itself, so no entry is rounded twice. No collective in the
backward: the gradient in logp and H is replicated on every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ._checks import host_readable, tensor
from .context_parallel import check_group


class VocabShard:
    """This rank's slice [start, start + v_local) of the vocabulary and its group."""

    def __init__(self, group, start, v_local):
        self.group, self.start, self.v_local = group, start, v_local
        self.size = dist.get_world_size(group)

    def local_tokens(self, tokens):
        """(ids local to the shard with the placeholder 0 where another rank holds the token,
        own: bool [B, T])."""
        local = tokens - self.start
        own = (local >= 0) & (local < self.v_local)
        return torch.where(own, local, 0), own

    def merge(self, logp_r, ent_r, row_max, log_sum, own, mask, temperature, tokens=None,
              extra=None):
        """The whole row's (logp, H or None, row max, log_sum) [B, T] from this shard's
        kernel outputs; one all-gather, which also carries every rank's (vocab_start, V_r)
        so that shards that overlap or leave a gap are caught, and every rank's mask and
        (global) token ids, which must be the same on every rank. Those, and valid rows
        whose token no shard holds, are a ValueError on CPU tensors (on every rank alike:
        each sees the same gathered numbers), an asynchronous device assertion elsewhere.
        extra: [B, T, k] more per-row numbers of this rank carried by the same all-gather
        (sampling replay's kept-set partials, ppo_kernels/kept_rows.py); then every rank's
        [tp, B, T, k] comes back as a fifth result."""
        has_ent = ent_r is not None and ent_r.numel() > 0
        # a row whose whole shard is -inf (banned) holds no mass here: the kernel's log_sum
        # and entropy of it are NaN, and must not reach the merge
        live = mask & (row_max > -math.inf)
        zero = torch.zeros_like(row_max)
        part = torch.stack([
            torch.where(mask, row_max, zero), torch.where(live, log_sum, zero),
            torch.where(live, ent_r, zero) if has_ent else zero,
            torch.where(mask & own, logp_r + log_sum, -math.inf),  # (x_tok - m_r) / T
            (mask & own).to(row_max.dtype),
            # the id (-1 where masked), for the check that every rank has the same ones
            torch.where(mask, (tokens if tokens is not None else zero).to(row_max.dtype),
                        -1.0)], dim=-1).reshape(-1, 6)
        k = 0 if extra is None else extra.shape[-1]
        if k:
            part = torch.cat([part, extra.to(part.dtype).reshape(-1, k)], dim=1)
        layout = part.new_zeros((1, 6 + k))
        layout[0, 0], layout[0, 1] = self.start, self.v_local
        parts = all_gather(torch.cat([part, layout]), self.group)  # [tp, N + 1, 6 + k]
        check_layout(parts[:, -1, 0], parts[:, -1, 1])
        rows = parts[:, :-1].reshape((self.size,) + tuple(mask.shape) + (6 + k,))
        mx, ls, h, d, owners, ids = rows[..., :6].unbind(-1)
        if tokens is not None:
            _check_same_tokens(ids)
        big = mx.max(0).values
        a = (mx - big) / temperature
        a = torch.where(mask, a, 0.0)  # masked rows: no NaN from -inf - -inf
        top = torch.zeros_like(mx, dtype=torch.bool).scatter_(0, mx.argmax(0, keepdim=True),
                                                               True)
        rest = torch.where(top, torch.expm1(ls), torch.exp(a + ls)).sum(0)
        ls_all = torch.log1p(rest)
        logp = torch.where(owners > 0, d + a, -math.inf).max(0).values - ls_all
        ent = None
        if has_ent:
            log_w = a + ls - ls_all
            w = torch.exp(log_w)
            ent = (w * h).sum(0) - torch.where(w > 0, w * log_w, 0.0).sum(0)
            ent = torch.where(mask, ent, 0.0)
        _check_owners(owners.sum(0), mask, self.start, self.v_local)
        if k:
            return torch.where(mask, logp, 0.0), ent, big, ls_all, rows[..., 6:]
        return torch.where(mask, logp, 0.0), ent, big, ls_all

    def fix_placeholder_(self, dz, logits, own, mask, dlogp, dent, row_max, log_sum, ent,
                         temperature):
        """Rewrites entry 0 of the rows whose token another rank holds (the kernel wrote the
        token formula there) with the dense formula. dz, logits: [B, Tl, V_r]; the rest
        [B, T]."""
        t = mask.shape[1]
        fix = mask & ~own
        x0 = logits[:, :t, 0].to(row_max.dtype)
        logp0 = (x0 - row_max) / temperature - log_sum
        p0 = torch.exp(logp0)
        g = dlogp if dent is None else dlogp + dent * (logp0 + ent)
        val = torch.where(p0 == 0, 0.0, -p0 * g) / temperature
        col = dz[:, :t, 0]
        col.copy_(torch.where(fix, val.to(dz.dtype), col))
        return dz


def check_layout(starts, sizes):
    """The shards, in order of their starts, must tile [0, sum V_r) (float32 holds the ids
    exactly up to 2^24)."""
    order = torch.argsort(starts)
    st, sz = starts[order], sizes[order]
    ok = (st[0] == 0) & (st[1:] == st[:-1] + sz[:-1]).all()
    msg = ("vocab_start: the vocabulary shards of tp_group must tile the vocabulary (each "
           "starting where another ends, the first at 0); its default, rank * local V, "
           "assumes an even split: pass vocab_start= for an uneven one")
    if not host_readable(starts):
        torch._assert_async(ok, msg)
    elif not bool(ok):
        shards = [(int(a), int(a + b)) for a, b in zip(st.tolist(), sz.tolist())]
        raise ValueError(f"{msg}; got the shards {shards}")


def _check_same_tokens(ids):
    """ids [tp, B, T]: every rank's token ids (-1 where masked) must be the same: a rank
    whose id differs where another rank holds the token would otherwise be given that rank's
    log-prob, silently (float32 holds the ids exactly below 2^24)."""
    bad = (ids != ids[:1]).any(0)
    msg = ("tokens: the ranks of tp_group must hold the same tokens and response_mask (each "
           "has its own slice of the vocabulary, not of the batch)")
    if not host_readable(ids):
        torch._assert_async(~bad.any(), msg)
    elif bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        got = [int(v) for v in ids[(slice(None), *idx)].tolist()]
        raise ValueError(f"{msg}; at position {idx} the ranks hold {got} (-1: masked)")


def _check_owners(count, mask, start, v_local):
    bad = mask & (count != 1)
    msg = ("tokens: with a vocabulary split over tp_group every valid token id must lie in "
           "exactly one rank's shard [vocab_start, vocab_start + local V); ids out of the "
           "whole vocabulary, or shards that overlap or leave gaps, break that")
    if not host_readable(count):
        torch._assert_async(~bad.any(), msg)
    elif bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{msg}: {int(count[tuple(idx)])} shards hold the token at position "
                         f"{idx} (this rank: [{start}, {start + v_local}))")


def all_gather(x, group):
    """[tp, *x.shape]: every rank's x, stacked (one collective)."""
    n = dist.get_world_size(group)
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    # (all_gather_single is all_gather_into_tensor's name from torch 2.14 on)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous(), group=group)
    return out.view((n,) + tuple(x.shape))


def shard_of(x, tp_group, vocab_start, v_dim, name):
    """(local tensor, VocabShard or None) for x whose vocabulary dimension v_dim is split:
    a DTensor sharded on it (torch's tensor parallel: Shard(v_dim); a head weight, v_dim 0,
    only with tp_group, since FSDP2 shards parameters on dim 0 too), or a plain local shard
    with tp_group (vocab_start defaults to rank * local V, an even split)."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # a torch without DTensor
        DTensor = ()
    if isinstance(x, DTensor):
        head = v_dim % x.dim() == 0
        if vocab_start is not None or (tp_group is not None and not head):
            raise ValueError(f"{name}: a DTensor carries its own mesh; pass neither tp_group "
                             f"nor vocab_start with it")
        mesh = x.device_mesh
        if head and tp_group is None:
            # a head weight sharded on its rows is what FSDP2 (fully_shard) leaves between
            # forwards as well as tensor parallel's vocabulary split: the hidden states are
            # the same on every rank only in the second case, and nothing in the tensor
            # says which
            raise ValueError(
                f"{name}: a DTensor sharded on dim 0 (placements {list(x.placements)}) is "
                f"either FSDP2's parameter shard or a tensor-parallel split of the "
                f"vocabulary, which need different computations; for a vocabulary split "
                f"pass tp_group= (its mesh's group), for FSDP2 call the op inside the "
                f"module's forward or pass the whole weight (docs/DISTRIBUTED.md)")
        if tp_group is not None and mesh.ndim == 1 and \
                dist.get_process_group_ranks(tp_group) != \
                dist.get_process_group_ranks(mesh.get_group()):
            raise ValueError(f"tp_group: the ranks {dist.get_process_group_ranks(tp_group)} "
                             f"are not those of {name}'s mesh "
                             f"{dist.get_process_group_ranks(mesh.get_group())}")
        if mesh.ndim != 1 or len(x.placements) != 1 or \
                x.placements[0] != Shard(v_dim % x.dim()):
            raise ValueError(f"{name}: a DTensor must be sharded on the vocabulary dimension "
                             f"(placements [Shard({v_dim})] on a 1-D mesh), got "
                             f"{list(x.placements)} on a {mesh.ndim}-D mesh")
        v = x.shape[v_dim]
        n = mesh.size()
        chunk = -(-v // n)  # DTensor's Shard splits like torch.chunk
        if chunk * (n - 1) >= v:  # (every rank knows: all of them raise, none waits)
            raise ValueError(f"{name}: a vocabulary of {v} split over {n} ranks leaves a rank "
                             f"an empty shard")
        start = min(mesh.get_local_rank() * chunk, v)
        local = x.to_local()
        group = mesh.get_group()
    elif tp_group is None:
        if vocab_start is not None:
            raise ValueError("vocab_start: only meaningful with tp_group")
        return x, None
    else:
        tensor(name, x)
        if x.dim() == 0:
            raise ValueError(f"{name}: expected a vocabulary dimension, got a 0-d tensor")
        local, group = x, check_group(tp_group, "tp_group")
        if vocab_start is None:
            start = dist.get_rank(group) * x.shape[v_dim]
        else:
            if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or \
                    vocab_start < 0:
                raise ValueError(f"vocab_start: expected an int >= 0, got {vocab_start!r}")
            start = vocab_start
    if local.shape[v_dim] == 0:
        raise ValueError(f"{name}: this rank's vocabulary shard is empty (more ranks than "
                         f"vocabulary entries)")
    return local, VocabShard(group, start, local.shape[v_dim])


def all_reduce_sum_(x, group):
    """In-place sum over the group, in float32 at least (bf16 / fp16 partial gradients of
    the hidden states would otherwise round once more per rank)."""
    if x.dtype in (torch.bfloat16, torch.float16):
        wide = x.float()
        dist.all_reduce(wide, group=group)
        x.copy_(wide)
    else:
        dist.all_reduce(x, group=group)
    return x


def require_kernels(be, shard):
    """The merge runs on the kernels' row statistics: no eager-composite twin."""
    if shard is not None and not be.is_kernel:
        raise ValueError(f"backend: a vocabulary split over tp_group runs on the kernel "
                         f"backends ('cpu', 'cuda', 'triton'), got {be.name!r}")
