"""Generalised advantage estimation and the rollout scoring pass, in Triton.

GAE (Schulman et al. 2016, eq. 16) with masked positions transparent (DESIGN.md):
    delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next
where V_next, A_next are those of the next VALID position (bootstrap_values[b], 0 after
the last one); masked positions carry both across unchanged, and get 0 in both outputs.
lam_per_seq [B] (VAPO's length-adaptive lambda) replaces lam sequence by sequence; with
value_lam the returns are the GAE of value_lam (the same maps with d = gamma * value_lam,
a second associative scan) + V (VAPO's decoupled GAE), else A + V.

Scan formulation. Going right to left, the state (V_next, A_next) goes through one affine
map per position: a valid one sends it to (V_t, gamma V_next + gamma lam A_next + r_t - V_t),
a masked one is the identity. Such maps have the form
    (v, a) -> (alpha v + u,  c v + d a + w)
and are closed under composition, so one program per sequence reduces a chunk of
BLOCK_T positions with a single tl.associative_scan over the 5-tuples (alpha, c, d, u, w)
instead of T dependent steps, then applies the scanned maps to the state carried in from
the chunk to the right. Chunks are scanned in reversed order of position (element k of a
chunk is position T - 1 - (chunk * BLOCK_T + k)), so that a forward scan composes the
maps right-to-left; padding lanes past the start of the row are identity maps.

Shapes/dtypes (csrc/ops.cpp): rewards, values [B, T], bootstrap_values [B] and lam_per_seq
[B] of one float dtype (float32 or float64), mask bool [B, T]; outputs [B, T] of that dtype.
"""

import torch
import triton
import triton.language as tl

from . import _config
from ._math import as_acc
from .logprobs import (check_logits, logprobs_fwd_kernel, acc_dtype, check_kl_estimator,
                       check_per_token, device_guard, inv_temperature, inv_temperatures,
                       tl_acc)


@triton.jit
def _compose(a1, c1, d1, u1, w1, a2, c2, d2, u2, w2):
    """Map 2 after map 1 (map 1 is the earlier element of the scan: further right).

    With M = [[a, 0], [c, d]] and offset o = (u, w): M2 M1 and M2 o1 + o2.
    """
    return (a2 * a1, c2 * a1 + d2 * c1, d2 * d1, a2 * u1 + u2, c2 * u1 + d2 * w1 + w2)


