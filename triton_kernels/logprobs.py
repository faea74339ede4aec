"""Token log-probabilities (and entropy) from logits, forward and backward, in Triton.

Shapes and dtypes (csrc/ops.cpp, the contract): logits [B, Tl, V], stride(2) == 1, any
strides on B and Tl (read in place, never copied), Tl >= T; tokens int64 [B, T]; mask bool
[B, T]; per-token tensors [B, T] contiguous, of the accumulation dtype ACC (float64 for
float64 logits, else float32). One program per row (token position), on grid axis 0 only
(2^31 - 1 programs; axes 1/2 would stop at 65,535). Masked rows never read their token.

Math (DESIGN.md; docs/DESIGN.md, Precision): z = logits / temperature, with the row's raw max
row_max and d_v = (x_v - row_max) / temperature, log_sum = log sum exp(d) (computed as
log1p of the non-top mass), logp = d[token] - log_sum, H = log_sum - sum p d;
d/dz of sum(g_logp * logp + g_H * H) is g_logp (onehot - p) - g_H p (log p + H), divided by
the temperature for d/dlogits. The forward returns (row_max, log_sum) for the backward.
"""

import contextlib

import torch
import triton
import triton.language as tl

from . import _config
from ..spec import FLOAT_SLOTS, INT_SLOTS
from ._math import (as_acc, kl_term, row_grad, row_stats, row_zero, token_col, token_logit,
                    token_logp)


def acc_dtype(logits):
    """Accumulation dtype of per-token tensors for these logits (float64 stays float64)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def tl_acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def device_guard(t):
    """Context of a launch on t's device: triton launches on the current CUDA
    device, so tensors on cuda:1 while device 0 is current need the guard. CPU tensors
    (the interpreter) need none."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def inv_temperature(temperature, acc):
    """1 / temperature in double on the host, the one rounding to ACC left to the kernel
    (not a 2-ulp float32 division on the device). A temperature that is not
    positive or whose reciprocal overflows ACC is a ValueError (the Python layer,
    ppo_kernels/_checks.py, rejects those first; this guards the raw ops)."""
    t = float(temperature)
    limit = torch.finfo(acc).max
    if not (t > 0.0) or t == float("inf") or 1.0 / t > limit:
        raise ValueError(f"temperature: expected a positive finite number whose reciprocal "
                         f"fits {acc}, got {temperature}")
    return 1.0 / t


def inv_temperatures(temperatures, shape, acc, device):
    """The per-row 1 / temperature [B, T] of ACC from the ops' optional `temperatures`
    (csrc/ops.cpp): taken in float64 and rounded once to ACC, as inv_temperature's number
    is, so that equal values give the scalar call's bits. Returns (tensor, True), or
    (None, False) without them. A bad value on a valid row is the Python layer's to reject
    (ppo_kernels/_checks.py temperature_values): this is a device tensor, and reading it
    here would stall the host."""
    if temperatures is None:
        return None, False
    check_per_token("temperatures", temperatures, shape, acc, device)
    return temperatures.double().reciprocal().to(acc).contiguous(), True


# Autotuning is keyed on V and the flags, never on the row count: the block size sets the
# order of a row's reductions and so its bits, and a key with the row count could pick a
# different BLOCK_V for a bigger batch, breaking batch invariance (DESIGN.md, Batch invariance
# asked for a row-count bucket - rejected for this reason).
@triton.autotune(configs=_config.row_configs(), key=["V", "NEED_ENT", "SCORE"],
                 prune_configs_by={"early_config_prune": _config.prune_row_configs})
