"""The PPO loss (and the token log-probs) with the LM head fused in: from the last hidden
states and the LM head weight, never materialising the [N, V] logits (docs/FROM_HIDDEN.md).

The rows of [B, T] (flattened, valid and masked alike) are processed in chunks of
``chunk_size`` rows. Per chunk: logits_c = h_c @ W^T (+ b) in hidden's dtype through torch
(oneDNN / cuBLAS), the optional soft cap z = cap * tanh(x / cap), the existing fused kernel
on the [1, C, V] view of the chunk, writing d loss / d z over the chunk's logits
(ppo_loss_fwd_inplace), times the soft cap's derivative 1 - tanh^2, then
d hidden_c = dz_c @ W, dW += dz_c^T h_c (float32 accumulator for bf16 / fp16 over several
chunks), db += sum dz_c.
All of it in the forward; the backward only rescales the saved (d hidden, dW, db) by
grad_output, in place (ppo_kernels._autograd.hand_out). The aggregation weights of the
whole batch are known before any logit, so each chunk's loss is exactly its share of the total.

The sequence-level losses (gspo, gspo-token, off_policy_mask_threshold) need every logp
before any gradient: a first chunked pass (token_logprobs_fwd) collects logp, H and the row
statistics, the [B, T] middle is that of ppo_kernels/_two_phase.py, and a second chunked
pass recomputes the logits (one more matmul) and writes dz with token_logprobs_bwd.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch

from . import _checks as ck
from . import _torch_impl, packed
from . import sampling
from ._checks import acc_dtype, split_temperature
from ._autograd import applied_scale, first_order_only, hand_out, wants_grad
from ._backends import get_backend
from ._two_phase import middle_grad
from .advantages import (packed_rollout_inputs, rollout_from_logprobs, rollout_inputs,
                         rollout_sizes)
from .lm_head import accepts_head_module
from .loss import (check_loss, composite_padded, loss_metrics, per_token_loss, two_phase,
                   weigh_loss)
from .rank_agreement import agreed_sizes, checks_together, groups
from .vocab_parallel import all_reduce_sum_, logits_grad, require_kernels, shard_of

CHUNK_BYTES = 256 << 20  # chunk_size=None: one chunk of logits is about this many bytes


# ------------------------------------------------------------------ argument checks

def _hidden_and_tokens(hidden, weight, bias, tokens):
    """(hidden3 [B, Tl, H], tokens2 [B, T] int64, flat) after checking hidden, the LM head
    and the tokens; every error names its argument."""
    ck.tensor("hidden", hidden)
    if hidden.dtype not in ck.LOGITS_DTYPES:
        raise TypeError(f"hidden: expected float32, bfloat16, float16 or float64, got "
                        f"{hidden.dtype}")
    ck.tensor("lm_head_weight", weight)
    ck.same_device("lm_head_weight", weight, "hidden", hidden)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"lm_head_weight: expected dtype {hidden.dtype} (that of hidden), got "
                        f"{weight.dtype}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden: expected [B, T, H], [B, T + 1, H] or [N, H], got shape "
                         f"{list(hidden.shape)}")
    h = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != h:
        raise ValueError(f"lm_head_weight: expected [V, H] with H = {h} (the last dimension "
                         f"of hidden), got shape {list(weight.shape)}")
    v = weight.shape[0]
    if v == 0:
        raise ValueError("lm_head_weight: empty vocabulary (V = 0)")
    if bias is not None:
        ck.tensor("lm_head_bias", bias)
        ck.same_device("lm_head_bias", bias, "hidden", hidden)
        if bias.dtype != hidden.dtype:
            raise TypeError(f"lm_head_bias: expected dtype {hidden.dtype} (that of hidden), "
                            f"got {bias.dtype}")
        if tuple(bias.shape) != (v,):
            raise ValueError(f"lm_head_bias: expected shape [V] = [{v}], got "
                             f"{list(bias.shape)}")
    hidden, tokens, flat = ck.align_tokens(tokens, hidden, "hidden", "H")
    return hidden, tokens.long().contiguous(), flat


def _head_shard(hidden, weight, bias, tp_group, vocab_start):
    """(hidden, weight, bias, VocabShard or None): the LM head's rows split over tp_group,
    or DTensors (weight / bias sharded on the vocabulary, Shard(0), with tp_group: FSDP2
    shards its parameters on dim 0 too; hidden replicated)."""
    weight, shard = shard_of(weight, tp_group, vocab_start, 0, "lm_head_weight")
    if shard is not None:
        if bias is not None and hasattr(bias, "to_local"):
            bias = bias.to_local()
        if hasattr(hidden, "to_local"):
            hidden = hidden.to_local()
    return hidden, weight, bias, shard


def _logits_dtype(logits_dtype, hidden3):
    """logits_dtype as the chunk loops read it: None (the hidden states' dtype) or
    torch.float32 for bfloat16 / float16 hidden states (float32 hidden states: None, the
    same thing). Anything else is a TypeError / ValueError naming logits_dtype."""
    if logits_dtype is None:
        return None
    if not isinstance(logits_dtype, torch.dtype):
        raise TypeError(f"logits_dtype: expected None or torch.float32, got "
                        f"{type(logits_dtype).__name__}")
    if logits_dtype != torch.float32:
        raise ValueError(f"logits_dtype: expected None (the hidden states' dtype) or "
                         f"torch.float32, got {logits_dtype}")
    if hidden3.dtype == torch.float64:
        raise ValueError("logits_dtype: torch.float32 would round the logits of float64 "
                         "hidden states down; pass None")
    return None if hidden3.dtype == torch.float32 else torch.float32


def _head_options(hidden3, weight, logit_softcap, chunk_size, logits_dtype=None):
    """(cap, rows per chunk); the default chunk holds about CHUNK_BYTES of logits in
    logits_dtype (checked: _logits_dtype) or hidden's dtype."""
    cap = None if logit_softcap is None else ck.number("logit_softcap", logit_softcap,
                                                       lo=0.0, lo_open=True)
    if chunk_size is None:
        chunk = default_chunk_size(weight.shape[0], logits_dtype or hidden3.dtype)
    else:
        if isinstance(chunk_size, bool) or not hasattr(type(chunk_size), "__index__"):
            raise TypeError(f"chunk_size: expected an int (rows per chunk) or None, got "
                            f"{type(chunk_size).__name__}")
        chunk = operator.index(chunk_size)
        if chunk < 1:
            raise ValueError(f"chunk_size: expected at least 1 row, got {chunk_size}")
    return cap, chunk


def default_chunk_size(vocab, dtype):
    """Rows per chunk for chunk_size=None: one chunk of [rows, V] logits in ``dtype`` is
    about CHUNK_BYTES = 256 MiB (at least 1 row)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, CHUNK_BYTES // (vocab * itemsize))


@dataclasses.dataclass
class _Chunks:
    """Everything but the three differentiable tensors, validated: what the chunk loops
    read. The per-token tensors are [B, T] in the layout the kernels read (packed again
    with cu_seqlens); tokens are shard-local ids over a split vocabulary (own: whether this
    rank holds the token)."""

    prefix: str
    cap: Optional[float]
    chunk: int
    temperature: Any  # a number, or the per-row [B, T] tensor (the kernels' layout)
    tokens: Any
    mask: Any
    acc: Any
    shard: Any = None
    own: Any = None
    return_entropy: bool = True
    spec: Any = None  # the LossSpec (the loss ops)
    inputs: Any = None  # the LossInputs, in their own (padded) layout
    old: Any = None
    adv: Any = None
    ref: Any = None
    isw: Any = None
    weights: Any = None
    w_ent: Any = None
    gs: float = 1.0
    logits_dtype: Any = None  # the chunks' logits dtype (None: hidden's)

    def __post_init__(self):
        self.global_tokens = self.tokens
        if self.shard is not None:
            self.tokens, self.own = self.shard.local_tokens(self.tokens)
        self.b, self.t = self.tokens.shape
        self.n = self.b * self.t


# ------------------------------------------------------------------ the chunk pieces

def chunk_logits(h, weight, bias, cap, logits_dtype=None):
    """[C, V] logits of the rows h [C, H] in hidden's dtype, soft-capped in place. The one
    place the fused paths create [rows, V] logits (tests spy on it).

    logits_dtype=torch.float32 with bfloat16 / float16 rows: the logits in float32, never
    rounded to the rows' dtype (vLLM's head_dtype=float32, SGLang's enable_fp32_lm_head,
    ScaleRL's FP32 LM head): on CUDA one cuBLAS matmul of the 16-bit operands with a
    float32 output (torch.mm out_dtype); elsewhere the float32 product of the rows and a
    weight the caller has already widened to float32 (head_for_logits: once per pass)."""
    if logits_dtype is not None and logits_dtype != h.dtype:
        if h.is_cuda and weight.dtype == h.dtype:
            z = torch.mm(h, weight.t(), out_dtype=logits_dtype)
            if bias is not None:
                z.add_(bias)
        else:
            w = weight.to(logits_dtype)
            h = h.to(logits_dtype)
            z = torch.mm(h, w.t()) if bias is None else torch.addmm(bias.to(logits_dtype), h,
                                                                   w.t())
        if cap is not None:
            z.div_(cap).tanh_().mul_(cap)
        return z
    z = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())
    if cap is not None:
        z.div_(cap).tanh_().mul_(cap)
    return z


def head_for_logits(weight, logits_dtype):
    """The weight chunk_logits multiplies by: itself, or (logits_dtype float32 off CUDA,
    where torch.mm has no float32 output for 16-bit operands) its float32 copy, made once
    per pass over the chunks ([V, H] float32 of memory while the pass runs)."""
    if logits_dtype is None or logits_dtype == weight.dtype or weight.is_cuda:
        return weight
    return weight.to(logits_dtype)


def _chunk_logits(s, h, head, bias):
    """A chunk's logits as the loops make them (s.logits_dtype only when set, so that the
    default call is chunk_logits(h, weight, bias, cap), as before)."""
    if s.logits_dtype is None:
        return chunk_logits(h, head, bias, s.cap)
    return chunk_logits(h, head, bias, s.cap, s.logits_dtype)


def _softcap_factor_(z, cap):
    """1 - tanh^2 = 1 - (z / cap)^2, the soft cap's derivative, computed over z in place."""
    return z.div_(cap).square_().neg_().add_(1.0)


