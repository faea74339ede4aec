"""Row sources: where the kernels' rows of logits come from, and the one place their
statistics and gradient are computed.

A row source is either the logits themselves (LogitRows: one block, [B, Tl, V]) or the LM
head applied to hidden states chunk by chunk (head_chunks.HeadRows: blocks of rows, the
logits never stored). Both give

  stats(inputs, rp)  the row statistics of token_logprobs_fwd (logp, H, row max, log-sum),
                     and with a kept set (sampling replay) the kept set's (KeptStats);
  grad(inputs, st, g_lp, g_ent, g_kept, g_ent_kept)
                     the gradient of sum(g_lp logp + g_ent H + g_kept logp_kept + g_ent_kept
                     H_kept) in the source's inputs: token_logprobs_bwd, plus the kept part
                     added in place (or written alone where the dense part is 0).

The vocabulary is whole (WholeVocab) or this rank's shard of it (SplitVocab): the same two
methods on either source, with the shards' statistics and kept partials merged by one
all-gather after the blocks (vocab_parallel.VocabShard.merge) and each shard writing its
own dlogits (the placeholder entries rewritten, no collective). The two-phase path of the
losses (_two_phase.passes) and the differentiable log-probs (RowLogprobs) run on them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ._autograd import first_order_only, wants_grad
from ._backends import call_op
from ._checks import acc_dtype, split_temperature
from ._extension import HAS_CPU
from .kept import replay_logprobs_torch
from .kept_rows import (KeptStats, kernel_grad, kernel_stats, kept_mass_op, merge_kept,
                        require_ops, shard_grad_, shard_partials)
from .vocab_parallel import all_reduce_sum_


class RowStats(NamedTuple):
    """The statistics of every row, [B, T] in the kernels' layout (over a split vocabulary
    the whole row's, the same on every rank)."""

    logp: Any
    ent: Any       # empty without the entropy
    row_max: Any
    log_sum: Any
    tokens: Any    # the ids the kernels read (shard-local over a split vocabulary)
    own: Any       # bool: this shard holds the token (None: a whole vocabulary)
    kept: Any = None      # KeptStats with a kept set
    entries: Any = None   # a shard's KeptEntries of every block (a split vocabulary)


class WholeVocab:
    """The vocabulary in one piece: the kernels' statistics are the row's."""

    shard = None

    def local_tokens(self, tokens):
        return tokens, None

    def block_kept(self, be, z3, tokens, mask, temperature, rp):
        return kernel_stats(be, z3, tokens, mask, temperature, rp)

    def merge(self, src, full, kept, rp):
        """(logp, H or None, row max, log_sum, KeptStats or None, None) from the blocks'
        parts (full: four lists, H's None without the entropy)."""
        cat = src.cat
        ks = None
        if rp is not None:
            ks = KeptStats(*(cat([k[i] for k in kept], dt)
                             for i, dt in enumerate(src.kept_dtypes())),
                           None if rp.given else cat([k.threshold for k in kept],
                                                     torch.float64))
        return (*(None if p is None else cat(p) for p in full), ks, None)

    def fix_(self, *_):
        pass

    def kept_grad(self, be, dz, g_kept, g_ent, z3, tokens, local, mask, st, blk, temperature,
                  rp):
        rows = blk.rows
        ks = KeptStats(None, rows(st.kept.entropy), rows(st.kept.kept_max),
                       rows(st.kept.kept_log_sum), None, None, rows(st.kept.threshold))
        return kernel_grad(be, dz, g_kept, g_ent, z3, local, mask, ks, temperature, rp)

    def reduce_(self, dh2):
        pass


