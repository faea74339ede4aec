"""GSPO's middle as one op against the two-phase path's eager middle
(_two_phase.middle_grad without fused_middle: autograd through _torch_impl's formulas):
the C++ op ppo_kernels::seq_loss_grad (csrc/cpu/seq_loss.cpp) on CPU tensors, and its
Triton twin (triton_kernels/seq_loss.py) on a CUDA device where one is present, else under
the Triton interpreter: gspo and gspo-token with the dual clip, the KL estimators with and
without the bias correction, entropy weights of their own, rollout weights, on-policy, an
empty sequence, a sequence whose mean log-ratio is clamped, NaN on a valid token, float64;
and ppo_loss on the paths that use them."""

import types

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import _backends, _two_phase
from ppo_kernels._extension import HAS_CPU
from ppo_kernels.spec import LossSpec

from helpers import device_path
from helpers.backends import TRITON_DEVICE, triton_ops

cpu_op = pytest.mark.skipif(not HAS_CPU, reason="the C++ extension is not built")
# each twin on its device: the C++ op on CPU tensors, the Triton one on a CUDA device
# where one is present, else on CPU tensors under the interpreter
IMPLS = [pytest.param("cpu", marks=cpu_op), pytest.param("triton", marks=triton_ops)]


def _op(impl):
    if impl == "cpu":
        return torch.ops.ppo_kernels.seq_loss_grad, "cpu"
    from ppo_kernels.triton_kernels import seq_loss
    return seq_loss.seq_loss_grad, TRITON_DEVICE


def _eager(logp, ent, spec, x, monkeypatch):
    with monkeypatch.context() as mp:
        mp.setattr(_two_phase, "fused_middle", lambda *a: None)
        return _two_phase.middle_grad(logp, ent, spec, x)


OPTIONS = {
    "plain": {},
    "dual-k3": dict(dual_clip_c=3.0, kl_coef=0.1, kl_estimator="k3"),
    "k1plus-bias": dict(kl_coef=0.2, kl_estimator="k1+", kl_bias_correction=True),
    "k2-entropy": dict(kl_coef=0.05, kl_estimator="k2", entropy_coef=0.01),
}
INPUTS = ["plain", "on-policy", "isw-went", "clamped", "nan-adv", "nan-logp", "float64"]


def _case(policy, opts, inputs, dev):
    dt = torch.float64 if inputs == "float64" else torch.float32
    g = torch.Generator().manual_seed(len(policy) * 7 + len(opts) * 3 + len(inputs))
    B, T = 5, 19  # 19: more than two of the interpreter's 8-wide blocks, the last partial
    logp = -torch.rand(B, T, generator=g, dtype=dt) * 3
    ent = torch.rand(B, T, generator=g, dtype=dt) * 2
    old = logp + 0.2 * torch.randn(B, T, generator=g, dtype=dt)
    old[0] = logp[0] + 0.04  # a sequence inside the clip band
    adv = torch.randn(B, T, generator=g, dtype=dt)
    adv[3] = -adv[3].abs()  # the dual clip's side
    old[3] = logp[3] - 0.5
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[2] = False  # an empty sequence
    ref = logp + 0.1 * torch.randn(B, T, generator=g, dtype=dt)
    w = mask.to(dt) / mask.sum().clamp(min=1)
    isw = w_ent = None
    if inputs == "on-policy":
        old = None
    if inputs == "isw-went":
        isw = torch.rand(B, T, generator=g, dtype=dt) * 2
        w_ent = 0.5 * mask.to(dt)
    if inputs == "clamped":
        old[1] = logp[1] + 30.0  # the mean log-ratio past -20: no gradient through s
    if inputs == "nan-adv":
        adv[4, mask[4].nonzero()[0, 0]] = float("nan")
    if inputs == "nan-logp":
        logp[4, mask[4].nonzero()[-1, 0]] = float("nan")
    logp, ent, old, adv, mask, ref, w, isw, w_ent = (
        None if v is None else v.to(dev) for v in (logp, ent, old, adv, mask, ref, w, isw,
                                                    w_ent))
    x = types.SimpleNamespace(old=old, adv=adv, mask=mask, ref=ref if opts.get("kl_coef")
                              else None, isw=isw, weights=w, w_ent=w_ent, behaviour=None,
                              be=_backends.get_backend("torch", logp.device))
    spec = LossSpec.from_options(dt, dict(policy_loss=policy, **opts))
    return logp, ent, spec, x


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("policy", ["gspo", "gspo-token"])
@pytest.mark.parametrize("impl", IMPLS)
def test_fused_middle_matches_the_eager_middle(monkeypatch, impl, policy, opts, inputs):
    op, dev = _op(impl)
    logp, ent, spec, x = _case(policy, OPTIONS[opts], inputs, dev)
    want = _eager(logp, ent, spec, x, monkeypatch)
    scalars, codes = spec.kernel_args(torch.float32)
    got = op(logp, ent, x.mask, x.old, x.adv, x.ref, x.isw, x.weights, x.w_ent, scalars, codes)
    tol = dict(rtol=1e-12, atol=1e-14) if logp.dtype == torch.float64 else \
        dict(rtol=2e-6, atol=2e-7)
    for a, b, name in zip(got, want, ("dlogp", "dent", "loss", "pol")):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name in ("dlogp", "pol"):
            # only the valid positions are read (the gradient pass writes zero rows for the
            # masked ones; the eager middle's autograd leaves them NaN in a NaN sequence)
            a, b = a[x.mask], b[x.mask]
        if name == "dent" and spec.entropy_coef == 0.0:
            continue  # (not read: the two-phase path passes no entropy gradient then)
        torch.testing.assert_close(a, b, equal_nan=True, msg=name, **tol)
    assert (got[0][~x.mask] == 0).all()
    if inputs == "clamped" and policy == "gspo" and not spec.kl_coef:
        assert (got[0][1] == 0).all()  # no gradient through a clamped sequence ratio
    if inputs.startswith("nan"):
        assert got[2].isnan() and got[0][4][x.mask[4]].isnan().any()
        assert torch.isfinite(got[0][:4]).all()  # the other sequences keep their values


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise(impl):
    op, dev = _op(impl)
    logp, ent, spec, x = _case("gspo", {}, "plain", dev)
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