class _Grads:
    """The gradient accumulators of one forward (None for inputs that need none)."""

    def __init__(self, s, hidden3, weight, bias, need):
        need_h, need_w, need_b = need
        n, h, v = s.n, weight.shape[1], weight.shape[0]
        dt = hidden3.dtype
        self.wide = torch.float32 if dt in (torch.bfloat16, torch.float16) else dt
        # one chunk for all rows: dW and db are that chunk's matmul and sum as they come
        # (no float32 accumulator for bf16 / fp16: it would add [V, H] float32 of memory
        # and two passes over it to a product that already rounds once)
        self.single = n <= s.chunk
        self.dh2 = torch.empty(n, h, dtype=dt, device=hidden3.device) if need_h else None
        self.need_w, self.need_b = need_w, need_b
        self.dw = self.db = None
        if not self.single:
            if need_w:
                self.dw = torch.zeros(v, h, dtype=self.wide, device=weight.device)
            if need_b:
                self.db = torch.zeros(v, dtype=self.wide, device=weight.device)
        self.any = need_h or need_w or need_b

    def add(self, r0, r1, dz, h, weight):
        """Accumulate a chunk's dz [C, V] (d loss / d logits of rows r0:r1, h = their
        hidden states). float32 dz of 16-bit weights (logits_dtype=torch.float32) is
        rounded to the weights' dtype first: the two matmuls run as in the default path
        (the float32 accumulation of cuBLAS / oneDNN), so d hidden and dW keep their dtype
        and cost."""
        if dz.dtype != weight.dtype:
            dz = dz.to(weight.dtype)
        if self.dh2 is not None:
            torch.mm(dz, weight, out=self.dh2[r0:r1])
        if self.single:
            if self.need_w:
                self.dw = torch.mm(dz.t(), h)
            if self.need_b:
                self.db = dz.sum(0, dtype=self.wide)
            return
        if self.dw is not None:
            if self.dw.dtype == dz.dtype:
                self.dw.addmm_(dz.t(), h)
            else:  # bf16 / fp16: the matmul accumulates in float32, rounds once per chunk
                self.dw.add_(torch.mm(dz.t(), h))
        if self.db is not None:
            self.db.add_(dz.sum(0, dtype=self.wide))

    def finish(self, s, hidden3, weight, bias):
        """(d hidden [B, Tl, H], dW [V, H], db [V]) in the inputs' dtypes."""
        dh = None
        if self.dh2 is not None:
            b, tl, h = hidden3.shape
            dh = self.dh2.view(b, s.t, h)
            if tl != s.t:
                full = torch.zeros(b, tl, h, dtype=dh.dtype, device=dh.device)
                full[:, :s.t] = dh
                dh = full
        dw, db = self.dw, self.db
        if self.need_w and dw is None:  # no rows at all
            dw = torch.zeros_like(weight)
        if self.need_b and db is None:
            db = torch.zeros_like(bias)
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        return dh, dw, db


def _rows(x, s, r0, r1):
    """Rows r0:r1 of a [B, T] per-token tensor, as the [1, C] the kernels take."""
    return None if x is None else x.reshape(s.n)[r0:r1].view(1, r1 - r0)


def _temperature_rows(s, r0, r1):
    """The temperature of rows r0:r1: a number, or their [1, C] per-row values."""
    t = s.temperature
    return _rows(t, s, r0, r1) if isinstance(t, torch.Tensor) else t


def _flat_hidden(hidden3, s):
    return hidden3[:, :s.t].reshape(s.n, hidden3.shape[2])


def _hidden_rows(h2, s, r0, r1):
    """Rows r0:r1 of the flat hidden states, masked rows zeroed ([C, H], small): whatever a
    padded position holds (NaN included) stays out of dW = sum dz^T h, where its zero
    dz would meet it as 0 * NaN."""
    return torch.where(s.mask.reshape(s.n)[r0:r1, None], h2[r0:r1], 0.0)


