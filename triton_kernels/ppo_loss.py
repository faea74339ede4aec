"""The fused PPO loss in Triton: loss, per-token terms and, in the same launch, dlogits.

Shapes and dtypes (csrc/ops.cpp): logits [B, Tl, V] (stride(2) == 1, any B/Tl strides,
Tl >= T); tokens int64, mask bool, old_logprobs, advantages, weights, ref_logprobs,
rollout_is_weights, entropy_weights [B, T] contiguous of the accumulation dtype ACC (float64
for float64 logits, else float32). old_logprobs None is on-policy (old = logp inside the
kernel: rho = 1, d rho / d logp = 1, no extra pass); entropy_weights None means weights.
scalars / codes: the loss options in the slot order of ppo_kernels/spec.py (FLOAT_SLOTS,
INT_SLOTS; F_* / I_* in _math.py); the policy_loss code 0 vanilla, 1 cispo, 2 sapo, the
kl_estimator code 0 k1, 1 k2, 2 k3, 3 abs, 4 k1+, 5 k3+; kl_bias_correction multiplies the
KL term by rho (csrc/ppo_math.h token_loss). Outputs: loss 0-d = sum(weights * loss_tok) (as the C++
ops, whatever the entropy weights: only the gradient's entropy part uses them); loss_tok,
logprobs, entropy [B, T] of ACC (0 on masked rows); dlogits = grad_scale * d loss / d logits like
logits (contiguous, zeros on masked rows and rows t >= T), or numel 0 when compute_grad is
False; the in-place variant writes dlogits over the logits instead. scale_grad_ rescales
such a gradient in place by grad_output / applied (autograd's backward), with no host read.

One program per row of [B, Tl] on grid axis 0. Pass 1 streams the row once for
(lse, H); the per-token math of csrc/ppo_math.h (token_loss) gives dlogp and dent; pass 2
streams the row again (still in L2: it was just read) and writes the gradient. Where the
launch config's block holds the whole row (ONE_TILE: BLOCK_V >= V, up to 64 Ki entries,
_config.tile_row_configs) the row stays in registers between the two: one read of the
logits and one write of the gradient, the same bits as the two passes with that block. The loss
is a scalar whose weights w_i are known before the launch, so the gradient can be written
now and autograd's backward only scales it by grad_output / grad_scale (nothing at all when
the forward's grad_scale was the grad_output): one read of the logits for the forward, one
read and one write for the gradient, no [N, V] intermediate.
"""

import torch
import triton
import triton.language as tl

from . import _config
from ..spec import KERNEL_POLICY_LOSSES, POLICY_LOSSES, F, I
from ._math import (F_GRAD_SCALE, as_acc, div_rn, round_to, row_grad, row_load, row_stats,
                    row_zero, tile_grad, tile_stats, token_col, token_logit, token_logp,
                    token_loss)
from .logprobs import (check_logits, acc_dtype, check_kl_estimator, check_per_token,
                       check_slots, device_guard, inv_temperature, inv_temperatures, tl_acc)


