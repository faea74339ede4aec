"""GSPO's [B, T] middle on the device in one launch: the loss of the sequence-ratio losses
(gspo, gspo-token) and its gradient in the per-token log-probs and entropies, which the
two-phase path (ppo_kernels/_two_phase.py middle_grad) otherwise differentiates by
autograd through the eager formulas (ppo_kernels/_torch_impl.py pg_terms, token_losses,
aggregate): about 60 small torch ops, each a kernel launch. Its C++ twin on the CPU is
csrc/cpu/seq_loss.cpp.

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5 and 10): per sequence
the ratio s = exp(clamp(mean_t (logp_t - old_t), -20, 20)) over its valid tokens, and per
valid token the clipped surrogate of s (PPO's, Schulman et al. 2017, eq. 7; the dual clip,
Ye et al. 2020, eq. 5), times the rollout weight is_w, plus kl_coef times the KL estimate
against the reference (times the ratio with kl_bias_correction). gspo: every token's
ratio is s, differentiable through every valid log-prob of the sequence (d s / d logp_t =
s / n); gspo-token: the value s with the gradient s on the own token only. Neither has a
gradient where the sequence's mean log-ratio was clamped. The loss is
sum_t w_t pol_t - entropy_coef sum_t w_ent_t H_t over the valid tokens.

Inputs [B, T] contiguous of the accumulation dtype ACC: logp, ent, old (None: on-policy,
old = sg(logp): s = 1 with its gradient), adv, ref, isw, w, w_ent (the last four optional
but w), mask bool; scalars / codes the loss options in the slot order of
ppo_kernels/spec.py. Outputs: dlogp, dent (d loss / d logp, d loss / d H; 0 where
masked), pol (the policy part of each token's loss), loss (0-d): the eager formulas'
values up to the summation order, NaN where they give NaN (tests/test_seq_loss.py).
One program per sequence; the loss is the sum of the sequences' partials.
"""

import torch
import triton
import triton.language as tl

from . import _config
from ..spec import POLICY_LOSSES, F, I
from ._math import LOG_RATIO_CLAMP, as_acc, clampv, exp_acc, kl_term
from .logprobs import check_kl_estimator, check_slots, device_guard, middle_inputs, tl_acc

# the policy losses this kernel computes (ppo_kernels/spec.py POLICY_LOSSES ids)
SEQ_LOSSES = ("gspo", "gspo-token")
# the block of tokens a program reads at once; small under the interpreter, so that the
# test shapes span several blocks
BLOCK = 8 if _config.INTERPRET else 1024


@triton.jit
def _pg(s, adv, live, eps_low, eps_high, dual_c, HAS_DUAL: tl.constexpr):
    """(pg, d pg / d s) of the clipped surrogate of ratio s at advantage adv, as autograd
    differentiates _torch_impl._clip_surrogate: the unclipped branch on ties; through the
    clipped branch where s lies in the band (a tie but for a NaN advantage); 0 where the
    dual clip's cap is the value."""
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    unclipped = -s * adv
    clipped = -clampv(s, lo, hi) * adv
    active = unclipped >= clipped
    pg = tl.where(active, unclipped, clipped)
    dpg = tl.where(active, -adv, tl.where(clampv(s, lo, hi) == s, -adv, 0.0))
    if HAS_DUAL:
        cap = -dual_c * adv
        dual = (adv < 0.0) & (pg > cap)
        pg = tl.where(dual, cap, pg)
        dpg = tl.where(dual, 0.0, dpg)
    return pg, tl.where(live, dpg, 0.0)