# ------------------------------------------------------------------ the loss passes

def _fused_pass(s, hidden3, weight, bias, need):
    """Token-level losses: one pass. Returns (loss, logp [B, T], ent [B, T], grads)."""
    op_name = "ppo_loss_fwd_inplace"
    ops = torch.ops.ppo_kernels
    spec = s.spec
    h2 = _flat_hidden(hidden3, s)
    g = _Grads(s, hidden3, weight, bias, need)
    dev = hidden3.device
    logp = torch.empty(s.n, dtype=s.acc, device=dev)
    ent = torch.empty(s.n, dtype=s.acc, device=dev)
    loss = torch.zeros((), dtype=s.acc, device=dev)
    scalars, codes = spec.kernel_args(hidden3.dtype)
    head = head_for_logits(weight, s.logits_dtype)
    for r0 in range(0, s.n, s.chunk):
        r1 = min(s.n, r0 + s.chunk)
        c = r1 - r0
        hc = _hidden_rows(h2, s, r0, r1)
        z = _chunk_logits(s, hc, head, bias)
        per_tok = tuple(_rows(x, s, r0, r1) for x in (s.tokens, s.mask, s.old, s.adv,
                                                       s.weights, s.ref, s.isw, s.w_ent))
        temps = _rows(s.temperature, s, r0, r1) if isinstance(s.temperature,
                                                              torch.Tensor) else None
        if g.any:
            factor = None if s.cap is None else _softcap_factor_(z.clone(), s.cap)
            lc, _, lp, en = getattr(ops, s.prefix + op_name)(z.view(1, c, -1), *per_tok,
                                                              scalars, codes,
                                                              temperatures=temps)
            if factor is not None:
                z.mul_(factor)
                del factor
            g.add(r0, r1, z, hc, weight)
        else:
            lc, _, lp, en, _ = getattr(ops, s.prefix + "ppo_loss_fwd")(
                z.view(1, c, -1), *per_tok, scalars, codes, False, temperatures=temps)
        del z
        loss += lc
        logp[r0:r1] = lp.view(c)
        ent[r0:r1] = en.view(c)
    logp, ent = logp.view(s.b, s.t), ent.view(s.b, s.t)
    if s.w_ent is not None and spec.entropy_coef != 0.0:
        # as KernelBackend.ppo_loss: the kernel's value sums w * (... - entropy_coef H); the
        # entropy term's own weights are w_ent (its gradient already carries them)
        loss = loss + spec.entropy_coef * ((s.weights - s.w_ent) * ent).sum()
    return loss, logp, ent, g


def _stats_pass(s, hidden3, weight, bias, return_entropy):
    """First pass of the two-phase paths: (logp, ent, row_max, log_sum), each [N] (ent
    empty without return_entropy)."""
    fwd = getattr(torch.ops.ppo_kernels, s.prefix + "token_logprobs_fwd")
    h2 = _flat_hidden(hidden3, s)
    dev = hidden3.device
    out = [torch.empty(s.n, dtype=s.acc, device=dev) for _ in range(4)]
    if not return_entropy:
        out[1] = torch.empty(0, dtype=s.acc, device=dev)
    head = head_for_logits(weight, s.logits_dtype)
    for r0 in range(0, s.n, s.chunk):
        r1 = min(s.n, r0 + s.chunk)
        c = r1 - r0
        z = _chunk_logits(s, _hidden_rows(h2, s, r0, r1), head, bias)
        t, temps = split_temperature(_temperature_rows(s, r0, r1))
        res = fwd(z.view(1, c, -1), _rows(s.tokens, s, r0, r1), _rows(s.mask, s, r0, r1),
                  t, return_entropy, temperatures=temps)
        del z
        for i, r in enumerate(res):
            if i != 1 or return_entropy:
                out[i][r0:r1] = r.view(c)
    if s.shard is not None:  # the whole vocabulary's statistics: one all-gather, all rows
        row = (1, s.n)
        lp, en, mx, ls = s.shard.merge(out[0].view(row), out[1].view(row) if return_entropy
                                       else None, out[2].view(row), out[3].view(row),
                                       s.own.view(row), s.mask.view(row),
                                       _temperature_rows(s, 0, s.n),
                                       s.global_tokens.reshape(row))
        out = [lp.view(s.n), en.view(s.n) if return_entropy else out[1], mx.view(s.n),
               ls.view(s.n)]
    return out


def _grad_pass(s, hidden3, weight, bias, g, dlogp, dent, stats):
    """Second pass of the two-phase paths: the logits once more (one more matmul), dz by
    token_logprobs_bwd from d loss / d logp and d loss / d H ([N]; dent may be None)."""
    _, ent, row_max, log_sum = stats
    h2 = _flat_hidden(hidden3, s)
    head = head_for_logits(weight, s.logits_dtype)
    for r0 in range(0, s.n, s.chunk):
        r1 = min(s.n, r0 + s.chunk)
        c = r1 - r0
        hc = _hidden_rows(h2, s, r0, r1)
        z = _chunk_logits(s, hc, head, bias)
        # (a shard's placeholder entries are rewritten here, before the soft cap's factor,
        # which reuses z)
        dz = logits_grad(s.prefix, dlogp[r0:r1].view(1, c).contiguous(),
                         None if dent is None else dent[r0:r1].view(1, c).contiguous(),
                         z.view(1, c, -1), _rows(s.tokens, s, r0, r1),
                         _rows(s.mask, s, r0, r1), row_max[r0:r1].view(1, c),
                         log_sum[r0:r1].view(1, c),
                         ent[r0:r1].view(1, c) if ent.numel() else ent,
                         _temperature_rows(s, r0, r1), s.shard,
                         _rows(s.own, s, r0, r1)).view(c, -1)
        if s.cap is not None:
            dz.mul_(_softcap_factor_(z, s.cap))
        del z
        g.add(r0, r1, dz, hc, weight)
        del dz
    if s.shard is not None and g.dh2 is not None:
        # d hidden is the sum of every shard's dz @ W_r: the one collective of the backward
        # (the hidden states are the same on every rank of the group)
        all_reduce_sum_(g.dh2, s.shard.group)


def _two_phase_pass(s, hidden3, weight, bias, need):
    spec, x = s.spec, s.inputs  # the middle reads the LossInputs' (padded) tensors
    stats = _stats_pass(s, hidden3, weight, bias, True)
    logp, ent = stats[0].view(s.b, s.t), stats[1].view(s.b, s.t)
    dlogp, dent, loss, _ = middle_grad(x.padded(logp), x.padded(ent), spec, x)
    g = _Grads(s, hidden3, weight, bias, need)
    if g.any:
        gs = s.gs
        _grad_pass(s, hidden3, weight, bias, g, x.kernel(dlogp * gs).reshape(s.n),
                   x.kernel(dent * gs).reshape(s.n) if spec.entropy_coef != 0.0 else None,
                   stats)
    return loss.detach(), logp, ent, g


