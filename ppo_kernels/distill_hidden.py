"""distill_loss with the LM head fused in: from the last hidden states and the LM head
weight, chunked over rows as ppo_loss_from_hidden (ppo_kernels/from_hidden.py, whose
helpers this module shares: the chunk's logits, the soft cap's derivative, the gradient
accumulators, the backward that only rescales). Per chunk of rows r0:r1: z_c = h_c W^T
(+ b), soft-capped; the distill_fwd kernel on the [1, C, V] view with the teacher's CSR
(a view of offsets[r0:r1 + 1] into the whole token_ids: no host read), writing
d loss / d z_c in the same pass; times 1 - tanh^2 with a soft cap; then
d hidden_c = dz_c W, dW += dz_c^T h_c, db += sum dz_c, all in the forward.
"""

from __future__ import annotations

import torch

from ._autograd import LossWithGrad
from .distill import check_call, metrics_of, placeholder_tokens, torch_terms
from .distill_tp import distill_loss_from_hidden_tp
from .head_chunks import (Grads, HeadRows, head_options, hidden_and_tokens,
                          materialised_logits, softcap_factor_)
from .lm_head import accepts_head_module


class DistillHead:
    """The chunked distillation loss, as LossWithGrad runs it (its backward rescales the
    saved d hidden, dW, db in place by grad_output / grad_scale)."""

    name = "distill_loss_from_hidden"

    def __init__(self, src, call, temperature, tail, gs):
        self.src, self.call, self.temperature, self.tail, self.gs = (src, call, temperature,
                                                                     tail, gs)
        self.prefix = src.be.prefix

    def loss(self, inputs, need):
        """((loss, kl, student_mass, teacher_tail) [B, T], (d hidden, dW, db), grad_scale)."""
        s, c = self.src, self.call
        op = s.be.op("distill_fwd")
        g = Grads(s.n, s.head, *inputs, need)
        loss = torch.zeros((), dtype=c.acc, device=inputs[0].device)
        terms = ([], [], [])

        def block(blk, hc, z3):
            n_c = blk.r1 - blk.r0
            lc, k, p, t, dz = op(z3, blk.rows(c.mask), c.offsets[blk.r0:blk.r1 + 1], c.ids,
                                 c.lt, blk.rows(c.weights), self.temperature, self.gs,
                                 self.tail, g.any)
            if g.any:
                dz = dz.view(n_c, -1)
                if s.cap is not None:
                    dz.mul_(softcap_factor_(z3.view(n_c, -1), s.cap))
                g.add(blk, dz, hc)
                del dz
            loss.add_(lc)
            for part, v in zip(terms, (k, p, t)):
                part.append(v)

        s.each_block(inputs, block)
        return (loss, *(s.cat(v) for v in terms)), g.finish(s.t, *inputs), self.gs


@accepts_head_module  # a head module: the op runs as its forward (lm_head.py)
def distill_loss_from_hidden(hidden, lm_head_weight, teacher, response_mask=None, *,
                             lm_head_bias=None, logit_softcap=None, chunk_size=None,
                             tail=True, temperature=1.0, loss_agg_mode="token-mean",
                             global_num_tokens=None, global_num_seqs=None, norm_length=None,
                             grad_scale=1.0, cu_seqlens=None, max_seqlen=None, tp_group=None,
                             vocab_start=None, backend="auto", accum_dtype=None):
    """pk.distill_loss on the logits hidden @ lm_head_weight^T (+ lm_head_bias), soft-capped
    by cap * tanh(x / cap) with logit_softcap, never materialising the [N, V] logits: chunks
    of chunk_size rows (default: about 256 MiB of logits per chunk, or a quarter of dW's
    accumulator where that is more), the gradient with
    respect to hidden, lm_head_weight and lm_head_bias computed in the forward
    (docs/FROM_HIDDEN.md).

    Args:
        hidden: [B, T, H], [B, T + 1, H] or [N, H]; float32, bfloat16, float16 or float64.
        lm_head_weight: [V, H] of hidden's dtype; or the head module (a torch.nn.Linear,
            plain, FSDP2- or ZeRO-3-wrapped; lm_head_bias None, its own bias is used): the
            op then runs as its forward, inside the framework's hooks, as
            ppo_loss_from_hidden (ppo_kernels/lm_head.py, docs/DISTRIBUTED.md); another
            module is a TypeError naming lm_head_weight. lm_head_bias: [V] or None.
        teacher, response_mask and the keywords: as pk.distill_loss (the CSR over the
            B * T positions). loss_agg_mode="none" runs only on backend="torch" (the chunked
            kernels write a gradient weighted before the backward).
        logit_softcap: > 0 or None. chunk_size: rows per chunk (int >= 1) or None.
        accum_dtype: dW's sum over the chunks, as in pk.ppo_loss_from_hidden.
        tp_group, vocab_start: the head's rows [V_r, H] (bias [V_r]) of this rank, hidden
            the same on every rank, as ppo_loss_from_hidden; this first version
            materialises the shard's logits [B, T, V_r] (torch ops, any backend, also
            loss_agg_mode="none"; chunk_size and accum_dtype unused) and merges them as
            distill_loss does; d hidden is summed over the group in the backward
            (ppo_kernels/distill_tp.py).

    Returns:
        (loss, metrics) as pk.distill_loss.

    Raises:
        TypeError / ValueError naming the argument (those of pk.distill_loss, the LM head's
        shapes and dtypes, chunk_size, logit_softcap, loss_agg_mode="none" on a kernel
        backend; with tp_group, decided by the ranks together).
    """
    opts = dict(tail=tail, temperature=temperature, loss_agg_mode=loss_agg_mode,
                grad_scale=grad_scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                tp_group=tp_group, vocab_start=vocab_start, global_num_tokens=global_num_tokens,
                global_num_seqs=global_num_seqs, norm_length=norm_length, backend=backend)
    if tp_group is not None or vocab_start is not None:
        return distill_loss_from_hidden_tp(hidden, lm_head_weight, lm_head_bias, teacher,
                                           response_mask, opts, logit_softcap, chunk_size,
                                           accum_dtype)
    tokens = placeholder_tokens(hidden, teacher)
    hidden3, _, flat = hidden_and_tokens(hidden, lm_head_weight, lm_head_bias, tokens)
    opts["flat"] = flat
    c, tail, temperature, gs = check_call(hidden3, lm_head_weight.shape[0], teacher,
                                          response_mask, opts, name="hidden")
    head = head_options(hidden3, lm_head_weight, logit_softcap, chunk_size,
                        accum_dtype=accum_dtype)  # (two buffers: the logits, distill_fwd's dz)
    if not c.be.is_kernel:
        logits = materialised_logits(hidden3, lm_head_weight, lm_head_bias, head.cap, c.mask)
        loss, kl, ps, tt = torch_terms(c, logits, tail, temperature)
        if c.weights is None:
            per = torch.where(c.mask, kl, 0.0)
            loss = per[0] if flat else per
        return loss, metrics_of(c, kl, ps, tt)
    if c.weights is None:
        raise ValueError("loss_agg_mode: 'none' is not supported by distill_loss_from_hidden on "
                         "the kernel backends (the chunked pass writes the weighted gradient "
                         "in the forward); use a scalar mode or backend='torch'")
    src = HeadRows(c.be, head, None, c.mask, temperature, c.acc)
    run = DistillHead(src, c, temperature, tail, gs)
    loss, kl, ps, tt = LossWithGrad.apply(run, hidden3, lm_head_weight, lm_head_bias)
    return loss, metrics_of(c, kl, ps, tt)
