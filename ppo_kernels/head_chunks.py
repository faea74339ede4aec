"""The LM head in chunks of rows: the logits hidden @ W^T (+ b), soft-capped, made for
chunk_size rows at a time and never stored whole (docs/FROM_HIDDEN.md). The checks of
the head's arguments, the one chunk loop (HeadRows.each_block: a row source of
ppo_kernels/rows.py, for the statistics and gradient passes, and the fused losses'
single passes of from_hidden.py and distill_hidden.py), the gradient accumulators of
hidden, W and b (Grads), and the materialised logits of the eager composite.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch

from . import _checks as ck
from .rows import Block, RowSource
from .vocab_parallel import shard_of

CHUNK_BYTES = 256 << 20  # chunk_size=None: one chunk of logits is about this many bytes
# A chunk's masked rows (prompt, padding) skip the head's three matmuls where that pays
# (live_rows): the kept rows' logits and gradient are then gathered and scattered, about
# three more passes over the k x V elements (e bytes each), while each skipped row saves
# 6 H flops per element; that pays once masked * H >= kept * e F / (2 BW), F / BW the
# machine's flops per byte: about 20-40 for a 2-core CPU in float32, about 300 for an H100
# in bf16. 64 sits between: at H = 4096 a GPU also skips where only 2-7% of a chunk is
# masked, for a loss of a few per cent there; where prompt and padding are most of the
# batch, the gain is their share of the matmuls.
LIVE_ROWS_BALANCE = 64
# torch.addmm(..., out_dtype=torch.float32, out=acc) of 16-bit operands (CUDA only)
ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


# ------------------------------------------------------------------ argument checks

def hidden_and_tokens(hidden, weight, bias, tokens):
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


def head_shard(hidden, weight, bias, tp_group, vocab_start):
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


def check_logits_dtype(logits_dtype, hidden3):
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


def check_accum_dtype(accum_dtype, weight):
    """The dtype dW is summed in over the chunks (Liger-Kernel's accum_dtype, the other
    way round: None here is float32 for bfloat16 / float16 weights, the weight's dtype
    otherwise; the weight's own dtype sums in place, one rounding per chunk, and saves
    the [V, H] float32 buffer). Anything else is a TypeError / ValueError naming
    accum_dtype."""
    wide = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
    if accum_dtype is None:
        return wide
    if not isinstance(accum_dtype, torch.dtype):
        raise TypeError(f"accum_dtype: expected None or a torch.dtype, got "
                        f"{type(accum_dtype).__name__}")
    if accum_dtype not in (wide, weight.dtype):
        allowed = f"{wide}" if wide == weight.dtype else f"{wide} or {weight.dtype} (that of " \
            f"lm_head_weight)"
        raise ValueError(f"accum_dtype: expected None or {allowed}, got {accum_dtype}")
    return accum_dtype


class HeadOptions(NamedTuple):
    """The LM head's options as the chunk loops read them (head_options)."""

    cap: Optional[float]                 # logit_softcap: None or > 0
    chunk: int                           # rows per chunk
    logits_dtype: Optional[torch.dtype]  # the chunks' logits (None: hidden's dtype)
    accum_dtype: torch.dtype             # dW's sum over several chunks


def head_options(hidden3, weight, logit_softcap, chunk_size, logits_dtype=None,
                 accum_dtype=None, buffers=2):
    """HeadOptions after checking each option (errors name it). chunk_size=None:
    default_chunk_size, with the accumulator dW's bytes counted where the weight takes a
    gradient; buffers: the chunk-sized buffers the caller's path holds at once (1: the
    fused single pass without a soft cap; 2: the two passes' logits and dz, or a soft
    cap's derivative)."""
    cap = None if logit_softcap is None else ck.number("logit_softcap", logit_softcap,
                                                       lo=0.0, lo_open=True)
    ldt = check_logits_dtype(logits_dtype, hidden3)
    accum = check_accum_dtype(accum_dtype, weight)
    if chunk_size is None:
        acc_bytes = 0
        if torch.is_grad_enabled() and weight.requires_grad:
            acc_bytes = weight.numel() * torch.empty((), dtype=accum).element_size()
        chunk = default_chunk_size(weight.shape[0], ldt or hidden3.dtype, acc_bytes, buffers)
    else:
        if isinstance(chunk_size, bool) or not hasattr(type(chunk_size), "__index__"):
            raise TypeError(f"chunk_size: expected an int (rows per chunk) or None, got "
                            f"{type(chunk_size).__name__}")
        chunk = operator.index(chunk_size)
        if chunk < 1:
            raise ValueError(f"chunk_size: expected at least 1 row, got {chunk_size}")
    # no more than the rows there are (a larger chunk is one chunk of all of them; the
    # chunks' bookkeeping is sized by it: live_rows pads the mask to a multiple)
    chunk = min(chunk, max(1, hidden3.shape[0] * hidden3.shape[1]))
    return HeadOptions(cap, chunk, ldt, accum)


