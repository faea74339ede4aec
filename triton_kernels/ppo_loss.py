"""The fused PPO loss in Triton: loss, per-token terms and, in the same launch, dlogits.

Shapes and dtypes (csrc/ops.cpp): logits [B, Tl, V] (stride(2) == 1, any B/Tl strides,
Tl >= T); tokens int64, mask bool, old_logprobs, advantages, weights, ref_logprobs,
rollout_is_weights [B, T] contiguous of the accumulation dtype ACC (float64 for float64
logits, else float32). Outputs: loss 0-d = sum(weights * loss_tok); loss_tok, logprobs,
entropy [B, T] of ACC (0 on masked rows); dlogits like logits (contiguous, zeros on masked
rows and rows t >= T), or numel 0 when compute_grad is False; the in-place variant writes
dlogits over the logits instead.

One program per row of [B, Tl] on grid axis 0. Pass 1 streams the row once for
(lse, H); the per-token math of csrc/ppo_math.h (token_loss) gives dlogp and dent; pass 2
streams the row again (still in L2: it was just read) and writes the gradient. The loss
is a scalar whose weights w_i are known before the launch, so the gradient can be written
now and autograd's backward only scales it by grad_output: one read of the logits for the
forward, one read and one write for the gradient, no [N, V] intermediate.
"""

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from . import _config
from ._math import as_acc, row_grad, row_stats, row_zero, token_logp, token_loss
from .logprobs import _check_logits, acc_dtype, check_kl_estimator, check_per_token, tl_acc


