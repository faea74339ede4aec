"""The LM head called where the training framework expects its parameters to be used:
"forward redirection" (docs/DISTRIBUTED.md, "Inside DDP, FSDP2 and ZeRO-3").

DDP, FSDP2 and DeepSpeed ZeRO-3 act on a module's parameters from hooks around the module's
forward: FSDP2's pre-forward hook all-gathers (unshards) the parameters and its post-backward
hook reduce-scatters their gradients; ZeRO-3 gathers and releases them the same way; DDP's
forward records which parameters the outputs depend on (find_unused_parameters=True) and
marks the others ready at once. A fused loss that reads ``lm_head.weight`` outside that
forward sees a shard, or gives DDP a gradient for a parameter it already marked ready
("Expected to mark a variable ready only once"). The known remedy (PyTorch Lightning's
``_ForwardRedirection``, used by TRL, Liger Kernel and OpenRLHF for their fused
linear-cross-entropy under FSDP / ZeRO; https://github.com/Lightning-AI/pytorch-lightning,
src/lightning/pytorch/strategies/strategy.py) is to run the loss *as* the module's forward:
replace the wrapped module's ``forward`` for one call by a function that computes the loss,
call the wrapper, and let its hooks run around it.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ._ddp_unused import after_ddp_forward

__all__ = ["accepts_head_module", "forward_redirect", "head_parameters", "is_head_module",
           "through_head"]


def _inner(wrapper):
    """The module whose forward the wrapper calls: DDP's and DeepSpeed's engine's
    ``.module``; an FSDP2 module (fully_shard) or any other module is its own."""
    inner = getattr(wrapper, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else wrapper


def forward_redirect(wrapper, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run as the forward of ``wrapper``: returns what fn returns.

    For the one call, the forward of the module that ``wrapper`` wraps (DDP's and
    DeepSpeed's ``.module``; an FSDP2 ``fully_shard`` module, a ZeRO-3 submodule or a
    plain module: the module itself) is replaced by ``fn``; ``wrapper(*args, **kwargs)``
    then runs every hook of the framework around fn, and the original forward is back
    before fn runs (fn may call the module itself). fn receives the arguments as the
    wrapper's hooks pass them on (FSDP2 wraps tensors requiring a gradient for its
    post-backward hook: use fn's arguments, not the tensors of the enclosing scope).

    Typical use: the parameters of ``wrapper`` (an FSDP2 unit's, a ZeRO-3 module's) are
    whole inside fn, their gradients are reduced by the framework's own hooks, and DDP
    counts as used every parameter the outputs of fn depend on.

    Raises TypeError when ``wrapper`` is not a torch.nn.Module or fn is not callable.
    """
    if not isinstance(wrapper, torch.nn.Module):
        raise TypeError(f"wrapper: expected a torch.nn.Module (the DDP / FSDP2 / DeepSpeed "
                        f"wrapper or the module), got {type(wrapper).__name__}")
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    inner = _inner(wrapper)
    had_own = "forward" in inner.__dict__
    own = inner.__dict__.get("forward")

    def restore():
        if had_own:
            inner.forward = own
        elif "forward" in inner.__dict__:
            del inner.forward

    def redirected(*a, **k):
        restore()
        return fn(*a, **k)

    inner.forward = redirected
    try:
        return wrapper(*args, **kwargs)
    finally:
        restore()


def _forward_owner(cls):
    for c in cls.__mro__:
        if "forward" in c.__dict__:
            return c
    return None


def is_head_module(x):
    """Whether ``x`` is taken as an LM head module (a torch.nn.Module) rather than a weight
    tensor by the from-hidden ops."""
    return isinstance(x, torch.nn.Module)


def head_parameters(module, bias, name="lm_head_weight"):
    """Checks an LM head given as a module: a torch.nn.Linear (any subclass that keeps
    Linear's forward: FSDP2's FSDPLinear, DeepSpeed's ZeRO-3 Linear) and no separate
    ``lm_head_bias`` (the module's own bias is used). TypeError naming the argument
    otherwise: a head whose forward does more than ``x @ W^T + b`` (a LoRA-wrapped head,
    a scaled one) would be bypassed silently, so it must be passed as tensors."""
    if not isinstance(module, torch.nn.Linear) or \
            _forward_owner(type(module)) is not torch.nn.Linear:
        raise TypeError(f"{name}: a module LM head must be a torch.nn.Linear whose forward is "
                        f"Linear's (FSDP2 / ZeRO-3 wrapped alike); got "
                        f"{type(module).__name__}, whose forward the fused op would bypass: "
                        f"pass its weight (and bias) as tensors instead")
    if bias is not None:
        raise TypeError(f"lm_head_bias: must be None when {name} is a module (its .bias is "
                        f"used), got a {type(bias).__name__}")


def through_head(module, hidden, bias, op):
    """op(hidden, weight, bias) run as ``module``'s forward (forward_redirect), with the
    weight and bias the module holds inside its forward (whole under FSDP2 / ZeRO-3)."""
    head_parameters(module, bias)
    return forward_redirect(module, lambda h: op(h, module.weight, module.bias), hidden)


def accepts_head_module(op):
    """Decorates a from-hidden op ``op(hidden, lm_head_weight, ..., lm_head_bias=None, ...)``
    so that ``lm_head_weight`` may be the head module: the call then runs as the module's
    forward (through_head) with every argument passed on and the weight and bias the module
    holds inside its forward. A weight tensor goes straight to ``op`` (one isinstance on the
    call's path; nothing here for torch.compile to trace, unlike a frame's ``locals()``)."""
    sig = inspect.signature(op)

    @functools.wraps(op)
    def call(*args, **kwargs):
        head = args[1] if len(args) > 1 else kwargs.get("lm_head_weight")
        hidden = args[0] if args else kwargs.get("hidden")
        if not is_head_module(head):  # (after DDP's forward: tell DDP the head is used)
            return after_ddp_forward(hidden, op(*args, **kwargs))
        given = {}
        for name, value in sig.bind(*args, **kwargs).arguments.items():
            if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                given.update(value)
            else:
                given[name] = value
        given.pop("lm_head_weight")
        return after_ddp_forward(hidden, through_head(
            head, given.pop("hidden"), given.pop("lm_head_bias", None),
            lambda h, w, b: op(h, w, lm_head_bias=b, **given)))
    return call
