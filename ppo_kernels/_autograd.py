"""The autograd side of the kernel ops: for each op of csrc/ops.cpp (and its Triton twin
`triton_<name>`) the fake (shape) function and the autograd formula (torch.library), and
the backward's in-place rescale of a gradient the forward already wrote (scale_grad). The
compiled modules are loaded by ppo_kernels/_extension.py; the backends that call these ops
are ppo_kernels/_backends.py.
"""

from __future__ import annotations

import weakref

import torch

from ._checks import acc_dtype
from ._extension import HAS_SCHEMAS, eager_call
from .spec import F

# ------------------------------------------------------------------ fake (shape) functions
# Shapes only: each names the leading arguments its outputs' shapes and dtypes come from and
# takes the rest as *_ (the schemas, csrc/ops.cpp, are the one list of the arguments); a
# flag that changes a shape (compute_grad, slots) is found by its schema name (_arg_index).

def _per_token(like, logits, n, dtype=None):
    """n tensors of like's [B, T] shape, of the accumulation dtype of logits (or dtype)."""
    dt = acc_dtype(logits) if dtype is None else dtype
    return [like.new_empty(like.shape, dtype=dt) for _ in range(n)]


def _fake_token_logprobs_fwd(logits, tokens, mask, temperature, return_entropy, *_, **__):
    logp, ent, row_max, log_sum = _per_token(tokens, logits, 4)
    return logp, ent if return_entropy else ent.new_empty((0,)), row_max, log_sum


def _fake_token_logprobs_bwd(grad_logprobs, grad_entropy, logits, *_, **__):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _dlogits(logits, compute_grad):
    return torch.empty(logits.shape if compute_grad else (0,), dtype=logits.dtype,
                       device=logits.device)


def _fake_ppo_loss_fwd(at_compute_grad):
    def fake(logits, tokens, *rest, **__):
        return (tokens.new_empty((), dtype=acc_dtype(logits)), *_per_token(tokens, logits, 3),
                _dlogits(logits, rest[at_compute_grad - 2]))
    return fake


def _fake_ppo_loss_fwd_inplace(logits, tokens, *_, **__):
    return tokens.new_empty((), dtype=acc_dtype(logits)), *_per_token(tokens, logits, 3)


def _fake_zeros_grad(like):
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _fake_none(*_, **__):
    return None


def _fake_ppo_loss_metrics(at_slots):
    def fake(logprobs, entropy, mask, *rest, **__):
        return mask.new_empty((len(rest[at_slots - 3]),), dtype=torch.float32)
    return fake


def _fake_agg_weights(mask, mode, denom, float64):
    return mask.new_empty(mask.shape, dtype=torch.float64 if float64 else torch.float32)


def _fake_seq_loss_grad(logprobs, *_, **__):
    return (torch.empty_like(logprobs), torch.empty_like(logprobs),
            logprobs.new_empty(()), torch.empty_like(logprobs))


def _fake_token_loss_grad(logprobs, *args, **kwargs):
    kl = kwargs.get("kl_logprobs", args[10] if len(args) > 10 else None)
    return (*_fake_seq_loss_grad(logprobs),
            torch.empty_like(logprobs) if kl is not None else logprobs.new_empty((0,)))


def _fake_sampling_threshold(logits, mask, *_, **__):
    return mask.new_empty(mask.shape, dtype=torch.float64)


def _fake_kept_logprobs_fwd(logits, tokens, *_, **__):
    return (*_per_token(tokens, logits, 4), *_per_token(tokens, logits, 1, torch.int64),
            *_per_token(tokens, logits, 1, torch.bool))


def _fake_threshold_kept_fwd(logits, tokens, *_, **__):
    return (*_fake_kept_logprobs_fwd(logits, tokens),
            tokens.new_empty(tokens.shape, dtype=torch.float64))


def _fake_kept_logprobs_bwd(grad_logprobs, grad_entropy, logits, *_, **__):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _fake_gae(rewards, *_, **__):
    return torch.empty_like(rewards), torch.empty_like(rewards)


def _fake_score_rollout(logits, tokens, *_, **__):
    return tuple(_per_token(tokens, logits, 5))


# ------------------------------------------------------------------ autograd formulas