def _loss_pass(s, hidden3, weight, bias, need):
    if two_phase(s.spec, s.inputs, s.shard):
        return _two_phase_pass(s, hidden3, weight, bias, need)
    return _fused_pass(s, hidden3, weight, bias, need)


class _LossFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden3, weight, bias, s):
        need = tuple(ctx.needs_input_grad[:3])
        loss, logp, ent, g = _loss_pass(s, hidden3, weight, bias, need)
        dh, dw, db = g.finish(s, hidden3, weight, bias)
        ctx.save_for_backward(dh, dw, db)
        ctx.prefix = s.prefix
        # (one per gradient: scale_grad_ updates each)
        ctx.applied = [applied_scale(s.gs, hidden3) for _ in range(3)]
        ctx.mark_non_differentiable(logp, ent)
        ctx.set_materialize_grads(False)
        return loss, logp, ent

    @staticmethod
    def backward(ctx, grad_loss, *_):
        first_order_only("ppo_loss_from_hidden")
        dh, dw, db = ctx.saved_tensors
        ap, pre = ctx.applied, ctx.prefix
        dh = hand_out(pre, dh, grad_loss, ap[0])
        dw = hand_out(pre, dw, grad_loss, ap[1], None if dw is None else (1, *dw.shape))
        db = hand_out(pre, db, grad_loss, ap[2], None if db is None else (1, 1, db.numel()))
        return dh, dw, db, None