def default_chunk_size(vocab, dtype, accum_bytes=0, buffers=1):
    """Rows per chunk for chunk_size=None: one chunk of [rows, V] logits in ``dtype`` is
    about max(CHUNK_BYTES, accum_bytes / (2 buffers)) bytes (at least 1 row).
    accum_bytes: the dW accumulator's ([V, H] in accum_dtype; 0 without a gradient into
    the weight); buffers: the chunk-sized buffers held at once (1 or 2). Each chunk reads
    and writes the accumulator once (2 A bytes) against the 6 C V H flops of its three
    matmuls; a chunk of A / 2 bytes of logits (C = H a / (2 e) rows, a and e the
    accumulator's and the logits' itemsizes) keeps that traffic at 4 e F / (6 BW H) of
    the matmuls' time, F / BW the machine's flops per byte: about 7% at H = 4096 in bf16
    on an H200 (~200), under 1% on a CPU; with 256 MiB chunks at V = 151,936 (883 bf16
    rows) it was about 30% there (14% with two buffers of A / 4). The chunk buffers
    together stay at half the accumulator: the peak is about 1.5 times it plus the
    gradients."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, max(CHUNK_BYTES, accum_bytes // (2 * buffers)) // (vocab * itemsize))


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


def softcap_factor_(z, cap):
    """1 - tanh^2 = 1 - (z / cap)^2, the soft cap's derivative, computed over z in place."""
    return z.div_(cap).square_().neg_().add_(1.0)


def live_rows(keep, chunk, h):
    """For each chunk of chunk rows of keep [N] (bool: the rows the loss reads), None where
    every row goes through the head's matmuls, else the indices of its kept rows (int64
    [k]): where masked * h >= LIVE_ROWS_BALANCE * kept, the masked rows' matmuls cost more
    than gathering the kept rows' logits and gradient. One host read of the chunks' counts
    (a device sync on CUDA); the kept rows' indices then come without one (nonzero_static,
    their number known)."""
    n = keep.numel()
    if n == 0:
        return []
    counts = torch.nn.functional.pad(keep.int(), (0, -n % chunk)).view(-1, chunk).sum(1)
    lives = []
    for i, k in enumerate(counts.tolist()):
        r0, r1 = i * chunk, min(n, (i + 1) * chunk)
        masked = r1 - r0 - k
        skip = masked > 0 and masked * h >= LIVE_ROWS_BALANCE * k
        lives.append(torch.nonzero_static(keep[r0:r1], size=k).view(-1) if skip else None)
    return lives


class Grads:
    """The gradient accumulators of hidden, W and b over the chunks of one pass (None
    for inputs that need none); dW summed in head.accum_dtype, db in float32 for bf16 /
    fp16 ([V]: nothing to save)."""

    def __init__(self, n, head, hidden3, weight, bias, need):
        need_h, need_w, need_b = need
        self.weight = weight
        h = weight.shape[1]
        dt = hidden3.dtype
        self.wide = torch.float32 if dt in (torch.bfloat16, torch.float16) else dt
        self.accum = head.accum_dtype
        # one chunk for all rows: dW and db are that chunk's matmul and sum as they come
        # (no float32 accumulator for bf16 / fp16: it would add [V, H] float32 of memory
        # and two passes over it to a product that already rounds once)
        self.single = n <= head.chunk
        self.dh2 = torch.empty(n, h, dtype=dt, device=hidden3.device) if need_h else None
        self.need_w, self.need_b = need_w, need_b
        self.dw = self.db = None  # made by the first chunk (no zeros to add to)
        self.any = need_h or need_w or need_b

    def add(self, blk, dz, h):
        """Accumulate a chunk's dz [C, V] (d loss / d logits of the block's rows, h = their
        hidden states; where blk.live is set, h holds the unmasked rows alone, and the
        masked rows, whose dz is 0, get a d hidden of 0 and no matmul). float32 dz of
        16-bit weights (logits_dtype=torch.float32) is rounded to the weights' dtype
        first: the two matmuls run as in the default path (the float32 accumulation of
        cuBLAS / oneDNN), so d hidden and dW keep their dtype and cost."""
        weight = self.weight
        r0, r1 = blk.r0, blk.r1
        if dz.dtype != weight.dtype:
            dz = dz.to(weight.dtype)
        if blk.live is not None:
            dz = dz.index_select(0, blk.live)
        if self.dh2 is not None:
            if blk.live is None:
                torch.mm(dz, weight, out=self.dh2[r0:r1])
            else:
                self.dh2[r0:r1].zero_().index_copy_(0, blk.live, torch.mm(dz, weight))
        if self.need_w:
            self.dw = self._add_dw(dz, h)
        if self.need_b:
            db = dz.sum(0, dtype=self.wide)
            self.db = db if self.db is None else self.db.add_(db)

    def _add_dw(self, dz, h):
        """dW + dz^T h, in self.accum (the first chunk: the product alone)."""
        dw, accum = self.dw, self.accum
        if self.single or accum == dz.dtype:
            # the weight's dtype (one chunk, or accum_dtype=its dtype): the matmul's float32
            # sum rounded once per chunk, added in place (beta = 1) without a temporary
            return torch.mm(dz.t(), h) if dw is None else dw.addmm_(dz.t(), h)
        if dz.is_cuda and ADDMM_OUT_DTYPE:
            # bf16 / fp16 on CUDA: cuBLAS writes (then adds) the product of the 16-bit
            # operands into the float32 accumulator itself: no [V, H] temporary, no
            # rounding per chunk
            if dw is None:
                return torch.mm(dz.t(), h, out_dtype=accum)
            return torch.addmm(dw, dz.t(), h, out_dtype=accum, out=dw)
        # bf16 / fp16 elsewhere: the matmul's float32 sum, rounded once per chunk
        p = torch.mm(dz.t(), h)
        return p.to(accum) if dw is None else dw.add_(p)

    def finish(self, t, hidden3, weight, bias):
        """(d hidden [B, Tl, H], dW [V, H], db [V]) in the inputs' dtypes."""
        dh = None
        if self.dh2 is not None:
            b, tl, h = hidden3.shape
            dh = self.dh2.view(b, t, h)
            if tl != t:
                full = torch.zeros(b, tl, h, dtype=dh.dtype, device=dh.device)
                full[:, :t] = dh
                dh = full
        dw, db = self.dw, self.db
        if self.need_w and dw is None:  # no rows at all
            dw = torch.zeros_like(weight)
        if self.need_b and db is None:
            db = torch.zeros_like(bias)
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        return dh, dw, db