def scale_grad(prefix, dlogits, grad, applied):
    """grad * d loss / d logits from the forward's dlogits, pre-scaled by ``applied``
    (grad_scale): in place, in the accumulation type, decided on the device (no host read,
    so CUDA-graph capturable), and no pass at all when grad == applied (loss.backward()
    after grad_scale=1, or (loss * s).backward() after grad_scale=s)."""
    op = getattr(torch.ops.ppo_kernels, prefix + "scale_grad_")
    if prefix == "triton_" and not torch.compiler.is_compiling():
        # eager: the launcher itself (imported here: the Triton package is optional).
        # Through the Python-registered op every call would
        # bump dlogits' version counter, and a retained graph's second backward would
        # refuse the saved (rescaled) tensor; the C++ ops do not bump it either
        from .triton_kernels import scale_grad_ as op
    g = grad.detach()
    if g.dtype != applied.dtype:
        g = g.to(applied.dtype)
    op(dlogits, g if g.dim() == 0 else g.reshape(()), applied)
    return dlogits


def wants_grad(*tensors):
    """Whether the kernels should write a gradient for these inputs: one requires it and
    grad mode is on."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def not_traceable(what):
    """NotImplementedError for a path that torch.jit.trace cannot record: one that
    differentiates part of the loss by autograd inside the call, or writes the gradient
    into its input."""
    return NotImplementedError(
        f"ppo_kernels: torch.jit.trace cannot record {what}; use torch.compile "
        f"(fullgraph=True works), which records every path")


def first_order_only(what):
    """Raises in a backward run with create_graph=True (the engine enables grad mode in a
    backward only then): the kernels give first derivatives, and a gradient without its own
    graph would make loss + f(grad) differentiate as the loss alone, silently."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"ppo_kernels: {what} is differentiable once; a second derivative "
                           f"(create_graph=True, torch.autograd.functional.hessian, "
                           f"gradient penalties) is not supported on the kernel backends: "
                           f"use backend='torch' for it")


def _graph_retained():
    """Whether the running backward keeps the graph (retain_graph=True): then a later
    backward reads the saved gradient again, so this one must not hand it out."""
    if torch.compiler.is_compiling():  # (traced backward graphs are functional)
        return False
    return torch._C._autograd._get_current_graph_task_keep_graph()


def applied_scale(grad_scale, like):
    """The scale a saved gradient carries, as the 0-d device tensor (of like's accumulation
    dtype) that hand_out compares with grad_output on the device and scale_grad_ updates."""
    return torch.full((), grad_scale, dtype=acc_dtype(like), device=like.device)


def hand_out(prefix, buf, grad_output, applied, shape3=None, held=None):
    """grad_output * d loss / d x from buf, the gradient the forward wrote pre-scaled by
    ``applied`` (0-d, the accumulation dtype): the one place every fused backward gives its
    gradient. A backward that frees the graph (the plain loss.backward()) rescales buf in
    place (no pass at all when grad_output == applied) and hands it out: it is the last
    reader. A backward that keeps the graph (retain_graph=True, autograd.grad(...,
    retain_graph=True)) returns a fresh copy and leaves buf and applied as they were, so
    every backward gives exactly its own gradient and their sum is exact (also with
    copying saved-tensor hooks: nothing the next backward reads is changed). shape3: the
    [B, Tl, V]-like view scale_grad_ takes, when buf is not 3-D. held: a weak reference to
    the op output that buf aliases (the raw op's dlogits): while the caller still holds that
    output, buf is theirs too, and the rescale goes to a fresh copy (a backward must not
    change a tensor the forward returned; the public ops drop that output, so their
    backward stays in place; under AOT autograd an output changed by the backward is a
    graph the partitioner refuses)."""
    if buf is None or grad_output is None:
        return None
    out, ap = buf, applied
    if _graph_retained() or (held is not None and held() is not None):
        out, ap = buf.clone(), applied.clone()
    scale_grad(prefix, out if shape3 is None else out.view(shape3), grad_output, ap)
    return out


def _lp_setup(ctx, inputs, output):
    logits, tokens, mask, temperature, return_entropy, temperatures = inputs
    _, ent, row_max, log_sum = output
    ctx.save_for_backward(logits, tokens, mask, row_max, log_sum, ent, temperatures)
    ctx.temperature, ctx.return_entropy = temperature, return_entropy