class _LogprobsFromHidden(torch.autograd.Function):
    """token_logprobs from hidden: chunked forward that keeps [N]-sized statistics only;
    the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden3, weight, bias, s):
        stats = _stats_pass(s, hidden3, weight, bias, s.return_entropy)
        ctx.s = s
        ctx.save_for_backward(hidden3, weight, bias, *stats[1:])
        logp = stats[0].view(s.b, s.t)
        ent = stats[1].view(s.b, s.t) if s.return_entropy else stats[1]
        if not s.return_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        first_order_only("token_logprobs_from_hidden")
        s = ctx.s
        hidden3, weight, bias, ent, row_max, log_sum = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        g = _Grads(s, hidden3, weight, bias, need)
        if g.any and (grad_logp is not None or grad_ent is not None):
            dlogp = (torch.zeros(s.n, dtype=s.acc, device=hidden3.device) if grad_logp is None
                     else grad_logp.to(s.acc).reshape(s.n))
            dent = (grad_ent.to(s.acc).reshape(s.n)
                    if s.return_entropy and grad_ent is not None else None)
            _grad_pass(s, hidden3, weight, bias, g, dlogp, dent, (None, ent, row_max, log_sum))
        dh, dw, db = g.finish(s, hidden3, weight, bias)
        return dh, dw, db, None


class _ReplayFromHidden(torch.autograd.Function):
    """Sampling replay from hidden states (docs/SAMPLING.md): per chunk of rows the logits,
    the full statistics (token_logprobs_fwd) and the kept set's (sampling.kernel_stats);
    returns (logp_kept, H_kept, logp, H, kept_mass, kept_size, missing) [B, T], the first
    four differentiable. The backward recomputes each chunk's logits: dz is the full part
    (token_logprobs_bwd) plus the kept-set part added in place (kept_logprobs_bwd_)."""

    @staticmethod
    def forward(ctx, hidden3, weight, bias, s, rp):
        fwd = getattr(torch.ops.ppo_kernels, s.prefix + "token_logprobs_fwd")
        h2 = _flat_hidden(hidden3, s)
        dev = hidden3.device
        names = ("logp", "ent", "row_max", "log_sum", "lp_k", "ent_k", "kmax", "kls")
        st = {k: torch.empty(s.n, dtype=s.acc, device=dev) for k in names}
        size = torch.empty(s.n, dtype=torch.int64, device=dev)
        missing = torch.empty(s.n, dtype=torch.bool, device=dev)
        thr = None if rp.given else torch.empty(s.n, dtype=torch.float64, device=dev)
        head = head_for_logits(weight, s.logits_dtype)
        for r0 in range(0, s.n, s.chunk):
            r1 = min(s.n, r0 + s.chunk)
            c = r1 - r0
            z = _chunk_logits(s, _hidden_rows(h2, s, r0, r1), head, bias).view(1, c, -1)
            tok, msk = _rows(s.tokens, s, r0, r1), _rows(s.mask, s, r0, r1)
            temp = _temperature_rows(s, r0, r1)
            t_num, temps = split_temperature(temp)
            full = fwd(z, tok, msk, t_num, True, temperatures=temps)
            ks = sampling.kernel_stats(s.prefix, z, tok, msk, temp,
                                       sampling.chunk_replay(rp, r0, r1))
            del z
            for k, v in zip(names, (*full, ks.logp, ks.entropy, ks.kept_max,
                                    ks.kept_log_sum)):
                st[k][r0:r1] = v.view(c)
            size[r0:r1], missing[r0:r1] = ks.kept_size.view(c), ks.missing.view(c)
            if thr is not None:
                thr[r0:r1] = ks.threshold.view(c)
        mask = s.mask.reshape(s.n)
        t_flat = sampling._flat(s.temperature)
        mass = sampling.kept_mass(st["kmax"] / t_flat + st["kls"], st["row_max"],
                                  st["log_sum"], t_flat, mask)
        ctx.s, ctx.rp = s, rp
        ctx.save_for_backward(hidden3, weight, bias, *(st[k] for k in names[1:4]),
                              *(st[k] for k in names[5:]),
                              thr if thr is not None else torch.empty(0, device=dev))
        out = [st["lp_k"], st["ent_k"], st["logp"], st["ent"], mass, size, missing]
        out = [v.view(s.b, s.t) for v in out]
        ctx.mark_non_differentiable(*out[4:])
        return tuple(out)

    @staticmethod
    def backward(ctx, g_lpk, g_entk, g_lp, g_ent, *_):
        first_order_only("token_logprobs_from_hidden")
        s, rp = ctx.s, ctx.rp
        hidden3, weight, bias, ent, row_max, log_sum, ent_k, kmax, kls, thr = \
            ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        g = _Grads(s, hidden3, weight, bias, need)

        def flat(x):
            return None if x is None else x.to(s.acc).reshape(s.n)

        g_lpk, g_entk, g_lp, g_ent = (flat(x) for x in (g_lpk, g_entk, g_lp, g_ent))
        if g.any:
            h2 = _flat_hidden(hidden3, s)
            zero = torch.zeros(s.n, dtype=s.acc, device=hidden3.device)
            bwd = getattr(torch.ops.ppo_kernels, s.prefix + "token_logprobs_bwd")
            head = head_for_logits(weight, s.logits_dtype)
            for r0 in range(0, s.n, s.chunk):
                r1 = min(s.n, r0 + s.chunk)
                c = r1 - r0
                hc = _hidden_rows(h2, s, r0, r1)
                z = _chunk_logits(s, hc, head, bias)
                z3 = z.view(1, c, -1)
                tok, msk = _rows(s.tokens, s, r0, r1), _rows(s.mask, s, r0, r1)

                def part(x, default=None):
                    x = default if x is None else x
                    return None if x is None else x[r0:r1].view(1, c).contiguous()

                temp = _temperature_rows(s, r0, r1)
                t_num, temps = split_temperature(temp)
                dz = bwd(part(g_lp, zero), part(g_ent), z3, tok, msk, part(row_max),
                         part(log_sum), part(ent), t_num, temperatures=temps)
                if g_lpk is not None or g_entk is not None:
                    ks = sampling.KeptStats(None, part(ent_k), part(kmax), part(kls), None,
                                            None, None if rp.given else part(thr))
                    sampling.kernel_grad_(s.prefix, dz, part(g_lpk, zero), part(g_entk), z3,
                                          tok, msk, ks, temp,
                                          sampling.chunk_replay(rp, r0, r1))
                dz = dz.view(c, -1)
                if s.cap is not None:
                    dz.mul_(_softcap_factor_(z, s.cap))
                del z
                g.add(r0, r1, dz, hc, weight)
                del dz
        dh, dw, db = g.finish(s, hidden3, weight, bias)
        return dh, dw, db, None, None


class _VpReplayFromHidden(torch.autograd.Function):
    """Sampling replay from hidden states over a vocabulary split over tp_group (a given
    kept set, docs/SAMPLING.md / docs/DISTRIBUTED.md): per chunk of rows this shard's
    logits [C, V_r] and sampling.vp_stats on them, i.e. the full statistics and this
    shard's kept-set partials merged by ONE all-gather per chunk (the kept partials ride
    on the statistics' all-gather; a first version: one all-gather per chunk rather than
    one for all rows). Returns what _ReplayFromHidden returns, the same on every rank. The
    backward recomputes each chunk's logits: dz = the full part (logits_grad, the
    placeholder entries rewritten) plus the kept part on this shard's kept entries
    (sampling.vp_kept_grad_); d hidden summed over the group (one all-reduce), this
    shard's dW / db."""

    @staticmethod
    def forward(ctx, hidden3, weight, bias, s, rp):
        h2 = _flat_hidden(hidden3, s)
        head = head_for_logits(weight, s.logits_dtype)
        outs, saved = [], []
        for r0 in range(0, s.n, s.chunk):
            r1 = min(s.n, r0 + s.chunk)
            c = r1 - r0
            z = _chunk_logits(s, _hidden_rows(h2, s, r0, r1), head, bias).view(1, c, -1)
            tok, msk = _rows(s.global_tokens, s, r0, r1), _rows(s.mask, s, r0, r1)
            temp = _temperature_rows(s, r0, r1)
            logp, ent, big, ls, local, own, kept = sampling.vp_stats(
                s.prefix, z, tok, msk, temp, sampling.chunk_replay(rp, r0, r1), s.shard)
            del z
            mass = sampling.kept_mass(kept.kept_max / temp + kept.log_sum, big, ls, temp, msk)
            outs.append((kept.logp, kept.entropy, logp, ent, mass, kept.size, kept.missing))
            saved.append((big, ls, ent, local, own, kept))
        if not outs:  # no rows: no chunk, on every rank alike (no collective)
            dev = hidden3.device
            outs = [tuple(torch.zeros(0, dtype=d, device=dev) for d in
                          (s.acc,) * 5 + (torch.int64, torch.bool))]
        out = [torch.cat([o[i].reshape(-1) for o in outs]).view(s.b, s.t) for i in range(7)]
        ctx.s, ctx.saved = s, saved
        ctx.save_for_backward(hidden3, weight, bias)
        ctx.mark_non_differentiable(*out[4:])
        return tuple(out)

    @staticmethod
    def backward(ctx, g_lpk, g_entk, g_lp, g_ent, *_):
        first_order_only("token_logprobs_from_hidden (a split vocabulary)")
        s = ctx.s
        hidden3, weight, bias = ctx.saved_tensors
        g = _Grads(s, hidden3, weight, bias, tuple(ctx.needs_input_grad[:3]))

        def flat(x):
            return None if x is None else x.to(s.acc).reshape(s.n)

        g_lpk, g_entk, g_lp, g_ent = (flat(x) for x in (g_lpk, g_entk, g_lp, g_ent))
        if g.any:
            h2 = _flat_hidden(hidden3, s)
            zero = torch.zeros(s.n, dtype=s.acc, device=hidden3.device)
            head = head_for_logits(weight, s.logits_dtype)
            for i, r0 in enumerate(range(0, s.n, s.chunk)):
                r1 = min(s.n, r0 + s.chunk)
                c = r1 - r0
                big, ls, ent, local, own, kept = ctx.saved[i]

                def part(x, default=None):
                    x = default if x is None else x
                    return None if x is None else x[r0:r1].view(1, c).contiguous()

                hc = _hidden_rows(h2, s, r0, r1)
                z = _chunk_logits(s, hc, head, bias)
                temp = _temperature_rows(s, r0, r1)
                msk = _rows(s.mask, s, r0, r1)
                dz = logits_grad(s.prefix, part(g_lp, zero), part(g_ent), z.view(1, c, -1),
                                 local, msk, big, ls, ent, temp, s.shard, own)
                if g_lpk is not None or g_entk is not None:
                    sampling.vp_kept_grad_(dz, part(g_lpk, zero), part(g_entk),
                                           _rows(s.global_tokens, s, r0, r1), msk, kept, temp,
                                           s.shard)
                dz = dz.view(c, -1)
                if s.cap is not None:
                    dz.mul_(_softcap_factor_(z, s.cap))
                del z
                g.add(r0, r1, dz, hc, weight)
                del dz
        if g.dh2 is not None:  # d hidden: the sum of every shard's dz @ W_r
            all_reduce_sum_(g.dh2, s.shard.group)
        dh, dw, db = g.finish(s, hidden3, weight, bias)
        return dh, dw, db, None, None


def replay_from_hidden(be, hidden3, weight, bias, tokens, mask, temperature, rp, cap, chunk,
                       logits_dtype=None, shard=None):
    """(logp_kept, H_kept, logp, H, kept_mass, kept_size, missing) [B, T] of the logits
    hidden @ weight^T (+ bias), soft-capped (in logits_dtype, None: hidden's); the first
    four differentiable. Kernel backends: chunks of rows, never the [N, V] logits; "torch":
    the materialised logits."""
    if not be.is_kernel:
        logits = materialised_logits(hidden3, weight, bias, cap, mask, logits_dtype)
        return sampling.replay_logprobs(be, logits, tokens, mask, temperature, rp)
    s = _Chunks(prefix=be.prefix, cap=cap, chunk=chunk, temperature=temperature,
                tokens=tokens, mask=mask, acc=acc_dtype(hidden3), logits_dtype=logits_dtype,
                shard=shard)
    fn = _ReplayFromHidden if shard is None else _VpReplayFromHidden
    args = (hidden3, weight, bias)
    if wants_grad(*args):
        return fn.apply(*args, s, rp)
    with torch.no_grad():
        return fn.apply(*args, s, rp)


# ------------------------------------------------------------------ the torch reference

