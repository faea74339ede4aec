"""Context parallel: every rank of ``cp_group`` holds a contiguous piece of each sequence
(the same B sequences, [B, T_r] positions each). The per-token terms are local; what
reduces over a whole sequence is not: GSPO's sequence ratio, the seq-mean modes' lengths
and counts, the token-mean count, the sequence rollout corrections, the off-policy mask and
the per-sequence metrics. Those reductions go through the functions here, which sum over
the group while an op runs under ``sequence_group(cp_group)`` and are plain sums otherwise.

The sum that carries a gradient (GSPO's mean log-ratio) is an all-reduce whose backward is
an all-reduce of the incoming gradient: with the loss of the whole batch the sum of the
ranks' losses, each rank's gradient is then the whole loss's gradient in its own logits.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

# The group of the op running now (None: none). A module global, not a ContextVar:
# torch.compile traces a read of a global (a guard) but not ContextVar.set, and only an op
# with a cp_group ever sets it.
_GROUP = None


@contextlib.contextmanager
def sequence_group(group):
    """Within the block, the sequence reductions below sum over ``group``."""
    global _GROUP
    previous, _GROUP = _GROUP, group
    try:
        yield
    finally:
        _GROUP = previous


def run_in(group, fn):
    """fn() with the sequence reductions over group; a plain call for group None (so that
    torch.compile sees no context manager at all)."""
    if group is None:
        return fn()
    with sequence_group(group):
        return fn()


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


def group_sum(x):
    """x summed over the sequence group, elementwise (differentiable); x itself without
    one."""
    return x if _GROUP is None else _AllReduceSum.apply(x, _GROUP)


def seq_sum(x):
    """sum over the last dimension of [B, T] (the whole sequence across the group), [B, 1]."""
    return group_sum(x.sum(-1, keepdim=True))


def seq_any(b):
    """Whether any position of each sequence (across the group) is set: bool [B]."""
    return seq_sum(b.to(torch.float32))[:, 0] > 0


def length(t, like):
    """The whole sequences' padded length: T summed over the group (a 0-d tensor), or T."""
    if _GROUP is None:
        return t
    return group_sum(torch.tensor(float(t), dtype=like.dtype, device=like.device))
