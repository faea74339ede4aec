"""GSPO's middle as one op against the two-phase path's eager middle
(_two_phase.middle_grad without fused_middle: autograd through _torch_impl's formulas):
the C++ op ppo_kernels::seq_loss_grad (csrc/cpu/seq_loss.cpp) on CPU tensors, and its
Triton twin (triton_kernels/seq_loss.py) on a CUDA device where one is present, else under
the Triton interpreter: gspo and gspo-token with the dual clip, the KL estimators with and
without the bias correction, entropy weights of their own, rollout weights, on-policy, an
empty sequence, a sequence whose mean log-ratio is clamped, NaN on a valid token, float64;
and ppo_loss on the paths that use them."""

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import _two_phase

from helpers import device_path
from helpers.backends import TRITON_DEVICE, triton_ops
from helpers.middle_cases import (IMPLS, INPUTS, OPTIONS, assert_middle_close, case, cpu_op,
                                  eager, op_of)


def _op(impl):
    return op_of(impl, "seq_loss_grad", "seq_loss")


@pytest.mark.parametrize("inputs", [i for i in INPUTS if i != "kl-logp"])
@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("policy", ["gspo", "gspo-token"])
@pytest.mark.parametrize("impl", IMPLS)
def test_fused_middle_matches_the_eager_middle(monkeypatch, impl, policy, opts, inputs):
    op, dev = _op(impl)
    logp, ent, spec, x, _ = case(policy, OPTIONS[opts], inputs, dev)
    want = eager(monkeypatch, logp, ent, spec, x)
    scalars, codes = spec.kernel_args(torch.float32)
    got = op(logp, ent, x.mask, x.old, x.adv, x.ref, x.isw, x.weights, x.w_ent, scalars, codes)
    assert_middle_close(got, want, spec, x)
    if inputs == "clamped" and policy == "gspo" and not spec.kl_coef:
        assert (got[0][1] == 0).all()  # no gradient through a clamped sequence ratio
    if inputs.startswith("nan"):
        assert got[2].isnan() and got[0][4][x.mask[4]].isnan().any()
        assert torch.isfinite(got[0][:4]).all()  # the other sequences keep their values


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise(impl):
    op, dev = _op(impl)
    logp, ent, spec, x, _ = case("gspo", {}, "plain", dev)
    scalars, codes = spec.kernel_args(torch.float32)
    vanilla = list(codes)
    vanilla[0] = 0
    with pytest.raises(ValueError, match="policy_loss"):
        op(logp, ent, x.mask, x.old, x.adv, None, None, x.weights, None, scalars, vanilla)
    # (the Triton launcher's ValueError; the raw C++ op's RuntimeError, as its other checks)
    with pytest.raises(ValueError if impl == "triton" else RuntimeError, match="adv"):
        op(logp, ent, x.mask, x.old, x.adv[:, :3], None, None, x.weights, None, scalars, codes)
    if impl == "cpu":
        with pytest.raises(RuntimeError, match="ref_logprobs: expected dtype"):
            op(logp, ent, x.mask, x.old, x.adv, x.adv.double(), None, x.weights, None,
               scalars, codes)


def _loss_inputs(policy, opts, dev):
    g = torch.Generator().manual_seed(41)
    B, T, V = 3, 9, 13
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    old = old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T)
    mask = torch.rand(B, T, generator=g) > 0.2
    kw = dict(policy_loss=policy, **opts)
    if "kl_coef" in opts:
        kw["ref_logprobs"] = (old + 0.05 * torch.randn(B, T, generator=g)).to(dev)
    return [v.to(dev) for v in (logits, tokens, old, adv, mask)], kw


LOSS_CASES = [("gspo", dict(kl_coef=0.1, entropy_coef=0.01)),
              ("gspo-token", dict(dual_clip_c=3.0))]


@triton_ops
@pytest.mark.parametrize("policy,opts", LOSS_CASES)
def test_ppo_loss_gspo_on_the_device_path(monkeypatch, policy, opts):
    """ppo_loss with GSPO on the triton backend: the middle from the one launch where the
    tensors are on a CUDA device (forced here), loss and gradient the eager middle's within
    float32 rounding."""
    from ppo_kernels.triton_kernels import seq_loss
    args, kw = _loss_inputs(policy, opts, TRITON_DEVICE)
    want, got, calls = device_path.eager_and_device(monkeypatch, seq_loss, "seq_loss_grad",
                                                    *args, backend="triton", **kw)
    assert calls, "the device middle did not run"
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)
    assert "seq_clip_frac" in got[2]


@cpu_op
@pytest.mark.parametrize("policy,opts", LOSS_CASES)
def test_ppo_loss_gspo_on_the_cpu_backend(monkeypatch, policy, opts):
    """ppo_loss with GSPO on the cpu backend: the middle from the C++ op, loss, gradient and
    metrics the eager middle's within float32 rounding."""
    (logits, *rest), kw = _loss_inputs(policy, opts, "cpu")
    out = []
    for fused in (False, True):
        with monkeypatch.context() as mp:
            if not fused:
                mp.setattr(_two_phase, "fused_middle", lambda *a: None)
            calls = device_path.spy(mp, torch.ops.ppo_kernels, "seq_loss_grad")
            x = logits.clone().requires_grad_()
            loss, metrics = pk.ppo_loss(x, *rest, backend="cpu", **kw)
            loss.backward()
            out.append((loss.detach(), x.grad, dict(metrics)))
            assert bool(calls) == fused
    (want, got) = out
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)
    assert got[2].keys() == want[2].keys()
    for k in want[2]:
        torch.testing.assert_close(got[2][k], want[2][k], msg=k)
