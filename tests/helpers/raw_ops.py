"""The raw kernel ops' arguments: the LossSpec a backend's ppo_loss takes, the (float[],
int[]) slot lists of the ppo_loss kernel ops, and ppo_kernels::triton_ppo_loss_fwd run and
checked against the reference (test_triton_kernels.py and the raw-op tests beside their
backend-parametrised siblings)."""

import torch

import ppo_kernels as pk
from ppo_kernels import reference as ref
from ppo_kernels.spec import FLOAT_SLOTS, INT_SLOTS

from helpers.asserts import TOK_TOL, assert_close_np, grad_tol
from helpers.backends import KL_CODES
from helpers.inputs import acc_of, per_token

def loss_params(**kw):
    """The LossSpec the backends' ppo_loss takes, as pk.ppo_loss builds it (defaults of the
    public API; keyword arguments override)."""
    return pk.LossSpec.build(**kw)


def kernel_args(dtype=torch.float32, **kw):
    """(scalars, codes): the float[] / int[] the ppo_loss kernel ops take for LossSpec
    options kw (the logits of ``dtype``)."""
    return pk.LossSpec.build(**kw).kernel_args(dtype)


def _opt(inp, key, acc):
    """per_token of inp[key], or None."""
    x = inp.get(key)
    return None if x is None else per_token(x, acc)


def slot_args(eps_low, eps_high, dual, kl_coef, kl_est, ent_coef, temp, grad_scale,
              policy_loss, tau_pos, tau_neg, kl_bias):
    """(scalars, codes) of the ppo_loss ops, by slot name (ppo_kernels/spec.py)."""
    f = dict(clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip_c=dual, kl_coef=kl_coef,
             entropy_coef=ent_coef, temperature=temp, grad_scale=grad_scale,
             sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
    i = dict(policy_loss=policy_loss, kl_estimator=kl_est, kl_bias_correction=int(kl_bias))
    return [float(f[n]) for n in FLOAT_SLOTS], [int(i[n]) for n in INT_SLOTS]


def run_ppo(logits, tokens, mask, inp, *, eps_low=0.2, eps_high=0.28, dual=0.0,
            kl_coef=0.1, kl_est=2, ent_coef=0.01, temp=1.0, grad_scale=1.0,
            compute_grad=True, policy_loss=0, tau_pos=1.0, tau_neg=1.05, kl_bias=False):
    """ppo_kernels::triton_ppo_loss_fwd on ppo_inputs' inp (codes as the ops take them):
    (loss, loss_tok, logprobs, entropy, dlogits)."""
    acc = inp["acc"]
    return torch.ops.ppo_kernels.triton_ppo_loss_fwd(
        logits, tokens, mask, _opt(inp, "old", acc), per_token(inp["adv"], acc),
        per_token(inp["w"], acc), _opt(inp, "ref", acc), _opt(inp, "isw", acc),
        _opt(inp, "went", acc), *slot_args(eps_low, eps_high, dual, kl_coef, kl_est, ent_coef,
                                           temp, grad_scale, policy_loss, tau_pos, tau_neg,
                                           kl_bias), compute_grad)


def ref_ppo(logits, tokens, mask, inp, *, eps_low=0.2, eps_high=0.28, dual=0.0,
            kl_coef=0.1, kl_est=2, ent_coef=0.01, temp=1.0, mode="token-mean"):
    """The reference's (loss, per-token loss, dlogits) for run_ppo's arguments."""
    loss, metrics, dl = ref.ppo_loss(
        logits, tokens, inp["old"], inp["adv"], mask, inp["ref"], clip_eps_low=eps_low,
        clip_eps_high=eps_high, dual_clip_c=dual if dual > 0 else None,
        kl_coef=kl_coef if inp["ref"] is not None else 0.0, kl_estimator=KL_CODES[kl_est],
        entropy_coef=ent_coef, temperature=temp, loss_agg_mode=mode,
        rollout_is_weights=inp["isw"])
    # per-token loss: loss_agg_mode "none" gives it (0 on masked positions)
    loss_tok, _, _ = ref.ppo_loss(
        logits, tokens, inp["old"], inp["adv"], mask, inp["ref"], clip_eps_low=eps_low,
        clip_eps_high=eps_high, dual_clip_c=dual if dual > 0 else None,
        kl_coef=kl_coef if inp["ref"] is not None else 0.0, kl_estimator=KL_CODES[kl_est],
        entropy_coef=ent_coef, temperature=temp, loss_agg_mode="none",
        rollout_is_weights=inp["isw"])
    return loss, loss_tok, dl


def check_ppo(out, rout, logits, tokens, mask, dtype, temp=1.0):
    """run_ppo's outputs against ref_ppo's (TOK_TOL, grad_tol): dtypes, shapes, values."""
    loss, loss_tok, logp, ent, dl = out
    rloss, rloss_tok, rdl = rout
    rtol, atol = TOK_TOL[dtype]
    acc = acc_of(dtype)
    assert loss.dim() == 0 and loss.dtype == loss_tok.dtype == logp.dtype == acc
    assert_close_np(loss_tok, rloss_tok, rtol, atol, what="loss_tok")
    assert_close_np(loss, rloss, rtol, atol, what="loss")
    rl, re_ = ref.token_logprobs(logits, tokens, mask, temp)
    assert_close_np(logp, rl, rtol, atol, what="logprobs")
    assert_close_np(ent, re_, rtol, atol, what="entropy")
    assert dl.shape == logits.shape and dl.dtype == logits.dtype and dl.is_contiguous()
    assert_close_np(dl, rdl, *grad_tol(dtype, rdl), what="dlogits")
