"""The weights of a ppo_loss call on the device in two launches: the loss_agg_mode weights
(the Triton twin of the CPU op ppo_kernels::agg_weights, csrc/cpu/metrics.cpp; the modes
in csrc/ops_host.cpp), the token-id check, and the rollout-correction weights
(ppo_kernels/rollout_correction.py weights), which the eager formulas compute with about
4 (_torch_impl.agg_weights), 8 (_checks.token_range) and 4-12 small torch ops, each a
kernel launch.

Inputs: mask bool [B, T] contiguous; tokens int64 [B, T] (or None: no check), vocab V;
mode 0 token-mean (w = 1 / denom, or 1 / max(valid tokens, 1) for denom <= 0),
1 token-sum (w = 1), 2 a constant denominator (w = 1 / denom), 3 seq-mean-token-mean
(w = 1 / (max(len_b, 1) n), n = denom, or max(non-empty sequences, 1) for denom <= 0);
float64: the weights' dtype is float64, else float32; old, rollout [B, T] of that dtype
and rc_mode (one of RC_MODES, or None) with its bounds lo, hi: the rollout correction.

Outputs: w [B, T] (0 where masked), the same bits as the CPU op and the eager formulas
(exact counts, each weight one correctly rounded division: div_rn, not the approximate
float32 `/` of a GPU); with tokens, ok: a 0-d bool, False where a valid position holds an
id outside [0, V); with rc_mode, rc_w [B, T] (0 where masked): the eager formulas' values
within about 1e-7 relative (the exponential is _math.exp_acc, a sequence's log-ratio sum
in another order), NaN kept where a valid log-prob is NaN.

Launch 1, one program per sequence: its valid-token count, its bad-id count, and for the
sequence modes its sum of clamped log-ratios. Launch 2, one program per sequence: the
totals over every sequence's counts (B numbers: small next to the B * T mask), its row of
weights and of rollout-correction weights; program 0 writes ok.
"""

import torch
import triton
import triton.language as tl

from . import _config
from ._math import LOG_RATIO_CLAMP, as_acc, clampv, div_rn, exp_acc
from .logprobs import device_guard, tl_acc

# the block of positions (launch 1) and of sequences (launch 2) a program reads at once;
# small under the interpreter, so that the test shapes span several blocks
BLOCK = 8 if _config.INTERPRET else 1024
# ppo_kernels/rollout_correction.py's modes, in the order of their RC codes (-1: none)
RC_MODES = ("tis", "mis", "tis-seq", "mis-seq", "geo-seq")
RC_NONE = tl.constexpr(-1)
RC_TIS = tl.constexpr(0)
RC_MIS = tl.constexpr(1)
RC_TIS_SEQ = tl.constexpr(2)
RC_MIS_SEQ = tl.constexpr(3)
RC_GEO_SEQ = tl.constexpr(4)


