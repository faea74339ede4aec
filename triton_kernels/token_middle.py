"""The [B, T] middle of the two-phase path for the token-level policy losses on the device in
one launch: the Triton twin of the CPU op ppo_kernels::token_loss_grad
(csrc/cpu/token_middle.cpp; its contract in csrc/ops_host.cpp), in place of autograd
through the eager formulas (ppo_kernels/_torch_impl.py pg_terms, token_losses, aggregate:
about 40 small torch ops, each a kernel launch). It runs where the row statistics had to be
complete before any gradient: a kept set (sampling replay), a split vocabulary.

Per valid token, with the fused kernels' own formulas (_math.pg_term, kl_term):
pol = is_w pg(logp) + kl_coef kl(logp_kl - ref) (* rho with KL_BIAS), logp_kl the KL's
log-probs where given (sampling replay: the full ones, the ratio's being the kept set's),
else logp; loss = sum w pol - entropy_coef sum w_ent H. Outputs: dlogp (the ratio's logp;
with no logp_kl the KL's part too), dent, pol (0 where masked), the loss (0-d), and with
logp_kl its gradient dkl (else an empty [0]): the eager formulas' values up to the
rounding of their summation order (tests/test_token_middle.py).

One program per block of BLOCK positions of the flat [B * T]; the loss is the sum of the
programs' partials.
"""

import torch
import triton
import triton.language as tl

from . import _config
from ._math import (F_CLIP_EPS_HIGH, F_CLIP_EPS_LOW, F_DUAL_CLIP_C, F_ENTROPY_COEF,
                    F_KL_COEF, F_SAPO_TAU_NEG, F_SAPO_TAU_POS, as_acc, kl_term, pg_term)
from .logprobs import device_guard, middle_inputs, tl_acc
from .ppo_loss import check_loss_args
from ..spec import F, I

# the block of positions a program reads; small under the interpreter, so that the test
# shapes span several blocks
BLOCK = 8 if _config.INTERPRET else 1024


@triton.jit
def _token_middle_kernel(
    logp_ptr, lkl_ptr, ent_ptr, mask_ptr, old_ptr, adv_ptr, ref_ptr, isw_ptr, w_ptr, went_ptr,
    dlogp_ptr, dkl_ptr, dent_ptr, pol_ptr, part_ptr, N,
    clip_eps_low: tl.float64, clip_eps_high: tl.float64, dual_clip_c: tl.float64,
    kl_coef: tl.float64, entropy_coef: tl.float64, temperature: tl.float64,
    grad_scale: tl.float64, sapo_tau_pos: tl.float64, sapo_tau_neg: tl.float64,
    ACC: tl.constexpr, POLICY_LOSS: tl.constexpr, KL_EST: tl.constexpr,
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_ISW: tl.constexpr,
    HAS_WENT: tl.constexpr, HAS_DUAL: tl.constexpr, KL_BIAS: tl.constexpr,
    HAS_LKL: tl.constexpr, BLOCK: tl.constexpr,
):
    FS = (clip_eps_low, clip_eps_high, dual_clip_c, kl_coef, entropy_coef, temperature,
          grad_scale, sapo_tau_pos, sapo_tau_neg)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = i < N
    m = (tl.load(mask_ptr + i, mask=inb, other=0) != 0) & inb
    eps_low, eps_high = as_acc(FS[F_CLIP_EPS_LOW], ACC), as_acc(FS[F_CLIP_EPS_HIGH], ACC)
    dual_c, kc = as_acc(FS[F_DUAL_CLIP_C], ACC), as_acc(FS[F_KL_COEF], ACC)
    ec = as_acc(FS[F_ENTROPY_COEF], ACC)
    tau_pos, tau_neg = as_acc(FS[F_SAPO_TAU_POS], ACC), as_acc(FS[F_SAPO_TAU_NEG], ACC)
    lp = tl.load(logp_ptr + i, mask=m, other=0.0)
    if HAS_OLD:
        old = tl.load(old_ptr + i, mask=m, other=0.0)
    else:
        old = lp  # on-policy: rho = exp(logp - sg(logp)) = 1, d rho / d logp = 1
    adv = tl.load(adv_ptr + i, mask=m, other=0.0)
    w = tl.load(w_ptr + i, mask=m, other=0.0)
    pg, dpg, rho, dratio = pg_term(lp, old, adv, eps_low, eps_high, dual_c, tau_pos, tau_neg,
                                   HAS_DUAL, POLICY_LOSS)
    if HAS_ISW:
        isw = tl.load(isw_ptr + i, mask=m, other=0.0)
        term = isw * pg
        d = isw * dpg
    else:
        term = pg
        d = dpg
    dk = tl.zeros([BLOCK], ACC)
    if HAS_REF:
        if HAS_LKL:
            lk = tl.load(lkl_ptr + i, mask=m, other=0.0)
        else:
            lk = lp
        kl, dkl = kl_term(lk - tl.load(ref_ptr + i, mask=m, other=0.0), KL_EST)
        if KL_BIAS:  # kl * rho, rho differentiable in the ratio's logp
            term += kc * kl * rho
            d += kc * kl * dratio
            dk = kc * rho * dkl
        else:
            term += kc * kl
            dk = kc * dkl
    if not HAS_LKL:
        d += dk
    # a NaN term (a NaN input on a valid token) reaches the ratio's gradient, as
    # _torch_impl.token_losses's NaN * logp
    d = tl.where(term != term, term, d)
    tl.store(pol_ptr + i, tl.where(m, term, 0.0), mask=inb)
    tl.store(dlogp_ptr + i, tl.where(m, w * d, 0.0), mask=inb)
    if HAS_LKL:
        tl.store(dkl_ptr + i, tl.where(m, w * dk, 0.0), mask=inb)
    if HAS_WENT:
        we = tl.load(went_ptr + i, mask=m, other=0.0)
    else:
        we = w
    h = tl.load(ent_ptr + i, mask=m, other=0.0)
    part = tl.where(m, w * term, 0.0)
    # (no term at all for a coefficient of 0: 0 * NaN would be NaN)
    part -= tl.where(m, tl.where(ec != 0.0, ec * (we * h), 0.0), 0.0)
    tl.store(dent_ptr + i, tl.where(m, -ec * we, 0.0), mask=inb)
    tl.store(part_ptr + tl.program_id(0), tl.sum(part, axis=0))