class HeadRows(RowSource):
    """The rows of the logits hidden3 @ weight^T (+ bias) as head (a HeadOptions) says:
    soft-capped with head.cap, made head.chunk rows at a time in head.logits_dtype (None:
    hidden's): inputs (hidden3, weight, bias). tokens may be None (a loss that reads no
    token: distillation)."""

    name = "token_logprobs_from_hidden"

    def __init__(self, be, head, tokens, mask, temperature, acc, shard=None):
        super().__init__(be, tokens, mask, temperature, shard)
        self.head, self.acc = head, acc
        self.cap, self.chunk, self.logits_dtype = head.cap, head.chunk, head.logits_dtype
        self.lives = None  # live_rows of the mask, read at the first pass (the rest reuse it)

    def each_block(self, inputs, fn):
        """The one chunk loop: fn(block, h, z [1, C, V]) for each chunk of rows. h: the
        chunk's hidden rows [C, H] with masked rows zeroed (whatever a padded position
        holds, NaN included, stays out of dW = sum dz^T h, where its zero dz would meet it
        as 0 * NaN); or, where skipping the masked rows pays (live_rows), the unmasked rows
        alone [k, H], block.live their indices, and the masked rows' logits those of a
        zero hidden state (the bias, soft-capped) as before, computed once."""
        hidden3, weight, bias = inputs
        h2 = hidden3[:, :self.t].reshape(self.n, hidden3.shape[2])
        head = head_for_logits(weight, self.logits_dtype)
        keep = self.mask.reshape(self.n)
        if self.lives is None:
            self.lives = live_rows(keep, self.chunk, h2.shape[1])
        masked_row = None
        for i, r0 in enumerate(range(0, self.n, self.chunk)):
            r1, live = min(self.n, r0 + self.chunk), self.lives[i]
            if live is None:
                hc = torch.where(keep[r0:r1, None], h2[r0:r1], 0.0)
                z = self.logits(hc, head, bias)
            else:
                if masked_row is None:
                    masked_row = self.logits(h2.new_zeros(1, h2.shape[1]), head, bias)
                hc = h2[r0:r1].index_select(0, live)
                z = masked_row.expand(r1 - r0, -1).clone()
                if live.numel():  # (a chunk of masked rows alone: no matmul at all)
                    z.index_copy_(0, live, self.logits(hc, head, bias))
            fn(Block(i, r0, r1, live=live), hc, z.view(1, r1 - r0, -1))
            del z

    def logits(self, h, head, bias):
        # (logits_dtype only when set: the default call is chunk_logits(h, W, b, cap))
        return (chunk_logits(h, head, bias, self.cap) if self.logits_dtype is None else
                chunk_logits(h, head, bias, self.cap, self.logits_dtype))

    def cat(self, pieces, dtype=None):
        if not pieces:
            return torch.empty(self.b, self.t, dtype=dtype or self.acc,
                               device=self.mask.device)
        rest = tuple(pieces[0].shape[2:])  # ([1, C] pieces, or [1, C, k])
        return torch.cat([p.reshape((-1,) + rest) for p in pieces]).view(
            (self.b, self.t) + rest)

    def start_grad(self, inputs, need):
        g = Grads(self.n, self.head, *inputs, need)
        return g if g.any else None

    def take_grad(self, g, blk, h, z3, dz):
        """d loss / d logits of a chunk -> through the soft cap (its factor computed over
        the chunk's logits, which are not needed after) -> the accumulators."""
        c = blk.r1 - blk.r0
        dz = dz.view(c, -1)
        if self.cap is not None:
            dz.mul_(softcap_factor_(z3.view(c, -1), self.cap))
        g.add(blk, dz, h)

    def finish_grad(self, g, inputs):
        if g.dh2 is not None:
            self.vocab.reduce_(g.dh2)
        return g.finish(self.t, *inputs)


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