class SplitVocab:
    """This rank's shard of the vocabulary (a vocab_parallel.VocabShard): the kernels reduce
    the shard; one all-gather of the statistics (and of the kept partials, which ride
    along) gives the whole row's; each rank writes its own shard of the gradient."""

    def __init__(self, shard):
        self.shard = shard

    def local_tokens(self, tokens):
        return self.shard.local_tokens(tokens)

    def block_kept(self, be, z3, tokens, mask, temperature, rp):
        if not rp.given:
            raise NotImplementedError("top_k / top_p / min_p with tp_group: re-deriving the "
                                      "kept sets over a split vocabulary is not implemented; "
                                      "pass the engine's sampling_mask")
        require_ops(be)
        return shard_partials(z3, tokens, mask, temperature, rp, self.shard)

    def merge(self, src, full, kept, rp):
        cat = src.cat
        lp, ent, mx, ls = (None if p is None else cat(p) for p in full)
        extra = cat([k[0] for k in kept]) if kept else None
        out = self.shard.merge(lp, ent, mx, ls, src.own, src.mask, src.temperature,
                               src.global_tokens, extra=extra)
        ks = entries = None
        if rp is not None:
            entries = [k[2] for k in kept]
            if kept:
                ks = merge_kept(out[4], src.mask, src.temperature, rp.offsets,
                                cat([k[1] for k in kept]))
            else:  # no rows
                ks = KeptStats(*(cat([], dt) for dt in src.kept_dtypes()))
        return (*out[:4], ks, entries)

    def fix_(self, dz, z3, own, mask, g_lp, g_ent, row_max, log_sum, ent, temperature):
        self.shard.fix_placeholder_(dz, z3, own, mask, g_lp, g_ent, row_max, log_sum, ent,
                                    temperature)

    def kept_grad(self, be, dz, g_kept, g_ent, z3, tokens, local, mask, st, blk, temperature,
                  rp):
        rows = blk.rows
        kept = KeptStats(None, rows(st.kept.entropy), rows(st.kept.kept_max),
                         rows(st.kept.kept_log_sum), None, None)
        return shard_grad_(zero_grad(z3) if dz is None else dz, g_kept, g_ent, tokens, mask,
                           kept, st.entries[blk.index], temperature, self.shard)

    def reduce_(self, dh2):
        # d hidden is the sum of every shard's dz @ W_r: the one collective of the backward
        # (the hidden states are the same on every rank of the group)
        all_reduce_sum_(dh2, self.shard.group)


class RowSource:
    """The blocks of rows of a source and their statistics and gradient (the module's
    docstring). A subclass gives each_block (the loop over the blocks: (blk, h, z3) to a
    function), cat (the blocks' [rows] pieces as [B, T]), start_grad / take_grad /
    finish_grad (where each block's dlogits go)."""

    name = "token_logprobs"

    def __init__(self, be, tokens, mask, temperature, shard=None):
        self.be, self.mask, self.temperature = be, mask, temperature
        self.global_tokens = tokens
        self.vocab = WholeVocab() if shard is None else SplitVocab(shard)
        self.tokens, self.own = (None, None) if tokens is None else self.vocab.local_tokens(
            tokens)
        self.b, self.t = mask.shape
        self.n = self.b * self.t

    @property
    def shard(self):
        return self.vocab.shard

    def stats(self, inputs, rp=None, need_ent=True):
        """RowStats of every row (with a kept set rp, the kept set's too)."""
        fwd = self.be.op("token_logprobs_fwd")
        full, kept = ([], [], [], []), []

        def block(blk, _h, z3):
            rows = blk.rows
            temp, msk = blk.temperature(self.temperature), rows(self.mask)
            t, temps = split_temperature(temp)
            for part, v in zip(full, call_op(fwd, z3, z3, rows(self.tokens), msk, t, need_ent,
                                           temperatures=temps)):
                part.append(v)
            if rp is not None:
                kept.append(self.vocab.block_kept(self.be, z3, rows(self.global_tokens), msk,
                                                  temp, blk.replay(rp)))

        self.each_block(inputs, block)
        if not need_ent:  # (the kernels' empty H)
            full = (full[0], None, full[2], full[3])
        logp, ent, mx, ls, ks, entries = self.vocab.merge(self, full, kept, rp)
        if ent is None:
            ent = torch.empty(0, dtype=self.acc, device=self.mask.device)
        return RowStats(logp, ent, mx, ls, self.tokens, self.own, ks, entries)

    def grad(self, inputs, st, g_lp, g_ent=None, g_kept=None, g_ent_kept=None, rp=None,
             need=None):
        """The gradient in inputs (one per input, None where need says no) of sum(g_lp
        logp + g_ent H + g_kept logp_kept + g_ent_kept H_kept), g_* [B, T] or None (none
        at all: no gradient, every input's None). Where the full row's logp and H take no
        gradient (g_lp and g_ent None: sampling replay without a KL on the full logp or an
        entropy bonus over the full row) the dense part is 0: each block's dz is the kept
        part alone, written once (kept_logprobs_bwd: 0 off the kept sets; over a split
        vocabulary zeros with the shard's kept entries added)."""
        kept = g_kept is not None or g_ent_kept is not None
        dense = g_lp is not None or g_ent is not None
        bwd = self.be.op("token_logprobs_bwd")
        acc = self.start_grad(inputs, need) if kept or dense else None
        if acc is None:
            return (None,) * len(inputs)
        # (the kernels take g_lp and g_kept as tensors: zeros beside a given H's gradient)
        if dense and g_lp is None:
            g_lp = torch.zeros_like(st.row_max)
        if kept and g_kept is None:
            g_kept = torch.zeros_like(st.row_max)

        def block(blk, h, z3):
            rows = blk.rows

            def g(v):
                return None if v is None else rows(v).contiguous()

            temp, msk = blk.temperature(self.temperature), rows(self.mask)
            t, temps = split_temperature(temp)
            ent = rows(st.ent) if st.ent.numel() else st.ent
            lp_b, ent_b, mx, ls = g(g_lp), g(g_ent), rows(st.row_max), rows(st.log_sum)
            dz = None
            if dense:
                dz = call_op(bwd, z3, lp_b, ent_b, z3, rows(st.tokens), msk, mx, ls, ent, t,
                             temperatures=temps)
                # (a shard's placeholder entries, before the soft cap's factor reuses z)
                self.vocab.fix_(dz, z3, rows(st.own), msk, lp_b, ent_b, mx, ls, ent, temp)
            if kept:
                dz = self.vocab.kept_grad(self.be, dz, g(g_kept), g(g_ent_kept), z3,
                                          rows(self.global_tokens), rows(st.tokens), msk, st,
                                          blk, temp, blk.replay(rp))
            self.take_grad(acc, blk, h, z3, dz)

        self.each_block(inputs, block)
        return self.finish_grad(acc, inputs)

    def outputs(self, st, rp):
        """What RowLogprobs returns: (logp, H), or with a kept set (logp_kept, H_kept, logp,
        H, kept_mass, kept_size, missing)."""
        if rp is None:
            return st.logp, st.ent
        ks = st.kept
        mass = kept_mass_op(self.be, self.mask)(ks.kept_max, ks.kept_log_sum, st.row_max,
                                                st.log_sum, self.temperature, self.mask)
        return ks.logp, ks.entropy, st.logp, st.ent, mass, ks.kept_size, ks.missing

    def kept_dtypes(self):
        """The dtypes of KeptStats' first six fields."""
        return (self.acc,) * 4 + (torch.int64, torch.bool)


