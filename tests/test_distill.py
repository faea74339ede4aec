"""pk.distill_loss (top-k distillation): the numpy reference's gradient by finite
differences, every backend against the reference (forward, gradient, metrics), gradcheck in
float64, hypothesis over random sets, the numerics of the edge cases (empty sets, size 1,
the whole vocabulary, a teacher mass of 1, a student mass near 1), packed sequences,
grad_scale and the bad-input table."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ppo_kernels as pk
from ppo_kernels import reference as ref

from helpers.asserts import raises_naming
from helpers.backends import BACKENDS_CPU, KERNELS_CPU
from helpers.inputs import make_teacher

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
         "seq-mean-token-sum-norm"]


def on(be, teacher):
    return pk.SparseLogprobs(*(be.t(x) for x in teacher))


def run(be, logits, teacher, mask=None, **kw):
    leaf = be.t(logits.detach()).requires_grad_()
    loss, m = pk.distill_loss(leaf, on(be, teacher), be.t(mask), backend=be.name, **kw)
    (loss.sum() if loss.dim() else loss).backward()
    return loss.detach().cpu(), leaf.grad.cpu(), {k: float(v) for k, v in m.items()}


def check_against_reference(be, logits, teacher, mask=None, tol=2e-6, **kw):
    loss, grad, m = run(be, logits, teacher, mask, **kw)
    rl, rg, rm = ref.distill_loss(logits.double(), teacher.offsets, teacher.token_ids,
                                  teacher.logprobs.double(), mask, **kw)
    scale = max(1.0, float(np.abs(rl).max()))
    np.testing.assert_allclose(loss.double().numpy(), rl, rtol=tol, atol=tol * scale)
    gmax = max(float(np.abs(rg).max()), 1e-30)
    assert float(np.abs(grad.double().numpy() - rg).max()) <= tol * gmax + 1e-12, "dlogits"
    for k, v in rm.items():
        assert m[k] == pytest.approx(v, rel=tol * 10, abs=tol * 10), k


# ------------------------------------------------------------------ the reference itself

@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_reference_gradient_finite_differences(tail, temperature, gen):
    n, v = 5, 7
    z = np.random.default_rng(1).normal(size=(n, v)) * 2
    te = make_teacher(n, v, gen, sizes=[0, 1, 3, v, 5], dtype=torch.float64)
    args = (te.offsets, te.token_ids, te.logprobs)
    kl, _, _, g = ref.distill_terms(z, *args, tail=tail, temperature=temperature)
    w = np.random.default_rng(2).uniform(0.5, 1.5, size=n)
    eps = 1e-6
    num = np.zeros_like(z)
    for i in range(n):
        for j in range(v):
            zp, zm = z.copy(), z.copy()
            zp[i, j] += eps
            zm[i, j] -= eps
            fp = ref.distill_terms(zp, *args, tail=tail, temperature=temperature)[0]
            fm = ref.distill_terms(zm, *args, tail=tail, temperature=temperature)[0]
            num[i, j] = (w * (fp - fm)).sum() / (2 * eps)
    np.testing.assert_allclose(g * w[:, None], num, rtol=1e-6, atol=1e-8)
    assert kl[0] == 0.0  # the empty set


def test_reference_whole_vocabulary_is_the_full_kl(gen):
    n, v = 3, 6
    z = np.random.default_rng(3).normal(size=(n, v))
    te = make_teacher(n, v, gen, sizes=[v] * n, dtype=torch.float64)
    kl, ps, tt, _ = ref.distill_terms(z, te.offsets, te.token_ids, te.logprobs, tail=True)
    pt = np.zeros((n, v))
    for i in range(n):
        pt[i, te.token_ids[i * v:(i + 1) * v].numpy()] = np.exp(te.logprobs[i * v:(i + 1) *
                                                                           v].numpy())
    logq = z - np.log(np.exp(z).sum(1, keepdims=True))
    full = (pt * (np.log(pt) - logq)).sum(1)
    np.testing.assert_allclose(kl, full, rtol=1e-12)
    np.testing.assert_allclose(tt, 0.0)
    np.testing.assert_allclose(ps, 1.0, rtol=1e-12)


def test_reference_tail_is_the_kl_of_the_bucketed_distributions():
    # S = {0}, V = 3: the two distributions over {0, rest}
    z = np.array([[1.0, 0.5, -0.3]])
    q = np.exp(z[0]) / np.exp(z[0]).sum()
    lt = np.log(0.6)
    kl, ps, tt, _ = ref.distill_terms(z, [0, 1], [0], [lt], tail=True)
    expect = 0.6 * np.log(0.6 / q[0]) + 0.4 * np.log(0.4 / (1 - q[0]))
    assert kl[0] == pytest.approx(expect, rel=1e-14)
    assert ps[0] == pytest.approx(q[0], rel=1e-14) and tt[0] == pytest.approx(0.4, rel=1e-14)
    kl0, _, _, _ = ref.distill_terms(z, [0, 1], [0], [lt], tail=False)
    assert kl0[0] == pytest.approx(0.6 * np.log(0.6 / q[0]), rel=1e-14)


# ------------------------------------------------------------------ every backend

@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("mode", MODES + ["none"])
def test_backends_match_reference(be, tail, mode, gen):
    b, t, v = 3, 4, 37
    logits = torch.randn(b, t, v, generator=gen) * 3
    mask = torch.rand(b, t, generator=gen) > 0.3
    mask[1] = False  # an empty sequence
    sizes = [0, 1, v, 4, 8, 2, 0, 37, 5, 3, 1, 6]
    te = make_teacher(b * t, v, gen, sizes=sizes)
    check_against_reference(be, logits, te, mask, tail=tail, loss_agg_mode=mode)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("layout", ["raw", "flat", "view"])
def test_layouts_and_temperature(be, layout, gen):
    b, t, v = 2, 3, 29
    full = torch.randn(b, t + 1, v, generator=gen) * 2
    te = make_teacher(b * t, v, gen, sizes=[3, 0, 29, 1, 7, 2])
    kw = dict(temperature=0.7, tail=True)
    if layout == "raw":
        loss, grad, _ = run(be, full, te, **kw)
        rl, rg, _ = ref.distill_loss(full.double(), te.offsets, te.token_ids,
                                     te.logprobs.double(), **kw)
        assert float(grad[:, t].abs().max()) == 0.0
    elif layout == "flat":
        x = full[:, :t].reshape(b * t, v)
        loss, grad, _ = run(be, x, te, **kw)
        rl, rg, _ = ref.distill_loss(x.double()[None], te.offsets, te.token_ids,
                                     te.logprobs.double(), **kw)
        rg = rg[0]
    else:
        leaf = be.t(full).requires_grad_()
        loss, _ = pk.distill_loss(leaf[:, :t], on(be, te), backend=be.name, **kw)
        loss.backward()
        loss = loss.detach()
        grad = leaf.grad.cpu()[:, :t]
        rl, rg, _ = ref.distill_loss(full[:, :t].double(), te.offsets, te.token_ids,
                                     te.logprobs.double(), **kw)
    assert float(loss) == pytest.approx(rl, rel=2e-6)
    np.testing.assert_allclose(grad.double().numpy(), rg, atol=2e-6 * np.abs(rg).max())


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision(be, dtype, gen):
    b, t, v = 2, 3, 41
    logits = (torch.randn(b, t, v, generator=gen) * 2).to(dtype)
    te = make_teacher(b * t, v, gen, sizes=[5, 0, 41, 1, 9, 3])
    loss, grad, _ = run(be, logits, te, grad_scale=4.0)
    rl, rg, _ = ref.distill_loss(logits.double(), te.offsets, te.token_ids, te.logprobs.double())
    assert grad.dtype == dtype
    assert float(loss) == pytest.approx(rl, rel=1e-5)  # (the logits as rounded: float32 math)
    assert float((grad.double() - torch.from_numpy(rg)).abs().max()) <= 1e-2 * np.abs(rg).max()


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("tail", [True, False])
def test_gradcheck_float64(be, tail, gen):
    b, t, v = 2, 2, 6
    logits = torch.randn(b, t, v, generator=gen, dtype=torch.float64)
    te = on(be, make_teacher(b * t, v, gen, sizes=[2, 0, 6, 1], dtype=torch.float64))
    mask = be.t(torch.tensor([[True, True], [False, True]]))

    def f(x):
        return pk.distill_loss(x, te, mask, tail=tail, temperature=0.8,
                               loss_agg_mode="seq-mean-token-mean", backend=be.name)[0]

    assert torch.autograd.gradcheck(f, (be.t(logits).requires_grad_(),))


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_gradcheck_float64_per_token(be, gen):
    b, t, v = 1, 3, 5
    logits = torch.randn(b, t, v, generator=gen, dtype=torch.float64)
    te = on(be, make_teacher(b * t, v, gen, sizes=[2, 5, 1], dtype=torch.float64))

    def f(x):
        return pk.distill_loss(x, te, loss_agg_mode="none", backend=be.name)[0]

    assert torch.autograd.gradcheck(f, (be.t(logits).requires_grad_(),))


# ------------------------------------------------------------------ numerics

@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_student_mass_near_one(be):
    """A confident student whose set holds 1 - 1e-6 of its mass: the complement is summed
    over the entries outside the set, so log(1 - PS) keeps its digits in float32."""
    v = 50
    x = torch.zeros(1, 2, v)
    x[..., :3] = 15.0  # three entries hold all but ~e^-15 * 47 / 3 of the mass
    ids = torch.tensor([0, 1, 2, 0, 1, 2])
    lt = torch.log(torch.tensor([0.3, 0.3, 0.3] * 2))  # teacher tail 0.1
    te = pk.SparseLogprobs(ids, torch.tensor([0, 3, 6]), lt)
    loss, grad, m = run(be, x, te)
    rl, rg, rm = ref.distill_loss(x.double(), te.offsets, te.token_ids, te.logprobs.double())
    assert float(loss) == pytest.approx(rl, rel=1e-6)
    np.testing.assert_allclose(grad.double().numpy(), rg, rtol=1e-5, atol=1e-6 * np.abs(rg).max())
    assert 1.0 - m["student_mass"] < 1e-5


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_teacher_mass_one_has_no_tail(be, gen):
    v = 9
    x = torch.randn(1, 2, v, generator=gen)
    te = make_teacher(2, v, gen, sizes=[4, 2], full_mass=True)
    with_tail = run(be, x, te, tail=True)
    without = run(be, x, te, tail=False)
    assert float(with_tail[0]) == pytest.approx(float(without[0]), rel=1e-6)
    assert with_tail[2]["teacher_tail_mass"] == pytest.approx(0.0, abs=1e-6)
    check_against_reference(be, x, te)


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_empty_sets_and_masked_garbage(be, gen):
    v = 8
    x = torch.randn(1, 3, v, generator=gen)
    # position 0 empty; position 1 masked with out-of-range ids, positive and NaN log-probs
    te = pk.SparseLogprobs(torch.tensor([99, -3, 2]), torch.tensor([0, 0, 2, 3]),
                           torch.tensor([float("nan"), 3.0, -0.5]))
    mask = torch.tensor([[True, False, True]])
    loss, grad, m = run(be, x, te, mask)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert float(grad[0, :2].abs().max()) == 0.0  # empty set: kl 0, no gradient
    te_ok = pk.SparseLogprobs(torch.tensor([0, 0, 2]), te.offsets, torch.tensor([-1.0, -1.0,
                                                                                 -0.5]))
    check_against_reference(be, x, te_ok, mask)
    all_masked = run(be, x, te_ok, torch.zeros(1, 3, dtype=torch.bool))
    assert float(all_masked[0]) == 0.0 and float(all_masked[1].abs().max()) == 0.0


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_whole_vocabulary_equals_full_kl(be, gen):
    v = 11
    x = torch.randn(2, 2, v, generator=gen) * 2
    te = make_teacher(4, v, gen, sizes=[v] * 4)
    loss, grad, m = run(be, x, te, loss_agg_mode="token-sum")
    pt = torch.zeros(4, v, dtype=torch.float64)
    pt[torch.arange(4).repeat_interleave(v), te.token_ids] = te.logprobs.double().exp()
    logq = torch.log_softmax(x.double().reshape(4, v), -1)
    full = (pt * (pt.log() - logq)).sum()
    assert float(loss) == pytest.approx(float(full), rel=1e-5)
    assert m["teacher_tail_mass"] == 0.0


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_vocabulary_of_one(be):
    x = torch.randn(1, 2, 1)
    te = pk.SparseLogprobs(torch.tensor([0]), torch.tensor([0, 1, 1]), torch.tensor([0.0]))
    loss, grad, _ = run(be, x, te)
    assert float(loss) == pytest.approx(0.0, abs=1e-7)
    assert float(grad.abs().max()) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("be", KERNELS_CPU)
def test_grad_scale_is_a_hint(be, gen):
    x = torch.randn(2, 3, 17, generator=gen)
    te = make_teacher(6, 17, gen)
    a = be.t(x).clone().requires_grad_()
    pk.distill_loss(a, on(be, te), backend=be.name)[0].backward()
    b_ = be.t(x).clone().requires_grad_()
    (pk.distill_loss(b_, on(be, te), grad_scale=0.25, backend=be.name)[0] * 0.25).backward()
    c = be.t(x).clone().requires_grad_()
    (pk.distill_loss(c, on(be, te), grad_scale=0.25, backend=be.name)[0] * 3.0).backward()
    torch.testing.assert_close(b_.grad, a.grad * 0.25)
    torch.testing.assert_close(c.grad, a.grad * 3.0)


# ------------------------------------------------------------------ hypothesis

@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(v=st.integers(1, 24), n=st.integers(1, 6), seed=st.integers(0, 2 ** 31 - 1),
       tail=st.booleans(), kind=st.sampled_from(["random", "empty", "one", "whole", "mixed"]),
       be_name=st.sampled_from(["cpu", "torch"]))
def test_hypothesis_random_sets(v, n, seed, tail, kind, be_name):
    gen = torch.Generator().manual_seed(seed)
    sizes = {"random": None, "empty": [0] * n, "one": [1] * n, "whole": [v] * n,
             "mixed": [(0, 1, v)[i % 3] for i in range(n)]}[kind]
    te = make_teacher(n, v, gen, sizes=sizes)
    x = torch.randn(1, n, v, generator=gen) * 3
    be = next(p.values[0] for p in BACKENDS_CPU if p.values[0].name == be_name)
    check_against_reference(be, x, te, tol=5e-6, tail=tail)


# ------------------------------------------------------------------ packed sequences

@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_matches_padded(be, mode, gen):
    v = 13
    lens = [3, 1, 4]
    total = sum(lens)
    x = torch.randn(total, v, generator=gen)
    te = make_teacher(total, v, gen)
    cu = torch.tensor([0, 3, 4, 8])
    loss_p, grad_p, m_p = run(be, x, te, cu_seqlens=cu, max_seqlen=4, loss_agg_mode=mode)
    # the padded equivalent, [S, 4] with empty sets on the padding
    xs = torch.zeros(3, 4, v)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    ids, lps, off = [], [], [0]
    for s, (a, ln) in enumerate(zip([0, 3, 4], lens)):
        for p in range(4):
            if p < ln:
                i = a + p
                xs[s, p] = x[i]
                mask[s, p] = True
                o0, o1 = int(te.offsets[i]), int(te.offsets[i + 1])
                ids.append(te.token_ids[o0:o1])
                lps.append(te.logprobs[o0:o1])
                off.append(off[-1] + o1 - o0)
            else:
                off.append(off[-1])
    te_pad = pk.SparseLogprobs(torch.cat(ids), torch.tensor(off), torch.cat(lps))
    loss_d, grad_d, m_d = run(be, xs, te_pad, mask, loss_agg_mode=mode)
    assert float(loss_p) == pytest.approx(float(loss_d), rel=1e-6)
    assert m_p["num_seqs"] == m_d["num_seqs"] == 3
    torch.testing.assert_close(grad_p, grad_d[mask].view(total, v), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ bad input

def _base():
    x = torch.randn(1, 2, 5)
    te = pk.SparseLogprobs(torch.tensor([0, 1, 3]), torch.tensor([0, 2, 3]),
                           torch.tensor([-1.0, -2.0, -0.5]))
    return x, te


BAD = [
    ("teacher.token_ids", lambda te: te._replace(token_ids=torch.tensor([0, 1, 5]))),
    ("teacher.token_ids", lambda te: te._replace(token_ids=torch.tensor([0, -1, 3]))),
    ("teacher.token_ids", lambda te: te._replace(token_ids=torch.tensor([1, 1, 3]))),
    ("teacher.token_ids", lambda te: te._replace(token_ids=te.token_ids.float())),
    # (a repeat within a position when every position holds k ids: the per-row check)
    ("teacher.token_ids", lambda te: pk.SparseLogprobs(
        torch.tensor([0, 4, 2, 2]), torch.tensor([0, 2, 4]), torch.tensor([-1.0, -2.0, -1.0,
                                                                           -2.0]))),
    ("teacher.offsets", lambda te: te._replace(offsets=torch.tensor([0, 3, 2]))),
    ("teacher.offsets", lambda te: te._replace(offsets=torch.tensor([0, 2, 2]))),
    ("teacher.offsets", lambda te: te._replace(offsets=torch.tensor([1, 2, 3]))),
    ("teacher.offsets", lambda te: te._replace(offsets=torch.tensor([0, 1, 2, 3]))),
    ("teacher.logprobs", lambda te: te._replace(logprobs=torch.tensor([-1.0, 0.1, -0.5]))),
    ("teacher.logprobs", lambda te: te._replace(logprobs=torch.tensor([-0.1, -0.2, -0.5]))),
    ("teacher.logprobs", lambda te: te._replace(logprobs=torch.tensor([-1.0, float("nan"),
                                                                       -0.5]))),
    ("teacher.logprobs", lambda te: te._replace(logprobs=torch.tensor([-1.0, -2.0]))),
    ("teacher.logprobs", lambda te: te._replace(logprobs=torch.tensor([0, -1, -1]))),
    ("teacher", lambda te: (te.token_ids, te.offsets)),
    ("teacher", lambda te: {"token_ids": te.token_ids}),
]


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("name,make", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_teacher(be, name, make):
    x, te = _base()
    bad = make(te)
    if isinstance(bad, pk.SparseLogprobs):
        bad = on(be, bad)
    raises_naming(lambda: pk.distill_loss(be.t(x), bad, backend=be.name), name)


@pytest.mark.parametrize("name,kw", [
    ("tail", dict(tail=1)), ("temperature", dict(temperature=0.0)),
    ("loss_agg_mode", dict(loss_agg_mode="mean")), ("grad_scale", dict(grad_scale=-1.0)),
    ("backend", dict(backend="nope")), ("response_mask", dict(response_mask=torch.ones(3, 2))),
    ("global_num_tokens", dict(global_num_tokens=0)), ("norm_length", dict(norm_length=-1)),
    ("max_seqlen", dict(max_seqlen=3)),
])
def test_bad_options(name, kw):
    x, te = _base()
    raises_naming(lambda: pk.distill_loss(x, te, **kw), name)


def test_bad_logits():
    _, te = _base()
    raises_naming(lambda: pk.distill_loss(torch.randn(1, 2, 5).long(), te), "logits")
    raises_naming(lambda: pk.distill_loss(torch.randn(5), te), "logits")
    raises_naming(lambda: pk.distill_loss(torch.randn(1, 2, 0), te), "logits")
    raises_naming(lambda: pk.distill_loss(torch.randn(3, 2, 5), te), "teacher.offsets")
    raises_naming(lambda: pk.distill_loss(torch.randn(3, 5), te), "teacher.offsets")


def test_public_names():
    assert pk.SparseLogprobs._fields == ("token_ids", "offsets", "logprobs")
    assert "distill_loss" in pk.__all__ and "distill_loss_from_hidden" in pk.__all__
    assert math.isclose(pk.distill.MASS_TOLERANCE, 1e-3)


# ------------------------------------------------------------------ the raw ops

@pytest.mark.parametrize("be", KERNELS_CPU)
def test_raw_op_defends_itself(be):
    """Direct callers of ppo_kernels::[triton_]distill_fwd get an error naming the
    argument, never an out-of-bounds read."""
    import ppo_kernels.distill  # noqa: F401  (registers the op's autograd)

    op = getattr(torch.ops.ppo_kernels, ("triton_" if be.name == "triton" else "") +
                 "distill_fwd")
    x = torch.randn(1, 2, 5)
    m = torch.ones(1, 2, dtype=torch.bool)
    w = torch.ones(1, 2)
    lt = torch.tensor([-1.0, -2.0, -0.5])
    with pytest.raises((RuntimeError, ValueError), match="offsets"):
        op(x, m, torch.tensor([0, 3]), torch.tensor([0, 1, 3]), lt, w, 1.0, 1.0, True, True)
    with pytest.raises((RuntimeError, ValueError), match="teacher_logprobs"):
        op(x, m, torch.tensor([0, 2, 3]), torch.tensor([0, 1, 3]), lt[:2], w, 1.0, 1.0, True,
           True)
    if be.name == "cpu":
        with pytest.raises(RuntimeError, match="token_ids"):
            op(x, m, torch.tensor([0, 2, 3]), torch.tensor([0, 1, 7]), lt, w, 1.0, 1.0, True,
               True)
    # a chunk's view of the offsets (starting past 0) is accepted
    loss, kl, _, _, _ = op(x[:, 1:], m[:, 1:], torch.tensor([2, 3]), torch.tensor([0, 1, 3]),
                           lt, w[:, 1:], 1.0, 1.0, True, False)
    rk, _, _, _ = ref.distill_terms(x[0, 1:].double(), [0, 1], [3], [-0.5])
    assert float(kl[0, 0]) == pytest.approx(float(rk[0]), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("grad", [False, True])
def test_opcheck_distill_fwd(grad, gen):
    """torch.library.opcheck of the C++ op: schema, fake function, autograd registration
    (and AOT dispatch without a gradient: with one, the dlogits output is the buffer the
    backward rescales in place, which a raw call returns, as for ppo_loss_fwd)."""
    from ppo_kernels._autograd import register_distill

    register_distill("")
    x = torch.randn(2, 3, 9, generator=gen).requires_grad_(grad)
    te = make_teacher(6, 9, gen, sizes=[2, 0, 9, 1, 3, 4])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    w = mask.float() / mask.sum()
    utils = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
    if grad:
        utils = utils[:-1]
    torch.library.opcheck(torch.ops.ppo_kernels.distill_fwd,
                          (x, mask, te.offsets, te.token_ids, te.logprobs, w, 0.9, 1.0, True,
                           grad), test_utils=utils)


def test_compile_fullgraph_matches_eager(gen):
    """torch.compile(fullgraph=True) traces the checks (device-assert form), the kernel op
    and its autograd: loss and gradient as eager, with a grad_output != grad_scale."""
    x = torch.randn(2, 3, 17, generator=gen)
    te = make_teacher(6, 17, gen)
    pk.distill_loss(x, te)  # (registers the op's autograd outside the trace)

    def f(z):
        return pk.distill_loss(z, te, loss_agg_mode="seq-mean-token-mean")[0]

    a = x.clone().requires_grad_()
    (f(a) * 2.0).backward()
    b = x.clone().requires_grad_()
    loss_c = torch.compile(f, fullgraph=True)(b)
    (loss_c * 2.0).backward()
    assert float(loss_c.detach()) == pytest.approx(float(f(x)), rel=1e-6)
    torch.testing.assert_close(b.grad, a.grad)


# ------------------------------------------------------------------ the CSR checks' cost

def _brute_first_problem(ids, off, vocab, valid):
    """The error check_csr must raise, from Python loops: ("offsets" / "range" / "dup",
    detail) or None."""
    n = len(off) - 1
    for i in range(n):
        if valid[i]:
            for a in range(off[i], off[i + 1]):
                if not 0 <= ids[a] < vocab:
                    return "range", (ids[a], a, i)
    for i in range(n):
        if valid[i]:
            row = ids[off[i]:off[i + 1]]
            dups = sorted({x for x in row if row.count(x) > 1})
            if dups:
                return "dup", (dups[0], i)
    return None


@pytest.mark.parametrize("vocab", [7, 2 ** 40])  # int32 keys; int64 keys (n * V >= 2^31)
def test_check_csr_random_against_brute_force(vocab):
    """check_csr (one range pass, one key sort) raises exactly when a valid position holds
    an id out of [0, vocab) or a repeated id, naming the first such entry / position as the
    Python loops find it; masked positions' entries are never looked at."""
    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        n = int(torch.randint(1, 7, (1,), generator=g))
        fixed = trial % 2 == 0
        counts = [3] * n if fixed else torch.randint(0, 5, (n,), generator=g).tolist()
        off = [0]
        for c in counts:
            off.append(off[-1] + c)
        hi = 7 + (trial % 3)  # ids in [-1, hi): sometimes out of range, often repeated
        ids = (torch.randint(-1, hi, (off[-1],), generator=g) if trial % 5 == 0 else
               torch.randint(0, min(hi, 7), (off[-1],), generator=g)).tolist()
        valid = (torch.rand(n, generator=g) > 0.3).tolist()
        want = _brute_first_problem(ids, off, vocab, valid)
        call = lambda: pk.distill.check_csr(  # noqa: E731
            "teacher", torch.tensor(ids, dtype=torch.long), torch.tensor(off), n,
            torch.zeros(1), vocab=vocab, row_valid=torch.tensor(valid))
        if want is None:
            out_ids, out_off, row_of = call()
            assert out_ids.tolist() == ids and out_off.tolist() == off
            assert row_of.tolist() == [i for i, c in enumerate(counts) for _ in range(c)]
            continue
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        if want[0] == "range":
            assert f"got {want[1][0]} at entry {want[1][1]} (position {want[1][2]})" in msg
        else:
            assert f"id {want[1][0]} appears twice at position {want[1][1]}" in msg