def materialised_logits(hidden3, weight, bias, cap, mask, logits_dtype=None):
    """The logits the fused paths never store, differentiably (backend="torch"); masked
    rows' hidden states zeroed first, as in the chunked paths. logits_dtype float32: the
    float32 product of the widened operands (their gradients flow back in their dtype)."""
    keep = torch.zeros(hidden3.shape[:2], dtype=torch.bool, device=hidden3.device)
    keep[:, :mask.shape[1]] = mask
    h = torch.where(keep[..., None], hidden3, 0.0)
    if logits_dtype is not None:
        h, weight = h.to(logits_dtype), weight.to(logits_dtype)
        bias = None if bias is None else bias.to(logits_dtype)
    x = torch.nn.functional.linear(h, weight, bias)
    return x if cap is None else cap * torch.tanh(x / cap)


def _squeeze(x, flat):
    return x[0] if flat and x is not None and x.dim() == 2 else x


# ------------------------------------------------------------------ public ops

@accepts_head_module  # a head module: the op runs as its forward (lm_head.py)
def token_logprobs_from_hidden(hidden, lm_head_weight, tokens, response_mask=None, *,
                               lm_head_bias=None, logit_softcap=None, temperature=1.0,
                               return_entropy=False, chunk_size=None, tp_group=None,
                               vocab_start=None, backend="auto", logits_dtype=None,
                               sampling_mask=None, top_k=None, top_p=None, min_p=None,
                               return_full=False, entropy_over="full"):
    """pk.token_logprobs of the logits hidden @ lm_head_weight^T (+ lm_head_bias), soft-capped
    to cap * tanh(x / cap) with logit_softcap, without storing them: chunks of chunk_size
    rows (None: about 256 MiB of logits per chunk); the backward recomputes each chunk's
    logits (one more matmul). Differentiable in hidden, lm_head_weight and lm_head_bias.

    hidden: [B, T, H], [B, T + 1, H] (the last position is ignored, zero gradient) or
    [N, H]; lm_head_weight [V, H] and lm_head_bias [V] of hidden's dtype and device.
    lm_head_weight may also be the head module (a torch.nn.Linear, FSDP2- or ZeRO-3-wrapped
    alike; lm_head_bias None: its own bias is used): the op then runs as the module's
    forward, inside the framework's hooks (ppo_kernels/lm_head.py, docs/DISTRIBUTED.md).
    Returns logprobs [B, T] (or [N]), or (logprobs, entropy); backend "torch" materialises
    the logits (the reference composite). tp_group / vocab_start: the head's rows split over
    ranks ([V_r, H] here; docs/DISTRIBUTED.md): the whole vocabulary's results on every
    rank, d hidden summed over the group, this shard's dW / db. temperature: a number or a
    tensor per sequence [B] / per token [B, T] ([N] flat), as in pk.token_logprobs.
    logits_dtype: None (the logits in hidden's dtype, as the model's own LM head makes them)
    or torch.float32: with bfloat16 / float16 hidden states and head, each chunk's logits
    are computed and kept in float32 (vLLM's head_dtype=float32, SGLang's
    enable_fp32_lm_head), the gradients into hidden / lm_head_weight / lm_head_bias stay in
    their dtype (docs/FROM_HIDDEN.md, "float32 logits"); float64 hidden states take None.
    Errors: a TypeError / ValueError naming the argument (temperature as in
    pk.token_logprobs; logits_dtype other than None / torch.float32).
    sampling_mask, top_k, top_p, min_p, return_full, entropy_over: sampling replay, as in
    pk.token_logprobs (docs/SAMPLING.md); with tp_group a given sampling_mask only
    (top_k / top_p / min_p with tp_group: NotImplementedError).
    """
    def checks():  # no collective: the ranks of tp_group decide validity together
        h, w, bias, shard = _head_shard(hidden, lm_head_weight, lm_head_bias, tp_group,
                                        vocab_start)
        hidden3, tokens2, flat = _hidden_and_tokens(h, w, bias, tokens)
        mask = ck.response_mask(response_mask, tokens2, flat)
        t = ck.temperature(temperature, hidden3, tokens2, flat, mask)
        ck.flag("return_entropy", return_entropy)
        ldt = _logits_dtype(logits_dtype, hidden3)
        cap, chunk = _head_options(hidden3, w, logit_softcap, chunk_size, ldt)
        be = get_backend(backend, hidden3.device)
        require_kernels(be, shard)
        if shard is None:
            tokens2 = ck.token_range(tokens2, mask, w.shape[0])
        rp = sampling.check_replay(sampling_mask, top_k, top_p, min_p, tokens2,
                                   None if shard is not None else w.shape[0])
        sampling.check_outputs(rp, return_full, entropy_over)
        _vp_given_only(rp, shard)
        return w, bias, shard, hidden3, tokens2, flat, mask, t, cap, chunk, be, ldt, rp

    (lm_head_weight, lm_head_bias, shard, hidden3, tokens2, flat, mask, temperature, cap, chunk,
     be, ldt, rp) = checks_together(groups(tp_group=tp_group), checks,
                                    lambda r: {"tp_group": tuple(r[4].shape)})
    if rp is not None:
        lp_k, ent_k, logp, ent, _, _, _ = replay_from_hidden(
            be, hidden3, lm_head_weight, lm_head_bias, tokens2, mask, temperature, rp, cap,
            chunk, ldt, shard)
        return sampling.outputs(lp_k, ent_k, logp, ent, return_full, return_entropy,
                                entropy_over, lambda v: _squeeze(v, flat))
    if not be.is_kernel:
        logits = materialised_logits(hidden3, lm_head_weight, lm_head_bias, cap, mask, ldt)
        logp, ent = be.token_logprobs(logits, tokens2, mask, temperature, return_entropy)
    else:
        s = _Chunks(prefix=be.prefix, cap=cap, chunk=chunk, temperature=temperature,
                    tokens=tokens2, mask=mask, acc=acc_dtype(hidden3), shard=shard,
                    return_entropy=return_entropy, logits_dtype=ldt)
        args = (hidden3, lm_head_weight, lm_head_bias)
        if wants_grad(*args):
            logp, ent = _LogprobsFromHidden.apply(*args, s)
        else:
            stats = _stats_pass(s, *args, return_entropy)
            logp, ent = stats[0].view(s.b, s.t), stats[1].view(s.b, s.t) if return_entropy \
                else None
        if not return_entropy:
            ent = None
    logp, ent = _squeeze(logp, flat), _squeeze(ent, flat)
    return (logp, ent) if return_entropy else logp


