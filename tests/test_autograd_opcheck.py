"""Tests of ppo_kernels/_autograd.py's op registrations: torch.library.opcheck of every
compiled op and of the Triton ops (schema, fake/meta function, autograd registration, AOT
dispatch), and torch.compile(fullgraph=True) of the public API against eager."""

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as ref
from ppo_kernels import testing

from helpers.asserts import assert_grad_close
from helpers.backends import TRITON_DEVICE, triton_ops
from helpers.inputs import make_inputs
from helpers.raw_ops import kernel_args, slot_args

OPS = torch.ops.ppo_kernels
DEV = TRITON_DEVICE  # the Triton ops' tensors
B, T, V = 3, 5, 37


@pytest.fixture
def case(gen):
    inp = make_inputs(B, T, V, gen)
    inp["logits"] = inp["full"][:, :T].contiguous()
    inp["weights"] = inp["mask"].float() / inp["mask"].sum()
    return inp


def _lp_args(inp, grad, raw=False):
    logits = (inp["full"] if raw else inp["logits"]).clone().requires_grad_(grad)
    return (logits, inp["tokens"], inp["mask"], 0.8, True)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("raw", [False, True])
def test_opcheck_token_logprobs_fwd(case, grad, raw):
    torch.library.opcheck(OPS.token_logprobs_fwd, _lp_args(case, grad, raw))
    a = _lp_args(case, grad, raw)
    torch.library.opcheck(OPS.token_logprobs_fwd, a[:4] + (False,))


def test_opcheck_token_logprobs_bwd(case):
    logits = case["logits"]
    logp, ent, mx, ls = OPS.token_logprobs_fwd(logits, case["tokens"], case["mask"], 0.8, True)
    g = torch.randn(B, T)
    torch.library.opcheck(OPS.token_logprobs_bwd, (g, torch.randn(B, T), logits, case["tokens"],
                                                   case["mask"], mx, ls, ent, 0.8))
    torch.library.opcheck(OPS.token_logprobs_bwd, (g, None, logits, case["tokens"],
                                                   case["mask"], mx, ls, ent, 0.8))


def _loss_args(inp, logits, *, ref_=True, isw=True):
    # optional=False also leaves out old_logprobs (on-policy) and uses entropy weights
    return (logits, inp["tokens"], inp["mask"], inp["old"] if ref_ else None, inp["adv"],
            inp["weights"], inp["ref"] if ref_ else None, inp["isw"] if isw else None,
            None if ref_ else inp["weights"] * 0.5,
            *kernel_args(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0, kl_coef=0.1,
                         kl_estimator="k3", entropy_coef=0.01, temperature=0.9, grad_scale=0.5,
                         kl_bias_correction=not ref_))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("optional", [True, False])
def test_opcheck_ppo_loss_fwd(case, grad, optional):
    logits = case["logits"].clone().requires_grad_(grad)
    args = _loss_args(case, logits, ref_=optional, isw=optional)
    # opcheck's default checks, test_aot_dispatch_dynamic included: the backward rescales
    # the dlogits buffer in place only once the caller has let go of the op's dlogits
    # output (_autograd.hand_out), so a raw call that keeps it gets a fresh gradient
    res = torch.library.opcheck(OPS.ppo_loss_fwd, args + (grad,))
    assert set(res) == set(DEFAULT_UTILS) and all(v == "SUCCESS" for v in res.values()), res


DEFAULT_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name", testing.registered_ops())
@pytest.mark.parametrize("temps", [False, True], ids=["temperature", "per_row"])
def test_opcheck_default_checks_every_cpu_op(name, temps):
    """torch.library.opcheck with its default checks on every op of the compiled extension
    (listed from the dispatcher), the differentiable ones with logits that require grad,
    arguments built from public options (ppo_kernels.testing.opcheck_arguments)."""
    schema = getattr(OPS, name).default._schema
    if temps and "temperatures" not in [a.name for a in schema.arguments]:
        pytest.skip(f"{name} takes no per-row temperature")
    res = testing.opcheck(name, dict(clip_eps_high=0.28, dual_clip_c=3.0, grad_scale=0.5),
                          temperatures=temps)
    assert set(res) == set(DEFAULT_UTILS) and all(v == "SUCCESS" for v in res.values()), res