def _ppo_loss_kernel_fn(
    logits_ptr, stride_lb, stride_lt,
    tokens_ptr, mask_ptr, old_ptr, adv_ptr, w_ptr, ref_ptr, isw_ptr, went_ptr,
    loss_tok_ptr, logp_ptr, ent_ptr,
    grad_ptr, stride_gb, stride_gt, invt_ptr,
    T, TG, V, ROWS,
    # the loss options, FLOAT_SLOTS of ppo_kernels/spec.py in slot order; float64 by
    # annotation: triton's JIT types a plain Python float (even in a tuple) as fp32
    clip_eps_low: tl.float64, clip_eps_high: tl.float64, dual_clip_c: tl.float64,
    kl_coef: tl.float64, entropy_coef: tl.float64, temperature: tl.float64,
    grad_scale: tl.float64, sapo_tau_pos: tl.float64, sapo_tau_neg: tl.float64,
    inv_temp: tl.float64,
    ACC: tl.constexpr, KL_EST: tl.constexpr, HAS_REF: tl.constexpr, HAS_ISW: tl.constexpr,
    HAS_DUAL: tl.constexpr, HAS_OLD: tl.constexpr, HAS_WENT: tl.constexpr,
    POLICY_LOSS: tl.constexpr, KL_BIAS: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
    ROW_TEMP: tl.constexpr, BLOCK_V: tl.constexpr, ONE_TILE: tl.constexpr,
    PERSIST: tl.constexpr = 0,
):
    """Row r = b * TG + t (TG = Tl with a gradient, so that rows t >= T get their zeros,
    else T). grad_ptr/stride_g* address the gradient rows: a fresh contiguous buffer, or
    the logits themselves in place (each row is fully read in pass 1 before pass 2
    overwrites it, and no other program touches that row). The gradient written is
    grad_scale * d loss / d logits (dlogp and dent scaled before the sweep); the per-token
    outputs are not scaled. HAS_OLD False: on-policy, old = logp (old_ptr is not read);
    HAS_WENT False: the entropy weight is w (went_ptr is not read). ROW_TEMP: the row's
    1 / temperature is invt_ptr[b * T + t] (logprobs.inv_temperatures), else inv_temp.
    The float options come as float64 arguments (annotated: an unannotated Python float
    would be specialised as fp32 on a GPU and cost float64 runs 1e-9..1e-7 relative), each
    rounded once to ACC where it is used (as_acc), as the C++ T(p.x).
    Rows r = program_id, program_id + num_programs, ... < ROWS: one per program on a grid
    of ROWS programs, or (PERSIST = k, the launcher's grid of k programs a multiprocessor)
    a persistent grid whose rows in flight, k a multiprocessor, may stay in L2 between the
    two sweeps where a program per row keeps more rows in flight than the L2 holds. The
    same bits either way: a row's work does not depend on its program."""
    FS = (clip_eps_low, clip_eps_high, dual_clip_c, kl_coef, entropy_coef, temperature,
          grad_scale, sapo_tau_pos, sapo_tau_neg)
    # (int64 from the start: pid + num_programs may pass 2^31 where the rows are near it;
    # r + an int64 zero, as r is a Python int under the interpreter)
    for r in range(tl.program_id(0).to(tl.int64), ROWS, tl.num_programs(0)):
        _ppo_loss_row(r + tl.zeros([], tl.int64), logits_ptr, stride_lb, stride_lt,
                      tokens_ptr, mask_ptr, old_ptr, adv_ptr, w_ptr, ref_ptr, isw_ptr,
                      went_ptr, loss_tok_ptr, logp_ptr, ent_ptr, grad_ptr, stride_gb,
                      stride_gt, invt_ptr, T, TG, V,
                      FS, inv_temp, ACC, KL_EST, HAS_REF, HAS_ISW, HAS_DUAL, HAS_OLD,
                      HAS_WENT, POLICY_LOSS, KL_BIAS, COMPUTE_GRAD, ROW_TEMP, BLOCK_V,
                      ONE_TILE)


