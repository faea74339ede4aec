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

import dataclasses
from typing import Any

import torch

from ._autograd import applied_scale
from .distill import _torch_terms, check_call, metrics_of
from .from_hidden import (_Grads, _LossFromHidden, _flat_hidden, _head_options,
                          _hidden_and_tokens, _hidden_rows, _rows, _softcap_factor_,
                          chunk_logits, materialised_logits)
from .lm_head import accepts_head_module


@dataclasses.dataclass
class _DistillChunks:
    """What the chunk loop reads (the fields from_hidden's helpers take: n, t, chunk,
    mask)."""

    prefix: str
    cap: Any
    chunk: int
    temperature: float
    tail: bool
    gs: float
    call: Any

    def __post_init__(self):
        self.mask = self.call.mask
        self.b, self.t = self.mask.shape
        self.n = self.b * self.t


def _chunk_pass(s, hidden3, weight, bias, need):
    c = s.call
    op = getattr(torch.ops.ppo_kernels, s.prefix + "distill_fwd")
    h2 = _flat_hidden(hidden3, s)
    g = _Grads(s, hidden3, weight, bias, need)
    dev = hidden3.device
    kl = torch.empty(s.n, dtype=c.acc, device=dev)
    ps = torch.empty(s.n, dtype=c.acc, device=dev)
    tt = torch.empty(s.n, dtype=c.acc, device=dev)
    loss = torch.zeros((), dtype=c.acc, device=dev)
    for r0 in range(0, s.n, s.chunk):
        r1 = min(s.n, r0 + s.chunk)
        n_c = r1 - r0
        hc = _hidden_rows(h2, s, r0, r1)
        z = chunk_logits(hc, weight, bias, s.cap)
        lc, k, p, t, dz = op(z.view(1, n_c, -1), _rows(c.mask, s, r0, r1),
                             c.offsets[r0:r1 + 1], c.ids, c.lt, _rows(c.weights, s, r0, r1),
                             s.temperature, s.gs, s.tail, g.any)
        if g.any:
            dz = dz.view(n_c, -1)
            if s.cap is not None:
                dz.mul_(_softcap_factor_(z, s.cap))
            del z
            g.add(r0, r1, dz, hc, weight)
            del dz
        loss += lc
        kl[r0:r1], ps[r0:r1], tt[r0:r1] = k.view(n_c), p.view(n_c), t.view(n_c)
    return loss, kl.view(s.b, s.t), ps.view(s.b, s.t), tt.view(s.b, s.t), g


class _DistillFromHidden(_LossFromHidden):
    """The forward of the chunked distillation loss; the backward is ppo_loss_from_hidden's
    (rescale the saved d hidden, dW, db in place by grad_output / grad_scale)."""

    @staticmethod
    def forward(ctx, hidden3, weight, bias, s):
        need = tuple(ctx.needs_input_grad[:3])
        loss, kl, ps, tt, g = _chunk_pass(s, hidden3, weight, bias, need)
        dh, dw, db = g.finish(s, hidden3, weight, bias)
        ctx.save_for_backward(dh, dw, db)
        ctx.prefix = s.prefix
        ctx.applied = [applied_scale(s.gs, hidden3) for _ in range(3)]
        ctx.mark_non_differentiable(kl, ps, tt)
        ctx.set_materialize_grads(False)
        return loss, kl, ps, tt


def placeholder_tokens(hidden, teacher):
    """Checks hidden's rank and the teacher's N against it; zero tokens of the positions'
    shape ([N] for [N, H] hidden, else [B, T]) for from_hidden's shape checks."""
    from .distill import SparseLogprobs
    from . import _checks as ck

    if not isinstance(teacher, (SparseLogprobs, tuple)) or len(teacher) != 3:
        raise TypeError(f"teacher: expected a SparseLogprobs(token_ids, offsets, logprobs), got "
                        f"{type(teacher).__name__}")
    ck.tensor("hidden", hidden)
    ck.tensor("teacher.offsets", teacher[1], integer=True)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden: expected [B, T, H], [B, T + 1, H] or [N, H], got shape "
                         f"{list(hidden.shape)}")
    n = teacher[1].numel() - 1
    flat = hidden.dim() == 2
    if flat:
        tokens = torch.zeros(n, dtype=torch.long, device=hidden.device)
    else:
        b, tl = hidden.shape[0], hidden.shape[1]
        t = tl if b * tl == n else tl - 1
        if b * t != n:
            raise ValueError(f"teacher.offsets: N + 1 = {n + 1} entries do not fit hidden of "
                             f"shape {list(hidden.shape)} (expected N = B * T = {b * tl}, or "
                             f"{b * (tl - 1)} for the raw [B, T + 1, H] output)")
        tokens = torch.zeros(b, t, dtype=torch.long, device=hidden.device)
    return tokens


@accepts_head_module  # a head module: the op runs as its forward (lm_head.py)
def distill_loss_from_hidden(hidden, lm_head_weight, teacher, response_mask=None, *,
                             lm_head_bias=None, logit_softcap=None, chunk_size=None,
                             tail=True, temperature=1.0, loss_agg_mode="token-mean",
                             global_num_tokens=None, global_num_seqs=None, norm_length=None,
                             grad_scale=1.0, cu_seqlens=None, max_seqlen=None, tp_group=None,
                             vocab_start=None, backend="auto"):
    """pk.distill_loss on the logits hidden @ lm_head_weight^T (+ lm_head_bias), soft-capped
    by cap * tanh(x / cap) with logit_softcap, never materialising the [N, V] logits: chunks
    of chunk_size rows (default: about 256 MiB of logits per chunk), the gradient with
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
        tp_group, vocab_start: the head's rows [V_r, H] (bias [V_r]) of this rank, hidden
            the same on every rank, as ppo_loss_from_hidden; this first version
            materialises the shard's logits [B, T, V_r] (torch ops, any backend, also
            loss_agg_mode="none"; chunk_size unused) and merges them as distill_loss does;
            d hidden is summed over the group in the backward (ppo_kernels/distill_tp.py).

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
        from .distill_tp import distill_loss_from_hidden_tp
        return distill_loss_from_hidden_tp(hidden, lm_head_weight, lm_head_bias, teacher,
                                           response_mask, opts, logit_softcap, chunk_size)
    tokens = placeholder_tokens(hidden, teacher)
    hidden3, _, flat = _hidden_and_tokens(hidden, lm_head_weight, lm_head_bias, tokens)
    opts["flat"] = flat
    c, tail, temperature, gs = check_call(hidden3, lm_head_weight.shape[0], teacher,
                                          response_mask, opts, name="hidden")
    cap, chunk = _head_options(hidden3, lm_head_weight, logit_softcap, chunk_size)
    if not c.be.is_kernel:
        logits = materialised_logits(hidden3, lm_head_weight, lm_head_bias, cap, c.mask)
        loss, kl, ps, tt = _torch_terms(c, logits, tail, temperature)
        if c.weights is None:
            per = torch.where(c.mask, kl, 0.0)
            loss = per[0] if flat else per
        return loss, metrics_of(c, kl, ps, tt)
    if c.weights is None:
        raise ValueError("loss_agg_mode: 'none' is not supported by distill_loss_from_hidden on "
                         "the kernel backends (the chunked pass writes the weighted gradient "
                         "in the forward); use a scalar mode or backend='torch'")
    s = _DistillChunks(c.be.prefix, cap, chunk, temperature, tail, gs, c)
    loss, kl, ps, tt = _DistillFromHidden.apply(hidden3, lm_head_weight, lm_head_bias, s)
    return loss, metrics_of(c, kl, ps, tt)