def _lp_backward_for(prefix):
    def backward(ctx, grad_logp, grad_ent, _grad_max, _grad_log_sum):
        first_order_only("token_logprobs")
        logits, tokens, mask, row_max, log_sum, ent, temps = ctx.saved_tensors
        bwd = getattr(torch.ops.ppo_kernels, prefix + "token_logprobs_bwd")
        acc = row_max.dtype
        g_ent = grad_ent.to(acc).contiguous() if ctx.return_entropy and grad_ent is not None \
            else None
        g_lp = (torch.zeros_like(row_max) if grad_logp is None
                else grad_logp.to(acc).contiguous())
        dl = bwd(g_lp, g_ent, logits, tokens, mask, row_max, log_sum, ent, ctx.temperature,
                 temperatures=temps)
        return dl, None, None, None, None, None
    return backward


def _arg_index(qualname, name):
    """The position of argument ``name`` in the schema of ppo_kernels::<qualname>."""
    schema = getattr(torch.ops.ppo_kernels, qualname).default._schema
    return [a.name for a in schema.arguments].index(name)


def _loss_autograd_for(prefix):
    """(setup_context, backward) of prefix + ppo_loss_fwd: the forward wrote dlogits
    pre-scaled by grad_scale; the backward rescales it in place (scale_grad)."""
    qualname = prefix + "ppo_loss_fwd"
    at_scalars = _arg_index(qualname, "scalars")
    n_args = len(getattr(torch.ops.ppo_kernels, qualname).default._schema.arguments)

    def setup(ctx, inputs, output):
        logits, grad_scale = inputs[0], inputs[at_scalars][F["grad_scale"]]
        # the scale the saved dlogits carry, as a device scalar that the backward compares
        # with grad_output on the device
        ctx.applied = applied_scale(grad_scale, logits)
        # saved (not a ctx attribute): autograd frees it right after the backward, so the
        # gradient it becomes is the only reference left and nothing clones it. Saved as a
        # detached alias, not as the op's output: an output is saved without a reference
        # of its own, so with retain_graph autograd would make the buffer the logits' .grad
        # and the next backward would rescale that .grad in place
        ctx.save_for_backward(output[4].detach())
        # the dlogits output itself: the backward rescales in place only once the caller
        # has let go of it (hand_out)
        ctx.held = weakref.ref(output[4])
        # the other outputs carry no gradient: materialising zeros for them would allocate a
        # second [N, V] buffer (for the dlogits output) in every backward
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_loss, *_):
        first_order_only("ppo_loss")
        (dlogits,) = ctx.saved_tensors
        return (hand_out(prefix, dlogits, grad_loss, ctx.applied, held=ctx.held),) + (
            None,) * (n_args - 1)

    return setup, backward


def _no_setup(ctx, inputs, output):
    pass


def _no_double_backward(ctx, *grads):
    # the kernels give first derivatives only; without this a second derivative through
    # token_logprobs would silently miss the kernel's part
    raise RuntimeError("ppo_kernels: token_logprobs / ppo_loss are differentiable once; a "
                       "second derivative (create_graph=True) is not supported, use "
                       "backend='torch' for it")


_registered = set()


def register(prefix):
    """fake + autograd for the kernel ops named prefix + name (once per prefix)."""
    if prefix in _registered:
        return
    lib = "ppo_kernels::" + prefix
    fakes = {"token_logprobs_fwd": _fake_token_logprobs_fwd,
             "token_logprobs_bwd": _fake_token_logprobs_bwd,
             "ppo_loss_fwd": _fake_ppo_loss_fwd(_arg_index(prefix + "ppo_loss_fwd",
                                                           "compute_grad")),
             "ppo_loss_fwd_inplace": _fake_ppo_loss_fwd_inplace,
             "scale_grad_": _fake_none,
             "gae": _fake_gae, "score_rollout": _fake_score_rollout}
    # sampling replay's ops (ppo_kernels/sampling.py), and the CPU-only [B, T] ops
    # (csrc/ops_host.cpp), where this backend has them
    for name, fn in (("ppo_loss_metrics", lambda: _fake_ppo_loss_metrics(
                         _arg_index(prefix + "ppo_loss_metrics", "slots"))),
                     ("agg_weights", lambda: _fake_agg_weights),
                     ("seq_loss_grad", lambda: _fake_seq_loss_grad),
                     ("check_kept_ids", lambda: _fake_none),
                     ("token_loss_grad", lambda: _fake_token_loss_grad),
                     ("sampling_threshold", lambda: _fake_sampling_threshold),
                     ("kept_logprobs_fwd", lambda: _fake_kept_logprobs_fwd),
                     ("kept_logprobs_bwd_", lambda: _fake_none),
                     ("kept_logprobs_bwd", lambda: _fake_kept_logprobs_bwd),
                     ("threshold_kept_fwd", lambda: _fake_threshold_kept_fwd),
                     ("zeros_grad", lambda: _fake_zeros_grad)):
        if hasattr(torch.ops.ppo_kernels, prefix + name):
            fakes[name] = fn()
    for name, fn in fakes.items():
        torch.library.register_fake(lib + name, fn)
    torch.library.register_autograd(lib + "token_logprobs_fwd", _lp_backward_for(prefix),
                                    setup_context=_lp_setup)
    setup, backward = _loss_autograd_for(prefix)
    torch.library.register_autograd(lib + "ppo_loss_fwd", backward, setup_context=setup)
    torch.library.register_autograd(lib + "token_logprobs_bwd", _no_double_backward,
                                    setup_context=_no_setup)
    _registered.add(prefix)