@accepts_head_module  # a head module: the op runs as its forward (lm_head.py)
def ppo_loss_from_hidden(hidden, lm_head_weight, tokens, old_logprobs, advantages,
                         response_mask=None, ref_logprobs=None, *, lm_head_bias=None,
                         logit_softcap=None, chunk_size=None, tp_group=None, vocab_start=None,
                         cp_group=None, logits_dtype=None, **loss_options):
    """pk.ppo_loss(hidden @ lm_head_weight^T (+ lm_head_bias), ...) without the [N, V]
    logits ever being stored (docs/FROM_HIDDEN.md).

    Args:
        hidden: [B, T, H], [B, T + 1, H] (last position ignored, zero gradient) or [N, H];
            float32, bfloat16, float16 or float64.
        lm_head_weight: [V, H], hidden's dtype and device (a frozen head, a LoRA-wrapped
            or embedding-tied weight: any tensor; a gradient only where it requires one).
            Or the head module itself (torch.nn.Linear; FSDP2's fully_shard or ZeRO-3
            wrapped alike, lm_head_bias None): the op runs as its forward, so the
            framework's hooks gather the weight and reduce its gradient
            (ppo_kernels/lm_head.py, docs/DISTRIBUTED.md); another module is a TypeError.
        lm_head_bias: [V] or None.
        logit_softcap: None or cap > 0: logits z = cap * tanh(x / cap) (Gemma 2).
        chunk_size: rows of [B, T] per chunk, >= 1; None: about 256 MiB of logits (in
            hidden's dtype) per chunk, at least 1 row.
        tp_group, vocab_start: the head's rows split over ranks (lm_head_weight [V_r, H],
            lm_head_bias [V_r]; a DTensor head sharded with Shard(0) needs tp_group, its
            mesh's group, and no vocab_start: without it the weight could as well be
            FSDP2's shard, a ValueError): every policy loss then runs the two chunked
            passes with the statistics merged in between (one all-gather of 24 bytes per
            row) and d hidden summed over the group (one
            all-reduce); docs/DISTRIBUTED.md.
        cp_group: context parallel, as in pk.ppo_loss.
        logits_dtype: None (hidden's dtype) or torch.float32: each chunk's logits in
            float32 from bfloat16 / float16 hidden states and head (as in
            token_logprobs_from_hidden; docs/FROM_HIDDEN.md).
        **loss_options: every keyword of pk.ppo_loss (policy_loss, clip_eps_*, kl_*,
            entropy_*, temperature, loss_agg_mode, global counts, rollout_*, grad_scale,
            backend, ...), checked by the same code (loss.check_loss; an unknown keyword
            is a TypeError). inplace_backward is accepted and has no effect (the chunks' logits are always overwritten by
            their gradient; nothing of the caller's is). loss_agg_mode="none" goes through
            token_logprobs_from_hidden.
        backend: "auto" | "cpu" | "cuda" | "triton" | "torch" ("torch" materialises the
            logits and runs pk.ppo_loss(backend="torch"): the reference composite).

    Returns:
        (loss, metrics) as pk.ppo_loss; the gradient flows to hidden, lm_head_weight and
        lm_head_bias (those that require it). All of it is computed in the forward; the
        backward only rescales it by grad_output (no pass when grad_output == grad_scale).
    """
    options = dict(loss_options, old_logprobs=old_logprobs, advantages=advantages,
                   response_mask=response_mask, ref_logprobs=ref_logprobs, cp_group=cp_group)
    def checks(options):  # no collective: the ranks of tp_group / cp_group decide together
        h, w, bias, shard = _head_shard(hidden, lm_head_weight, lm_head_bias, tp_group,
                                        vocab_start)
        hidden3, tokens2, flat = _hidden_and_tokens(h, w, bias, tokens)
        ldt = _logits_dtype(logits_dtype, hidden3)
        cap, chunk = _head_options(hidden3, w, logit_softcap, chunk_size, ldt)
        spec, x, pending = check_loss(hidden3, None if shard else w.shape[0], tokens2, flat,
                                      options)
        require_kernels(x.be, shard)
        return w, bias, shard, hidden3, cap, chunk, spec, x, pending, ldt

    lm_head_weight, lm_head_bias, shard, hidden3, cap, chunk, spec, x, pending, ldt = \
        checks_together(groups(tp_group=tp_group, cp_group=cp_group), checks,
                        lambda r: agreed_sizes(r[7]), options)
    x = weigh_loss(spec, x, pending)
    k = x.kernel  # the packed layout again, with cu_seqlens
    diff = (hidden3, lm_head_weight, lm_head_bias)
    if x.replay is not None:
        _vp_given_only(x.replay, shard)
        # (the kept-set statistics chunk by chunk; the [B, T] loss by autograd on them, the
        # backward recomputing each chunk's logits; over a split vocabulary the kept
        # partials ride on each chunk's statistics all-gather)
        out = replay_from_hidden(x.be, hidden3, lm_head_weight, lm_head_bias, k(x.tokens),
                                 k(x.mask), x.kernel_temperature(spec), x.replay, cap, chunk,
                                 ldt, shard)
        lp_k, ent_k, logp, ent, mass, size, missing = (x.padded(v) for v in out)
        ent_sel = ent_k if spec.entropy_over == "kept" else ent
        lp_kl = None if spec.kl_logprobs == "kept" else logp
        if x.weights is None:
            loss = per_token_loss(spec, x, lp_k, ent_sel, lp_kl)
        else:
            pol, _ = _torch_impl.token_losses(lp_k, ent_sel, x.old, x.adv, x.ref, x.isw,
                                              x.mask, spec, x.behaviour, logp_kl=lp_kl)
            loss = _torch_impl.aggregate(pol, ent_sel, x.mask, x.weights, x.w_ent, spec)
        return loss, loss_metrics(spec, x, lp_k.detach(), ent_sel.detach(),
                                  (logp.detach(), mass, size, missing))
    if x.weights is None:
        logp, ent = token_logprobs_from_hidden(
            hidden3, lm_head_weight, k(x.tokens), k(x.mask), lm_head_bias=lm_head_bias,
            logit_softcap=cap, temperature=x.kernel_temperature(spec), return_entropy=True,
            chunk_size=chunk, tp_group=None if shard is None else shard.group,
            vocab_start=None if shard is None else shard.start, backend=x.be.name,
            logits_dtype=ldt)
        logp, ent = x.padded(logp), x.padded(ent)
        loss = per_token_loss(spec, x, logp, ent)
    elif not x.be.is_kernel:
        logits = materialised_logits(*diff, cap, k(x.mask), ldt)
        if two_phase(spec, x, shard):
            loss, logp, ent = composite_padded(spec, x, logits)
        else:
            loss, _, logp, ent = x.be.ppo_loss(logits, k(x.tokens), k(x.mask), k(x.old),
                                               k(x.adv), k(x.weights), k(x.ref), k(x.isw),
                                               spec, k(x.w_ent), k(x.temperature))
            logp, ent = x.padded(logp), x.padded(ent)
    else:
        st = _Chunks(prefix=x.be.prefix, cap=cap, chunk=chunk,
                     temperature=x.kernel_temperature(spec),
                     tokens=k(x.tokens), mask=k(x.mask), acc=x.acc, shard=shard, spec=spec,
                     inputs=x, old=k(x.old), adv=k(x.adv), ref=k(x.ref), isw=k(x.isw),
                     weights=k(x.weights), w_ent=k(x.w_ent),
                     gs=spec.effective_grad_scale(hidden3.dtype), logits_dtype=ldt)
        if wants_grad(*diff):
            loss, logp, ent = _LossFromHidden.apply(*diff, st)
        else:
            loss, logp, ent, _ = _loss_pass(st, *diff, (False, False, False))
        logp, ent = x.padded(logp), x.padded(ent)
    return loss, loss_metrics(spec, x, logp, ent)


