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
from ppo_kernels import _two_phase
from ppo_kernels.spec import KERNEL_POLICY_LOSSES

from helpers import device_path
from helpers.backends import TRITON_DEVICE, triton_ops
from helpers.inputs import random_csr
from helpers.middle_cases import (IMPLS, INPUTS, OPTIONS, assert_middle_close, case, cpu_op,
                                  eager, op_of)


def _op(impl):
    return op_of(impl, "token_loss_grad", "token_middle")


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("policy", KERNEL_POLICY_LOSSES)
@pytest.mark.parametrize("impl", IMPLS)
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
    assert_middle_close(got, want, spec, x)
    if inputs.startswith("nan"):
        assert got[2].isnan() and got[0][4][x.mask[4]].isnan().any()
        assert torch.isfinite(got[0][:4]).all()  # the other sequences keep their values


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise(impl):
    op, dev = _op(impl)
    logp, ent, spec, x, _ = case("vanilla", {}, "plain", dev)
    scalars, codes = spec.kernel_args(torch.float32)
    gspo = list(codes)
    gspo[0] = 5
    err = ValueError if impl == "triton" else RuntimeError  # (the raw C++ op's TORCH_CHECK)
    with pytest.raises(err, match="policy_loss"):
        op(logp, ent, x.mask, x.old, x.adv, None, None, x.weights, None, scalars, gspo)
    with pytest.raises(err, match="adv"):
        op(logp, ent, x.mask, x.old, x.adv[:, :3], None, None, x.weights, None, scalars, codes)
    with pytest.raises(err, match="kl_logprobs"):
        op(logp, ent, x.mask, x.old, x.adv, None, None, x.weights, None, scalars, codes,
           logp[:, :2])


def _loss_inputs(dev):
    g = torch.Generator().manual_seed(43)
    B, T, V = 3, 9, 13
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    old = old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T)
    mask = torch.rand(B, T, generator=g) > 0.2
    ref = old + 0.05 * torch.randn(B, T, generator=g)
    csr, _ = random_csr(B, T, V, g, tokens=tokens)
    return [v.to(dev) for v in (logits, tokens, old, adv, mask)], ref.to(dev), csr


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


def _close(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)
    assert got[2].keys() == want[2].keys()
    for k in want[2]:
        torch.testing.assert_close(got[2][k], want[2][k], rtol=2e-6, atol=1e-7, msg=k)


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
    _close(got, want)


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
    out = []
    for fused in (False, True):
        with monkeypatch.context() as mp:
            if not fused:
                mp.setattr(_two_phase, "fused_middle", lambda *a: None)
            calls = device_path.spy(mp, torch.ops.ppo_kernels, "token_loss_grad")
            x = logits.clone().requires_grad_()
            loss, metrics = pk.ppo_loss(x, *rest, backend="cpu", **kw)
            loss.backward()
            out.append((loss.detach(), x.grad, dict(metrics)))
            assert bool(calls) == fused
    _close(out[1], out[0])