if HAS_SCHEMAS:
    register("")



# FusedLoss's C++ twin for the compiled ops (csrc/eager_calls.cpp), or None (a build
# from before it)
_CPP_FUSED_LOSS = eager_call("fused_loss")


def fused_loss(prefix, logits, tensors, scalars, codes, rows):
    """(loss, loss_tok, logp, ent) of the prefix + ppo_loss_fwd op with its gradient in the
    autograd graph, in eager mode: for the compiled ops (prefix "", cpu and cuda) the C++
    autograd Function of csrc/eager_calls.cpp, which costs a few microseconds per
    forward and per backward where a Python Function costs tens; for the Triton ones
    FusedLoss. The same op, the same backward (hand_out's rules), the same bits."""
    if prefix == "" and _CPP_FUSED_LOSS is not None:
        return _CPP_FUSED_LOSS(logits, tensors, scalars, codes, rows, F["grad_scale"])
    return FusedLoss.apply(logits, getattr(torch.ops.ppo_kernels, prefix + "ppo_loss_fwd"),
                           tensors, scalars, codes, prefix, rows)


class FusedLoss(torch.autograd.Function):
    """The public ppo_loss's eager call of a ppo_loss_fwd op with a gradient: the autograd
    formula registered for the op (_loss_autograd_for), without the per-call Python of
    torch.library's generated wrapper (it binds every schema argument again). The op's
    dlogits output never reaches the caller, so the backward rescales it in place (no
    ``held`` reference to respect). torch.compile and torch.jit.trace record the op
    itself, with its registered formula.

    inplace=True: op is ppo_loss_fwd_inplace, whose gradient is written over the logits
    (inplace_backward=True): the one [N, V] buffer is the logits, kept as a ctx attribute;
    the caller promised not to use the logits afterwards."""

    @staticmethod
    def forward(ctx, logits, op, tensors, scalars, codes, prefix, rows=(), inplace=False):
        ctx.prefix = prefix
        ctx.applied = applied_scale(scalars[F["grad_scale"]], logits)
        ctx.inplace = inplace
        if inplace:
            loss, loss_tok, logp, ent = op(logits, *tensors, scalars, codes, *rows)
            # the logits now hold dlogits: anything that saved them for its own backward
            # must see the change (the C++ op has no ADInplaceOrView kernel to do this)
            torch.autograd.graph.increment_version(logits)
            ctx.buf = logits
            # a change after this is the caller's, and an error (traced: no version to
            # compare)
            ctx.version = None if torch.compiler.is_compiling() else logits._version
        else:
            # (straight to the device kernel: the op's own autograd kernel would only
            # redispatch, grad mode being off here)
            with torch._C._AutoDispatchBelowAutograd():
                loss, loss_tok, logp, ent, dlogits = op(logits, *tensors, scalars, codes,
                                                        True, *rows)
            ctx.save_for_backward(dlogits)
            ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(loss_tok, logp, ent)
        return loss, loss_tok, logp, ent

    @staticmethod
    def backward(ctx, grad_loss, *_):
        none = (None,) * 7
        if not ctx.inplace:
            first_order_only("ppo_loss")
            (dlogits,) = ctx.saved_tensors
            return (hand_out(ctx.prefix, dlogits, grad_loss, ctx.applied), *none)
        first_order_only("ppo_loss(inplace_backward=True)")
        buf = ctx.buf
        if buf is None:
            raise RuntimeError("ppo_loss(inplace_backward=True): the gradient stored in the "
                               "logits was already handed out by an earlier backward that "
                               "freed the graph")
        if ctx.version is not None and buf._version != ctx.version:
            raise RuntimeError("logits: changed in place between the forward and the backward "
                               "of ppo_loss(inplace_backward=True), which stored the gradient "
                               "in them; leave them untouched until the backward, or use "
                               "inplace_backward=False")
        grad = hand_out(ctx.prefix, buf, grad_loss, ctx.applied)
        if grad is buf:  # handed out: the logits' storage is the caller's gradient now
            ctx.buf = None  # (not `del`: torch.compile cannot trace a ctx __delattr__)
        return (grad, *none)