@accepts_head_module  # a head module: the op runs as its forward (lm_head.py)
def score_rollout_from_hidden(hidden, lm_head_weight, tokens, ref_logprobs, values, scores,
                              response_mask, *, lm_head_bias=None, logit_softcap=None,
                              chunk_size=None, kl_coef, kl_estimator="k1", gamma=1.0,
                              lam=0.95, value_lam=None, lam_alpha=None, temperature=1.0,
                              whiten=True, cu_seqlens=None, max_seqlen=None, tp_group=None,
                              vocab_start=None, backend="auto", logits_dtype=None,
                              sampling_mask=None, top_k=None, top_p=None, min_p=None,
                              kl_logprobs="full"):
    """pk.score_rollout of the logits hidden @ lm_head_weight^T (+ lm_head_bias), soft-capped
    with logit_softcap, without storing them (docs/FROM_HIDDEN.md): the log-probs come from
    token_logprobs_from_hidden (chunks of chunk_size rows, no gradient), then the same
    [B, T] steps as pk.score_rollout: KL-penalised rewards, GAE, whitening.

    Args:
        hidden: [B, T, H] or [B, T + 1, H] (the last position is ignored) of the policy
            that sampled ``tokens``; lm_head_weight [V, H], lm_head_bias [V] or None, of
            hidden's dtype and device. No gradient flows to any of them.
        tokens, ref_logprobs, values, scores, response_mask, kl_coef, kl_estimator, gamma,
        lam, value_lam, lam_alpha, temperature, whiten, cu_seqlens, max_seqlen, backend: as
            pk.score_rollout
            (cu_seqlens: hidden [1, total, H] or [total, H]).
        logit_softcap, chunk_size, tp_group, vocab_start, logits_dtype: as
            token_logprobs_from_hidden.
        sampling_mask, top_k, top_p, min_p, kl_logprobs: sampling replay as in
            pk.score_rollout (docs/SAMPLING.md); with tp_group a given sampling_mask only
            (top_k / top_p / min_p with tp_group: NotImplementedError).

    Returns:
        Rollout(logprobs, kl, rewards, advantages, returns), float32 [B, T] each, 0 where
        masked.
    """
    opts = dict(kl_coef=kl_coef, kl_estimator=kl_estimator, gamma=gamma, lam=lam,
                whiten=whiten, value_lam=value_lam, lam_alpha=lam_alpha)

    def checks():  # no collective: the ranks of tp_group decide validity together,
        # the packing's checks included
        h, w, bias, shard = _head_shard(hidden, lm_head_weight, lm_head_bias, tp_group,
                                        vocab_start)
        hidden3, tokens2, flat = _hidden_and_tokens(h, w, bias, tokens)
        if cu_seqlens is not None:
            checked = packed_rollout_inputs(tokens2, tokens, ref_logprobs, values, scores,
                                            response_mask, cu_seqlens, max_seqlen, opts)
            return w, bias, shard, hidden3, tokens2, checked
        packed.check_max_seqlen(max_seqlen)
        if flat:
            raise ValueError(f"hidden: score_rollout_from_hidden needs [B, T, H] or "
                             f"[B, T + 1, H] (or cu_seqlens for the packed [total, H]), got "
                             f"{list(h.shape)}")
        checked = rollout_inputs(tokens2, response_mask, ref_logprobs, values, scores,
                                 kl_coef, kl_estimator, gamma, lam, whiten, value_lam,
                                 lam_alpha)
        return w, bias, shard, hidden3, tokens2, checked

    lm_head_weight, lm_head_bias, shard, hidden3, tokens2, checked = checks_together(
        groups(tp_group=tp_group), checks,
        lambda r: {"tp_group": rollout_sizes(r[4], r[5][0] if cu_seqlens is not None
                                             else None)})
    packing = None
    if cu_seqlens is not None:
        packing, mask, ref, vals, kl_coef, gamma, lams = checked
        mask_k = packing.unpad(mask)
        temperature = packed.packed_temperature(packing, temperature)
    else:
        mask, ref, vals, kl_coef, gamma, lams = checked
        mask_k = mask
    ck.choice("kl_logprobs", kl_logprobs, sampling.KL_LOGPROBS)
    rp = sampling.check_replay(sampling_mask, top_k, top_p, min_p, tokens2,
                               None if shard is not None else lm_head_weight.shape[0], packing)
    lp_k = None
    with torch.no_grad():
        kw = dict(lm_head_bias=None if lm_head_bias is None else lm_head_bias.detach(),
                  logit_softcap=logit_softcap, temperature=temperature, chunk_size=chunk_size,
                  tp_group=None if shard is None else shard.group,
                  vocab_start=None if shard is None else shard.start, backend=backend,
                  logits_dtype=logits_dtype)
        if rp is None:
            logp = token_logprobs_from_hidden(hidden3.detach(), lm_head_weight.detach(),
                                              tokens2, mask_k, **kw)
        else:
            # (the packed layout's CSR rows and per-sequence parameters, already checked)
            lp_k, logp = _replay_no_grad(hidden3, lm_head_weight, tokens2, mask_k, rp, kw)
            if kl_logprobs == "kept":
                logp = lp_k
    pad = (lambda v: v) if packing is None else packing.pad
    r = rollout_from_logprobs(pad(logp), ref, vals, scores, mask, kl_coef, kl_estimator,
                              gamma, lams, whiten, backend)
    if lp_k is not None:
        r = r._replace(logprobs=pad(lp_k).float())
    if packing is None:
        return r
    return type(r)(*(packed.unpadded(packing, x, tokens) for x in r))


def _vp_given_only(rp, shard):
    """Over a split vocabulary only given kept sets (sampling_mask) replay: re-deriving
    top_k / top_p / min_p sets needs a global selection (not implemented)."""
    if shard is not None and rp is not None and not rp.given:
        raise NotImplementedError("top_k / top_p / min_p with tp_group: re-deriving the kept "
                                  "sets over a split vocabulary is not implemented; pass the "
                                  "engine's sampling_mask")


def _replay_no_grad(hidden3, weight, tokens2, mask, rp, kw):
    """(logp_kept, logp) for kept sets already checked (score_rollout_from_hidden)."""
    h, w, bias, shard = _head_shard(hidden3.detach(), weight.detach(), kw["lm_head_bias"],
                                    kw["tp_group"], kw["vocab_start"])
    _vp_given_only(rp, shard)
    ldt = _logits_dtype(kw["logits_dtype"], h)
    cap, chunk = _head_options(h, w, kw["logit_softcap"], kw["chunk_size"], ldt)
    be = get_backend(kw["backend"], h.device)
    require_kernels(be, shard)
    out = replay_from_hidden(be, h, w, bias, tokens2, mask,
                             ck.temperature(kw["temperature"], h, tokens2, False, mask), rp,
                             cap, chunk, ldt, shard)
    return out[0], out[2]