@triton.jit
def _ppo_loss_row(row, logits_ptr, stride_lb, stride_lt, tokens_ptr, mask_ptr, old_ptr,
                  adv_ptr, w_ptr, ref_ptr, isw_ptr, went_ptr, loss_tok_ptr, logp_ptr, ent_ptr,
                  grad_ptr, stride_gb, stride_gt, invt_ptr, T, TG, V, FS, inv_temp,
                  ACC: tl.constexpr, KL_EST: tl.constexpr, HAS_REF: tl.constexpr,
                  HAS_ISW: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_OLD: tl.constexpr,
                  HAS_WENT: tl.constexpr, POLICY_LOSS: tl.constexpr, KL_BIAS: tl.constexpr,
                  COMPUTE_GRAD: tl.constexpr, ROW_TEMP: tl.constexpr, BLOCK_V: tl.constexpr,
                  ONE_TILE: tl.constexpr):
    """Row `row` of _ppo_loss_kernel_fn (its docstring)."""
    b = row // TG
    t = row % TG
    in_seq = t < T
    idx = b * T + t
    valid = tl.load(mask_ptr + idx, mask=in_seq, other=0) != 0
    out_row = grad_ptr + b * stride_gb + t * stride_gt
    if valid:
        if ROW_TEMP:
            inv = tl.load(invt_ptr + idx).to(ACC)
        else:
            inv = as_acc(inv_temp, ACC)
        in_row = logits_ptr + b * stride_lb + t * stride_lt
        # every per-token load is issued before the sweep, which hides its latency
        tok = tl.load(tokens_ptr + idx)
        x_tok = token_logit(in_row, tok, V, ACC)
        if HAS_OLD:
            old = tl.load(old_ptr + idx).to(ACC)
        adv = tl.load(adv_ptr + idx).to(ACC)
        w = tl.load(w_ptr + idx).to(ACC)
        if HAS_WENT:
            w_ent = tl.load(went_ptr + idx).to(ACC)
        else:
            w_ent = w
        if HAS_REF:
            ref = tl.load(ref_ptr + idx).to(ACC)
        else:
            ref = tl.zeros([], ACC)
        if HAS_ISW:
            is_w = tl.load(isw_ptr + idx).to(ACC)
        else:
            is_w = tl.full([], 1.0, ACC)
        if ONE_TILE:  # (the row whole in registers: read once for both sweeps)
            x = row_load(in_row, V, ACC, BLOCK_V)
            row_max, log_sum, ent = tile_stats(x, inv, True)
        else:
            row_max, log_sum, ent = row_stats(in_row, V, inv, ACC, True, BLOCK_V)
        logp = token_logp(x_tok, row_max, log_sum, inv)
        if not HAS_OLD:
            old = logp  # on-policy: rho = exp(logp - sg(logp)) = 1, d rho / d logp = 1
        loss, dlogp, dent = token_loss(logp, ent, old, adv, ref, is_w, w, w_ent, FS, ACC,
                                       KL_EST, HAS_REF, HAS_DUAL, POLICY_LOSS, KL_BIAS)
        tl.store(loss_tok_ptr + idx, loss)
        tl.store(logp_ptr + idx, logp)
        tl.store(ent_ptr + idx, ent)
        if COMPUTE_GRAD:
            gs = as_acc(FS[F_GRAD_SCALE], ACC)
            if ONE_TILE:
                tile_grad(x, out_row, V, token_col(tok, V), logp, row_max, log_sum, ent,
                          dlogp * gs, dent * gs, inv, BLOCK_V)
            else:
                row_grad(in_row, out_row, V, token_col(tok, V), logp, row_max, log_sum,
                         ent, dlogp * gs, dent * gs, inv, ACC, BLOCK_V)
    else:
        zero = tl.zeros([], ACC)
        tl.store(loss_tok_ptr + idx, zero, mask=in_seq)
        tl.store(logp_ptr + idx, zero, mask=in_seq)
        tl.store(ent_ptr + idx, zero, mask=in_seq)
        if COMPUTE_GRAD:
            row_zero(out_row, V, BLOCK_V)


# Keyed on V and the flags, not on the row count: see logprobs.py (batch invariance).
_KEY = ["V", "COMPUTE_GRAD", "HAS_REF", "KL_EST", "POLICY_LOSS"]
_PRUNE = {"early_config_prune": _config.prune_tile_row_configs}
# (ROWS not specialized: its %16 / == 1 variants would only add compiles)
_ppo_loss_jit = triton.jit(_ppo_loss_kernel_fn, do_not_specialize=["ROWS"])
_ppo_loss_kernel = triton.autotune(configs=_config.tile_row_configs(), key=_KEY,
                                   prune_configs_by=_PRUNE)(_ppo_loss_jit)
# The in-place variant is NOT autotuned: trials overwrite the input, so the autotuner would
# have to clone the logits (restore_value) - a second [N, V] buffer, the very allocation
# inplace_backward exists to avoid. It runs the plain JIT kernel with a fixed config
# (_config.inplace_row_config).


def check_grad_scale(grad_scale):
    """grad_scale as the ops take it: a positive finite number (1.0: the plain gradient)."""
    g = float(grad_scale)
    if not (0.0 < g < float("inf")):
        raise ValueError(f"grad_scale: expected a positive finite number, got {grad_scale}")
    return g


def check_loss_args(scalars, codes):
    """The ops' float[] / int[] (the slots of ppo_kernels/spec.py): (floats, codes)."""
    check_slots(scalars, codes)
    check_kl_estimator(codes[I["kl_estimator"]])
    pl = codes[I["policy_loss"]]
    kernel_ids = [POLICY_LOSSES.index(x) for x in KERNEL_POLICY_LOSSES]
    if isinstance(pl, bool) or int(pl) not in kernel_ids:
        raise ValueError(f"policy_loss: expected the id of a token-level policy loss "
                         f"{kernel_ids} (ppo_kernels/spec.py KERNEL_POLICY_LOSSES), got {pl}")
    check_grad_scale(scalars[F["grad_scale"]])
    return tuple(float(x) for x in scalars), [int(c) for c in codes]


