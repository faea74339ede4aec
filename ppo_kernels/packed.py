"""Packed sequences (verl's and OpenRLHF's remove-padding layout): S sequences laid end to
end as [1, total] (or [total]) with their boundaries in ``cu_seqlens`` (int [S + 1],
cu_seqlens[0] = 0, non-decreasing, cu_seqlens[S] = total), as flash-attn's varlen API takes
them.

The kernels never see the layout: a row of logits is a row, and the per-token ops read the
packed tensors as they are. Only the [B, T]-sized steps that reduce over a sequence (GAE's
reverse scan, the last-token score, GSPO's ratio, the seq-mean modes, the sequence-level
rollout correction, the metrics per sequence) run on a padded [S, max_seqlen] copy of the
per-token tensors, which costs O(total) and never touches the logits.
"""

from __future__ import annotations

import torch

from . import _checks as ck


class Packing:
    """The index maps of one cu_seqlens: token i of the packed layout is position
    pos[i] of sequence seq_id[i]."""

    def __init__(self, seq_id, pos, num_seqs, max_len, total, lens):
        self.seq_id, self.pos = seq_id, pos
        self.num_seqs, self.max_len, self.total = num_seqs, max_len, total
        self.lens = lens  # int64 [S], the sequences' lengths

    def pad(self, x, fill=0.0):
        """[1, total] (or [total]) -> [S, max_seqlen], ``fill`` off the sequences;
        differentiable."""
        x = x.reshape(self.total)
        out = torch.full((self.num_seqs, self.max_len), fill, dtype=x.dtype, device=x.device)
        return out.index_put((self.seq_id, self.pos), x)

    def unpad(self, y):
        """[S, max_seqlen] -> [1, total]; differentiable."""
        return y[self.seq_id, self.pos].unsqueeze(0)

    def per_seq(self, a):
        """A per-sequence [S] tensor spread over its tokens, [1, total]."""
        return a.reshape(self.num_seqs)[self.seq_id].unsqueeze(0)


def check_max_seqlen(max_seqlen):
    """Without cu_seqlens there is no packing for max_seqlen to describe."""
    if max_seqlen is not None:
        raise ValueError("max_seqlen: only meaningful with cu_seqlens")


def packing(cu_seqlens, total, like, max_seqlen=None):
    """Checks cu_seqlens against ``total`` packed positions (like: a tensor of the device
    they must share) and returns a Packing, or None for cu_seqlens=None.

    The longest sequence sets the padded width: ``max_seqlen`` when given (an upper bound
    is fine), else read from cu_seqlens, which on a device is a host read (pass max_seqlen
    to avoid it, as with flash-attn). On CPU tensors a bad cu_seqlens is a ValueError; on a
    device an asynchronous device assertion."""
    if cu_seqlens is None:
        check_max_seqlen(max_seqlen)
        return None
    ck.tensor("cu_seqlens", cu_seqlens, integer=True)
    ck.same_device("cu_seqlens", cu_seqlens, "tokens", like)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens: expected int [S + 1] (a 1-D tensor of at least one "
                         f"entry), got shape {list(cu_seqlens.shape)}")
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    ok = (cu[0] == 0) & (cu[-1] == total) & (lens >= 0).all()
    msg = (f"cu_seqlens: expected cu_seqlens[0] = 0, non-decreasing, cu_seqlens[-1] = "
           f"{total} (the packed length)")
    if ck.host_readable(cu):
        if not bool(ok):
            raise ValueError(f"{msg}; got {cu.tolist()[:8]}{' ...' if cu.numel() > 8 else ''}")
    else:
        torch._assert_async(ok, msg)
    s = cu.numel() - 1
    if max_seqlen is None:
        max_len = int(lens.max()) if s > 0 else 0
    else:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
            raise ValueError(f"max_seqlen: expected an int >= 0, got {max_seqlen!r}")
        max_len = max_seqlen
        if s > 0 and ck.host_readable(lens):
            if int(lens.max()) > max_len:
                raise ValueError(f"max_seqlen: {max_len} is shorter than the longest "
                                 f"sequence ({int(lens.max())})")
        elif s > 0:
            torch._assert_async(lens.max() <= max_len, "max_seqlen: shorter than the longest "
                                                       "sequence of cu_seqlens")
    idx = torch.arange(total, device=cu.device)
    seq_id = torch.searchsorted(cu[1:], idx, right=True).clamp(max=max(s - 1, 0))
    pos = idx - cu[seq_id] if s > 0 else idx
    return Packing(seq_id, pos.clamp(max=max(max_len - 1, 0)), s, max_len, total, lens)


def packed_like(x, name, total):
    """[total] or [1, total] per-token tensors of the packed layout; a ValueError naming x
    otherwise. Returns x as [1, total]."""
    ck.tensor(name, x)
    if x.dim() == 1 and x.shape[0] == total:
        return x.unsqueeze(0)
    if x.dim() == 2 and tuple(x.shape) == (1, total):
        return x
    raise ValueError(f"{name}: with cu_seqlens expected the packed layout [1, {total}] or "
                     f"[{total}], got {list(x.shape)}")


def total_of(x, name):
    """The packed length of a [total] or [1, total] tensor (a ValueError otherwise)."""
    ck.tensor(name, x)
    if x.dim() == 1 or (x.dim() == 2 and x.shape[0] == 1):
        return x.shape[-1]
    raise ValueError(f"{name}: with cu_seqlens expected the packed layout [1, total] or "
                     f"[total], got {list(x.shape)}")


def packed_temperature(pk, temperature):
    """A temperature of packed sequences in the packed layout: a per-sequence [S] / [S, 1]
    tensor spread over its tokens (a 1-D tensor of S == total entries is per token), a
    per-token [total] / [1, total] one as [1, total]; a number as it is (ck.temperature
    checks either)."""
    if not isinstance(temperature, torch.Tensor):
        return temperature
    if temperature.dim() == 0:
        return temperature.reshape(1, 1).expand(1, pk.total)
    s = pk.num_seqs
    if tuple(temperature.shape) == (s, 1) or (tuple(temperature.shape) == (s,) and
                                              s != pk.total):
        return pk.per_seq(temperature)
    return packed_like(temperature, "temperature", pk.total)


def padded_inputs(pk, mask, like_name, like, **tensors):
    """(mask [S, L], {name: [S, L] or None}) for per-token tensors of the packed layout of
    ``like`` (mask None: every packed position is valid; the padding never is). The
    tensors' own checks (dtype, device) are the caller's, on the padded copies."""
    total = pk.total
    if mask is None:
        m = torch.ones(1, total, dtype=torch.bool, device=like.device)
    else:
        ck.tensor("response_mask", mask)
        ck.same_device("response_mask", mask, like_name, like)
        m = packed_like(mask, "response_mask", total) != 0
    out = {}
    for k, v in tensors.items():
        if v is not None:
            ck.tensor(k, v)
            ck.same_device(k, v, like_name, like)
            v = pk.pad(packed_like(v, k, total))
        out[k] = v
    return pk.pad(m, False), out


def unpadded(pk, y, like):
    """y [S, L] back to the packed layout of ``like`` ([total] or [1, total])."""
    out = pk.unpad(y)
    return out[0] if like.dim() == 1 else out
