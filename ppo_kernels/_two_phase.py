"""The two-phase path of the kernel backends, for the policy losses whose per-token terms
need every token's logp of their sequence before any gradient (gspo, gspo-token: the
sequence ratio). One extra read of the logits compared with the fused single pass:

  1. statistics: token_logprobs_fwd reads the logits once -> logp, H, row max, log-sum;
  2. the [B, T] middle: the sequence reductions and the per-token loss, from the eager
     composite's formulas (_torch_impl: one source of truth for these losses), and their
     gradient in logp and H (torch.func.grad on [B, T] tensors: cheap next to [N, V]);
     GSPO's in eager mode one op with the same formulas (fused_middle: C++ on the CPU,
     Triton on a CUDA device);
  3. gradient: token_logprobs_bwd reads the logits again and writes dlogits once
     (d/dz of sum(dlogp * logp + dH * H), pre-scaled by grad_scale).

The backward only rescales dlogits in place (scale_grad_), as for the fused losses.

The same three steps serve every policy loss where the row statistics must be complete
before any gradient: a vocabulary split over ranks (vocab_parallel.py merges the shards'
statistics between steps 1 and 2), a kept set (sampling replay: the kept set's statistics
beside the full ones) and packed sequences (packed.py: the kernels read the packed rows,
the middle runs on their padded [S, max_seqlen] copy). passes() runs them on any row
source (ppo_kernels/rows.py): the logits, or the LM head's chunks (from_hidden.py).
"""

from __future__ import annotations

import torch

from . import _backends, _torch_impl
from ._autograd import LossWithGrad, not_traceable, wants_grad
from .rows import LogitRows
from .spec import KERNEL_POLICY_LOSSES


def middle(logp, ent, spec, x, logp_kl=None):
    """The aggregated loss as a function of the per-token logp and H ([B, T], the layout of
    the LossInputs x), and the per-token policy part. logp_kl: the KL's log-probs where
    they are not logp (sampling replay: logp is then over the kept set)."""
    pol, _ = _torch_impl.token_losses(logp, ent, x, spec, x.behaviour, logp_kl=logp_kl)
    return _torch_impl.aggregate(pol, ent, x.mask, x.weights, x.w_ent, spec), pol


def middle_grad(logp, ent, spec, x, logp_kl=None):
    """(d loss / d logp, d loss / d H, loss, pol[, d loss / d logp_kl]): the middle and its
    gradient in logp and H ([B, T] tensors: cheap next to [N, V]); the last only for a
    logp_kl. Eagerly by autograd on detached leaves, which also runs under saved-tensor
    hooks (activation offloading, non-reentrant checkpoints), where torch.func cannot;
    traced (torch.compile) by torch.func, which Dynamo captures whole. In eager mode one
    op instead, where there is one (fused_middle)."""
    op = fused_middle(spec, x, logp, logp_kl)
    if op is not None:
        scalars, codes = spec.kernel_args(torch.float32)
        args = (logp.detach(), ent.detach(), x.mask, x.old, x.adv, x.ref, x.isw, x.weights,
                x.w_ent, scalars, codes)
        if spec.sequence_loss:
            return op(*args)
        out = op(*args, None if logp_kl is None else logp_kl.detach())
        return out if logp_kl is not None else out[:4]
    if logp_kl is not None:
        leaves = (logp, ent, logp_kl)
        f = lambda lp, h, lk: middle(lp, h, spec, x, lk)  # noqa: E731
    else:
        leaves = (logp, ent)
        f = lambda lp, h: middle(lp, h, spec, x)  # noqa: E731
    if torch.compiler.is_compiling():
        grads, (loss, pol) = torch.func.grad_and_value(
            f, argnums=tuple(range(len(leaves))), has_aux=True)(*leaves)
        return (*grads[:2], loss, pol, *grads[2:])
    with torch.enable_grad():
        ls = [v.detach().requires_grad_(True) for v in leaves]
        loss, pol = f(*ls)
        grads = torch.autograd.grad(loss, ls, allow_unused=True)
    grads = [torch.zeros_like(v) if g is None else g for g, v in zip(grads, ls)]
    return (grads[0], grads[1], loss.detach(), pol.detach(), *grads[2:])


def fused_middle(spec, x, logp, logp_kl=None):
    """The one op that computes the middle and its analytic gradient (the eager formulas'
    values up to the summation order) in place of autograd through 40-60 eager ops, or
    None where none applies: GSPO's and GSPO-token's (ppo_kernels::seq_loss_grad,
    csrc/cpu/seq_loss.cpp; with no logp_kl) and the token-level losses'
    (ppo_kernels::token_loss_grad, csrc/cpu/token_middle.cpp; the KL on logp_kl where
    given) on the cpu backend with CPU tensors, their Triton twins on a CUDA device
    (triton_kernels/seq_loss.py, token_middle.py; unrun on a GPU since they were added);
    in eager mode only, without an off-policy mask, a context-parallel group or
    loss_agg_mode="none"."""
    seq = spec.policy_loss in ("gspo", "gspo-token")
    if not ((seq and logp_kl is None) or spec.policy_loss in KERNEL_POLICY_LOSSES) or not (
            x.behaviour is None and spec.cp_group is None and x.weights is not None
            and not torch.compiler.is_compiling()):
        return None
    if x.be.name == "cpu" and logp.device.type == "cpu":
        return getattr(torch.ops.ppo_kernels, "seq_loss_grad" if seq else "token_loss_grad")
    if _backends.device_eager(x.be, logp):
        if seq:
            from .triton_kernels import seq_loss
            return seq_loss.seq_loss_grad
        from .triton_kernels import token_middle
        return token_middle.token_loss_grad
    return None