def _passes_over(n_big, fn, threads=2):
    """The ATen ops fn() runs on tensors of at least n_big elements, each with the number of
    intra-op threads it ran under."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            big = any(isinstance(a, torch.Tensor) and a.numel() >= n_big
                      for a in torch.utils._pytree.tree_leaves((args, kwargs)))
            if big and func.__name__.split(".")[0] not in ("view", "detach", "alias",
                                                           "_to_copy", "slice", "select"):
                seen.append((func.__name__, torch.get_num_threads()))
            return func(*args, **(kwargs or {}))

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with Count():
            fn()
    finally:
        torch.set_num_threads(before)
    return seen


@pytest.mark.parametrize("masked", [False, True])
def test_csr_checks_are_a_few_single_threaded_passes(masked):
    """At a top-k teacher's size the CPU checks of check_call are a few passes over the
    [nnz] entries, on one intra-op thread: above ATen's grain size each op would otherwise
    be a parallel region, a scheduler time slice each on a loaded machine (the old checks:
    about 25 passes, 2 threads; 270-400 ms against a 40-100 ms kernel at N 1024, V 32000,
    k 64 with 2 threads on a loaded 2-core machine)."""
    g = torch.Generator().manual_seed(0)
    n, k = 64, 1024  # nnz = 65536, above the grain size
    v = 2 * k
    x = torch.randn(1, n, v)
    te = pk.SparseLogprobs(torch.stack([torch.randperm(v, generator=g)[:k]
                                        for _ in range(n)]).reshape(-1),
                           torch.arange(0, n * k + 1, k), torch.full((n * k,), -20.0))
    mask = torch.rand(1, n, generator=g) > 0.3 if masked else None
    opts = dict(tail=True, temperature=1.0, loss_agg_mode="token-mean", grad_scale=1.0,
                global_num_tokens=None, global_num_seqs=None, norm_length=None,
                backend="cpu", flat=False)
    passes = _passes_over(n * k - 1, lambda: pk.distill.check_call(x, v, te, mask, opts))
    assert all(t == 1 for _, t in passes), passes
    assert len(passes) <= (15 if masked else 11), passes
