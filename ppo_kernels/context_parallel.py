"""Context parallel: every rank of ``cp_group`` holds a contiguous piece of each sequence
(the same B sequences, [B, T_r] positions each). The per-token terms are local; what
reduces over a whole sequence is not: GSPO's sequence ratio, the seq-mean modes' lengths
and counts, the token-mean count, the sequence rollout corrections, the off-policy mask and
the per-sequence metrics. Those reductions go through the functions here, which take the
group as an argument (the record's LossSpec.cp_group): sums over it, or plain sums for None.

The sum that carries a gradient (GSPO's mean log-ratio) is an all-reduce whose backward is
an all-reduce of the incoming gradient: with the loss of the whole batch the sum of the
ranks' losses, each rank's gradient is then the whole loss's gradient in its own logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

def check_group(cp_group, name="cp_group"):
    """cp_group: None or a ProcessGroup of an initialised torch.distributed."""
    if cp_group is None:
        return None
    if not dist.is_initialized():
        raise ValueError(f"{name}: torch.distributed is not initialised")
    if not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"{name}: expected a torch.distributed ProcessGroup, got "
                        f"{type(cp_group).__name__}")
    return cp_group


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the backward sums the incoming gradients (setup_context style, so
    torch.func.grad can differentiate through it)."""

    @staticmethod
    def forward(x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def group_sum(x, group=None):
    """x summed over ``group``, elementwise (differentiable); x itself for None."""
    return x if group is None else _AllReduceSum.apply(x, group)


def seq_sum(x, group=None):
    """sum over the last dimension of [B, T] (the whole sequence across the group), [B, 1]."""
    return group_sum(x.sum(-1, keepdim=True), group)


def seq_any(b, group=None):
    """Whether any position of each sequence (across the group) is set: bool [B]."""
    return seq_sum(b.to(torch.float32), group)[:, 0] > 0


def length(t, like, group=None):
    """The whole sequences' padded length: T summed over the group (a 0-d tensor), or T."""
    if group is None:
        return t
    return group_sum(torch.tensor(float(t), dtype=like.dtype, device=like.device), group)
