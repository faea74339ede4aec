"""The inputs of the two-phase path's [B, T] middle and its eager reference, for the tests of
the middle's ops (test_seq_loss.py: GSPO's, test_token_middle.py: the token-level losses'):
each op's C++ version on CPU tensors and its Triton twin on a CUDA device where one is
present, else under the Triton interpreter, against _two_phase.middle_grad with no op
(autograd through _torch_impl's formulas)."""

import importlib
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

OPTIONS = {
    "plain": {},
    "dual-k3": dict(dual_clip_c=3.0, kl_coef=0.1, kl_estimator="k3"),
    "k1plus-bias": dict(kl_coef=0.2, kl_estimator="k1+", kl_bias_correction=True),
    "k2-entropy": dict(kl_coef=0.05, kl_estimator="k2", entropy_coef=0.01),
}
# (kl-logp: the KL on log-probs of its own, sampling replay's full ones)
INPUTS = ["plain", "on-policy", "isw-went", "clamped", "nan-adv", "nan-logp", "float64",
          "kl-logp"]


def twin_cases(inputs=INPUTS):
    """(impl, option set, input set) params: the C++ op every pair, the Triton twin every
    input set with one option set (dual-k3) and every option set with plain inputs, which
    reaches each of its specialisations' flags (each Triton case is ~1 s under the
    interpreter and a compilation on a device, where benchmarks/gpu_check.sh's test stage
    has a budget)."""
    return [pytest.param(impl, o, i, marks=cpu_op if impl == "cpu" else triton_ops,
                         id=f"{impl}-{o}-{i}")
            for impl in ("cpu", "triton") for o in OPTIONS for i in inputs
            if impl == "cpu" or o == "dual-k3" or i == "plain"]


def op_of(impl, name, module):
    """(the op ``name`` of impl "cpu" (torch.ops.ppo_kernels) or "triton" (the function of
    ppo_kernels.triton_kernels.<module>), the device its tensors live on)."""
    if impl == "cpu":
        return getattr(torch.ops.ppo_kernels, name), "cpu"
    mod = importlib.import_module(f"ppo_kernels.triton_kernels.{module}")
    return getattr(mod, name), TRITON_DEVICE


def case(policy, opts, inputs, dev):
    """(logp, ent, spec, x, logp_kl) of one case, [B, T] = [5, 19] on dev: a sequence inside
    the clip band, one on the dual clip's side, an empty one; logp_kl None but for
    inputs "kl-logp". (The dual clip only where the policy loss has one.)"""
    if policy in ("cispo", "sapo"):
        opts = {k: v for k, v in opts.items() if k != "dual_clip_c"}
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
    isw = w_ent = logp_kl = None
    if inputs == "on-policy":
        old = None
    if inputs == "isw-went":
        isw = torch.rand(B, T, generator=g, dtype=dt) * 2
        w_ent = 0.5 * mask.to(dt)
    if inputs == "clamped":
        old[1] = logp[1] + 30.0  # the log-ratios past -20: no gradient through the ratio
    if inputs == "nan-adv":
        adv[4, mask[4].nonzero()[0, 0]] = float("nan")
    if inputs == "nan-logp":
        logp[4, mask[4].nonzero()[-1, 0]] = float("nan")
    if inputs == "kl-logp":
        logp_kl = logp - 0.3 * torch.rand(B, T, generator=g, dtype=dt)
    logp, ent, old, adv, mask, ref, w, isw, w_ent, logp_kl = (
        None if v is None else v.to(dev) for v in (logp, ent, old, adv, mask, ref, w, isw,
                                                    w_ent, logp_kl))
    x = types.SimpleNamespace(old=old, adv=adv, mask=mask, ref=ref if opts.get("kl_coef")
                              else None, isw=isw, weights=w, w_ent=w_ent, behaviour=None,
                              be=_backends.get_backend("torch", logp.device))
    spec = LossSpec.from_options(dt, dict(policy_loss=policy, **opts))
    return logp, ent, spec, x, logp_kl


def eager(monkeypatch, logp, ent, spec, x, logp_kl=None):
    """_two_phase.middle_grad with no op: (dlogp, dent, loss, pol[, dlogp_kl])."""
    with monkeypatch.context() as mp:
        mp.setattr(_two_phase, "fused_middle", lambda *a: None)
        return _two_phase.middle_grad(logp, ent, spec, x, logp_kl)