@triton.jit
def logprobs_fwd_kernel(
    logits_ptr, stride_lb, stride_lt,
    tokens_ptr, mask_ptr,
    logp_ptr, ent_ptr, max_ptr, lsum_ptr,
    ref_ptr, kl_ptr, rew_ptr, invt_ptr,
    T, V,
    inv_temp: tl.float64, kl_coef: tl.float64,
    ACC: tl.constexpr, NEED_ENT: tl.constexpr, SCORE: tl.constexpr, KL_EST: tl.constexpr,
    ROW_TEMP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Row r = b * T + t: logp, (entropy), row_max, log_sum of token (b, t); 0 on masked
    rows. ROW_TEMP: row r's 1 / temperature is invt_ptr[r] (inv_temperatures), else
    inv_temp.

    SCORE (score_rollout's first half): kl = kl_term(logp - ref) and the KL part of the
    reward, -kl_coef * kl, both 0 on masked rows, instead of row_max / log_sum.
    """
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
        x_tok = token_logit(in_row, tl.load(tokens_ptr + row), V, ACC)
        row_max, log_sum, ent = row_stats(in_row, V, inv, ACC, NEED_ENT, BLOCK_V)
        logp = token_logp(x_tok, row_max, log_sum, inv)
        tl.store(logp_ptr + row, logp)
        if NEED_ENT:
            tl.store(ent_ptr + row, ent)
        if SCORE:
            kl, _ = kl_term(logp - tl.load(ref_ptr + row).to(ACC), KL_EST)
            tl.store(kl_ptr + row, kl)
            tl.store(rew_ptr + row, -as_acc(kl_coef, ACC) * kl)
        else:
            tl.store(max_ptr + row, row_max)
            tl.store(lsum_ptr + row, log_sum)
    else:
        zero = tl.zeros([], ACC)
        tl.store(logp_ptr + row, zero)
        if NEED_ENT:
            tl.store(ent_ptr + row, zero)
        if SCORE:
            tl.store(kl_ptr + row, zero)
            tl.store(rew_ptr + row, zero)
        else:
            tl.store(max_ptr + row, zero)
            tl.store(lsum_ptr + row, zero)


@triton.autotune(configs=_config.row_configs(), key=["V", "HAS_GENT"],
                 prune_configs_by={"early_config_prune": _config.prune_row_configs})
@triton.jit
def _logprobs_bwd_kernel(
    logits_ptr, stride_lb, stride_lt,
    tokens_ptr, mask_ptr, max_ptr, lsum_ptr, ent_ptr, glogp_ptr, gent_ptr,
    grad_ptr, invt_ptr,
    T, TL, V,
    inv_temp: tl.float64,
    ACC: tl.constexpr, HAS_GENT: tl.constexpr, ROW_TEMP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Row r = b * Tl + t of dlogits [B, Tl, V] (contiguous): the gradient of
    sum(g_logp * logp + g_H * H) on valid rows, zeros on masked rows and rows t >= T
    (writing those zeros here saves a separate memset pass over [B, Tl, V]).

    log p_v = (x_v - row_max) inv_temp - log_sum, from the forward's row_max and log_sum
    (rebuilding it from lse alone, x_v inv_temp - lse, loses the digits of the
    max entry at small temperatures or huge logits: p = inf at T = 1e-10)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // TL
    t = row % TL
    out_row = grad_ptr + row * V
    in_seq = t < T
    tok_idx = b * T + t
    valid = tl.load(mask_ptr + tok_idx, mask=in_seq, other=0) != 0
    if valid:
        if ROW_TEMP:
            inv = tl.load(invt_ptr + tok_idx).to(ACC)
        else:
            inv = as_acc(inv_temp, ACC)
        in_row = logits_ptr + b * stride_lb + t * stride_lt
        tok = tl.load(tokens_ptr + tok_idx)
        x_tok = token_logit(in_row, tok, V, ACC)
        row_max = tl.load(max_ptr + tok_idx).to(ACC)
        log_sum = tl.load(lsum_ptr + tok_idx).to(ACC)
        dlogp = tl.load(glogp_ptr + tok_idx).to(ACC)
        if HAS_GENT:
            ent = tl.load(ent_ptr + tok_idx).to(ACC)
            dent = tl.load(gent_ptr + tok_idx).to(ACC)
        else:
            ent = tl.zeros([], ACC)
            dent = tl.zeros([], ACC)
        logp_tok = token_logp(x_tok, row_max, log_sum, inv)
        row_grad(in_row, out_row, V, token_col(tok, V), logp_tok, row_max, log_sum, ent,
                 dlogp, dent, inv, ACC, BLOCK_V)
    else:
        row_zero(out_row, V, BLOCK_V)


def check_logits(logits, tokens, mask):
    """Shape/dtype/layout checks the kernels rely on (cheap: no device sync)."""
    if logits.dim() != 3:
        raise ValueError(f"logits: expected [B, Tl, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"logits: expected a float32/bfloat16/float16/float64 tensor, "
                        f"got {logits.dtype}")
    if logits.shape[2] == 0:
        raise ValueError("logits: expected a non-empty vocabulary, got V = 0")
    if logits.shape[2] > 1 and logits.stride(2) != 1:
        raise ValueError(f"logits: expected stride(2) == 1, got strides {logits.stride()}")
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise TypeError(f"tokens: expected int64 [B, T], got {tokens.dtype} "
                        f"{tuple(tokens.shape)}")
    B, T = tokens.shape
    if logits.shape[0] != B or logits.shape[1] < T:
        raise ValueError(f"logits: expected [B={B}, Tl>={T}, V], got {tuple(logits.shape)}")
    if mask.dtype != torch.bool or tuple(mask.shape) != (B, T):
        raise TypeError(f"mask: expected bool [{B}, {T}], got {mask.dtype} "
                        f"{tuple(mask.shape)}")
    for name, x in (("tokens", tokens), ("mask", mask)):
        if not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
        if x.device != logits.device:
            raise ValueError(f"{name}: expected device {logits.device}, got {x.device}")


def check_per_token(name, x, shape, dtype, device):
    """A per-token (or per-sequence) tensor: given shape, accumulation dtype, contiguous."""
    if x.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device}, got {x.device}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def middle_inputs(logp, mask, named):
    """The [B, T] middle launchers' inputs (seq_loss.py, token_middle.py) checked as the C++
    ops check them (csrc/cpu/middle_args.h): logp float32 or float64 [B, T], mask bool of
    its shape, each (name, tensor or None) of named of logp's dtype, shape and device.
    Returns (logp, mask, [each tensor or None]) contiguous; raises ValueError / TypeError
    naming the argument."""
    if logp.dim() != 2 or logp.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"logprobs: expected float32 or float64 [B, T], got {logp.dtype} "
                         f"{list(logp.shape)}")
    if mask.dtype != torch.bool or mask.shape != logp.shape:
        raise ValueError(f"mask: expected bool {list(logp.shape)}, got {mask.dtype} "
                         f"{list(mask.shape)}")
    out = []
    for name, x in named:
        if x is not None:
            if x.shape != logp.shape:
                raise ValueError(f"{name}: expected shape {list(logp.shape)}, got "
                                 f"{list(x.shape)}")
            if x.dtype != logp.dtype:
                raise TypeError(f"{name}: expected dtype {logp.dtype}, got {x.dtype}")
            if x.device != logp.device:
                raise ValueError(f"{name}: expected device {logp.device}, got {x.device}")
            x = x.contiguous()
        out.append(x)
    return logp.contiguous(), mask.contiguous(), out


def check_slots(scalars, codes):
    """scalars / codes as the loss ops take them: the slots of ppo_kernels/spec.py
    (FLOAT_SLOTS numbers, INT_SLOTS integers, kl_bias_correction 0 or 1), or a ValueError
    (as the C++ ops' ppo::slot_params)."""
    if len(scalars) != len(FLOAT_SLOTS) or len(codes) != len(INT_SLOTS):
        raise ValueError(f"scalars / codes: expected {len(FLOAT_SLOTS)} numbers and "
                         f"{len(INT_SLOTS)} integers in the slot order of ppo_kernels/spec.py, "
                         f"got {len(scalars)} and {len(codes)}")
    bias = codes[INT_SLOTS.index("kl_bias_correction")]
    if isinstance(bias, bool) or int(bias) not in (0, 1):
        raise ValueError(f"kl_bias_correction: expected 0 or 1, got {bias}")


def check_kl_estimator(kl_estimator):
    """kl_estimator as the ops take it (csrc/ppo_math.h KlEstimator): 0 (k1), 1 (k2),
    2 (k3), 3 (abs), 4 (k1+) or 5 (k3+)."""
    if isinstance(kl_estimator, bool) or int(kl_estimator) not in range(6):
        raise ValueError(f"kl_estimator: expected 0 (k1), 1 (k2), 2 (k3), 3 (abs), 4 (k1+) "
                         f"or 5 (k3+), got {kl_estimator}")


def token_logprobs_fwd(logits, tokens, mask, temperature, return_entropy, temperatures=None):
    """(logprobs, entropy, row_max, log_sum), each [B, T] of ACC, 0 on masked rows;
    entropy has numel 0 unless return_entropy.

    row_max is the raw (un-tempered) max logit of the row, log_sum =
    log sum_v exp((x_v - row_max) / temperature): what token_logprobs_bwd needs.
    temperatures: the optional per-row temperature [B, T] of ACC (the float is then unread).
    """
    check_logits(logits, tokens, mask)
    B, T = tokens.shape
    V = logits.shape[2]
    acc = acc_dtype(logits)
    inv = inv_temperature(temperature, acc)
    dev = logits.device
    invt, row_temp = inv_temperatures(temperatures, (B, T), acc, dev)
    logp = torch.empty((B, T), dtype=acc, device=dev)
    row_max = torch.empty((B, T), dtype=acc, device=dev)
    log_sum = torch.empty((B, T), dtype=acc, device=dev)
    ent = (torch.empty((B, T), dtype=acc, device=dev) if return_entropy
           else torch.empty((0,), dtype=acc, device=dev))
    if B * T > 0:
        with device_guard(logits):
            _config.wrap(logprobs_fwd_kernel)[(B * T,)](
                logits, logits.stride(0), logits.stride(1), tokens, mask,
                logp, ent if return_entropy else logp, row_max, log_sum,
                logp, logp, logp,  # ref / kl / rewards: unused without SCORE
                invt if row_temp else logp,
                T, V, inv, 0.0,
                ACC=tl_acc(acc), NEED_ENT=bool(return_entropy), SCORE=False, KL_EST=0,
                ROW_TEMP=row_temp)
    return logp, ent, row_max, log_sum


def token_logprobs_bwd(grad_logprobs, grad_entropy, logits, tokens, mask, row_max, log_sum,
                       entropy, temperature, temperatures=None):
    """dlogits [B, Tl, V] (logits' dtype, contiguous) of
    sum(grad_logprobs * logp + grad_entropy * H); grad_entropy may be None. row_max,
    log_sum (and entropy, with grad_entropy) [B, T] of ACC: token_logprobs_fwd's."""
    check_logits(logits, tokens, mask)
    B, T = tokens.shape
    TL, V = logits.shape[1], logits.shape[2]
    acc = acc_dtype(logits)
    inv = inv_temperature(temperature, acc)
    invt, row_temp = inv_temperatures(temperatures, (B, T), acc, logits.device)
    for name, x in (("grad_logprobs", grad_logprobs), ("row_max", row_max),
                    ("log_sum", log_sum)):
        check_per_token(name, x, (B, T), acc, logits.device)
    has_gent = grad_entropy is not None
    if has_gent:
        check_per_token("grad_entropy", grad_entropy, (B, T), acc, logits.device)
        check_per_token("entropy", entropy, (B, T), acc, logits.device)
    grad = torch.empty((B, TL, V), dtype=logits.dtype, device=logits.device)
    if B * TL > 0:
        with device_guard(logits):
            _config.wrap(_logprobs_bwd_kernel)[(B * TL,)](
                logits, logits.stride(0), logits.stride(1), tokens, mask, row_max, log_sum,
                entropy if has_gent else log_sum, grad_logprobs,
                grad_entropy if has_gent else grad_logprobs,
                grad, invt if row_temp else log_sum, T, TL, V, inv,
                ACC=tl_acc(acc), HAS_GENT=has_gent, ROW_TEMP=row_temp)
    return grad