def _ppo_loss_kernel_fn(
    logits_ptr, stride_lb, stride_lt,
    tokens_ptr, mask_ptr, old_ptr, adv_ptr, w_ptr, ref_ptr, isw_ptr,
    loss_tok_ptr, logp_ptr, ent_ptr,
    grad_ptr, stride_gb, stride_gt,
    T, TG, V,
    clip_eps_low: tl.float64, clip_eps_high: tl.float64, dual_clip_c: tl.float64,
    kl_coef: tl.float64, entropy_coef: tl.float64, temperature: tl.float64,
    ACC: tl.constexpr, KL_EST: tl.constexpr, HAS_REF: tl.constexpr, HAS_ISW: tl.constexpr,
    HAS_DUAL: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Row r = b * TG + t (TG = Tl with a gradient, so that rows t >= T get their zeros,
    else T). grad_ptr/stride_g* address the gradient rows: a fresh contiguous buffer, or
    the logits themselves in place (each row is fully read in pass 1 before pass 2
    overwrites it, and no other program touches that row)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // TG
    t = row % TG
    in_seq = t < T
    idx = b * T + t
    valid = tl.load(mask_ptr + idx, mask=in_seq, other=0) != 0
    out_row = grad_ptr + b * stride_gb + t * stride_gt
    if valid:
        inv_temp = 1.0 / as_acc(temperature, ACC)
        in_row = logits_ptr + b * stride_lb + t * stride_lt
        tok = tl.load(tokens_ptr + idx)
        xmax, log_s, lse, ent = row_stats(in_row, V, inv_temp, ACC, True, BLOCK_V)
        logp = token_logp(in_row, tok, V, inv_temp, xmax, log_s, ACC)
        old = tl.load(old_ptr + idx).to(ACC)
        adv = tl.load(adv_ptr + idx).to(ACC)
        w = tl.load(w_ptr + idx).to(ACC)
        if HAS_REF:
            ref = tl.load(ref_ptr + idx).to(ACC)
        else:
            ref = tl.zeros([], ACC)
        if HAS_ISW:
            is_w = tl.load(isw_ptr + idx).to(ACC)
        else:
            is_w = tl.full([], 1.0, ACC)
        loss, dlogp, dent = token_loss(
            logp, ent, old, adv, ref, is_w, w,
            as_acc(clip_eps_low, ACC), as_acc(clip_eps_high, ACC), as_acc(dual_clip_c, ACC),
            as_acc(kl_coef, ACC), as_acc(entropy_coef, ACC), KL_EST, HAS_REF, HAS_DUAL)
        tl.store(loss_tok_ptr + idx, loss)
        tl.store(logp_ptr + idx, logp)
        tl.store(ent_ptr + idx, ent)
        if COMPUTE_GRAD:
            row_grad(in_row, out_row, V, tok, xmax, log_s, ent, dlogp, dent, inv_temp, ACC,
                     BLOCK_V)
    else:
        zero = tl.zeros([], ACC)
        tl.store(loss_tok_ptr + idx, zero, mask=in_seq)
        tl.store(logp_ptr + idx, zero, mask=in_seq)
        tl.store(ent_ptr + idx, zero, mask=in_seq)
        if COMPUTE_GRAD:
            row_zero(out_row, V, BLOCK_V)


_KEY = ["V", "COMPUTE_GRAD", "HAS_REF", "KL_EST"]
_PRUNE = {"early_config_prune": _config.prune_row_configs}
_ppo_loss_jit = triton.jit(_ppo_loss_kernel_fn)
_ppo_loss_kernel = triton.autotune(configs=_config.row_configs(), key=_KEY,
                                   prune_configs_by=_PRUNE)(_ppo_loss_jit)
# The in-place variant is NOT autotuned: trials overwrite the input, so the autotuner would
# have to clone the logits (restore_value) - a second [N, V] buffer, the very allocation
# inplace_backward exists to avoid. It runs the plain JIT kernel with a fixed config
# (_config.inplace_row_config).


def _launch(logits, tokens, mask, old_logprobs, advantages, weights, ref_logprobs,
            rollout_is_weights, clip_eps_low, clip_eps_high, dual_clip_c, kl_coef,
            kl_estimator, entropy_coef, temperature, grad, inplace):
    _check_logits(logits, tokens, mask)
    B, T = tokens.shape
    TL, V = logits.shape[1], logits.shape[2]
    acc = acc_dtype(logits)
    dev = logits.device
    for name, x in (("old_logprobs", old_logprobs), ("advantages", advantages),
                    ("weights", weights), ("ref_logprobs", ref_logprobs),
                    ("rollout_is_weights", rollout_is_weights)):
        if x is not None:
            check_per_token(name, x, (B, T), acc, dev)
    check_kl_estimator(kl_estimator)
    loss_tok = torch.empty((B, T), dtype=acc, device=dev)
    logp = torch.empty((B, T), dtype=acc, device=dev)
    ent = torch.empty((B, T), dtype=acc, device=dev)
    compute_grad = grad is not None
    rows = B * (TL if compute_grad else T)
    if rows > 0:
        kernel, launch = _ppo_loss_kernel, {}
        if inplace:
            kernel, launch = _ppo_loss_jit, _config.inplace_row_config(V)
        g = grad if compute_grad else logits
        wrap_triton(kernel)[(rows,)](
            logits, logits.stride(0), logits.stride(1),
            tokens, mask, old_logprobs, advantages, weights,
            ref_logprobs if ref_logprobs is not None else old_logprobs,
            rollout_is_weights if rollout_is_weights is not None else old_logprobs,
            loss_tok, logp, ent,
            g, g.stride(0), g.stride(1),
            T, TL if compute_grad else T, V,
            float(clip_eps_low), float(clip_eps_high), float(dual_clip_c), float(kl_coef),
            float(entropy_coef), float(temperature),
            ACC=tl_acc(acc), KL_EST=int(kl_estimator), HAS_REF=ref_logprobs is not None,
            HAS_ISW=rollout_is_weights is not None, HAS_DUAL=float(dual_clip_c) > 0.0,
            COMPUTE_GRAD=compute_grad, **launch)
    # sum(w * loss_tok) over [B, T] in a deterministic order (no atomics): this reads
    # 8 bytes per token, nothing next to the [B, T, V] sweep.
    loss = torch.dot(weights.reshape(-1), loss_tok.reshape(-1))
    return loss, loss_tok, logp, ent


def ppo_loss_fwd(logits, tokens, mask, old_logprobs, advantages, weights, ref_logprobs,
                 rollout_is_weights, clip_eps_low, clip_eps_high, dual_clip_c, kl_coef,
                 kl_estimator, entropy_coef, temperature, compute_grad):
    """(loss, loss_tok, logprobs, entropy, dlogits); dlogits has numel 0 unless
    compute_grad."""
    grad = (torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            if compute_grad else torch.empty((0,), dtype=logits.dtype, device=logits.device))
    loss, loss_tok, logp, ent = _launch(
        logits, tokens, mask, old_logprobs, advantages, weights, ref_logprobs,
        rollout_is_weights, clip_eps_low, clip_eps_high, dual_clip_c, kl_coef, kl_estimator,
        entropy_coef, temperature, grad if compute_grad else None, inplace=False)
    return loss, loss_tok, logp, ent, grad


def ppo_loss_fwd_inplace(logits, tokens, mask, old_logprobs, advantages, weights,
                         ref_logprobs, rollout_is_weights, clip_eps_low, clip_eps_high,
                         dual_clip_c, kl_coef, kl_estimator, entropy_coef, temperature):
    """(loss, loss_tok, logprobs, entropy); the logits now hold dlogits (zeros on masked
    rows and rows t >= T), in their own dtype and strides."""
    return _launch(logits, tokens, mask, old_logprobs, advantages, weights, ref_logprobs,
                   rollout_is_weights, clip_eps_low, clip_eps_high, dual_clip_c, kl_coef,
                   kl_estimator, entropy_coef, temperature, logits, inplace=True)
