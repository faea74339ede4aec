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

from helpers import device_path
from helpers.backends import TRITON_DEVICE, triton_ops
from helpers.middle_cases import (IMPLS, INPUTS, OPTIONS, assert_bad_arguments_raise,
                                  assert_loss_close, assert_middle_close, case, cpu_op, eager,
                                  eager_and_cpu_op, loss_inputs, op_of, twin_cases)


def _op(impl):
    return op_of(impl, "seq_loss_grad", "seq_loss")


@pytest.mark.parametrize("policy", ["gspo", "gspo-token"])
@pytest.mark.parametrize("impl,opts,inputs", twin_cases([i for i in INPUTS if i != "kl-logp"]))
def test_fused_middle_matches_the_eager_middle(monkeypatch, impl, policy, opts, inputs):
    op, dev = _op(impl)
    logp, ent, spec, x, _ = case(policy, OPTIONS[opts], inputs, dev)
    want = eager(monkeypatch, logp, ent, spec, x)
    scalars, codes = spec.kernel_args(torch.float32)
    got = op(logp, ent, x.mask, x.old, x.adv, x.ref, x.isw, x.weights, x.w_ent, scalars, codes)
    assert_middle_close(got, want, spec, x, inputs)
    if inputs == "clamped" and policy == "gspo" and not spec.kl_coef:
        assert (got[0][1] == 0).all()  # no gradient through a clamped sequence ratio


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise(impl):
    op, dev = _op(impl)
    # (the Triton launcher's ValueErrors; the raw C++ op's RuntimeError for a shape, as its
    # other checks)
    logp, ent, x, scalars, codes = assert_bad_arguments_raise(
        op, dev, "gspo", 0, ValueError, ValueError if impl == "triton" else RuntimeError)
    if impl == "cpu":
        with pytest.raises(RuntimeError, match="ref_logprobs: expected dtype"):
            op(logp, ent, x.mask, x.old, x.adv, x.adv.double(), None, x.weights, None,
               scalars, codes)


def _loss_inputs(policy, opts, dev):
    args, ref, _ = loss_inputs(41, dev)
    kw = dict(policy_loss=policy, **opts)
    if "kl_coef" in opts:
        kw["ref_logprobs"] = ref
    return args, kw


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
    assert_loss_close(got, want)
    assert "seq_clip_frac" in got[2]


@cpu_op
@pytest.mark.parametrize("policy,opts", LOSS_CASES)
def test_ppo_loss_gspo_on_the_cpu_backend(monkeypatch, policy, opts):
    """ppo_loss with GSPO on the cpu backend: the middle from the C++ op, loss, gradient and
    metrics the eager middle's within float32 rounding."""
    (logits, *rest), kw = _loss_inputs(policy, opts, "cpu")
    want, got = eager_and_cpu_op(monkeypatch, "seq_loss_grad", logits, *rest, **kw)
    assert_loss_close(got, want)


@pytest.mark.parametrize("policy", ["gspo", "gspo-token"])
def test_minus_inf_log_prob_on_a_valid_token_every_backend_the_reference(policy):
    """A valid token whose logit is -inf (a banned entry sampled all the same): its
    sequence's mean log-ratio is -inf, clamped at -20 as every clamped ratio is, so the
    loss is finite and the sequence gets no gradient, on the cpu backend (the C++ op) and
    the eager composite (a select, not a product of NaN with 0) alike, as the float64
    reference says."""
    from ppo_kernels import reference
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 6, (2, 4), generator=g)
    logits[0, 1, tokens[0, 1]] = float("-inf")
    old = torch.full((2, 4), -1.5, dtype=torch.float64)
    adv = torch.randn(2, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    want_loss, _, want_grad = reference.ppo_loss(logits.numpy(), tokens.numpy(), old.numpy(),
                                                 adv.numpy(), mask.numpy(), policy_loss=policy)
    assert torch.isfinite(torch.tensor(want_loss)) and not want_grad[0].any()
    for backend in ("cpu", "torch"):
        x = logits.clone().requires_grad_()
        loss, _ = pk.ppo_loss(x, tokens, old, adv, mask, policy_loss=policy, backend=backend)
        loss.backward()
        torch.testing.assert_close(loss, torch.tensor(want_loss, dtype=torch.float64),
                                   rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(x.grad, torch.from_numpy(want_grad), rtol=1e-12,
                                   atol=1e-15)
