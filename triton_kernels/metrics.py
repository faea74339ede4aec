"""ppo_loss's metrics on the device in two launches: the Triton twin of the CPU op
ppo_kernels::ppo_loss_metrics (csrc/cpu/metrics.cpp), which the eager formulas
(ppo_kernels/_torch_impl.py metrics, rollout_correction.metrics) compute with about 85 small
torch ops, each a kernel launch.

Inputs [B, T] contiguous: logp, entropy, old_logprobs (None: on-policy), advantages,
ref_logprobs, rollout_logprobs, rollout_is_weights (the last three optional) of the
accumulation dtype ACC (float32, or float64), mask bool; scalars / codes in the slot order
of ppo_kernels/spec.py. Output: float32 [NUM_METRICS], the metrics in the order of
ppo_kernels/loss.py METRIC_SLOTS (the CPU op's enum Metric), 0 for the ones the options do
not produce.

Launch 1, one program per sequence: the sequence ratio of the sequence-level losses
(GSPO's mean log-ratio, VESPO's clamped sum), then the per-token terms of the sequence,
summed in float64 (as the CPU op) and maxed with NaN kept, into a [B, NUM_PARTS] float64
row of partials. Launch 2, one program: the partials of every sequence reduced, in the
same order whatever the batch, and the means formed as the CPU op forms them (the sum
rounded to ACC, divided by the token count in ACC, then float32). The values equal the
CPU op's and the eager formulas' up to the summation order (tests/test_triton_metrics.py).
"""

import torch
import triton
import triton.language as tl

from . import _config
from ..spec import POLICY_LOSSES, F, I
from ._math import (LOG_RATIO_CLAMP, as_acc, clampv, dppo_masked, exp_acc, expm1_minus_x,
                    kl_term)
from .logprobs import check_kl_estimator, check_slots, device_guard, tl_acc

N_METRICS = 24  # ppo_kernels/loss.py METRIC_SLOTS
N_PARTS = 24  # the partials of one sequence (P_* below)
NUM_METRICS = tl.constexpr(N_METRICS)
NUM_PARTS = tl.constexpr(N_PARTS)
# the partials' columns
(P_TOK, P_SEQ, P_CLIP, P_CLIP_HI, P_CLIP_LO, P_DUAL, P_AKL, P_KL, P_ENT, P_RHO, P_RHO_MAX,
 P_CISPO, P_SEQ_CLIP, P_SEQ_SUM, P_SEQ_MAX, P_R_MEAN, P_R_MAX, P_R_MIN, P_R_OUT, P_R_K3,
 P_R_CHI, P_W_MEAN, P_W_MAX, P_W_ZERO) = (tl.constexpr(i) for i in range(N_PARTS))
# the policy loss ids (spec.py POLICY_LOSSES; csrc/ppo_math.h PolicyLoss)
PL_VANILLA = tl.constexpr(POLICY_LOSSES.index("vanilla"))
PL_CISPO = tl.constexpr(POLICY_LOSSES.index("cispo"))
PL_DPPO_TV = tl.constexpr(POLICY_LOSSES.index("dppo-tv"))
PL_DPPO_KL = tl.constexpr(POLICY_LOSSES.index("dppo-kl"))
PL_GSPO = tl.constexpr(POLICY_LOSSES.index("gspo"))
PL_GSPO_TOKEN = tl.constexpr(POLICY_LOSSES.index("gspo-token"))
PL_VESPO = tl.constexpr(POLICY_LOSSES.index("vespo"))
# VESPO's lower clamp of the sequence log-ratio (TRL's get_gamma_weights: log 1e-8), as
# csrc/cpu/metrics.cpp kVespoLogWMin
VESPO_LOG_W_MIN = tl.constexpr(-18.420680743952367)
# the block of tokens (rows) a program reads at once; small under the interpreter, so that
# the test shapes span several blocks
BLOCK = 8 if _config.INTERPRET else 1024


@triton.jit
def _nan_max(acc, x, live):
    """max over the live lanes, NaN if any live lane is NaN (torch.max's rule); acc is a
    block of running maxima."""
    return tl.where(live & (x != x), x, tl.where(live & (x > acc), x, acc))