def test_ppo_loss_fwd_raw_output_is_not_changed_by_the_backward(case):
    """The dlogits output a raw caller holds is theirs: the backward hands out a fresh,
    rescaled gradient instead of rescaling that output in place (what AOT autograd's
    partitioner refused as "Node ... was invalid, but is output")."""
    logits = case["logits"].clone().requires_grad_(True)
    out = OPS.ppo_loss_fwd(*_loss_args(case, logits), True)
    before = out[4].detach().clone()
    (out[0] * 3.0).backward()
    torch.testing.assert_close(out[4].detach(), before, rtol=0, atol=0)
    torch.testing.assert_close(logits.grad, before * (3.0 / 0.5))  # grad_scale 0.5


def test_opcheck_ppo_loss_fwd_inplace(case):
    logits = case["logits"].clone()
    torch.library.opcheck(OPS.ppo_loss_fwd_inplace, _loss_args(case, logits))


def _row_temps(inp):
    """A per-row temperature [B, T] (1 on masked positions), the ops' `temperatures`."""
    g = torch.Generator().manual_seed(7)
    return torch.where(inp["mask"], 0.5 + torch.rand(B, T, generator=g), 1.0)


@pytest.mark.parametrize("grad", [False, True])
def test_opcheck_with_per_row_temperatures(case, grad):
    """The optional `temperatures` argument through every op's schema, fake function and
    autograd registration (token_logprobs_fwd's backward saves it for token_logprobs_bwd)."""
    tt = _row_temps(case)
    logits = case["logits"].clone().requires_grad_(grad)
    torch.library.opcheck(OPS.token_logprobs_fwd, (logits, case["tokens"], case["mask"], 1.0,
                                                   True), {"temperatures": tt})
    logp, ent, mx, ls = OPS.token_logprobs_fwd(case["logits"], case["tokens"], case["mask"],
                                               1.0, True, temperatures=tt)
    g = torch.randn(B, T)
    torch.library.opcheck(OPS.token_logprobs_bwd, (g, g.clone(), case["logits"],
                                                   case["tokens"], case["mask"], mx, ls, ent,
                                                   1.0), {"temperatures": tt})
    torch.library.opcheck(OPS.ppo_loss_fwd, _loss_args(case, logits) + (grad,),
                          {"temperatures": tt})
    torch.library.opcheck(OPS.ppo_loss_fwd_inplace, _loss_args(case, case["logits"].clone()),
                          {"temperatures": tt})
    torch.library.opcheck(OPS.score_rollout, (case["logits"], case["tokens"], case["mask"],
                                              case["ref"], torch.randn(B, T), torch.randn(B),
                                              0.05, 0, 0.99, 0.95, 1.0), {"temperatures": tt})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("go", [1.0, 0.25])