def _launch(logits, tokens, mask, old_logprobs, advantages, weights, ref_logprobs,
            rollout_is_weights, entropy_weights, scalars, codes, grad, inplace,
            temperatures=None):
    check_logits(logits, tokens, mask)
    B, T = tokens.shape
    TL, V = logits.shape[1], logits.shape[2]
    acc = acc_dtype(logits)
    dev = logits.device
    for name, x in (("old_logprobs", old_logprobs), ("advantages", advantages),
                    ("weights", weights), ("ref_logprobs", ref_logprobs),
                    ("rollout_is_weights", rollout_is_weights),
                    ("entropy_weights", entropy_weights)):
        if x is not None:
            check_per_token(name, x, (B, T), acc, dev)
    fs, codes = check_loss_args(scalars, codes)
    inv = inv_temperature(fs[F["temperature"]], acc)
    invt, row_temp = inv_temperatures(temperatures, (B, T), acc, dev)
    loss_tok = torch.empty((B, T), dtype=acc, device=dev)
    logp = torch.empty((B, T), dtype=acc, device=dev)
    ent = torch.empty((B, T), dtype=acc, device=dev)
    compute_grad = grad is not None
    rows = B * (TL if compute_grad else T)
    if rows > 0:
        kernel, launch = _ppo_loss_kernel, {}
        if inplace or _config.INTERPRET:  # (not autotuned: see below and tile_row_configs)
            kernel, launch = _ppo_loss_jit, _config.inplace_tile_row_config(V)
        g = grad if compute_grad else logits
        grid = _config.row_grid(rows, dev, launch)
        with device_guard(logits):
            _config.wrap(kernel)[grid](
                logits, logits.stride(0), logits.stride(1),
                # an absent optional tensor is never read: any pointer stands in for it
                tokens, mask, old_logprobs if old_logprobs is not None else advantages,
                advantages, weights,
                ref_logprobs if ref_logprobs is not None else advantages,
                rollout_is_weights if rollout_is_weights is not None else advantages,
                entropy_weights if entropy_weights is not None else advantages,
                loss_tok, logp, ent,
                g, g.stride(0), g.stride(1), invt if row_temp else advantages,
                T, TL if compute_grad else T, V, rows, *fs, inv,
                ACC=tl_acc(acc), KL_EST=codes[I["kl_estimator"]],
                HAS_REF=ref_logprobs is not None, HAS_ISW=rollout_is_weights is not None,
                HAS_DUAL=fs[F["dual_clip_c"]] > 0.0, HAS_OLD=old_logprobs is not None,
                HAS_WENT=entropy_weights is not None, POLICY_LOSS=codes[I["policy_loss"]],
                KL_BIAS=bool(codes[I["kl_bias_correction"]]), COMPUTE_GRAD=compute_grad,
                ROW_TEMP=row_temp, **launch)
    # sum(w * loss_tok) over [B, T] in a deterministic order (no atomics): this reads
    # 8 bytes per token, nothing next to the [B, T, V] sweep.
    loss = torch.dot(weights.reshape(-1), loss_tok.reshape(-1))
    return loss, loss_tok, logp, ent


def ppo_loss_fwd(logits, tokens, mask, old_logprobs, advantages, weights, ref_logprobs,
                 rollout_is_weights, entropy_weights, scalars, codes, compute_grad,
                 temperatures=None):
    """(loss, loss_tok, logprobs, entropy, dlogits); dlogits (like logits, contiguous) is
    grad_scale * d loss / d logits, numel 0 unless compute_grad."""
    grad = (torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            if compute_grad else torch.empty((0,), dtype=logits.dtype, device=logits.device))
    loss, loss_tok, logp, ent = _launch(
        logits, tokens, mask, old_logprobs, advantages, weights, ref_logprobs,
        rollout_is_weights, entropy_weights, scalars, codes,
        grad if compute_grad else None, inplace=False, temperatures=temperatures)
    return loss, loss_tok, logp, ent, grad


def ppo_loss_fwd_inplace(logits, tokens, mask, old_logprobs, advantages, weights,
                         ref_logprobs, rollout_is_weights, entropy_weights, scalars, codes,
                         temperatures=None):
    """(loss, loss_tok, logprobs, entropy); the logits now hold grad_scale * dlogits
    (zeros on masked rows and rows t >= T), in their own dtype and strides."""
    return _launch(logits, tokens, mask, old_logprobs, advantages, weights, ref_logprobs,
                   rollout_is_weights, entropy_weights, scalars, codes, logits, inplace=True,
                   temperatures=temperatures)


