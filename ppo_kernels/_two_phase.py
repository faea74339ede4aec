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
from ._ops import effective_grad_scale, scale_grad
from .vocab_parallel import logits_grad, shard_stats


def _middle(logp, ent, mask, old, adv, weights, w_ent, ref, isw, p):
    """The aggregated loss as a function of the per-token logp and H ([B, T])."""
    pol, _ = _torch_impl.token_losses(logp, ent, old, adv, ref, isw, mask, p)
    return _torch_impl.aggregate(pol, ent, mask, weights, w_ent, p), pol


def _passes(logits, tokens, mask, old, adv, weights, w_ent, ref, isw, p, prefix, need_grad,
            shard=None, packing=None):
    """The three steps: (loss, loss_tok, logp, ent, dlogits or None, the scale dlogits
    carries). shard: a vocab_parallel.VocabShard when the logits are this rank's shard of
    the vocabulary (the statistics are merged over its group between steps 1 and 2).
    packing: a packed.Packing when the logits' rows are packed sequences; the [B, T]
    tensors are then padded ([S, max_seqlen]) and the kernels read them packed again."""
    ops = torch.ops.ppo_kernels
    fwd = getattr(ops, prefix + "token_logprobs_fwd")

    def kernel(x):
        return x if x is None or packing is None else packing.unpad(x).contiguous()

    def padded(x):
        return x if packing is None else packing.pad(x)

    tok, msk = kernel(tokens), kernel(mask)
    own = None
    if shard is not None:  # (tok becomes the shard-local ids)
        logp, ent, row_max, log_sum, tok, own = shard_stats(logits, tok, msk,
                                                             p["temperature"], shard, prefix)
    else:
        logp, ent, row_max, log_sum = fwd(logits, tok, msk, p["temperature"], True)

    def f(lp, h):
        return _middle(lp, h, mask, old, adv, weights, w_ent, ref, isw, p)

    (dlogp, dent), (loss, pol) = torch.func.grad_and_value(f, argnums=(0, 1), has_aux=True)(
        padded(logp), padded(ent))
    gs = effective_grad_scale(p["grad_scale"], logits.dtype)
    dlogits = None
    if need_grad:  # else no second pass over the logits
        g_lp = kernel(dlogp * gs).contiguous()
        g_ent = kernel(dent * gs).contiguous() if p["entropy_coef"] != 0.0 else None
        dlogits = logits_grad(prefix, g_lp, g_ent, logits, tok, msk, row_max, log_sum, ent,
                              p["temperature"], shard, own)
    ent_p = padded(ent)
    loss_tok = torch.where(mask, pol - p["entropy_coef"] * ent_p, 0.0)
    return loss.detach(), loss_tok, padded(logp), ent_p, dlogits, gs


class TwoPhaseLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, mask, old, adv, weights, w_ent, ref, isw, p, prefix,
                shard, packing):
        loss, loss_tok, logp, ent, dlogits, gs = _passes(
            logits, tokens, mask, old, adv, weights, w_ent, ref, isw, p, prefix, True, shard,
            packing)
        ctx.prefix = prefix
        ctx.applied = torch.full((), gs, dtype=logp.dtype, device=logits.device)
        ctx.save_for_backward(dlogits)
        ctx.mark_non_differentiable(loss_tok, logp, ent)
        return loss, loss_tok, logp, ent

    @staticmethod
    def backward(ctx, grad_loss, *_):
        (dlogits,) = ctx.saved_tensors
        return (scale_grad(ctx.prefix, dlogits, grad_loss, ctx.applied),) + (None,) * 12


def ppo_loss(prefix, logits, tokens, mask, old, adv, weights, ref, isw, p, w_ent, shard=None,
             packing=None):
    """(loss, loss_tok, logp, ent) of a sequence-level policy loss (or of any policy loss
    over a vocabulary split across ranks: shard) on a kernel backend."""
    if not (torch.is_grad_enabled() and logits.requires_grad):
        with torch.no_grad():
            return _passes(logits, tokens, mask, old, adv, weights, w_ent, ref, isw, p, prefix,
                           False, shard, packing)[:4]
    return TwoPhaseLoss.apply(logits, tokens, mask, old, adv, weights, w_ent, ref, isw, p,
                              prefix, shard, packing)
