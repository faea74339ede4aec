"""Sampling replay's kept mass in one launch (docs/SAMPLING.md): the Triton twin of
ppo_kernels/kept.py kept_mass for the device path (ppo_kernels/_backends.device_eager),
where the eager formula is seven small torch ops, each a kernel launch.

    mass = exp(lse_kept - lse_full) on valid positions, 0 on masked ones, with
    lse_kept = kept_max / temperature + kept_log_sum, lse_full = row_max / temperature +
    log_sum (the kept set's and the whole row's log-sum-exp in units of z = x / T).

Inputs: kept_max, kept_log_sum, row_max, log_sum [B, T] of the accumulation dtype ACC
(float32 or float64, contiguous); mask bool [B, T]; temperature a number > 0 or the
per-row [B, T] tensor of ACC (positive on valid rows: the Python layer checks it). Output:
mass [B, T] of ACC. Each division one correctly rounded ACC division (div_rn) and each sum
one ACC rounding, as the eager formula's; the exponential is _math.exp_acc (within about
1e-7 relative of torch's in float32; float64's libdevice exp).
"""

import torch
import triton
import triton.language as tl

from . import _config
from ._math import as_acc, div_rn, exp_acc
from .logprobs import device_guard, tl_acc

# positions a program handles; small under the interpreter, so the tests span blocks
BLOCK = 8 if _config.INTERPRET else 1024


@triton.jit
def _kept_mass_kernel(kmax_ptr, kls_ptr, rmax_ptr, ls_ptr, mask_ptr, temps_ptr, out_ptr, N,
                      temperature: tl.float64, ACC: tl.constexpr, ROW_TEMP: tl.constexpr,
                      BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < N
    valid = live & (tl.load(mask_ptr + offs, mask=live, other=0) != 0)
    if ROW_TEMP:
        t = tl.load(temps_ptr + offs, mask=valid, other=1.0).to(ACC)
    else:
        t = as_acc(temperature, ACC)
    kmax = tl.load(kmax_ptr + offs, mask=valid, other=0.0).to(ACC)
    kls = tl.load(kls_ptr + offs, mask=valid, other=0.0).to(ACC)
    rmax = tl.load(rmax_ptr + offs, mask=valid, other=0.0).to(ACC)
    ls = tl.load(ls_ptr + offs, mask=valid, other=0.0).to(ACC)
    lse_kept = div_rn(kmax, t, ACC) + kls
    lse_full = div_rn(rmax, t, ACC) + ls
    mass = tl.where(valid, exp_acc(lse_kept - lse_full), 0.0).to(ACC)
    tl.store(out_ptr + offs, mass, mask=live)


def kept_mass(kept_max, kept_log_sum, row_max, log_sum, temperature, mask):
    """mass [B, T] (module docstring); the signature of ppo_kernels/kept.py kept_mass."""
    acc = row_max.dtype
    per_row = isinstance(temperature, torch.Tensor)
    ins = [v.contiguous() for v in (kept_max, kept_log_sum, row_max, log_sum)]
    temps = temperature.to(acc).contiguous() if per_row else ins[0]
    out = torch.empty_like(ins[2])
    n = out.numel()
    if n:
        with device_guard(row_max):
            _config.wrap(_kept_mass_kernel)[(triton.cdiv(n, BLOCK),)](
                *ins, mask.contiguous(), temps, out, n,
                1.0 if per_row else float(temperature), ACC=tl_acc(acc), ROW_TEMP=per_row,
                BLOCK=BLOCK)
    return out