def kl_on_full_logp(spec, x):
    """With a kept set: whether the KL reads the full vocabulary's logp with a nonzero
    coefficient, the one way the full logp takes a gradient (its entropy's: an entropy
    bonus with entropy_over="full")."""
    return x.ref is not None and spec.kl_coef != 0.0 and spec.kl_logprobs != "kept"


def passes(source, inputs, spec, x, need):
    """The three steps on a row source (its inputs: the logits, or hidden and the LM head):
    (loss, logp, ent, grads, the scale grads carry, aux); logp and ent in the layout of the
    LossInputs x, grads one per input (None where need says no). With
    a kept set (x.replay) logp is logp_kept, the ratio's log-prob, the KL's the full or kept
    logp and the entropy the full or kept one (spec.kl_logprobs, spec.entropy_over); aux
    then holds the full logp, the kept mass, the kept set's size and whether the set lacked
    the sampled token, [B, T] each."""
    rp = x.replay
    st = source.stats(inputs, rp)
    kl_kept = rp is not None and spec.kl_logprobs == "kept"
    ent_kept = rp is not None and spec.entropy_over == "kept"
    lp_sel = st.logp if rp is None else st.kept.logp
    ent_sel = st.kept.entropy if ent_kept else st.ent
    lp_kl = None if rp is None or kl_kept else x.padded(st.logp)
    out = middle_grad(x.padded(lp_sel), x.padded(ent_sel), spec, x, lp_kl)
    dsel, dent, loss = out[:3]
    gs = spec.effective_grad_scale(inputs[0].dtype)
    grads = (None,) * len(inputs)
    if any(need):  # else no second pass over the rows
        def k(v):  # (x * 1.0 is x: no multiply for the default grad_scale)
            return x.kernel(v if gs == 1.0 else v * gs).contiguous()

        g_ent = k(dent) if spec.entropy_coef != 0.0 else None
        if rp is None:
            grads = source.grad(inputs, st, k(dsel), g_ent, need=need)
        else:
            # without a gradient on the full logp (and without an entropy bonus over the
            # full row) the gradient pass writes the kept part only (RowSource.grad)
            g_full = k(out[4]) if kl_on_full_logp(spec, x) else None
            grads = source.grad(inputs, st, g_full, None if ent_kept else g_ent, k(dsel),
                                g_ent if ent_kept else None, rp, need=need)
    aux = ()
    if rp is not None:  # (the kept mass as RowSource.outputs computes it)
        _, _, logp_full, _, mass, size, missing = source.outputs(st, rp)
        aux = tuple(x.padded(v) for v in (logp_full, mass, size, missing))
    return loss.detach(), x.padded(lp_sel), x.padded(ent_sel), grads, gs, aux


class TwoPhase:
    """The two-phase loss of a row source, as LossWithGrad runs it."""

    name = "ppo_loss"

    def __init__(self, source, spec, x):
        self.source, self.spec, self.x = source, spec, x
        self.prefix = source.be.prefix

    def loss(self, inputs, need):
        loss, logp, ent, grads, gs, aux = passes(self.source, inputs, self.spec, self.x, need)
        return (loss, logp, ent, *aux), grads, gs


def ppo_loss(be, logits, spec, x, shard=None):
    """(loss, logp, ent) of the two-phase path on a kernel backend (loss.two_phase says
    when); logp and ent in the layout of the LossInputs x. With a kept set (x.replay) four
    more [B, T] tensors follow: the full logp, the kept mass, the kept set's
    size and whether the set lacked the sampled token; logp is then logp_kept and ent the
    entropy spec.entropy_over names."""
    if torch.jit.is_tracing():  # (its middle is differentiated by autograd, even without grad)
        raise not_traceable("the two-phase path (gspo, gspo-token, vespo, the off-policy "
                            "mask, a kept set, a split vocabulary)")
    kin = x.kin
    src = LogitRows(be, logits, kin.tokens, kin.mask, kin.temperature(spec), shard)
    if not wants_grad(logits):
        with torch.no_grad():
            out = passes(src, (logits,), spec, x, (False,))
            return (*out[:3], *out[5])
    return LossWithGrad.apply(TwoPhase(src, spec, x), logits)


def replay_loss(spec, x, lp_k, ent_k, logp, ent):
    """The loss of the kept-set log-probs (logp_kept, H_kept, the full logp and H, [B, T]
    in the layout of the LossInputs x, differentiable), by autograd through the eager
    composite's formulas: the per-token loss for loss_agg_mode="none", else the aggregate.
    Returns (loss, the entropy spec.entropy_over names)."""
    ent_sel = ent_k if spec.entropy_over == "kept" else ent
    lp_kl = None if spec.kl_logprobs == "kept" else logp
    if lp_kl is not None and not kl_on_full_logp(spec, x):
        # a KL term of 0: the full logp takes no gradient, so the log-probs' backward
        # skips the dense pass (as passes() does)
        lp_kl = lp_kl.detach()
    if x.weights is None:
        return per_token_loss(spec, x, lp_k, ent_sel, lp_kl), ent_sel
    return middle(lp_k, ent_sel, spec, x, lp_kl)[0], ent_sel


def per_token_loss(spec, x, logp, ent, logp_kl=None):
    """loss_agg_mode="none": the per-token loss [B, T] (or [N]) from differentiable logp,
    H, 0 where masked (logp_kl: the KL's log-probs where they are not logp)."""
    loss = torch.where(x.mask, _torch_impl.token_loss(logp, ent, x, spec, x.behaviour, logp_kl),
                       0.0)
    loss = x.kernel(loss)  # (the packed layout again, with cu_seqlens)
    return loss[0] if x.flat else loss
