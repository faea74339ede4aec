"""The LM head used after the forward of DistributedDataParallel(find_unused_parameters=True).

DDP's forward, with find_unused_parameters=True, walks the autograd graph from the outputs
of the wrapped module's forward and marks ready, at the first gradient of the backward,
every parameter the walk did not reach (torch/nn/parallel/distributed.py, ``_post_forward``:
``self.reducer.prepare_for_backward(list(_find_tensors(output)))``). A loop that takes the
hidden states from the wrapped model and only then applies the LM head (a fused loss from
hidden states: ``pk.ppo_loss_from_hidden(ddp(ids), ddp.module.lm_head, ...)``) uses the
head after that walk: its gradient then reaches DDP's hook for a parameter already marked
ready, and the backward dies on every rank with "Expected to mark a variable ready only
once".

The from-hidden ops repair it at the call: when their hidden states come from such a
forward (the outputs of DDP's forward pass through its ``_DDPSink`` autograd function, which
holds a weak reference to the DDP module), the walk is run again from the op's outputs, the
way DDP's own forward runs it: ``ddp.reducer.prepare_for_backward(outputs)``. The op's
outputs depend on the hidden states, so the walk still reaches everything the forward's
outputs reached (the sink's one node leads to all of them) and now the head too; the head's
gradient is then reduced by DDP with the others' (exact: the average over ranks, as inside
the forward). Parameters used by neither stay unused, as before.

Only the reducer's own entry point is called, between DDP's forward and the backward, where
DDP itself calls it; nothing is done outside torch.distributed, under torch.compile, under
no_sync() (DDP then expects no reduction), with static_graph or find_unused_parameters=False
(DDP then waits for every parameter's gradient, so a head used later is already exact).
"""

from __future__ import annotations

import collections

import torch

SEARCH_NODES = 16  # autograd nodes looked at from the hidden states back to DDP's sink


def _sink_ddp(node):
    """The DDP module whose _DDPSink produced the tensor of grad_fn ``node`` (within
    SEARCH_NODES nodes of it, breadth first), or None."""
    queue = collections.deque([node])
    seen = 0
    while queue and seen < SEARCH_NODES:
        fn = queue.popleft()
        seen += 1
        if type(fn).__name__ == "_DDPSinkBackward":
            ref = getattr(fn, "ddp_weakref", None)
            return ref() if callable(ref) else None
        for nxt, _ in getattr(fn, "next_functions", ()):
            if nxt is not None:
                queue.append(nxt)
    return None


def _grad_outputs(out):
    return [t for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def after_ddp_forward(hidden, out):
    """Returns ``out`` (a from-hidden op's result, computed from ``hidden``) after telling
    the DDP module whose forward produced ``hidden`` (find_unused_parameters=True) which
    parameters are used now: DDP's unused-parameter walk run again from the op's outputs
    (module docstring). Nothing when hidden comes from no such forward.

    Raises RuntimeError naming find_unused_parameters where this torch's DDP has no
    reducer.prepare_for_backward to call (the backward would otherwise fail later, in DDP,
    with "Expected to mark a variable ready only once")."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or \
            not isinstance(hidden, torch.Tensor) or hidden.grad_fn is None or \
            not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return out
    ddp = _sink_ddp(hidden.grad_fn)
    if ddp is None or not getattr(ddp, "find_unused_parameters", False) or \
            getattr(ddp, "static_graph", False) or \
            not getattr(ddp, "require_forward_param_sync", False):
        return out
    outputs = _grad_outputs(out)
    if not outputs:
        return out
    prepare = getattr(getattr(ddp, "reducer", None), "prepare_for_backward", None)
    if prepare is None:
        raise RuntimeError(
            "lm_head_weight: the hidden states come from the forward of "
            "DistributedDataParallel(find_unused_parameters=True) and the head is used after "
            "it, which DDP's backward rejects ('Expected to mark a variable ready only "
            "once'); this torch's DDP offers no reducer.prepare_for_backward to tell it. Run "
            "the loss inside DDP's forward (pk.forward_redirect(ddp, step, ...)) or use "
            "find_unused_parameters=False")
    prepare(outputs)
    return out
