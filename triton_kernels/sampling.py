"""Sampling replay in Triton (docs/SAMPLING.md): the kept-set log-probs and their gradient,
twins of csrc/cpu/sampling.cpp with the schemas of csrc/ops.cpp (prefixed triton_).

A row's kept set K is CSR (kept_ids[kept_offsets[r]:kept_offsets[r + 1]], global ids,
unique) or a value threshold (K = {j : x_j >= threshold[r]}, raw logit units); the sampled
token is always in K. One program per row; the CSR rows are gathered in blocks of BLOCK
ids, the threshold rows swept in blocks of BLOCK entries. Forward: kept_max = max_{K} x,
log_sum = log1p(the kept non-top mass) with d = (x - kept_max) / temperature, logp_kept =
d_y - log_sum, H_kept = log_sum - sum p d. Backward (added into dlogits, in place):
g (1[j = y] - p_j) - g_H p_j (log p_j + H) on K, divided by the temperature.

The re-derived sets' per-row threshold (sampling_threshold) is threshold.py's radix select.

Every op takes the optional per-row `temperatures` [B, T] (csrc/ops.cpp): row r then uses
1 / temperatures[r] (inv_temperatures: taken in float64, rounded once to ACC; ROW_TEMP).
"""

import torch
import triton
import triton.language as tl

from . import _config
from ._math import as_acc, expm1, log1p
from .logprobs import acc_dtype, device_guard, inv_temperature, inv_temperatures, tl_acc

BLOCK = 128


@triton.jit
def _kept_block(in_row, ids_ptr, start, end, k0, thr, V, CSR: tl.constexpr,
                ACC: tl.constexpr, BLOCK: tl.constexpr):
    """(column ids, x as ACC with -inf off the set, in-set flags) of block k0 of a row."""
    lane = tl.arange(0, BLOCK)
    if CSR:
        idx = start + k0 + lane
        live = idx < end
        col = tl.load(ids_ptr + idx, mask=live, other=0)
    else:
        col = (k0 + lane).to(tl.int64)
        live = col < V
    x = tl.load(in_row + col, mask=live, other=float("-inf")).to(ACC)
    if not CSR:
        live = live & (x.to(tl.float64) >= thr)
    x = tl.where(live, x, float("-inf"))
    return col, x, live