def test_opcheck_scale_grad_(case, dtype, go):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    grad = case["full"].to(dtype).clone()
    torch.library.opcheck(OPS.scale_grad_, (grad, torch.tensor(go, dtype=acc),
                                            torch.tensor(1.0, dtype=acc)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("big", [False, True])
def test_opcheck_zeros_grad(case, dtype, big):
    """zeros_grad: zeros of like's shape and dtype, contiguous (big: from the recycled
    gradient memory, which held a gradient before)."""
    like = case["full"].to(dtype)
    if big:  # over grad_buffer.h's 4 MiB: recycled memory, here left non-zero
        like = torch.empty(64, 9, 1024, dtype=dtype)
        OPS.zeros_grad(like).fill_(3.0)
    z = OPS.zeros_grad(like)
    assert z.shape == like.shape and z.dtype == dtype and z.is_contiguous()
    assert not z.any()
    torch.library.opcheck(OPS.zeros_grad, (like,))


@pytest.mark.parametrize("boot", [False, True])
@pytest.mark.parametrize("lams", ["scalar", "per_seq", "decoupled", "both"])
def test_opcheck_gae(case, gen, boot, lams):
    r = torch.randn(B, T, generator=gen)
    v = torch.randn(B, T, generator=gen)
    bv = torch.randn(B, generator=gen) if boot else None
    lps = torch.rand(B, generator=gen) if lams in ("per_seq", "both") else None
    vl = 1.0 if lams in ("decoupled", "both") else None
    torch.library.opcheck(OPS.gae, (r, v, case["mask"], bv, 0.99, 0.95, lps, vl))


@pytest.mark.parametrize("lams", ["scalar", "both"])
def test_opcheck_score_rollout(case, gen, lams):
    extra = (torch.rand(B, generator=gen), 1.0) if lams == "both" else ()
    torch.library.opcheck(OPS.score_rollout, (case["logits"], case["tokens"], case["mask"],
                                              case["ref"], torch.randn(B, T, generator=gen),
                                              torch.randn(B, generator=gen), 0.05, 0, 0.99,
                                              0.95, 1.0, *extra))


# ------------------------------------------------------------------ the Triton ops
# ppo_kernels::triton_* (registered by triton_kernels/library.py, their fake and
# autograd formulas by ppo_kernels/_autograd.py, as for the C++ ops above)

def _opcheck_cases():
    B, T, V = 2, 3, 7
    gen = torch.Generator().manual_seed(95)
    L = torch.randn(B, T + 1, V, generator=gen).to(DEV)
    t = torch.randint(0, V, (B, T), generator=gen).to(DEV)
    m = torch.tensor([[True, False, True], [True, True, True]], device=DEV)
    z = torch.randn(B, T, generator=gen).to(DEV)
    w = (m.float() / m.sum()).contiguous()
    s = torch.randn(B, generator=gen).to(DEV)
    _, ent, row_max, log_sum = OPS.triton_token_logprobs_fwd(L, t, m, 1.0, True)
    return {
        "triton_token_logprobs_fwd": (L, t, m, 0.9, True),
        "triton_token_logprobs_bwd": (z, z.clone(), L, t, m, row_max, log_sum, ent, 0.9),
        "triton_ppo_loss_fwd": (L, t, m, z, z, w, z, None, None,
                                *slot_args(0.2, 0.2, 3.0, 0.1, 2, 0.01, 1.0, 0.5, 0, 1.0, 1.05,
                                       False), True),
        "triton_ppo_loss_fwd_inplace": (L.clone(), t, m, None, z, w, z, None, w.clone(),
                                        *slot_args(0.2, 0.2, 0.0, 0.1, 5, 0.01, 1.0, 2.0, 2, 0.9,
                                               1.1, True)),
        "triton_scale_grad_": (L.clone(), torch.tensor(0.25, device=DEV),
                               torch.tensor(2.0, device=DEV)),
        "triton_gae": (z, z.clone(), m, s, 0.9, 0.95),
        "triton_gae_vapo": (z, z.clone(), m, s, 0.9, 0.95, s.clone().clamp(0, 1), 1.0),
        "triton_score_rollout": (L, t, m, z, z, s, 0.1, 2, 1.0, 0.95, 1.0),
        "triton_score_rollout_vapo": (L, t, m, z, z, s, 0.1, 2, 1.0, 0.95, 1.0,
                                      s.clone().clamp(0, 1), 0.5),
    }


@triton_ops
@pytest.mark.parametrize("name", ["triton_token_logprobs_fwd", "triton_token_logprobs_bwd",
                                  "triton_ppo_loss_fwd", "triton_ppo_loss_fwd_inplace",
                                  "triton_scale_grad_", "triton_gae",
                                  "triton_score_rollout", "triton_gae_vapo",
                                  "triton_score_rollout_vapo"])
def test_opcheck_triton_ops(name):
    """torch.library.opcheck of each op with the fake/autograd registrations of
    ppo_kernels/_autograd.py: the schema's mutation annotations are honest (only the in-place
    op writes an input), the fake shapes/dtypes match the real outputs. Under the
    interpreter torch cannot trace a Triton kernel (wrap_triton hands interpreted kernels
    back untraced), so the AOT-dispatch checks run on CUDA only."""
    from ppo_kernels import _backends

    _backends.get_backend("triton", torch.device(DEV))  # registers the triton_* fakes/autograd
    utils = ["test_schema", "test_autograd_registration", "test_faketensor"]
    if DEV == "cuda":
        utils.append("test_aot_dispatch_dynamic")
    # (*_vapo: the op with lam_per_seq and value_lam)
    res = torch.library.opcheck(getattr(OPS, name.removesuffix("_vapo")).default,
                                _opcheck_cases()[name],
                                test_utils=utils)
    assert set(res) == set(utils) and all(v == "SUCCESS" for v in res.values()), res


@triton_ops
@pytest.mark.parametrize("name", ["triton_token_logprobs_fwd", "triton_token_logprobs_bwd",
                                  "triton_ppo_loss_fwd", "triton_ppo_loss_fwd_inplace",
                                  "triton_score_rollout"])
def test_opcheck_triton_ops_with_per_row_temperatures(name):
    """The same with the optional `temperatures` [B, T] (1 on the masked position)."""
    from ppo_kernels import _backends

    _backends.get_backend("triton", torch.device(DEV))
    utils = ["test_schema", "test_autograd_registration", "test_faketensor"]
    if DEV == "cuda":
        utils.append("test_aot_dispatch_dynamic")
    args = _opcheck_cases()[name]
    m = args[2] if name != "triton_token_logprobs_bwd" else args[4]
    tt = torch.where(m, torch.linspace(0.5, 1.5, m.numel(), device=DEV).view(m.shape), 1.0)
    res = torch.library.opcheck(getattr(OPS, name).default, args, {"temperatures": tt},
                                test_utils=utils)
    assert set(res) == set(utils) and all(v == "SUCCESS" for v in res.values()), res


# ------------------------------------------------------------------ torch.compile

def _ppo(x, inp, **kw):
    return pk.ppo_loss(x, inp["tokens"], inp["old"], inp["adv"], inp["mask"], inp["ref"],
                       kl_coef=0.1, entropy_coef=0.01, dual_clip_c=3.0, backend="cpu", **kw)


@pytest.mark.parametrize("kw", [dict(), dict(loss_agg_mode="seq-mean-token-mean"),
                                dict(loss_agg_mode="none"), dict(inplace_backward=True)],
                         ids=["token-mean", "seq-mean-token-mean", "none", "inplace"])
def test_compile_fullgraph_ppo_loss_matches_eager(case, kw):
    """torch.compile(fullgraph=True) of a function calling pk.ppo_loss; its backward goes
    through the compiled graph's autograd. Same loss, metrics and gradient as eager."""
    torch._dynamo.reset()

    def f(x):
        loss, met = _ppo(x, case, **kw)
        if loss.dim():
            loss = (loss * torch.linspace(0.5, 1.5, T)).sum()
        return loss * 2.0, met

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if kw else "inductor")
    x1 = case["logits"].clone().requires_grad_(True)
    x2 = case["logits"].clone().requires_grad_(True)
    # a non-leaf in front of the loss, as in a model (in-place backward overwrites it)
    l1, m1 = compiled(x1 * 1.0)
    l2, m2 = f(x2 * 1.0)
    l1.backward()
    l2.backward()
    assert float(l1.detach()) == pytest.approx(float(l2.detach()), rel=1e-6, abs=1e-7)
    for k in m2:
        assert float(m1[k]) == pytest.approx(float(m2[k]), rel=1e-6, abs=1e-7), k
    assert_grad_close(x1.grad, x2.grad.double().numpy(), 1e-6)
    if not kw:  # and against the reference
        _, _, e_grad = ref.ppo_loss(case["base"], case["tokens"], case["old"], case["adv"],
                                    case["mask"], case["ref"], kl_coef=0.1, entropy_coef=0.01,
                                    dual_clip_c=3.0)
        assert_grad_close(x1.grad, 2.0 * e_grad, 1e-5)


def test_compile_fullgraph_rollout_and_logprobs(case, gen):
    torch._dynamo.reset()
    values = torch.randn(B, T, generator=gen)
    scores = torch.randn(B, generator=gen)

    def f(x):
        lp, h = pk.token_logprobs(x, case["tokens"], case["mask"], return_entropy=True,
                                  backend="cpu")
        out = pk.score_rollout(x.detach(), case["tokens"], case["ref"], values, scores,
                               case["mask"], kl_coef=0.05, backend="cpu")
        adv, ret = pk.gae(out.rewards, values, case["mask"], gamma=0.99, backend="cpu")
        return lp.sum() + 0.1 * h.sum(), out, adv

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x1 = case["logits"].clone().requires_grad_(True)
    x2 = case["logits"].clone().requires_grad_(True)
    s1, o1, a1 = compiled(x1)
    s2, o2, a2 = f(x2)
    s1.backward()
    s2.backward()
    torch.testing.assert_close(s1, s2)
    for name in o2._fields:
        torch.testing.assert_close(getattr(o1, name), getattr(o2, name))
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(x1.grad, x2.grad)


def test_compile_out_of_range_token_still_caught(case):
    """Inside a compiled graph the token check cannot raise a ValueError before tracing;
    it must still fail loudly (a runtime assertion naming `tokens`), never read out of
    bounds or return garbage."""
    torch._dynamo.reset()
    tokens = case["tokens"].clone()
    b, t = torch.nonzero(case["mask"])[0].tolist()
    tokens[b, t] = V + 5

    def f(x, tok):
        return pk.ppo_loss(x, tok, case["old"], case["adv"], case["mask"], backend="cpu")[0]

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="tokens"):
        compiled(case["logits"], tokens)
