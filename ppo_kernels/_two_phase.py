"""The two-phase path of the kernel backends, for the policy losses whose per-token terms
need every token's logp of their sequence before any gradient (gspo, gspo-token: the
sequence ratio). One extra read of the logits compared with the fused single pass:

  1. statistics: token_logprobs_fwd reads the logits once -> logp, H, row max, log-sum;
  2. the [B, T] middle: the sequence reductions and the per-token loss, from the eager
     composite's formulas (_torch_impl: one source of truth for these losses), and their
     gradient in logp and H (torch.func.grad on [B, T] tensors: cheap next to [N, V]);
  3. gradient: token_logprobs_bwd reads the logits again and writes dlogits once
     (d/dz of sum(dlogp * logp + dH * H), pre-scaled by grad_scale).

The backward only rescales dlogits in place (scale_grad_), as for the fused losses.

The same three steps serve every policy loss where the row statistics must be complete
before any gradient: a vocabulary split over ranks (vocab_parallel.py merges the shards'
statistics between steps 1 and 2) and packed sequences (packed.py: the kernels read the
packed rows, the middle runs on their padded [S, max_seqlen] copy).
"""

from __future__ import annotations

import torch

from . import _torch_impl
from ._autograd import applied_scale, first_order_only, hand_out
from ._checks import split_temperature
from .vocab_parallel import logits_grad, shard_stats


def middle(logp, ent, spec, x):
    """The aggregated loss as a function of the per-token logp and H ([B, T], the layout of
    the LossInputs x), and the per-token policy part."""
    pol, _ = _torch_impl.token_losses(logp, ent, x.old, x.adv, x.ref, x.isw, x.mask, spec,
                                      x.behaviour)
    return _torch_impl.aggregate(pol, ent, x.mask, x.weights, x.w_ent, spec), pol


def middle_grad(logp, ent, spec, x):
    """(d loss / d logp, d loss / d H, loss, pol): the middle and its gradient in logp and H
    ([B, T] tensors: cheap next to [N, V]). Eagerly by autograd on detached leaves, which
    also runs under saved-tensor hooks (activation offloading, non-reentrant checkpoints),
    where torch.func cannot; traced (torch.compile) by torch.func, which Dynamo captures
    whole."""
    if torch.compiler.is_compiling():
        (dlogp, dent), (loss, pol) = torch.func.grad_and_value(
            lambda lp, h: middle(lp, h, spec, x), argnums=(0, 1), has_aux=True)(logp, ent)
        return dlogp, dent, loss, pol
    with torch.enable_grad():
        lp, h = logp.detach().requires_grad_(True), ent.detach().requires_grad_(True)
        loss, pol = middle(lp, h, spec, x)
        dlogp, dent = torch.autograd.grad(loss, (lp, h), allow_unused=True)
    dlogp = torch.zeros_like(lp) if dlogp is None else dlogp
    dent = torch.zeros_like(h) if dent is None else dent
    return dlogp, dent, loss.detach(), pol.detach()


def _passes(logits, spec, x, prefix, need_grad, shard=None):
    """The three steps: (loss, loss_tok, logp, ent, dlogits or None, the scale dlogits
    carries). shard: a vocab_parallel.VocabShard when the logits are this rank's shard of
    the vocabulary (the statistics are merged over its group between steps 1 and 2). With
    x.packing the logits' rows are packed sequences: the [B, T] tensors of x are padded
    ([S, max_seqlen]) and the kernels read them packed again (x.kernel)."""
    fwd = getattr(torch.ops.ppo_kernels, prefix + "token_logprobs_fwd")
    tok, msk = x.kernel(x.tokens), x.kernel(x.mask)
    temp = x.kernel_temperature(spec)  # a number, or per row (the kernels' layout)
    own = None
    if shard is not None:  # (tok becomes the shard-local ids)
        logp, ent, row_max, log_sum, tok, own = shard_stats(logits, tok, msk, temp, shard,
                                                             prefix)
    else:
        t, temps = split_temperature(temp)
        logp, ent, row_max, log_sum = fwd(logits, tok, msk, t, True, temperatures=temps)
    dlogp, dent, loss, pol = middle_grad(x.padded(logp), x.padded(ent), spec, x)
    gs = spec.effective_grad_scale(logits.dtype)
    dlogits = None
    if need_grad:  # else no second pass over the logits
        g_lp = x.kernel(dlogp * gs).contiguous()
        g_ent = x.kernel(dent * gs).contiguous() if spec.entropy_coef != 0.0 else None
        dlogits = logits_grad(prefix, g_lp, g_ent, logits, tok, msk, row_max, log_sum, ent,
                              temp, shard, own)
    ent_p = x.padded(ent)
    loss_tok = torch.where(x.mask, pol - spec.entropy_coef * ent_p, 0.0)
    return loss.detach(), loss_tok, x.padded(logp), ent_p, dlogits, gs


class TwoPhaseLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, spec, x, prefix, shard):
        loss, loss_tok, logp, ent, dlogits, gs = _passes(logits, spec, x, prefix, True, shard)
        ctx.prefix = prefix
        ctx.applied = applied_scale(gs, logits)
        ctx.save_for_backward(dlogits)
        ctx.mark_non_differentiable(loss_tok, logp, ent)
        return loss, loss_tok, logp, ent

    @staticmethod
    def backward(ctx, grad_loss, *_):
        first_order_only("ppo_loss")
        (dlogits,) = ctx.saved_tensors
        return hand_out(ctx.prefix, dlogits, grad_loss, ctx.applied), None, None, None, None


def ppo_loss(prefix, logits, spec, x, shard=None):
    """(loss, loss_tok, logp, ent) of the two-phase path on a kernel backend (loss.two_phase
    says when); logp, ent and loss_tok in the layout of the LossInputs x."""
    if not (torch.is_grad_enabled() and logits.requires_grad):
        with torch.no_grad():
            return _passes(logits, spec, x, prefix, False, shard)[:4]
    return TwoPhaseLoss.apply(logits, spec, x, prefix, shard)