# ------------------------------------------------------------------ scale_grad_

@triton.jit
def _scale_grad_kernel(grad_ptr, stride_gb, stride_gt, go_ptr, applied_ptr, TL, V,
                       ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    """Row r = b * Tl + t of grad: grad *= grad_output / applied, in ACC, rounded once to
    grad's dtype; nothing is written when the two scalars are equal (f == 1: for
    correctly rounded division f == 1 exactly when they are equal). Reads `applied` only;
    _scale_grad_commit_kernel updates it after every program here has run."""
    go = tl.load(go_ptr).to(ACC)
    ap = tl.load(applied_ptr).to(ACC)
    if go != ap:
        f = div_rn(go, ap, ACC)
        row = tl.program_id(0).to(tl.int64)
        g_row = grad_ptr + (row // TL) * stride_gb + (row % TL) * stride_gt
        offs = tl.arange(0, BLOCK_V)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            inb = cols < V
            g = tl.load(g_row + cols, mask=inb, other=0.0).to(ACC)
            tl.store(g_row + cols, round_to(g * f, grad_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _scale_grad_commit_kernel(go_ptr, applied_ptr):
    """One program, launched after _scale_grad_kernel on the same stream (so after every
    one of its programs read `applied`): applied := grad_output where they differ."""
    go = tl.load(go_ptr)
    if go != tl.load(applied_ptr):
        tl.store(applied_ptr, go)


def scale_grad_(grad, grad_output, applied):
    """In place, without a host read: f = grad_output / applied; where f != 1, grad *= f
    and applied := grad_output (autograd's backward of the fused loss: the forward wrote
    grad_scale * dlogits and applied = grad_scale, so a matching grad_output costs nothing).

    grad: [B, Tl, V] of any float dtype, unit vocabulary stride, any batch/time strides
    (a contiguous dlogits, or the logits' own storage after the in-place forward).
    grad_output, applied: 0-d tensors of the accumulation dtype (float64 for float64 grad,
    else float32) on grad's device. Returns None.
    """
    if grad.dim() != 3:
        raise ValueError(f"grad: expected [B, Tl, V], got shape {tuple(grad.shape)}")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"grad: expected a float32/bfloat16/float16/float64 tensor, "
                        f"got {grad.dtype}")
    B, TL, V = grad.shape
    if V > 1 and grad.stride(2) != 1:
        raise ValueError(f"grad: expected stride(2) == 1, got strides {grad.stride()}")
    acc = acc_dtype(grad)
    for name, x in (("grad_output", grad_output), ("applied", applied)):
        check_per_token(name, x, (), acc, grad.device)
    traced = _traced(grad, grad_output, applied)
    scale = _config.wrap(_scale_grad_kernel) if traced else _scale_grad_kernel
    commit = _config.wrap(_scale_grad_commit_kernel) if traced else _scale_grad_commit_kernel
    with device_guard(grad):
        if B * TL * V > 0:
            scale[(B * TL,)](grad, grad.stride(0), grad.stride(1), grad_output, applied, TL, V,
                             ACC=tl_acc(acc), **_config.inplace_row_config(V))
        commit[(1,)](grad_output, applied, num_warps=1)


def _traced(*tensors):
    """True where a trace must see the launch (torch.compile, make_fx / export: a proxy,
    fake or functional mode, or tensor subclasses), so it goes through wrap_triton's
    triton_kernel_wrapper_mutation; False for an eager call, which launches the kernel
    itself. scale_grad_ is also called directly, outside its triton_op (the eager backward,
    ppo_kernels/_autograd.py), where wrap_triton is not switched off: there each call
    would go through the HOP's Python dispatch and append its constant arguments to
    torch's kernel_side_table (torch/_higher_order_ops/triton_kernel_wrap.py), which is
    never cleared. (Inside a triton_op's eager run wrap_triton returns the kernel anyway.)"""
    if torch.compiler.is_compiling() or any(type(t) is not torch.Tensor for t in tensors):
        return True
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(getattr(keys, k)) is not None
               for k in ("PROXY", "FAKE", "FUNCTIONAL") if hasattr(keys, k))