@triton.jit
def _gae_kernel(
    rew_ptr, val_ptr, mask_ptr, boot_ptr, scores_ptr, lams_ptr,
    adv_ptr, ret_ptr, rew_out_ptr,
    T,
    gamma: tl.float64, lam: tl.float64, value_lam: tl.float64,
    ACC: tl.constexpr, HAS_BOOT: tl.constexpr, HAS_SCORES: tl.constexpr,
    HAS_LAMS: tl.constexpr, DECOUPLED: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program per sequence b. HAS_SCORES (score_rollout): scores[b] is added to the
    reward of the LAST valid position (the first valid one met from the right), and the
    final rewards are written to rew_out_ptr (may be rew_ptr: each chunk is read before it
    is written, by the same program). HAS_LAMS: the advantages' lambda is lams[b].
    DECOUPLED: the returns come from a second scan with gamma * value_lam."""
    b = tl.program_id(0).to(tl.int64)
    base = b * T
    g = as_acc(gamma, ACC)
    if HAS_LAMS:
        gl = g * tl.load(lams_ptr + b).to(ACC)
    else:
        gl = g * as_acc(lam, ACC)
    glv = g * as_acc(value_lam, ACC)
    if HAS_BOOT:
        v_carry = tl.load(boot_ptr + b).to(ACC)
    else:
        v_carry = tl.zeros([], ACC)
    a_carry = tl.zeros([], ACC)
    g_carry = tl.zeros([], ACC)  # DECOUPLED: the value_lam advantage
    if HAS_SCORES:
        score = tl.load(scores_ptr + b).to(ACC)
    seen = tl.zeros([], tl.int32)  # a valid position was met already (to the right)
    k = tl.arange(0, BLOCK_T)
    for chunk in range(0, tl.cdiv(T, BLOCK_T)):
        pos = T - 1 - (chunk * BLOCK_T + k)
        inb = pos >= 0
        m = tl.load(mask_ptr + base + pos, mask=inb, other=0) != 0
        r = tl.load(rew_ptr + base + pos, mask=m, other=0.0).to(ACC)
        v = tl.load(val_ptr + base + pos, mask=m, other=0.0).to(ACC)
        if HAS_SCORES:
            first = tl.min(tl.where(m, k, BLOCK_T), axis=0)
            r = tl.where(m & (k == first) & (seen == 0), r + score, r)
            seen = tl.maximum(seen, (first < BLOCK_T).to(tl.int32))
            tl.store(rew_out_ptr + base + pos, tl.where(m, r, 0.0), mask=inb)
        one = tl.full([BLOCK_T], 1.0, ACC)
        zero = tl.zeros([BLOCK_T], ACC)
        ea = tl.where(m, zero, one)
        ec = tl.where(m, g + zero, zero)
        ed = tl.where(m, gl + zero, one)
        eu = tl.where(m, v, zero)
        ew = tl.where(m, r - v, zero)
        sa, sc, sd, su, sw = tl.associative_scan((ea, ec, ed, eu, ew), 0, _compose)
        v_state = sa * v_carry + su
        a_state = sc * v_carry + sd * a_carry + sw
        tl.store(adv_ptr + base + pos, tl.where(m, a_state, 0.0), mask=inb)
        # the state after the chunk's last (leftmost) element goes on to the next chunk
        last = k == BLOCK_T - 1
        if DECOUPLED:
            edv = tl.where(m, glv + zero, one)
            ta, tc, td, tu, tw = tl.associative_scan((ea, ec, edv, eu, ew), 0, _compose)
            g_state = tc * v_carry + td * g_carry + tw
            tl.store(ret_ptr + base + pos, tl.where(m, g_state + v, 0.0), mask=inb)
            g_carry = tl.sum(tl.where(last, g_state, 0.0), axis=0)
        else:
            tl.store(ret_ptr + base + pos, tl.where(m, a_state + v, 0.0), mask=inb)
        v_carry = tl.sum(tl.where(last, v_state, 0.0), axis=0)
        a_carry = tl.sum(tl.where(last, a_state, 0.0), axis=0)


def _launch_gae(rewards, values, mask, bootstrap_values, scores, rew_out, gamma, lam,
                lam_per_seq, value_lam, block_t):
    B, T = rewards.shape
    adv = torch.empty_like(rewards)
    ret = torch.empty_like(rewards)
    if B * T > 0:
        with device_guard(rewards):
            _config.wrap(_gae_kernel)[(B,)](
                rewards, values, mask,
                bootstrap_values if bootstrap_values is not None else rewards,
                scores if scores is not None else rewards,
                lam_per_seq if lam_per_seq is not None else rewards,
                adv, ret, rew_out if rew_out is not None else rewards,
                T, float(gamma), float(lam), float(0.0 if value_lam is None else value_lam),
                ACC=tl_acc(rewards.dtype), HAS_BOOT=bootstrap_values is not None,
                HAS_SCORES=scores is not None, HAS_LAMS=lam_per_seq is not None,
                DECOUPLED=value_lam is not None,
                BLOCK_T=block_t or _config.gae_block_t(T), num_warps=4)
    return adv, ret


def _check_lambdas(lam_per_seq, value_lam, B, dtype, device):
    """lam_per_seq: None or [B] of dtype on device (its values in [0, 1] are the caller's:
    reading them would sync); value_lam: None or a number in [0, 1]."""
    if lam_per_seq is not None:
        check_per_token("lam_per_seq", lam_per_seq, (B,), dtype, device)
    if value_lam is not None and not 0.0 <= value_lam <= 1.0:
        raise ValueError(f"value_lam: expected a number in [0, 1], got {value_lam!r}")


def gae(rewards, values, mask, bootstrap_values, gamma, lam, lam_per_seq=None, value_lam=None,
        block_t=None):
    """(advantages, returns) [B, T], 0 on masked positions. block_t overrides the scan
    chunk (a power of two; tests use it to exercise the carry between chunks)."""
    if rewards.dim() != 2 or rewards.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"rewards: expected float32/float64 [B, T], got {rewards.dtype} "
                        f"{tuple(rewards.shape)}")
    B, T = rewards.shape
    check_per_token("rewards", rewards, (B, T), rewards.dtype, rewards.device)
    check_per_token("values", values, (B, T), rewards.dtype, rewards.device)
    if mask.dtype != torch.bool:
        raise TypeError(f"mask: expected bool, got {mask.dtype}")
    check_per_token("mask", mask, (B, T), torch.bool, rewards.device)
    if bootstrap_values is not None:
        check_per_token("bootstrap_values", bootstrap_values, (B,), rewards.dtype,
                        rewards.device)
    _check_lambdas(lam_per_seq, value_lam, B, rewards.dtype, rewards.device)
    return _launch_gae(rewards, values, mask, bootstrap_values, None, None, gamma, lam,
                       lam_per_seq, value_lam, block_t)


def score_rollout(logits, tokens, mask, ref_logprobs, values, scores, kl_coef, kl_estimator,
                  gamma, lam, temperature, lam_per_seq=None, value_lam=None, temperatures=None,
                  block_t=None):
    """(logprobs, kl, rewards, advantages, returns) [B, T] of the accumulation dtype.

    Two launches: a row pass (logprobs at `temperature`, kl of the chosen estimator,
    -kl_coef * kl into the rewards) and a GAE pass that adds scores[b] at the last valid
    position and scans. Advantages are NOT whitened (the Python layer does that).
    temperatures: the optional per-row temperature [B, T] of ACC (the float is then unread).
    """
    check_logits(logits, tokens, mask)
    B, T = tokens.shape
    V = logits.shape[2]
    acc = acc_dtype(logits)
    dev = logits.device
    check_per_token("ref_logprobs", ref_logprobs, (B, T), acc, dev)
    check_per_token("values", values, (B, T), acc, dev)
    check_per_token("scores", scores, (B,), acc, dev)
    check_kl_estimator(kl_estimator)
    _check_lambdas(lam_per_seq, value_lam, B, acc, dev)
    inv = inv_temperature(temperature, acc)
    invt, row_temp = inv_temperatures(temperatures, (B, T), acc, dev)
    logp = torch.empty((B, T), dtype=acc, device=dev)
    kl = torch.empty((B, T), dtype=acc, device=dev)
    rewards = torch.empty((B, T), dtype=acc, device=dev)
    if B * T > 0:
        with device_guard(logits):
            _config.wrap(logprobs_fwd_kernel)[(B * T,)](
                logits, logits.stride(0), logits.stride(1), tokens, mask,
                logp, logp, logp, logp,  # entropy / row_max / log_sum: unused with SCORE
                ref_logprobs, kl, rewards, invt if row_temp else logp,
                T, V, inv, float(kl_coef),
                ACC=tl_acc(acc), NEED_ENT=False, SCORE=True, KL_EST=int(kl_estimator),
                ROW_TEMP=row_temp)
    adv, ret = _launch_gae(rewards, values, mask, None, scores, rewards, gamma, lam,
                           lam_per_seq, value_lam, block_t)
    return logp, kl, rewards, adv, ret