def zero_grad(z3):
    """A zero gradient of z3's shape and dtype, contiguous as the kernels write dlogits
    (z3 may be a permuted view: [S, B, V] logits read as [B, S, V]): on the CPU
    ppo_kernels::zeros_grad (the CPU kernels' recycled gradient memory, zeroed in
    parallel; csrc/cpu/zeros_grad.cpp), else torch.zeros (one fill kernel on a device)."""
    if z3.device.type == "cpu" and HAS_CPU:
        return torch.ops.ppo_kernels.zeros_grad(z3)
    return torch.zeros(z3.shape, dtype=z3.dtype, device=z3.device)


class Block(NamedTuple):
    """Rows r0:r1 of the flat [N] rows (index: the block's number); whole: the block is
    every row in the [B, T] layout (the logits); live: where the LM head's matmuls ran for
    the block's unmasked rows alone, their indices in the block (int64 [k]; None: every
    row went through them, head_chunks.live_rows)."""

    index: int
    r0: int
    r1: int
    whole: bool = False
    live: Any = None

    def rows(self, x):
        """x [B, T] (or None) as this block's rows: [B, T] itself, or [1, C]."""
        if x is None or self.whole:
            return x
        return x.reshape(-1)[self.r0:self.r1].view(1, self.r1 - self.r0)

    def temperature(self, t):
        """A number, or the per-row values of this block."""
        return self.rows(t) if isinstance(t, torch.Tensor) else t

    def replay(self, rp):
        """The Replay of this block's rows (the CSR ids rebased: a host read of two offsets
        on a device)."""
        if rp is None or self.whole:
            return rp
        c = self.r1 - self.r0
        if rp.given:
            o0, o1 = int(rp.offsets[self.r0]), int(rp.offsets[self.r1])
            return type(rp)(ids=rp.ids[o0:o1],
                            offsets=(rp.offsets[self.r0:self.r1 + 1] - o0).contiguous())

        def rows(v):
            return None if v is None else v.reshape(-1)[self.r0:self.r1].view(1, c).contiguous()

        return type(rp)(top_k=rows(rp.top_k), top_p=rows(rp.top_p), min_p=rows(rp.min_p))


