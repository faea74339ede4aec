"""Top-k distillation loss in Triton (ppo_kernels::triton_distill_fwd; the C++ twin is
csrc/cpu/distill.cpp, the formulas ppo_kernels/distill.py's module docstring).

Shapes and dtypes (csrc/ops.cpp): logits [B, Tl, V] (stride(2) == 1); mask bool [B, T];
offsets int64 [B * T + 1] (non-decreasing, indexing token_ids), token_ids int64 [nnz],
teacher_logprobs [nnz] and weights [B, T] of the accumulation dtype ACC. Outputs: loss 0-d
= sum(weights * kl); kl, student_mass, teacher_tail [B, T] of ACC (0 on masked rows);
dlogits = grad_scale * d loss / d logits (contiguous, zeros on masked rows and rows
t >= T), or numel 0 unless compute_grad.

One program per row of [B, Tl]. Pass 1: the row statistics (row_stats: max, log_sum =
log1p of the non-top mass). Pass 2: D = sum_v p_v, p_v = exp((x_v - max) inv - log_sum),
accumulated in float64. The set is gathered in blocks of BLOCK_K: log pS_j (exact digits)
and p_j by the same expression as pass 2, summed in float64 too, so D - sum_S p_j is the
sum of the very values of the entries outside the set (float64 holds the float32 sum with
room to spare): the complement 1 - PS without cancellation when PS -> 1. Pass 3 (with a
gradient) writes alpha p_v on the row, then the set's entries from their own formula.
"""

import torch
import triton
import triton.language as tl

from . import _config
from ._math import as_acc, round_to, row_stats, row_zero
from .logprobs import acc_dtype, check_per_token, device_guard, inv_temperature, tl_acc