def assert_middle_close(got, want, spec, x, inputs,
                        names=("dlogp", "dent", "loss", "pol", "dkl")):
    """An op's outputs against the eager middle's: float32 within 2e-6 relative, float64
    within 1e-12; dlogp, pol and dkl on valid positions (the op writes 0 on masked ones;
    autograd leaves NaN there in a NaN sequence), dent only where the entropy has a
    coefficient (the two-phase path passes no entropy gradient otherwise); NaN where the
    eager middle gives NaN. The op's masked dlogp are 0; a NaN input (case's "nan-*", in
    sequence 4) makes the loss NaN and stays in its sequence."""
    tol = dict(rtol=1e-12, atol=1e-14) if got[0].dtype == torch.float64 else \
        dict(rtol=2e-6, atol=2e-7)
    for a, b, name in zip(got, want, names):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name in ("dlogp", "pol", "dkl"):
            a, b = a[x.mask], b[x.mask]
        if name == "dent" and spec.entropy_coef == 0.0:
            continue
        torch.testing.assert_close(a, b, equal_nan=True, msg=name, **tol)
    assert (got[0][~x.mask] == 0).all() and (got[3][~x.mask] == 0).all()
    if inputs.startswith("nan"):
        assert got[2].isnan() and got[0][4][x.mask[4]].isnan().any()
        assert torch.isfinite(got[0][:4]).all()  # the other sequences keep their values


def assert_bad_arguments_raise(op, dev, policy, other_policy_id, policy_error, shape_error):
    """op (a middle op) refuses the id of a policy loss it does not compute and an input
    of another shape than logp's, each with an error naming the argument."""
    logp, ent, spec, x, _ = case(policy, {}, "plain", dev)
    scalars, codes = spec.kernel_args(torch.float32)
    other = list(codes)
    other[0] = other_policy_id
    with pytest.raises(policy_error, match="policy_loss"):
        op(logp, ent, x.mask, x.old, x.adv, None, None, x.weights, None, scalars, other)
    with pytest.raises(shape_error, match="adv"):
        op(logp, ent, x.mask, x.old, x.adv[:, :3], None, None, x.weights, None, scalars, codes)
    # an id that a cast to the kernels' int would truncate to the right one; a flag not 0 / 1
    wrapped = list(codes)
    wrapped[0] += 2**32
    with pytest.raises((ValueError, RuntimeError), match="policy_loss"):
        op(logp, ent, x.mask, x.old, x.adv, None, None, x.weights, None, scalars, wrapped)
    flag = list(codes)
    flag[2] = 2
    with pytest.raises((ValueError, RuntimeError), match="kl_bias_correction"):
        op(logp, ent, x.mask, x.old, x.adv, None, None, x.weights, None, scalars, flag)
    return logp, ent, x, scalars, codes


def loss_inputs(seed, dev):
    """([logits [3, 9, 13], tokens, old (the logits' own log-probs moved a little), adv (one
    per sequence), mask] on dev, ref on dev, the CPU generator for more draws)."""
    g = torch.Generator().manual_seed(seed)
    B, T, V = 3, 9, 13
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    old = old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T)
    mask = torch.rand(B, T, generator=g) > 0.2
    ref = old + 0.05 * torch.randn(B, T, generator=g)
    return [v.to(dev) for v in (logits, tokens, old, adv, mask)], ref.to(dev), g


def eager_and_cpu_op(monkeypatch, op_name, logits, *args, **kw):
    """ppo_loss(logits.clone(), *args, backend="cpu", **kw) forward and backward with the
    eager middle, then with the C++ op ppo_kernels.<op_name> (spied on: it must run then and
    only then). Returns ((loss, logits grad, metrics) eager, the same with the op)."""
    out = []
    for fused in (False, True):
        with monkeypatch.context() as mp:
            if not fused:
                mp.setattr(_two_phase, "fused_middle", lambda *a: None)
            calls = device_path.spy(mp, torch.ops.ppo_kernels, op_name)
            x = logits.detach().clone().requires_grad_()
            loss, metrics = pk.ppo_loss(x, *args, backend="cpu", **kw)
            loss.backward()
            out.append((loss.detach(), x.grad, dict(metrics)))
            assert bool(calls) == fused, op_name
    return out[0], out[1]


def assert_loss_close(got, want):
    """(loss, logits grad, metrics) within float32 rounding of the eager middle's."""
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)
    assert got[2].keys() == want[2].keys()
    for k in want[2]:
        torch.testing.assert_close(got[2][k], want[2][k], rtol=2e-6, atol=1e-7, msg=k)