class LogitRows(RowSource):
    """The rows of logits [B, Tl, V] (inputs: (logits3,)), one block."""

    def __init__(self, be, logits3, tokens, mask, temperature, shard=None):
        super().__init__(be, tokens, mask, temperature, shard)
        self.acc = acc_dtype(logits3)

    def each_block(self, inputs, fn):
        fn(Block(0, 0, self.n, True), None, inputs[0])

    def cat(self, pieces, dtype=None):
        return pieces[0]

    def start_grad(self, inputs, need):
        return [None]

    def take_grad(self, acc, blk, h, z3, dz):
        acc[0] = dz

    def finish_grad(self, acc, inputs):
        return (acc[0],)


class RowLogprobs(torch.autograd.Function):
    """The log-probs of a row source, differentiable in its inputs: (logp, H), or with a
    kept set (logp_kept, H_kept, logp, H, kept_mass, kept_size, missing), the first four
    differentiable. The forward keeps [B, T] statistics only; the backward is the source's
    grad (a head's chunks recompute their logits)."""

    @staticmethod
    def forward(ctx, source, rp, need_ent, *inputs):
        # an output the loss does not use gets None, not zeros: with a kept set, a full
        # logp and H without a gradient skip the dense pass (RowSource.grad)
        ctx.set_materialize_grads(False)
        st = source.stats(inputs, rp, need_ent)
        ctx.source, ctx.rp, ctx.entries, ctx.need_ent = source, rp, st.entries, need_ent
        ctx.n_inputs = len(inputs)
        kept = st.kept if st.kept is not None else (None,) * 7
        ctx.save_for_backward(*inputs, st.logp, st.ent, st.row_max, st.log_sum, st.tokens,
                              st.own, *kept)
        out = source.outputs(st, rp)
        if rp is None:
            if not need_ent:
                ctx.mark_non_differentiable(out[1])
        else:
            ctx.mark_non_differentiable(*out[4:])
        return out

    @staticmethod
    def backward(ctx, *grads):
        src = ctx.source
        first_order_only(src.name + ("" if src.shard is None else " (a split vocabulary)"))
        saved = ctx.saved_tensors
        k = ctx.n_inputs
        inputs = saved[:k]
        kept = None if ctx.rp is None else KeptStats(*saved[k + 6:])
        st = RowStats(*saved[k:k + 6], kept, ctx.entries)
        acc = st.row_max.dtype

        def opt(g):  # (None: the loss did not use that output)
            return None if g is None else g.to(acc).contiguous()

        if ctx.rp is None:
            g_lp, g_ent = grads
            out = src.grad(inputs, st, opt(g_lp), opt(g_ent) if ctx.need_ent else None,
                           need=ctx.needs_input_grad[3:])
        else:
            g_kept, g_ent_kept, g_lp, g_ent = grads[:4]
            out = src.grad(inputs, st, opt(g_lp), opt(g_ent), opt(g_kept), opt(g_ent_kept),
                           ctx.rp, need=ctx.needs_input_grad[3:])
        return (None, None, None, *out)


def row_logprobs(source, inputs, rp=None, need_ent=True):
    """RowLogprobs of the source, with autograd where an input needs a gradient."""
    if wants_grad(*inputs):
        return RowLogprobs.apply(source, rp, need_ent, *inputs)
    with torch.no_grad():
        return source.outputs(source.stats(inputs, rp, need_ent), rp)


def logits_logprobs(be, logits3, tokens, mask, temperature, rp=None, shard=None):
    """The log-probs of logits [B, Tl, V] on backend be: (logp, H), or with kept sets rp
    (logp_kept, H_kept, logp, H, kept_mass, kept_size, missing) [B, T]; shard: the logits
    are this rank's shard of the vocabulary (tokens global). Differentiable in logits3."""
    if not be.is_kernel:
        if rp is not None:
            return replay_logprobs_torch(logits3, tokens, mask, temperature, rp)
        return be.token_logprobs(logits3, tokens, mask, temperature, True)
    if rp is None and shard is None:  # (the op's own registered autograd)
        return be.token_logprobs(logits3, tokens, mask, temperature, True)
    src = LogitRows(be, logits3, tokens, mask, temperature, shard)
    return row_logprobs(src, (logits3,), rp)