@triton.jit
def _distill_kernel(
    logits_ptr, stride_lb, stride_lt, mask_ptr, off_ptr, ids_ptr, lt_ptr, w_ptr,
    kl_ptr, ps_ptr, tt_ptr, grad_ptr, stride_gb, stride_gt,
    T, TG, V, inv_temp: tl.float64, grad_scale: tl.float64,
    ACC: tl.constexpr, TAIL: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // TG
    t = row % TG
    in_seq = t < T
    idx = b * T + t
    valid = tl.load(mask_ptr + idx, mask=in_seq, other=0) != 0
    out_row = grad_ptr + b * stride_gb + t * stride_gt
    if valid:
        inv = as_acc(inv_temp, ACC)
        in_row = logits_ptr + b * stride_lb + t * stride_lt
        row_max, log_sum, _ = row_stats(in_row, V, inv, ACC, False, BLOCK_V)
        offs = tl.arange(0, BLOCK_V)
        d_sum = tl.zeros([BLOCK_V], tl.float64)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            x = tl.load(in_row + cols, mask=cols < V, other=float("-inf")).to(ACC)
            d_sum += tl.exp((x - row_max) * inv - log_sum).to(tl.float64)
        total = tl.sum(d_sum, axis=0)
        o0 = tl.load(off_ptr + idx)
        o1 = tl.load(off_ptr + idx + 1)
        koffs = tl.arange(0, BLOCK_K)
        s_sum = tl.zeros([BLOCK_K], tl.float64)
        kl_b = tl.zeros([BLOCK_K], ACC)
        pt_b = tl.zeros([BLOCK_K], ACC)
        for k0 in range(o0, o1, BLOCK_K):
            ks = k0 + koffs
            kin = ks < o1
            ids = tl.load(ids_ptr + ks, mask=kin, other=0)
            ok = kin & (ids >= 0) & (ids < V)
            x = tl.load(in_row + ids, mask=ok, other=float("-inf")).to(ACC)
            lps = (x - row_max) * inv - log_sum
            ps = tl.exp(lps)
            s_sum += tl.where(ok, ps, 0.0).to(tl.float64)
            lt = tl.load(lt_ptr + ks, mask=kin, other=float("-inf")).to(ACC)
            pt = tl.exp(lt)
            on = pt > 0.0
            kl_b += tl.where(on, pt * (tl.where(on, lt, 0.0) - tl.where(on, lps, 0.0)), 0.0)
            pt_b += pt
        s_tot = tl.sum(s_sum, axis=0)
        kl = tl.sum(kl_b, axis=0)
        pt_sum = tl.sum(pt_b, axis=0)
        ps_sum = s_tot.to(ACC)
        comp = tl.maximum(total - s_tot, 0.0)  # float64: no cancellation (docstring)
        whole = (o1 - o0) == V
        tail_t = tl.where(whole, 0.0, 1.0 - pt_sum)
        tail_t = tl.where(tail_t > 0.0, tail_t, 0.0)
        alpha = pt_sum
        beta = tl.zeros([], ACC)
        if TAIL:
            has = tail_t > 0.0
            log_tt = tl.log(tl.where(has, tail_t, 1.0).to(tl.float64))
            # relative to the row's own total D (1 up to rounding): an empty set gives 0
            log_cs = tl.log(tl.where(has, comp, 1.0)) - tl.log(total)
            diff = (log_tt - log_cs).to(ACC)
            kl += tl.where(has, tail_t * diff, 0.0)
            r = tl.where(has, tl.exp(diff), 0.0)
            alpha = 1.0 - r
            beta = r
        tl.store(kl_ptr + idx, kl.to(ACC))
        tl.store(ps_ptr + idx, ps_sum)
        tl.store(tt_ptr + idx, tail_t.to(ACC))
        if COMPUTE_GRAD:
            w = tl.load(w_ptr + idx).to(ACC)
            c = w * as_acc(grad_scale, ACC) * inv
            ca = c * alpha
            for start in range(0, V, BLOCK_V):
                cols = start + offs
                inb = cols < V
                x = tl.load(in_row + cols, mask=inb, other=float("-inf")).to(ACC)
                pv = tl.exp((x - row_max) * inv - log_sum)
                tl.store(out_row + cols, round_to(ca * pv, out_row.dtype.element_ty), mask=inb)
            # the set's entries, after the dense sweep of this program (same lanes do not
            # hold them: a barrier orders the two stores)
            tl.debug_barrier()
            for k0 in range(o0, o1, BLOCK_K):
                ks = k0 + koffs
                kin = ks < o1
                ids = tl.load(ids_ptr + ks, mask=kin, other=0)
                ok = kin & (ids >= 0) & (ids < V)
                x = tl.load(in_row + ids, mask=ok, other=float("-inf")).to(ACC)
                ps = tl.exp((x - row_max) * inv - log_sum)
                pt = tl.exp(tl.load(lt_ptr + ks, mask=kin, other=float("-inf")).to(ACC))
                if TAIL:
                    g = ps - pt
                else:
                    g = alpha * ps - pt
                tl.store(out_row + ids, round_to(c * g, out_row.dtype.element_ty), mask=ok)
    else:
        zero = tl.zeros([], ACC)
        tl.store(kl_ptr + idx, zero, mask=in_seq)
        tl.store(ps_ptr + idx, zero, mask=in_seq)
        tl.store(tt_ptr + idx, zero, mask=in_seq)
        if COMPUTE_GRAD:
            row_zero(out_row, V, BLOCK_V)


def distill_fwd(logits, mask, offsets, token_ids, teacher_logprobs, weights, temperature,
                grad_scale, tail, compute_grad):
    """(loss, kl, student_mass, teacher_tail, dlogits) as csrc/ops.cpp's distill_fwd."""
    if logits.dim() != 3 or (logits.shape[2] > 1 and logits.stride(2) != 1):
        raise ValueError(f"logits: expected [B, Tl, V] with stride(2) == 1, got "
                         f"{tuple(logits.shape)}")
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError("mask: expected bool [B, T]")
    B, T = mask.shape
    TL, V = logits.shape[1], logits.shape[2]
    acc = acc_dtype(logits)
    dev = logits.device
    if offsets.dtype != torch.int64 or tuple(offsets.shape) != (B * T + 1,):
        raise ValueError(f"offsets: expected int64 [{B * T + 1}], got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")
    if token_ids.dtype != torch.int64 or token_ids.dim() != 1:
        raise ValueError("token_ids: expected int64 [nnz]")
    check_per_token("teacher_logprobs", teacher_logprobs, tuple(token_ids.shape), acc, dev)
    check_per_token("weights", weights, (B, T), acc, dev)
    g = float(grad_scale)
    if not (0.0 < g < float("inf")):
        raise ValueError(f"grad_scale: expected a positive finite number, got {grad_scale}")
    inv = inv_temperature(temperature, acc)
    kl = torch.empty((B, T), dtype=acc, device=dev)
    ps = torch.empty((B, T), dtype=acc, device=dev)
    tt = torch.empty((B, T), dtype=acc, device=dev)
    grad = (torch.empty(logits.shape, dtype=logits.dtype, device=dev) if compute_grad
            else torch.empty((0,), dtype=logits.dtype, device=dev))
    rows = B * (TL if compute_grad else T)
    if rows > 0:
        gp = grad if compute_grad else logits
        with device_guard(logits):
            _config.wrap(_distill_kernel)[(rows,)](
                logits, logits.stride(0), logits.stride(1), mask, offsets.contiguous(),
                token_ids.contiguous(), teacher_logprobs, weights, kl, ps, tt,
                gp, gp.stride(0), gp.stride(1), T, TL if compute_grad else T, V, inv, g,
                ACC=tl_acc(acc), TAIL=bool(tail), COMPUTE_GRAD=bool(compute_grad),
                BLOCK_K=32, **_config.inplace_row_config(V))
    loss = torch.dot(weights.reshape(-1), kl.reshape(-1))
    return loss, kl, ps, tt, grad
