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

from . import _torch_impl, sampling
from ._autograd import applied_scale, first_order_only, hand_out, not_traceable, wants_grad
from ._checks import split_temperature
from .vocab_parallel import logits_grad, shard_stats


def middle(logp, ent, spec, x, logp_kl=None):
    """The aggregated loss as a function of the per-token logp and H ([B, T], the layout of
    the LossInputs x), and the per-token policy part. logp_kl: the KL's log-probs where
    they are not logp (sampling replay: logp is then over the kept set)."""
    pol, _ = _torch_impl.token_losses(logp, ent, x.old, x.adv, x.ref, x.isw, x.mask, spec,
                                      x.behaviour, logp_kl=logp_kl)
    return _torch_impl.aggregate(pol, ent, x.mask, x.weights, x.w_ent, spec), pol


def middle_grad(logp, ent, spec, x, logp_kl=None):
    """(d loss / d logp, d loss / d H, loss, pol[, d loss / d logp_kl]): the middle and its
    gradient in logp and H ([B, T] tensors: cheap next to [N, V]); the last only for a
    logp_kl. Eagerly by autograd on detached leaves, which also runs under saved-tensor
    hooks (activation offloading, non-reentrant checkpoints), where torch.func cannot;
    traced (torch.compile) by torch.func, which Dynamo captures whole."""
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


def _replay_passes(logits, spec, x, prefix, need_grad):
    """The three steps with a kept set (sampling replay, ppo_kernels/sampling.py): the
    statistics pass gives the full logp and H, the kept-set kernels logp_kept and H_kept
    (plus the threshold pre-pass for re-derived sets); the middle takes logp_kept as the
    ratio's log-prob and the full or kept logp / H for the KL / entropy (spec.kl_logprobs,
    spec.entropy_over); the gradient pass writes the full part with token_logprobs_bwd and
    adds the kept-set softmax part in place (kept_logprobs_bwd_)."""
    fwd = getattr(torch.ops.ppo_kernels, prefix + "token_logprobs_fwd")
    tok, msk, rp = x.kernel(x.tokens), x.kernel(x.mask), x.replay
    temp = x.kernel_temperature(spec)  # a number, or per row (the kernels' layout)
    t_num, temps = split_temperature(temp)
    logp, ent, row_max, log_sum = fwd(logits, tok, msk, t_num, True, temperatures=temps)
    ks = sampling.kernel_stats(prefix, logits, tok, msk, temp, rp)
    kl_kept, ent_kept = spec.kl_logprobs == "kept", spec.entropy_over == "kept"
    ent_sel = ks.entropy if ent_kept else ent
    out = middle_grad(x.padded(ks.logp), x.padded(ent_sel), spec, x,
                      None if kl_kept else x.padded(logp))
    dlk, dent, loss, pol = out[:4]
    gs = spec.effective_grad_scale(logits.dtype)
    dlogits = None
    if need_grad:
        g_full = torch.zeros_like(logp) if kl_kept else x.kernel(out[4] * gs).contiguous()
        g_ent = x.kernel(dent * gs).contiguous() if spec.entropy_coef != 0.0 else None
        dlogits = logits_grad(prefix, g_full, None if ent_kept else g_ent, logits, tok, msk,
                              row_max, log_sum, ent, temp)
        sampling.kernel_grad_(prefix, dlogits, x.kernel(dlk * gs).contiguous(),
                              g_ent if ent_kept else None, logits, tok, msk, ks, temp, rp)
    ent_p = x.padded(ent_sel)
    loss_tok = torch.where(x.mask, pol - spec.entropy_coef * ent_p, 0.0)
    mass = sampling.kept_mass(ks.lse(temp), row_max, log_sum, temp, msk)
    aux = (x.padded(logp), x.padded(mass), x.padded(ks.kept_size), x.padded(ks.missing))
    return loss.detach(), loss_tok, x.padded(ks.logp), ent_p, dlogits, gs, aux


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
    if x.replay is not None:
        if shard is not None:
            return sampling.vp_replay_passes(logits, spec, x, prefix, need_grad, shard)
        return _replay_passes(logits, spec, x, prefix, need_grad)
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
        # (x * 1.0 is x: no multiply for the default grad_scale)
        g_lp = x.kernel(dlogp if gs == 1.0 else dlogp * gs).contiguous()
        g_ent = (x.kernel(dent if gs == 1.0 else dent * gs).contiguous()
                 if spec.entropy_coef != 0.0 else None)
        dlogits = logits_grad(prefix, g_lp, g_ent, logits, tok, msk, row_max, log_sum, ent,
                              temp, shard, own)
    ent_p = x.padded(ent)
    loss_tok = torch.where(x.mask, pol - spec.entropy_coef * ent_p, 0.0)
    return loss.detach(), loss_tok, x.padded(logp), ent_p, dlogits, gs, ()


class TwoPhaseLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, spec, x, prefix, shard):
        loss, loss_tok, logp, ent, dlogits, gs, aux = _passes(logits, spec, x, prefix, True,
                                                              shard)
        ctx.prefix = prefix
        ctx.applied = applied_scale(gs, logits)
        ctx.save_for_backward(dlogits)
        ctx.mark_non_differentiable(loss_tok, logp, ent, *aux)
        return loss, loss_tok, logp, ent, *aux

    @staticmethod
    def backward(ctx, grad_loss, *_):
        first_order_only("ppo_loss")
        (dlogits,) = ctx.saved_tensors
        return hand_out(ctx.prefix, dlogits, grad_loss, ctx.applied), None, None, None, None


def ppo_loss(prefix, logits, spec, x, shard=None):
    """(loss, loss_tok, logp, ent) of the two-phase path on a kernel backend (loss.two_phase
    says when); logp, ent and loss_tok in the layout of the LossInputs x. With a kept set
    (x.replay) four more [B, T] tensors follow: the full logp, the kept mass, the kept set's
    size and whether the set lacked the sampled token; logp is then logp_kept and ent the
    entropy spec.entropy_over names."""
    if torch.jit.is_tracing():  # (its middle is differentiated by autograd, even without grad)
        raise not_traceable("the two-phase path (gspo, gspo-token, vespo, the off-policy "
                            "mask, a kept set, a split vocabulary)")
    if not wants_grad(logits):
        with torch.no_grad():
            out = _passes(logits, spec, x, prefix, False, shard)
            return (*out[:4], *out[6])
    return TwoPhaseLoss.apply(logits, spec, x, prefix, shard)