class LossWithGrad(torch.autograd.Function):
    """A loss whose forward computes its whole gradient: the two-phase path
    (_two_phase.TwoPhase) and the LM head's chunked losses (from_hidden.py,
    distill_hidden.py). run.loss(inputs, need) -> (outputs, grads, the scale grads carry):
    outputs[0] the loss, the rest not differentiable; one gradient per input (None where
    need says no), pre-scaled by grad_scale. The backward hands each out rescaled by
    grad_output (hand_out: in place, no pass when grad_output == grad_scale). run.name:
    the op, for first_order_only's message; run.prefix: its backend's."""

    @staticmethod
    def forward(ctx, run, *inputs):
        outs, grads, gs = run.loss(inputs, tuple(ctx.needs_input_grad[1:]))
        ctx.save_for_backward(*grads)
        ctx.prefix, ctx.what = run.prefix, run.name
        # (one per gradient: scale_grad_ updates each)
        ctx.applied = [applied_scale(gs, inputs[0]) for _ in inputs]
        ctx.mark_non_differentiable(*outs[1:])
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, grad_loss, *_):
        first_order_only(ctx.what)
        out = []
        for g, ap in zip(ctx.saved_tensors, ctx.applied):
            # (scale_grad_ takes a [B, Tl, V]-like view: dW [V, H] and db [V] as one)
            shape3 = None if g is None or g.dim() == 3 else (1,) * (3 - g.dim()) + tuple(
                g.shape)
            out.append(hand_out(ctx.prefix, g, grad_loss, ap, shape3))
        return (None, *out)


# ------------------------------------------------------------------ distill_fwd (top-k KD)

def _fake_distill_fwd(at_compute_grad):
    def fake(logits, mask, *rest, **__):
        return (mask.new_empty((), dtype=acc_dtype(logits)), *_per_token(mask, logits, 3),
                _dlogits(logits, rest[at_compute_grad - 2]))
    return fake


def _distill_autograd_for(prefix):
    """(setup_context, backward) of prefix + distill_fwd, as _loss_autograd_for's: the
    forward wrote dlogits pre-scaled by grad_scale (found by the schema's argument name),
    the backward hands it out rescaled in place."""
    qualname = prefix + "distill_fwd"
    at_gs = _arg_index(qualname, "grad_scale")
    n_args = len(getattr(torch.ops.ppo_kernels, qualname).default._schema.arguments)

    def setup(ctx, inputs, output):
        ctx.applied = applied_scale(inputs[at_gs], inputs[0])
        ctx.save_for_backward(output[4].detach())  # (a detached alias: see ppo_loss_fwd)
        ctx.held = weakref.ref(output[4])
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_loss, *_):
        first_order_only("distill_loss")
        (dlogits,) = ctx.saved_tensors
        return (hand_out(prefix, dlogits, grad_loss, ctx.applied, held=ctx.held),) + (
            None,) * (n_args - 1)

    return setup, backward


_distill_registered = set()


def register_distill(prefix):
    """fake + autograd of prefix + distill_fwd (once per prefix; the op must exist: the C++
    schema of csrc/ops.cpp, or the Triton library's)."""
    if prefix in _distill_registered:
        return
    if not hasattr(torch.ops.ppo_kernels, prefix + "distill_fwd"):
        raise ValueError(f"backend: the compiled extension has no {prefix}distill_fwd op (built "
                         f"before distill_loss existed); rebuild it or use backend='torch'")
    lib = "ppo_kernels::" + prefix
    torch.library.register_fake(lib + "distill_fwd", _fake_distill_fwd(
        _arg_index(prefix + "distill_fwd", "compute_grad")))
    setup, backward = _distill_autograd_for(prefix)
    torch.library.register_autograd(lib + "distill_fwd", backward, setup_context=setup)
    _distill_registered.add(prefix)