@triton.jit
def _seq_loss_kernel(
    logp_ptr, ent_ptr, mask_ptr, old_ptr, adv_ptr, ref_ptr, isw_ptr, w_ptr, went_ptr,
    dlogp_ptr, dent_ptr, pol_ptr, part_ptr, T,
    clip_eps_low: tl.float64, clip_eps_high: tl.float64, dual_clip_c: tl.float64,
    kl_coef: tl.float64, entropy_coef: tl.float64,
    ACC: tl.constexpr, TOKEN: tl.constexpr, KL_EST: tl.constexpr, HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr, HAS_ISW: tl.constexpr, HAS_WENT: tl.constexpr,
    HAS_DUAL: tl.constexpr, KL_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    row = b * T
    eps_low, eps_high = as_acc(clip_eps_low, ACC), as_acc(clip_eps_high, ACC)
    dual_c, kc = as_acc(dual_clip_c, ACC), as_acc(kl_coef, ACC)
    ec = as_acc(entropy_coef, ACC)
    # pass 1: the sequence's mean log-ratio
    lsum = tl.zeros([BLOCK], ACC)
    nv = tl.zeros([BLOCK], tl.int32)
    for start in range(0, T, BLOCK):
        t = start + offs
        m = tl.load(mask_ptr + row + t, mask=t < T, other=0) != 0
        lp = tl.load(logp_ptr + row + t, mask=m, other=0.0)
        if HAS_OLD:
            old = tl.load(old_ptr + row + t, mask=m, other=0.0)
        else:
            old = lp  # (on-policy: 0, NaN for a NaN logp, as logp - sg(logp))
        lsum += tl.where(m, lp - old, 0.0)
        nv += m.to(tl.int32)
    n = tl.maximum(tl.sum(nv, axis=0), 1).to(ACC)
    ls_raw = tl.sum(lsum, axis=0) / n
    ls = clampv(ls_raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    live = ls == ls_raw  # (not clamped, not NaN)
    s = exp_acc(ls)
    # pass 2: each token's terms; g_seq = sum_t d loss / d s_t (gspo: s is every token's)
    g_seq = tl.zeros([BLOCK], ACC)
    part = tl.zeros([BLOCK], ACC)
    for start in range(0, T, BLOCK):
        t = start + offs
        m = tl.load(mask_ptr + row + t, mask=t < T, other=0) != 0
        lp = tl.load(logp_ptr + row + t, mask=m, other=0.0)
        adv = tl.load(adv_ptr + row + t, mask=m, other=0.0)
        w = tl.load(w_ptr + row + t, mask=m, other=0.0)
        pg, dpg = _pg(s, adv, live, eps_low, eps_high, dual_c, HAS_DUAL)
        if HAS_ISW:
            isw = tl.load(isw_ptr + row + t, mask=m, other=0.0)
            pol = isw * pg
            d_s = isw * dpg
        else:
            pol = pg
            d_s = dpg
        d_own = tl.zeros([BLOCK], ACC)
        if HAS_REF:
            kl, dkl = kl_term(lp - tl.load(ref_ptr + row + t, mask=m, other=0.0), KL_EST)
            if KL_BIAS:
                pol += kc * kl * s
                d_s += tl.where(live, kc * kl, 0.0)
                d_own = kc * s * dkl
            else:
                pol += kc * kl
                d_own = kc * dkl
        d_s = w * d_s
        d_own = w * d_own
        # a NaN term (a NaN input on a valid token) reaches its own gradient
        # (_torch_impl.token_losses adds NaN * logp there)
        d_own = tl.where(pol != pol, pol, d_own)
        part += tl.where(m, w * pol, 0.0)
        if TOKEN:
            tl.store(dlogp_ptr + row + t, tl.where(m, d_s * s + d_own, 0.0), mask=t < T)
        else:
            g_seq += tl.where(m, d_s, 0.0)
            tl.store(dlogp_ptr + row + t, tl.where(m, d_own, 0.0), mask=t < T)
        tl.store(pol_ptr + row + t, tl.where(m, pol, 0.0), mask=t < T)
        if HAS_WENT:
            we = tl.load(went_ptr + row + t, mask=m, other=0.0)
        else:
            we = w
        h = tl.load(ent_ptr + row + t, mask=m, other=0.0)
        # (no term at all for a coefficient of 0: 0 * NaN would be NaN)
        part -= tl.where(m, tl.where(ec != 0.0, ec * (we * h), 0.0), 0.0)
        tl.store(dent_ptr + row + t, tl.where(m, -ec * we, 0.0), mask=t < T)
    tl.store(part_ptr + b, tl.sum(part, axis=0))
    if not TOKEN:  # pass 3: every valid token's share of d loss / d s, d s / d logp = s / n
        g = tl.sum(g_seq, axis=0) * (s / n)
        for start in range(0, T, BLOCK):
            t = start + offs
            m = tl.load(mask_ptr + row + t, mask=t < T, other=0) != 0
            d = tl.load(dlogp_ptr + row + t, mask=m, other=0.0)
            tl.store(dlogp_ptr + row + t, d + g, mask=m)


def seq_loss_grad(logp, ent, mask, old, adv, ref, isw, w, w_ent, scalars, codes):
    """(dlogp, dent, loss, pol) of the module docstring. scalars / codes: the loss options
    in the slot order of ppo_kernels/spec.py (LossSpec.kernel_args), codes' policy_loss one
    of SEQ_LOSSES. Eager launches only (the two-phase path calls it outside tracing).
    Raises ValueError for another policy loss or an input of another shape than logp's,
    TypeError for one of another dtype (logprobs.middle_inputs)."""
    check_slots(scalars, codes)
    pl = int(codes[I["policy_loss"]])
    if pl not in [POLICY_LOSSES.index(x) for x in SEQ_LOSSES]:
        raise ValueError(f"policy_loss: expected the id of one of {SEQ_LOSSES}, got {pl}")
    check_kl_estimator(codes[I["kl_estimator"]])
    logp, mask, (ent, adv, w, *opt) = middle_inputs(logp, mask, (
        ("entropy", ent), ("advantages", adv), ("weights", w), ("old_logprobs", old),
        ("ref_logprobs", ref), ("rollout_is_weights", isw), ("entropy_weights", w_ent)))
    B, T = logp.shape
    acc = logp.dtype
    dlogp, dent, pol = (torch.empty_like(logp) for _ in range(3))
    part = torch.empty((B,), dtype=acc, device=logp.device)
    if B * T == 0:
        return dlogp, dent, logp.new_zeros(()), pol
    fs = [float(x) for x in scalars]
    with device_guard(logp):
        _seq_loss_kernel[(B,)](
            logp, ent, mask, *(x if x is not None else logp for x in opt[:1]), adv,
            *(x if x is not None else logp for x in opt[1:3]), w,
            opt[3] if opt[3] is not None else w, dlogp, dent, pol, part, T,
            *(fs[F[k]] for k in ("clip_eps_low", "clip_eps_high", "dual_clip_c", "kl_coef",
                                 "entropy_coef")),
            ACC=tl_acc(acc), TOKEN=SEQ_LOSSES[1] == POLICY_LOSSES[pl],
            KL_EST=int(codes[I["kl_estimator"]]), HAS_OLD=old is not None,
            HAS_REF=ref is not None, HAS_ISW=isw is not None, HAS_WENT=w_ent is not None,
            HAS_DUAL=fs[F["dual_clip_c"]] > 0.0, KL_BIAS=bool(codes[I["kl_bias_correction"]]),
            BLOCK=BLOCK)
    return dlogp, dent, part.sum(), pol