@triton.jit
def _kept_fwd_kernel(
    logits_ptr, stride_lb, stride_lt, tokens_ptr, mask_ptr, ids_ptr, offs_ptr, thr_ptr,
    logp_ptr, ent_ptr, kmax_ptr, kls_ptr, size_ptr, miss_ptr, invt_ptr,
    T, V, inv_temp: tl.float64,
    ACC: tl.constexpr, CSR: tl.constexpr, ROW_TEMP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    valid = tl.load(mask_ptr + row)
    if valid:
        if ROW_TEMP:
            inv = tl.load(invt_ptr + row).to(ACC)
        else:
            inv = as_acc(inv_temp, ACC)
        in_row = logits_ptr + b * stride_lb + t * stride_lt
        y = tl.load(tokens_ptr + row)
        x_y = tl.load(in_row + y).to(ACC)
        if CSR:
            start = tl.load(offs_ptr + row)
            end = tl.load(offs_ptr + row + 1)
            n = end - start
            thr = 0.0
        else:
            start = 0
            end = 0
            n = V
            thr = tl.load(thr_ptr + row)
        # pass 1: the kept max, the size, whether the token is in the set
        top = tl.full([], float("-inf"), ACC)
        found = tl.zeros([], tl.int32)
        size = tl.zeros([], tl.int64)
        for k0 in range(0, n, BLOCK):
            col, x, live = _kept_block(in_row, ids_ptr, start, end, k0, thr, V, CSR, ACC,
                                       BLOCK)
            top = tl.maximum(top, tl.max(x, 0))
            found += tl.sum((live & (col == y)).to(tl.int32), 0)
            size += tl.sum(live.to(tl.int64), 0)
        missing = found == 0
        if missing:
            top = tl.maximum(top, x_y)
            size += 1
        # pass 2: the non-top mass (entries with d = 0 beyond the first count as 1 each)
        # and sum e d
        rest = tl.zeros([], ACC)
        ties = tl.zeros([], ACC)
        sd = tl.zeros([], ACC)
        for k0 in range(0, n, BLOCK):
            col, x, live = _kept_block(in_row, ids_ptr, start, end, k0, thr, V, CSR, ACC,
                                       BLOCK)
            d = tl.where(live, (x - top) * inv, 0.0)
            e = tl.where(live, tl.exp(d), 0.0)
            at_top = live & (d == 0.0)
            rest += tl.sum(tl.where(at_top, 0.0, e), 0)
            ties += tl.sum(at_top.to(ACC), 0)
            sd += tl.sum(tl.where(e > 0.0, e * d, 0.0), 0)  # (a -inf entry: 0, not NaN)
        if missing:
            d_y = (x_y - top) * inv
            if d_y == 0.0:
                ties += 1.0
            else:
                rest += tl.exp(d_y)
            if tl.exp(d_y) > 0.0:
                sd += tl.exp(d_y) * d_y
        rest += tl.maximum(ties - 1.0, 0.0)
        log_sum = log1p(rest)
        tl.store(logp_ptr + row, (x_y - top) * inv - log_sum)
        tl.store(ent_ptr + row, log_sum - sd / (1.0 + rest))
        tl.store(kmax_ptr + row, top)
        tl.store(kls_ptr + row, log_sum)
        tl.store(size_ptr + row, size)
        tl.store(miss_ptr + row, missing.to(tl.int1))
    else:
        zero = tl.zeros([], ACC)
        tl.store(logp_ptr + row, zero)
        tl.store(ent_ptr + row, zero)
        tl.store(kmax_ptr + row, zero)
        tl.store(kls_ptr + row, zero)
        tl.store(size_ptr + row, tl.zeros([], tl.int64))
        tl.store(miss_ptr + row, tl.zeros([], tl.int1))


@triton.jit
def _zero_row(out_row, V, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    for k0 in range(0, V, BLOCK):
        col = k0 + lane
        tl.store(out_row + col, tl.zeros([BLOCK], out_row.dtype.element_ty), mask=col < V)


@triton.jit
def _kept_bwd_kernel(
    logits_ptr, stride_lb, stride_lt, tokens_ptr, mask_ptr, ids_ptr, offs_ptr, thr_ptr,
    kmax_ptr, kls_ptr, ent_ptr, glogp_ptr, gent_ptr, grad_ptr, invt_ptr,
    T, TL, V, inv_temp: tl.float64,
    ACC: tl.constexpr, CSR: tl.constexpr, HAS_GENT: tl.constexpr, ROW_TEMP: tl.constexpr,
    WRITE: tl.constexpr, BLOCK: tl.constexpr,
):
    # WRITE: the row is written whole (0 off the kept set; kept_logprobs_bwd), else the kept
    # part is added into it (kept_logprobs_bwd_)
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    out_row = grad_ptr + (b * TL + t) * V
    valid = tl.load(mask_ptr + row)
    g = tl.load(glogp_ptr + row).to(ACC)
    if HAS_GENT:
        gh = tl.load(gent_ptr + row).to(ACC)
        h = tl.load(ent_ptr + row).to(ACC)
    else:
        gh = tl.zeros([], ACC)
        h = tl.zeros([], ACC)
    if valid & ((g != 0.0) | (gh != 0.0)):
        if ROW_TEMP:
            inv = tl.load(invt_ptr + row).to(ACC)
        else:
            inv = as_acc(inv_temp, ACC)
        in_row = logits_ptr + b * stride_lb + t * stride_lt
        y = tl.load(tokens_ptr + row)
        top = tl.load(kmax_ptr + row).to(ACC)
        log_sum = tl.load(kls_ptr + row).to(ACC)
        if CSR:
            start = tl.load(offs_ptr + row)
            end = tl.load(offs_ptr + row + 1)
            n = end - start
            thr = 0.0
            if WRITE:  # (the kept ids are then written over the zeros)
                _zero_row(out_row, V, BLOCK)
                tl.debug_barrier()
        else:
            start = 0
            end = 0
            n = V
            thr = tl.load(thr_ptr + row)
        found = tl.zeros([], tl.int32)
        for k0 in range(0, n, BLOCK):
            col, x, live = _kept_block(in_row, ids_ptr, start, end, k0, thr, V, CSR,
                                       ACC, BLOCK)
            lp = tl.where(live, (x - top) * inv - log_sum, 0.0)
            p = tl.where(live, tl.exp(lp), 0.0)
            dz = tl.where(col == y, 0.0 - g * expm1(lp), 0.0 - g * p)
            dz = dz - tl.where(p > 0.0, gh * p * (lp + h), 0.0)
            if WRITE:
                if CSR:
                    tl.store(out_row + col, (dz * inv).to(grad_ptr.dtype.element_ty),
                             mask=live)
                else:  # (every entry of the sweep: 0 off the set)
                    tl.store(out_row + col,
                             tl.where(live, dz * inv, 0.0).to(grad_ptr.dtype.element_ty),
                             mask=col < V)
            else:
                old = tl.load(out_row + col, mask=live, other=0.0).to(ACC)
                tl.store(out_row + col, (old + dz * inv).to(grad_ptr.dtype.element_ty),
                         mask=live)
            found += tl.sum((live & (col == y)).to(tl.int32), 0)
        if found == 0:  # the token, added to a set that lacked it
            x_y = tl.load(in_row + y).to(ACC)
            lp = (x_y - top) * inv - log_sum
            p = tl.exp(lp)
            dz = 0.0 - g * expm1(lp) - gh * p * (lp + h)
            if WRITE:  # (after the sweep's 0 there)
                tl.debug_barrier()
                tl.store(out_row + y, (dz * inv).to(grad_ptr.dtype.element_ty))
            else:
                old = tl.load(out_row + y).to(ACC)
                tl.store(out_row + y, (old + dz * inv).to(grad_ptr.dtype.element_ty))
    elif WRITE:
        _zero_row(out_row, V, BLOCK)


def _kept_args(logits, kept_ids, kept_offsets, threshold):
    csr = kept_ids is not None
    if csr == (threshold is not None) or (kept_ids is None) != (kept_offsets is None):
        raise ValueError("sampling mask: give exactly one of (kept_ids, kept_offsets) and "
                         "threshold")
    dummy = torch.zeros(1, dtype=torch.int64, device=logits.device)
    if csr:
        ids = kept_ids.contiguous() if kept_ids.numel() else dummy
        return csr, ids, kept_offsets.contiguous(), torch.zeros(1, dtype=torch.float64,
                                                                device=logits.device)
    return csr, dummy, dummy, threshold.contiguous()


def _row_inv(temperatures, shape, acc, logits, temperature):
    """(1 / temperature as a float, the per-row [B, T] of ACC or a dummy, ROW_TEMP)."""
    invt, row_temp = inv_temperatures(temperatures, shape, acc, logits.device)
    inv = 1.0 if row_temp else inv_temperature(temperature, acc)
    if invt is None:
        invt = torch.ones(1, dtype=acc, device=logits.device)
    return inv, invt, row_temp


def kept_logprobs_fwd(logits, tokens, mask, temperature, kept_ids, kept_offsets, threshold,
                      temperatures=None):
    B, T = tokens.shape
    acc = acc_dtype(logits)
    inv, invt, row_temp = _row_inv(temperatures, (B, T), acc, logits, temperature)
    csr, ids, offs, thr = _kept_args(logits, kept_ids, kept_offsets, threshold)
    outs = [torch.empty(B, T, dtype=acc, device=logits.device) for _ in range(4)]
    size = torch.empty(B, T, dtype=torch.int64, device=logits.device)
    miss = torch.empty(B, T, dtype=torch.bool, device=logits.device)
    if B * T:
        with device_guard(logits):
            _config.wrap(_kept_fwd_kernel)[(B * T,)](
                logits, logits.stride(0), logits.stride(1), tokens.contiguous(),
                mask.contiguous(), ids, offs, thr, *outs, size, miss, invt, T,
                logits.shape[2], inv, ACC=tl_acc(acc), CSR=csr, ROW_TEMP=row_temp,
                BLOCK=BLOCK)
    return (*outs, size, miss)


def _kept_grad(grad_logprobs, grad_entropy, logits, tokens, mask, kept_max, kept_log_sum,
               entropy, temperature, kept_ids, kept_offsets, threshold, dlogits, temperatures,
               write):
    B, T = tokens.shape
    acc = acc_dtype(logits)
    inv, invt, row_temp = _row_inv(temperatures, (B, T), acc, logits, temperature)
    csr, ids, offs, thr = _kept_args(logits, kept_ids, kept_offsets, threshold)
    if not dlogits.is_contiguous() or dlogits.shape != logits.shape:
        raise ValueError("dlogits: expected a contiguous tensor of the logits' shape")
    has_gent = grad_entropy is not None
    gent = grad_entropy.contiguous() if has_gent else grad_logprobs
    if write and logits.shape[1] > T:  # the rows past the tokens' T
        dlogits[:, T:].zero_()
    if B * T:
        with device_guard(logits):
            _config.wrap(_kept_bwd_kernel)[(B * T,)](
                logits, logits.stride(0), logits.stride(1), tokens.contiguous(),
                mask.contiguous(), ids, offs, thr, kept_max, kept_log_sum, entropy,
                grad_logprobs.contiguous(), gent, dlogits, invt, T, logits.shape[1],
                logits.shape[2], inv, ACC=tl_acc(acc), CSR=csr, HAS_GENT=has_gent,
                ROW_TEMP=row_temp, WRITE=write, BLOCK=BLOCK)


def kept_logprobs_bwd_(grad_logprobs, grad_entropy, logits, tokens, mask, kept_max,
                       kept_log_sum, entropy, temperature, kept_ids, kept_offsets, threshold,
                       dlogits, temperatures=None):
    _kept_grad(grad_logprobs, grad_entropy, logits, tokens, mask, kept_max, kept_log_sum,
               entropy, temperature, kept_ids, kept_offsets, threshold, dlogits, temperatures,
               False)


def kept_logprobs_bwd(grad_logprobs, grad_entropy, logits, tokens, mask, kept_max,
                      kept_log_sum, entropy, temperature, kept_ids, kept_offsets, threshold,
                      temperatures=None):
    """kept_logprobs_bwd_'s gradient written whole into a new tensor (0 off the kept sets,
    on masked rows and on the rows past T): no zero fill first."""
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _kept_grad(grad_logprobs, grad_entropy, logits, tokens, mask, kept_max, kept_log_sum,
               entropy, temperature, kept_ids, kept_offsets, threshold, out, temperatures,
               True)
    return out


def threshold_kept_fwd(logits, tokens, mask, temperature, top_k, top_p, min_p,
                       temperatures=None):
    """sampling_threshold (threshold.py's radix select), then kept_logprobs_fwd on its
    threshold: (logp_kept, H_kept, kept_max, kept_log_sum, kept_size, missing, threshold),
    the C++ op's schema (two launches here; the CUDA op fuses them)."""
    from .threshold import sampling_threshold
    thr = sampling_threshold(logits, mask, temperature, top_k, top_p, min_p, temperatures)
    return (*kept_logprobs_fwd(logits, tokens, mask, temperature, None, None, thr,
                               temperatures), thr)
