"""The token-level losses' [B, T] middle as one op against the two-phase path's eager middle
(_two_phase.middle_grad without fused_middle: autograd through _torch_impl's formulas): the
C++ op ppo_kernels::token_loss_grad (csrc/cpu/token_middle.cpp) on CPU tensors and its
Triton twin (triton_kernels/token_middle.py) on a CUDA device where one is present, else
under the Triton interpreter (tests/helpers/middle_cases.py): every token-level policy loss,
the dual clip, the KL estimators with and without the bias correction and on log-probs of
their own (sampling replay's full ones), entropy and rollout weights, on-policy, clamped
log-ratios, NaN on a valid token, float64; and ppo_loss with a kept set or a split
vocabulary on the paths that use them."""

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels.spec import KERNEL_POLICY_LOSSES

from helpers import device_path
from helpers.backends import TRITON_DEVICE, triton_ops
from helpers.inputs import random_csr
from helpers.middle_cases import (IMPLS, OPTIONS, assert_bad_arguments_raise,
                                  assert_loss_close, assert_middle_close, case, cpu_op, eager,
                                  eager_and_cpu_op, loss_inputs, op_of, twin_cases)


def _op(impl):
    return op_of(impl, "token_loss_grad", "token_middle")


@pytest.mark.parametrize("policy", KERNEL_POLICY_LOSSES)
@pytest.mark.parametrize("impl,opts,inputs", twin_cases())
def test_token_middle_matches_the_eager_middle(monkeypatch, impl, policy, opts, inputs):
    op, dev = _op(impl)
    logp, ent, spec, x, logp_kl = case(policy, OPTIONS[opts], inputs, dev)
    want = eager(monkeypatch, logp, ent, spec, x, logp_kl)
    scalars, codes = spec.kernel_args(torch.float32)
    got = op(logp, ent, x.mask, x.old, x.adv, x.ref, x.isw, x.weights, x.w_ent, scalars, codes,
             logp_kl)
    if logp_kl is None:
        assert got[4].numel() == 0
        got = got[:4]
    elif x.ref is None:  # (autograd: no gradient in the unused logp_kl, zeros)
        assert (got[4] == 0).all()
    assert_middle_close(got, want, spec, x, inputs)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise(impl):
    op, dev = _op(impl)
    err = ValueError if impl == "triton" else RuntimeError  # (the raw C++ op's TORCH_CHECK)
    logp, ent, x, scalars, codes = assert_bad_arguments_raise(op, dev, "vanilla", 5, err, err)
    with pytest.raises(err, match="kl_logprobs"):
        op(logp, ent, x.mask, x.old, x.adv, None, None, x.weights, None, scalars, codes,
           logp[:, :2])


def _loss_inputs(dev):
    args, ref, g = loss_inputs(43, dev)
    csr, _ = random_csr(*args[0].shape, g, tokens=args[1].cpu())
    return args, ref, csr


# (the kept set given or re-derived, the KL over the full or the kept log-probs)
REPLAYS = {
    "given": lambda csr: dict(sampling_mask=csr),
    "top-p-kl-kept": lambda csr: dict(top_k=6, top_p=0.8, kl_logprobs="kept",
                                      entropy_over="kept"),
}


def _loss_kw(replay, csr, ref, dev):
    kw = dict(kl_coef=0.1, entropy_coef=0.01, ref_logprobs=ref, clip_eps_high=0.28,
              **REPLAYS[replay](csr))
    if "sampling_mask" in kw:
        kw["sampling_mask"] = pk.SamplingMask(csr.token_ids.to(dev), csr.offsets.to(dev))
    return kw


@triton_ops
@pytest.mark.parametrize("replay", list(REPLAYS))
def test_ppo_loss_replay_on_the_device_path(monkeypatch, replay):
    """ppo_loss with a kept set on the triton backend: the middle from the one launch where
    the tensors are on a CUDA device (forced here), loss, gradient and metrics the eager
    middle's within float32 rounding."""
    from ppo_kernels.triton_kernels import token_middle
    args, ref, csr = _loss_inputs(TRITON_DEVICE)
    kw = _loss_kw(replay, csr, ref, TRITON_DEVICE)
    want, got, calls = device_path.eager_and_device(monkeypatch, token_middle,
                                                    "token_loss_grad", *args,
                                                    backend="triton", **kw)
    assert calls, "the device middle did not run"
    assert_loss_close(got, want)


@cpu_op
@pytest.mark.parametrize("replay", [*REPLAYS, "tp_group"])
def test_ppo_loss_two_phase_on_the_cpu_backend(monkeypatch, replay, request):
    """ppo_loss with a kept set, or over a split vocabulary (a group of one), on the cpu
    backend: the middle from the C++ op; loss, gradient and metrics the eager middle's
    within float32 rounding."""
    (logits, *rest), ref, csr = _loss_inputs("cpu")
    if replay == "tp_group":
        kw = dict(kl_coef=0.1, ref_logprobs=ref, tp_group=request.getfixturevalue("group1"))
    else:
        kw = _loss_kw(replay, csr, ref, "cpu")
    want, got = eager_and_cpu_op(monkeypatch, "token_loss_grad", logits, *rest, **kw)
    assert_loss_close(got, want)