def token_loss_grad(logp, ent, mask, old, adv, ref, isw, w, w_ent, scalars, codes,
                    kl_logprobs=None):
    """(dlogp, dent, loss, pol, dkl) of the module docstring, as the CPU op's schema:
    logp, ent, the per-token inputs [B, T] of the accumulation dtype (old None: on-policy;
    ref, isw, w_ent, kl_logprobs optional), mask bool [B, T]; scalars / codes the loss
    options in the slot order of ppo_kernels/spec.py with the id of a token-level policy
    loss. Eager launches only (the two-phase path calls it outside tracing). Raises
    ValueError for another policy loss, bad slots or an input of another shape than logp's,
    TypeError for one of another dtype (logprobs.middle_inputs)."""
    fs, codes = check_loss_args(scalars, codes)
    logp, mask, (ent, adv, w, *opt) = middle_inputs(logp, mask, (
        ("entropy", ent), ("advantages", adv), ("weights", w), ("old_logprobs", old),
        ("ref_logprobs", ref), ("rollout_is_weights", isw), ("entropy_weights", w_ent),
        ("kl_logprobs", kl_logprobs)))
    B, T = logp.shape
    acc = logp.dtype
    dlogp, dent, pol = (torch.empty_like(logp) for _ in range(3))
    dkl = torch.empty_like(logp) if kl_logprobs is not None else logp.new_empty((0,))
    n = B * T
    if n == 0:
        return dlogp, dent, logp.new_zeros(()), pol, dkl
    grid = triton.cdiv(n, BLOCK)
    part = torch.empty((grid,), dtype=acc, device=logp.device)
    stand_in = lambda x: logp if x is None else x  # noqa: E731 (never read)
    with device_guard(logp):
        _token_middle_kernel[(grid,)](
            logp, stand_in(opt[4]), ent, mask, stand_in(opt[0]), adv, stand_in(opt[1]),
            stand_in(opt[2]), w, stand_in(opt[3]), dlogp, dkl if dkl.numel() else dlogp,
            dent, pol, part, n, *fs, ACC=tl_acc(acc), POLICY_LOSS=codes[I["policy_loss"]],
            KL_EST=codes[I["kl_estimator"]], HAS_OLD=old is not None, HAS_REF=ref is not None,
            HAS_ISW=isw is not None, HAS_WENT=w_ent is not None,
            HAS_DUAL=fs[F["dual_clip_c"]] > 0.0, KL_BIAS=bool(codes[I["kl_bias_correction"]]),
            HAS_LKL=kl_logprobs is not None, BLOCK=BLOCK)
    return dlogp, dent, part.sum(), pol, dkl