@triton.jit
def _log_ratio(old_ptr, roll_ptr, idx, live, ACC: tl.constexpr):
    """l = clamp(old - rollout, -20, 20) (NaN kept) at the live positions idx, 0 elsewhere."""
    old = tl.load(old_ptr + idx, mask=live, other=0.0).to(ACC)
    roll = tl.load(roll_ptr + idx, mask=live, other=0.0).to(ACC)
    return tl.where(live, clampv(old - roll, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)


@triton.jit
def _counts_kernel(mask_ptr, tokens_ptr, counts_ptr, old_ptr, roll_ptr, lsum_ptr, T, V,
                   CHECK: tl.constexpr, RC: tl.constexpr, ACC: tl.constexpr,
                   BLOCK: tl.constexpr):
    """counts[b] = (valid tokens of sequence b, valid tokens with an id outside [0, V));
    for the sequence modes of the rollout correction lsum[b] = sum of its log-ratios."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    n = tl.zeros([BLOCK], tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    lsum = tl.zeros([BLOCK], ACC)
    for start in range(0, T, BLOCK):
        t = start + offs
        inb = t < T
        m = tl.load(mask_ptr + b * T + t, mask=inb, other=0) != 0
        n += m.to(tl.int32)
        if CHECK:
            tok = tl.load(tokens_ptr + b * T + t, mask=inb & m, other=0)
            bad += (m & ((tok < 0) | (tok >= V))).to(tl.int32)
        if RC >= RC_TIS_SEQ:
            lsum += _log_ratio(old_ptr, roll_ptr, b * T + t, inb & m, ACC)
    tl.store(counts_ptr + 2 * b, tl.sum(n, axis=0))
    tl.store(counts_ptr + 2 * b + 1, tl.sum(bad, axis=0))
    if RC >= RC_TIS_SEQ:
        tl.store(lsum_ptr + b, tl.sum(lsum, axis=0))


@triton.jit
def _correct(r, lo, hi, RC: tl.constexpr):
    """The rollout-correction weight of ratio r (rollout_correction.py weights): truncated
    (tis, tis-seq), masked outside [lo, hi] (mis, mis-seq), 1 / 0 (geo-seq); a NaN ratio
    stays NaN (bad data, never a silent 0)."""
    inside = (r >= lo) & (r <= hi)
    if (RC == RC_TIS) or (RC == RC_TIS_SEQ):
        w = tl.where(r < lo, lo, tl.where(r > hi, hi, r))
    elif RC == RC_GEO_SEQ:
        w = inside.to(r.dtype)
    else:
        w = tl.where(inside, r, 0.0)
    return tl.where(r != r, r, w)


@triton.jit
def _weights_kernel(mask_ptr, counts_ptr, w_ptr, ok_ptr, old_ptr, roll_ptr, lsum_ptr,
                    rc_ptr, B, T, denom: tl.float64, lo: tl.float64, hi: tl.float64,
                    MODE: tl.constexpr, CHECK: tl.constexpr, RC: tl.constexpr,
                    ACC: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    n_tok = tl.zeros([BLOCK], tl.int64)
    n_seq = tl.zeros([BLOCK], tl.int64)
    n_bad = tl.zeros([BLOCK], tl.int64)
    for start in range(0, B, BLOCK):
        s = start + offs
        inb = s < B
        lens = tl.load(counts_ptr + 2 * s, mask=inb, other=0).to(tl.int64)
        n_tok += lens
        n_seq += (lens > 0).to(tl.int64)
        if CHECK:
            n_bad += tl.load(counts_ptr + 2 * s + 1, mask=inb, other=0).to(tl.int64)
    if CHECK:
        if b == 0:
            tl.store(ok_ptr, tl.sum(n_bad, axis=0) == 0)
    d = as_acc(denom, ACC)
    one = tl.full([], 1.0, ACC)
    if MODE == 0:
        total = tl.maximum(tl.sum(n_tok, axis=0), 1).to(ACC)
        wb = div_rn(one, tl.where(d > 0.0, d, total), ACC)
    elif MODE == 2:
        wb = div_rn(one, d, ACC)
    elif MODE == 3:
        n = tl.where(d > 0.0, d, tl.maximum(tl.sum(n_seq, axis=0), 1).to(ACC))
        len_b = tl.maximum(tl.load(counts_ptr + 2 * b), 1).to(ACC)
        wb = div_rn(one, len_b * n, ACC)
    else:
        wb = one
    lo_a = as_acc(lo, ACC)
    hi_a = as_acc(hi, ACC)
    if RC >= RC_TIS_SEQ:  # the sequence's ratio, shared by its tokens
        ls = tl.load(lsum_ptr + b)
        if RC == RC_GEO_SEQ:
            ls = ls / tl.maximum(tl.load(counts_ptr + 2 * b), 1).to(ACC)
        else:
            ls = clampv(ls, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        w_seq = _correct(exp_acc(ls), lo_a, hi_a, RC)
    for start in range(0, T, BLOCK):
        t = start + offs
        inb = t < T
        m = tl.load(mask_ptr + b * T + t, mask=inb, other=0) != 0
        tl.store(w_ptr + b * T + t, tl.where(m, wb, 0.0), mask=inb)
        if RC != RC_NONE:
            if RC >= RC_TIS_SEQ:
                wr = tl.full([BLOCK], 0.0, ACC) + w_seq
            else:
                wr = _correct(exp_acc(_log_ratio(old_ptr, roll_ptr, b * T + t, inb & m, ACC)),
                              lo_a, hi_a, RC)
            tl.store(rc_ptr + b * T + t, tl.where(m, wr, 0.0), mask=inb)


def loss_weights(mask, mode, denom, float64, tokens=None, vocab=0, old=None, rollout=None,
                 rc_mode=None, lo=0.0, hi=1.0):
    """(w, ok, rc_w) of the module docstring, on mask's device: w [B, T] float64 or float32,
    ok a 0-d bool (None without tokens), rc_w [B, T] (None without rc_mode). Eager launches
    only (the callers run it outside tracing). Raises ValueError for a mode outside 0..3,
    a mask that is not bool [B, T], an rc_mode outside RC_MODES or missing log-probs."""
    if mode not in (0, 1, 2, 3):
        raise ValueError(f"mode: expected 0, 1, 2 or 3, got {mode}")
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask: expected bool [B, T], got {mask.dtype} {list(mask.shape)}")
    if rc_mode is not None and (rc_mode not in RC_MODES or old is None or rollout is None):
        raise ValueError(f"rc_mode: expected one of {RC_MODES} with old and rollout "
                         f"log-probs, got {rc_mode!r}")
    B, T = mask.shape
    acc = torch.float64 if float64 else torch.float32
    dev = mask.device
    mask = mask.contiguous()
    w = torch.empty((B, T), dtype=acc, device=dev)
    check = tokens is not None
    rc = -1 if rc_mode is None else RC_MODES.index(rc_mode)
    rc_w = None if rc < 0 else torch.empty((B, T), dtype=acc, device=dev)
    if B * T == 0:
        ok = torch.ones((), dtype=torch.bool, device=dev) if check else None
        return w, ok, rc_w
    ok = torch.empty((), dtype=torch.bool, device=dev) if check else None
    counts = torch.empty((B, 2), dtype=torch.int32, device=dev)
    lsum = torch.empty((B,), dtype=acc, device=dev) if rc >= 2 else w
    o, r = ((old.to(acc).contiguous(), rollout.to(acc).contiguous()) if rc >= 0
            else (w, w))  # (an absent tensor is never read: any pointer stands in)
    with device_guard(mask):
        tok = tokens.contiguous() if check else mask
        _counts_kernel[(B,)](mask, tok, counts, o, r, lsum, T, int(vocab), CHECK=check,
                             RC=rc, ACC=tl_acc(acc), BLOCK=BLOCK)
        _weights_kernel[(B,)](mask, counts, w, ok if check else counts, o, r, lsum,
                              w if rc_w is None else rc_w, B, T, float(denom), float(lo),
                              float(hi), MODE=mode, CHECK=check, RC=rc, ACC=tl_acc(acc),
                              BLOCK=BLOCK)
    return w, ok, rc_w