@triton.jit
def _nan_min(acc, x, live):
    return tl.where(live & (x != x), x, tl.where(live & (x < acc), x, acc))


@triton.jit
def _block_max(acc):
    """The max of a block, NaN if it holds one."""
    has_nan = tl.max((acc != acc).to(tl.int32), axis=0) > 0
    m = tl.max(tl.where(acc != acc, float("-inf"), acc), axis=0)
    return tl.where(has_nan, float("nan"), m)


@triton.jit
def _block_min(acc):
    has_nan = tl.max((acc != acc).to(tl.int32), axis=0) > 0
    m = tl.min(tl.where(acc != acc, float("inf"), acc), axis=0)
    return tl.where(has_nan, float("nan"), m)


@triton.jit
def _rows_kernel(logp_ptr, ent_ptr, mask_ptr, old_ptr, adv_ptr, ref_ptr, roll_ptr, isw_ptr,
                 lkl_ptr, part_ptr, T,
                 clip_eps_low: tl.float64, clip_eps_high: tl.float64, dual_clip_c: tl.float64,
                 ACC: tl.constexpr, PL: tl.constexpr, KL_EST: tl.constexpr,
                 HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_ROLL: tl.constexpr,
                 HAS_ISW: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_LKL: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Sequence b = program 0: its NUM_PARTS partials (P_*) into part_ptr[b]. HAS_LKL:
    kl_ref reads lkl_ptr (the KL's log-probs) in place of logp."""
    SEQ: tl.constexpr = (PL == PL_GSPO) | (PL == PL_GSPO_TOKEN) | (PL == PL_VESPO)
    SURROGATE: tl.constexpr = (PL == PL_VANILLA) | (PL == PL_GSPO) | (PL == PL_GSPO_TOKEN)
    DPPO: tl.constexpr = (PL == PL_DPPO_TV) | (PL == PL_DPPO_KL)
    b = tl.program_id(0).to(tl.int64)
    row = b * T
    offs = tl.arange(0, BLOCK)
    # the thresholds as the CPU op compares with them: 1 +- the Python double, rounded to ACC
    eps_lo = as_acc(clip_eps_low, ACC)
    eps_hi = as_acc(clip_eps_high, ACC)
    hi = as_acc(1.0 + clip_eps_high, ACC)
    lo = as_acc(1.0 - clip_eps_low, ACC)
    dual_c = as_acc(dual_clip_c, ACC)
    lim = as_acc(LOG_RATIO_CLAMP, ACC)
    # the sequence ratio (_torch_impl.pg_terms) and the sequence's length
    n_len = tl.zeros([BLOCK], tl.int32)
    acc_lr = tl.zeros([BLOCK], tl.float64)
    for t0 in range(0, T, BLOCK):
        idx = t0 + offs
        inb = idx < T
        m = tl.load(mask_ptr + row + idx, mask=inb, other=0) != 0
        n_len += m.to(tl.int32)
        if SEQ:
            lp = tl.load(logp_ptr + row + idx, mask=m, other=0.0).to(ACC)
            if HAS_OLD:
                o = tl.load(old_ptr + row + idx, mask=m, other=0.0).to(ACC)
            else:
                o = lp
            d = lp - o
            if PL == PL_VESPO:
                d = clampv(d, -lim, lim)
            acc_lr += tl.where(m, d.to(tl.float64), 0.0)
    length = tl.sum(n_len, axis=0)
    s = tl.full([], 1.0, ACC)
    if SEQ:
        total = tl.sum(acc_lr, axis=0).to(ACC)
        if PL == PL_VESPO:
            s = exp_acc(clampv(total, as_acc(VESPO_LOG_W_MIN, ACC), lim))
        else:
            s = exp_acc(clampv(total / tl.maximum(length, 1).to(ACC), -lim, lim))
    # the per-token terms (float64 sums, as the CPU op's doubles)
    z64 = tl.zeros([BLOCK], tl.float64)
    n_tok, clip_any, clip_hi, clip_lo, dual = z64, z64, z64, z64, z64
    akl, kl, ent, rho_sum, cispo = z64, z64, z64, z64, z64
    r_mean, r_out, r_k3, r_chi, w_mean, w_zero = z64, z64, z64, z64, z64, z64
    zt = tl.zeros([BLOCK], ACC)
    rho_max, r_max, w_max = zt, zt, zt
    r_min = tl.full([BLOCK], float("inf"), ACC)
    for t0 in range(0, T, BLOCK):
        idx = t0 + offs
        inb = idx < T
        m = tl.load(mask_ptr + row + idx, mask=inb, other=0) != 0
        lp = tl.load(logp_ptr + row + idx, mask=m, other=0.0).to(ACC)
        if HAS_OLD:
            o = tl.load(old_ptr + row + idx, mask=m, other=0.0).to(ACC)
        else:
            o = lp
        a = tl.load(adv_ptr + row + idx, mask=m, other=0.0).to(ACC)
        d = clampv(lp - o, -lim, lim)
        rho = exp_acc(d)
        ch = tl.zeros([BLOCK], tl.int1)
        cl = tl.zeros([BLOCK], tl.int1)
        du = tl.zeros([BLOCK], tl.int1)
        if SURROGATE:
            if SEQ:
                r = s + zt
            else:
                r = rho
            unclipped = -r * a
            clipped = -clampv(r, lo, hi) * a
            pg = tl.where(unclipped >= clipped, unclipped, clipped)
            ch = (r > hi) & (a > 0.0)
            cl = (r < lo) & (a < 0.0)
            if HAS_DUAL:
                du = (a < 0.0) & (pg > -dual_c * a)
        elif PL == PL_CISPO:
            above = rho > hi
            below = rho < lo
            ch = above & (a > 0.0)
            cl = below & (a < 0.0)
            cispo += tl.where(m & (above | below), 1.0, 0.0)
        elif DPPO:
            mk = dppo_masked(lp, o, a, eps_lo, eps_hi, PL == PL_DPPO_KL)
            ch = mk & (a > 0.0)
            cl = mk & (a < 0.0)
            if HAS_DUAL:
                du = (mk == 0) & (rho > dual_c)
        n_tok += tl.where(m, 1.0, 0.0)
        clip_hi += tl.where(m & ch, 1.0, 0.0)
        clip_lo += tl.where(m & cl, 1.0, 0.0)
        clip_any += tl.where(m & (ch | cl), 1.0, 0.0)
        dual += tl.where(m & du, 1.0, 0.0)
        akl += tl.where(m, expm1_minus_x(d).to(tl.float64), 0.0)
        if HAS_REF:
            rf = tl.load(ref_ptr + row + idx, mask=m, other=0.0).to(ACC)
            if HAS_LKL:
                lk = tl.load(lkl_ptr + row + idx, mask=m, other=0.0).to(ACC)
            else:
                lk = lp
            k, _ = kl_term(lk - rf, KL_EST)
            kl += tl.where(m, k.to(tl.float64), 0.0)
        e = tl.load(ent_ptr + row + idx, mask=m, other=0.0).to(ACC)
        ent += tl.where(m, e.to(tl.float64), 0.0)
        rho_sum += tl.where(m, rho.to(tl.float64), 0.0)
        rho_max = _nan_max(rho_max, rho, m)
        if HAS_ROLL:  # rollout_correction.metrics
            rl = tl.load(roll_ptr + row + idx, mask=m, other=0.0).to(ACC)
            lr = clampv(o - rl, -lim, lim)
            raw = exp_acc(lr)
            r_mean += tl.where(m, raw.to(tl.float64), 0.0)
            r_max = _nan_max(r_max, raw, m)
            r_min = _nan_min(r_min, raw, m)
            r_out += tl.where(m & ((raw < 0.9) | (raw > 1.1)), 1.0, 0.0)
            r_k3 += tl.where(m, expm1_minus_x(lr).to(tl.float64), 0.0)
            r_chi += tl.where(m, exp_acc(2.0 * lr).to(tl.float64), 0.0)
            if HAS_ISW:
                w = tl.load(isw_ptr + row + idx, mask=m, other=0.0).to(ACC)
            else:
                w = tl.full([BLOCK], 1.0, ACC)
            w_mean += tl.where(m, w.to(tl.float64), 0.0)
            w_max = _nan_max(w_max, w, m)
            w_zero += tl.where(m & (w == 0.0), 1.0, 0.0)
    out = part_ptr + b * NUM_PARTS
    nonempty = length > 0
    tl.store(out + P_TOK, tl.sum(n_tok, axis=0))
    tl.store(out + P_SEQ, tl.where(nonempty, 1.0, 0.0).to(tl.float64))
    tl.store(out + P_CLIP, tl.sum(clip_any, axis=0))
    tl.store(out + P_CLIP_HI, tl.sum(clip_hi, axis=0))
    tl.store(out + P_CLIP_LO, tl.sum(clip_lo, axis=0))
    tl.store(out + P_DUAL, tl.sum(dual, axis=0))
    tl.store(out + P_AKL, tl.sum(akl, axis=0))
    tl.store(out + P_KL, tl.sum(kl, axis=0))
    tl.store(out + P_ENT, tl.sum(ent, axis=0))
    tl.store(out + P_RHO, tl.sum(rho_sum, axis=0))
    tl.store(out + P_RHO_MAX, _block_max(rho_max).to(tl.float64))
    tl.store(out + P_CISPO, tl.sum(cispo, axis=0))
    if SEQ:
        if PL == PL_VESPO:  # (no clip)
            tl.store(out + P_SEQ_CLIP, tl.zeros([], tl.float64))
        else:
            clipped_seq = nonempty & ((s > hi) | (s < lo))
            tl.store(out + P_SEQ_CLIP, tl.where(clipped_seq, 1.0, 0.0).to(tl.float64))
        tl.store(out + P_SEQ_SUM, tl.where(nonempty, s.to(tl.float64), 0.0))
        seq_max = tl.where(s != s, s, tl.where(s > 0.0, s, 0.0))
        tl.store(out + P_SEQ_MAX, tl.where(nonempty, seq_max.to(tl.float64), 0.0))
    else:
        tl.store(out + P_SEQ_CLIP, tl.zeros([], tl.float64))
        tl.store(out + P_SEQ_SUM, tl.zeros([], tl.float64))
        tl.store(out + P_SEQ_MAX, tl.zeros([], tl.float64))
    tl.store(out + P_R_MEAN, tl.sum(r_mean, axis=0))
    tl.store(out + P_R_MAX, _block_max(r_max).to(tl.float64))
    tl.store(out + P_R_MIN, _block_min(r_min).to(tl.float64))
    tl.store(out + P_R_OUT, tl.sum(r_out, axis=0))
    tl.store(out + P_R_K3, tl.sum(r_k3, axis=0))
    tl.store(out + P_R_CHI, tl.sum(r_chi, axis=0))
    tl.store(out + P_W_MEAN, tl.sum(w_mean, axis=0))
    tl.store(out + P_W_MAX, _block_max(w_max).to(tl.float64))
    tl.store(out + P_W_ZERO, tl.sum(w_zero, axis=0))


@triton.jit
def _col_sum(part_ptr, B, col, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float64)
    for b0 in range(0, B, BLOCK):
        rows = b0 + offs
        acc += tl.load(part_ptr + rows * NUM_PARTS + col, mask=rows < B, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _col_max(part_ptr, B, col, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float64)  # (the CPU op's maxima start at 0)
    for b0 in range(0, B, BLOCK):
        rows = b0 + offs
        inb = rows < B
        acc = _nan_max(acc, tl.load(part_ptr + rows * NUM_PARTS + col, mask=inb, other=0.0),
                       inb)
    return _block_max(acc)


@triton.jit
def _col_min(part_ptr, B, col, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], float("inf"), tl.float64)
    for b0 in range(0, B, BLOCK):
        rows = b0 + offs
        inb = rows < B
        acc = _nan_min(acc, tl.load(part_ptr + rows * NUM_PARTS + col, mask=inb,
                                    other=float("inf")), inb)
    return _block_min(acc)


@triton.jit
def _mean(total, n, ACC: tl.constexpr):
    """csrc/cpu/metrics.cpp mean: the sum rounded to ACC over the count in ACC, as float32."""
    return (total.to(ACC) / n).to(tl.float32)


@triton.jit
def _finish_kernel(part_ptr, out_ptr, B, ACC: tl.constexpr, SEQ: tl.constexpr,
                   HAS_REF: tl.constexpr, HAS_ROLL: tl.constexpr, BLOCK: tl.constexpr):
    """One program: the [NUM_METRICS] float32 metrics from the [B, NUM_PARTS] partials."""
    n_tok = _col_sum(part_ptr, B, P_TOK, BLOCK)
    n_seq = _col_sum(part_ptr, B, P_SEQ, BLOCK)
    n = tl.maximum(n_tok, 1.0).to(ACC)
    ns = tl.maximum(n_seq, 1.0).to(ACC)
    zero = tl.zeros([], tl.float32)
    tl.store(out_ptr + 0, n_tok.to(tl.float32))
    tl.store(out_ptr + 1, n_seq.to(tl.float32))
    tl.store(out_ptr + 2, _mean(_col_sum(part_ptr, B, P_CLIP, BLOCK), n, ACC))
    tl.store(out_ptr + 3, _mean(_col_sum(part_ptr, B, P_CLIP_HI, BLOCK), n, ACC))
    tl.store(out_ptr + 4, _mean(_col_sum(part_ptr, B, P_CLIP_LO, BLOCK), n, ACC))
    tl.store(out_ptr + 5, _mean(_col_sum(part_ptr, B, P_DUAL, BLOCK), n, ACC))
    tl.store(out_ptr + 6, _mean(_col_sum(part_ptr, B, P_AKL, BLOCK), n, ACC))
    if HAS_REF:
        tl.store(out_ptr + 7, _mean(_col_sum(part_ptr, B, P_KL, BLOCK), n, ACC))
    else:
        tl.store(out_ptr + 7, zero)
    tl.store(out_ptr + 8, _mean(_col_sum(part_ptr, B, P_ENT, BLOCK), n, ACC))
    tl.store(out_ptr + 9, _mean(_col_sum(part_ptr, B, P_RHO, BLOCK), n, ACC))
    tl.store(out_ptr + 10, _col_max(part_ptr, B, P_RHO_MAX, BLOCK).to(ACC).to(tl.float32))
    tl.store(out_ptr + 11, _mean(_col_sum(part_ptr, B, P_CISPO, BLOCK), n, ACC))
    if SEQ:
        tl.store(out_ptr + 12, (_col_sum(part_ptr, B, P_SEQ_CLIP, BLOCK).to(ACC) / ns)
                 .to(tl.float32))
        tl.store(out_ptr + 13, (_col_sum(part_ptr, B, P_SEQ_SUM, BLOCK).to(ACC) / ns)
                 .to(tl.float32))
        tl.store(out_ptr + 14, _col_max(part_ptr, B, P_SEQ_MAX, BLOCK).to(ACC)
                 .to(tl.float32))
    else:
        tl.store(out_ptr + 12, zero)
        tl.store(out_ptr + 13, zero)
        tl.store(out_ptr + 14, zero)
    if HAS_ROLL:
        tl.store(out_ptr + 15, _mean(_col_sum(part_ptr, B, P_R_MEAN, BLOCK), n, ACC))
        tl.store(out_ptr + 16, _col_max(part_ptr, B, P_R_MAX, BLOCK).to(ACC).to(tl.float32))
        r_min = _col_min(part_ptr, B, P_R_MIN, BLOCK)
        tl.store(out_ptr + 17, tl.where(r_min == float("inf"), 0.0, r_min).to(ACC)
                 .to(tl.float32))
        tl.store(out_ptr + 18, _mean(_col_sum(part_ptr, B, P_R_OUT, BLOCK), n, ACC))
        tl.store(out_ptr + 19, _mean(_col_sum(part_ptr, B, P_R_K3, BLOCK), n, ACC))
        chi = _mean(_col_sum(part_ptr, B, P_R_CHI, BLOCK), n, ACC)
        tl.store(out_ptr + 20, chi - tl.where(n_tok > 0.0, 1.0, 0.0).to(tl.float32))
        tl.store(out_ptr + 21, _mean(_col_sum(part_ptr, B, P_W_MEAN, BLOCK), n, ACC))
        tl.store(out_ptr + 22, _col_max(part_ptr, B, P_W_MAX, BLOCK).to(ACC).to(tl.float32))
        tl.store(out_ptr + 23, _mean(_col_sum(part_ptr, B, P_W_ZERO, BLOCK), n, ACC))
    else:
        for k in tl.static_range(15, NUM_METRICS):
            tl.store(out_ptr + k, zero)


def ppo_loss_metrics(logp, ent, mask, old, adv, ref, roll, isw, scalars, codes, slots=None,
                     kl_logprobs=None):
    """The [N_METRICS] float32 metrics vector (ppo_kernels/loss.py METRIC_SLOTS) of a
    ppo_loss call from its per-token tensors, in two launches on their device; with slots
    (a list of METRIC_SLOTS indices, as the CPU op takes them) those entries only. roll
    (and with it isw) is read only with old given, as the CPU op does; kl_logprobs: what
    kl_ref reads where it is not logp (sampling replay's full log-probs). Raises ValueError
    for inputs of another shape, dtype or device than logp's [B, T], or scalars / codes
    that are not the slots of ppo_kernels/spec.py."""
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask: expected bool [B, T], got {mask.dtype} {list(mask.shape)}")
    check_slots(scalars, codes)
    acc = logp.dtype
    if acc not in (torch.float32, torch.float64):
        raise ValueError(f"logp: expected float32 or float64, got {acc}")
    if roll is None or old is None:
        roll = isw = None
    named = (("logp", logp), ("entropy", ent), ("old_logprobs", old), ("advantages", adv),
             ("ref_logprobs", ref), ("rollout_logprobs", roll), ("rollout_is_weights", isw),
             ("kl_logprobs", kl_logprobs))
    for name, x in named:
        if x is not None and (x.shape != mask.shape or x.dtype != acc
                              or x.device != mask.device):
            raise ValueError(f"{name}: expected {acc} {list(mask.shape)} on {mask.device}, "
                             f"got {x.dtype} {list(x.shape)} on {x.device}")
    pl, est = int(codes[I["policy_loss"]]), int(codes[I["kl_estimator"]])
    if not 0 <= pl < len(POLICY_LOSSES):
        raise ValueError(f"policy_loss: expected an id of ppo_kernels/spec.py POLICY_LOSSES, "
                         f"got {pl}")
    check_kl_estimator(est)
    if slots is not None and any(not 0 <= int(k) < N_METRICS for k in slots):
        raise ValueError(f"slots: expected indices in [0, {N_METRICS}), got {list(slots)}")
    B, T = mask.shape
    dev = mask.device
    part = torch.empty((B, N_PARTS), dtype=torch.float64, device=dev)
    out = torch.empty((N_METRICS,), dtype=torch.float32, device=dev)
    c = [x.contiguous() if x is not None else None for x in (logp, ent, mask, old, adv, ref,
                                                             roll, isw, kl_logprobs)]
    stand_in = c[0]  # an absent optional tensor is never read: any pointer stands in
    with device_guard(logp):
        if B > 0:
            _config.wrap(_rows_kernel)[(B,)](
                *[x if x is not None else stand_in for x in c], part, T,
                float(scalars[F["clip_eps_low"]]), float(scalars[F["clip_eps_high"]]),
                float(scalars[F["dual_clip_c"]]),
                ACC=tl_acc(acc), PL=pl, KL_EST=est, HAS_OLD=old is not None,
                HAS_REF=ref is not None, HAS_ROLL=roll is not None, HAS_ISW=isw is not None,
                HAS_DUAL=float(scalars[F["dual_clip_c"]]) > 0.0,
                HAS_LKL=kl_logprobs is not None, BLOCK=BLOCK)
        seq = POLICY_LOSSES[pl] in ("gspo", "gspo-token", "vespo")
        _config.wrap(_finish_kernel)[(1,)](
            part, out, B, ACC=tl_acc(acc), SEQ=seq, HAS_REF=ref is not None,
            HAS_ROLL=roll is not None, BLOCK=BLOCK)
    return out if slots is None else out[slots]
