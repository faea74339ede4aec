"""Tests of pk.token_logprobs (ppo_kernels/loss.py) and its entropy on every backend against
the numpy float64 reference: values, the gradient for arbitrary upstream gradients,
layouts, dtypes, -inf logits, masking, gradcheck; token ids out of range on masked
positions, token and mask dtypes, strided views of the logits."""

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as ref

from helpers.asserts import assert_close_np, assert_grad_close
from helpers.backends import BACKENDS, BACKENDS_CPU, combine
from helpers.inputs import SMALL_MASK, logits_for, make_inputs, small_inputs

# per-token outputs are float32 from float32 accumulation whatever the logits' dtype; the
# reference sees the same rounded logits
VAL_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6,
           torch.float64: 1e-11}
GRAD_REL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2,
            torch.float64: 1e-10}


def run(be, inp, *, temperature=1.0, entropy=True, dtype=torch.float32, gen=None,
        backward=True):
    leaf, logits = logits_for(inp, be, requires_grad=backward)
    out = pk.token_logprobs(logits, be.t(inp["tokens"]), be.t(inp["mask"]),
                            temperature=temperature, return_entropy=entropy, backend=be.name)
    logp, ent = out if entropy else (out, None)
    e_lp, e_h = ref.token_logprobs(inp["base"], inp["tokens"], inp["mask"], temperature)
    tol = VAL_TOL[dtype]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert logp.dtype == acc and logp.shape == inp["tokens"].shape
    assert_close_np(logp, e_lp, rtol=tol, atol=tol * max(1.0, np.abs(e_lp).max()),
                    what="logprobs")
    assert torch.all(logp.detach().cpu()[~inp["mask"]] == 0)
    if entropy:
        assert ent.dtype == acc
        assert_close_np(ent, e_h, rtol=tol, atol=tol * max(1.0, np.abs(e_h).max()),
                        what="entropy")
        assert torch.all(ent.detach().cpu()[~inp["mask"]] == 0)
    if not backward:
        return logp, ent, None
    glp = torch.randn(logp.shape, generator=gen, dtype=torch.float64)
    gh = torch.randn(logp.shape, generator=gen, dtype=torch.float64) if entropy else None
    total = (logp * be.t(glp.to(acc))).sum()
    if entropy:
        total = total + (ent * be.t(gh.to(acc))).sum()
    total.backward()
    grad = leaf.grad if logits is leaf else logits.grad
    e_grad = ref.token_logprobs_grad(inp["base"], inp["tokens"], inp["mask"], temperature,
                                     glp, gh)
    assert grad.dtype == dtype and grad.shape == e_grad.shape
    assert_grad_close(grad, e_grad, GRAD_REL[dtype])
    return logp, ent, grad


SIZES = [(3, 5, 1), (3, 5, 7), (2, 7, 257), (3, 5, 1000), (2, 3, 32000), (1, 1, 7),
         (1, 1, 32000)]


@pytest.mark.parametrize("be,B,T,V", combine(BACKENDS, SIZES, lambda B, T, V: f"B{B}T{T}V{V}"))
def test_matches_reference_sizes(be, B, T, V, gen):
    inp = make_inputs(B, T, V, gen)
    logp, ent, grad = run(be, inp, gen=gen)
    if V == 1:
        assert torch.all(logp == 0) and torch.all(ent == 0) and torch.all(grad == 0)


@pytest.mark.parametrize("be,dtype,B,T,V", combine(
    BACKENDS, [(d, 3, 5, 37) for d in (torch.bfloat16, torch.float16, torch.float64)] +
    [(d, 2, 3, 1000) for d in (torch.bfloat16, torch.float16, torch.float64)],
    lambda d, B, T, V: f"{str(d)[6:]}-V{V}"))
def test_dtypes(be, dtype, B, T, V, gen):
    run(be, make_inputs(B, T, V, gen, dtype=dtype), dtype=dtype, gen=gen, temperature=0.9)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 2.5])
@pytest.mark.parametrize("entropy", [False, True])
def test_temperature_and_entropy_flag(be, temperature, entropy, gen):
    run(be, make_inputs(3, 5, 37, gen), temperature=temperature, entropy=entropy, gen=gen)


@pytest.mark.parametrize("layout", ["view", "raw", "tbatch"])
@pytest.mark.parametrize("padding", ["left", "right", "interior", "random", "empty_row"])
def test_layouts_and_padding(be, layout, padding, gen):
    inp = make_inputs(3, 5, 37, gen, layout=layout, padding=padding)
    _, _, grad = run(be, inp, gen=gen)
    if layout == "raw":
        assert torch.all(grad[:, -1] == 0)


def test_neg_inf_logits(be, gen):
    inp = make_inputs(3, 5, 37, gen, neginf=True)
    logp, ent, grad = run(be, inp, gen=gen, temperature=0.8)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert torch.isfinite(grad).all()
    assert float(logp[0, 0].detach()) == 0.0 and float(ent[0, 0].detach()) == 0.0  # one finite entry: p = 1
    assert torch.all(grad.detach().cpu()[torch.isinf(inp["full"][:, :5])] == 0)


def test_all_masked(be, gen):
    inp = make_inputs(3, 5, 37, gen, padding="all")
    logp, ent, grad = run(be, inp, gen=gen)
    assert torch.all(logp == 0) and torch.all(ent == 0) and torch.all(grad == 0)


def test_flat_input_and_default_mask(be, gen):
    inp = make_inputs(1, 11, 37, gen, padding="none")
    logits = be.t(inp["full"][0, :11].contiguous()).requires_grad_(True)
    logp, ent = pk.token_logprobs(logits, be.t(inp["tokens"][0]), return_entropy=True,
                                  backend=be.name)
    assert logp.shape == (11,) and ent.shape == (11,)
    e_lp, e_h = ref.token_logprobs(inp["base"], inp["tokens"])
    assert_close_np(logp, e_lp[0], rtol=2e-6, atol=1e-5)
    assert_close_np(ent, e_h[0], rtol=2e-6, atol=1e-5)
    (logp.sum() - 0.5 * ent.sum()).backward()
    e_grad = ref.token_logprobs_grad(inp["base"], inp["tokens"], None, 1.0, np.ones((1, 11)),
                                     np.full((1, 11), -0.5))
    assert_grad_close(logits.grad, e_grad[0], 1e-5)


def test_only_logprobs_used_in_backward(be, gen):
    """Entropy returned but unused in the loss: its (None) gradient is handled."""
    inp = make_inputs(3, 5, 37, gen)
    leaf, logits = logits_for(inp, be)
    logp, ent = pk.token_logprobs(logits, be.t(inp["tokens"]), be.t(inp["mask"]),
                                  return_entropy=True, backend=be.name)
    logp.sum().backward()
    e_grad = ref.token_logprobs_grad(inp["base"], inp["tokens"], inp["mask"], 1.0,
                                     np.ones((3, 5)))
    assert_grad_close(leaf.grad, e_grad, 1e-5)
    leaf2, logits2 = logits_for(inp, be)
    _, ent2 = pk.token_logprobs(logits2, be.t(inp["tokens"]), be.t(inp["mask"]),
                                return_entropy=True, backend=be.name)
    ent2.sum().backward()
    e_grad2 = ref.token_logprobs_grad(inp["base"], inp["tokens"], inp["mask"], 1.0,
                                      np.zeros((3, 5)), np.ones((3, 5)))
    assert_grad_close(leaf2.grad, e_grad2, 1e-5)


def test_shift_invariance(gen):
    """logprobs and entropy do not change when a row of logits is shifted by a constant."""
    inp = make_inputs(3, 5, 37, gen)
    lp1, h1 = pk.token_logprobs(inp["full"][:, :5], inp["tokens"], inp["mask"],
                                return_entropy=True, backend="cpu")
    shift = torch.randn(3, 5, 1, generator=gen) * 30
    lp2, h2 = pk.token_logprobs(inp["full"][:, :5] + shift, inp["tokens"], inp["mask"],
                                return_entropy=True, backend="cpu")
    torch.testing.assert_close(lp2, lp1, rtol=0, atol=2e-5)
    torch.testing.assert_close(h2, h1, rtol=0, atol=2e-5)


GC_PARAMS = [pytest.param(b.values[0], e, t, id=f"{b.id}-entropy={e}-T={t}", marks=b.marks)
             for b in BACKENDS for e in (False, True) for t in (1.0, 0.7)
             if not (b.values[0].small and (not e or t != 0.7))]


@pytest.mark.parametrize("be,entropy,temperature", GC_PARAMS)
def test_gradcheck(be, entropy, temperature, gen):
    inp = make_inputs(2, 3, 5, gen, dtype=torch.float64, layout="raw")
    logits = be.t(inp["full"]).requires_grad_(True)
    tok, mask = be.t(inp["tokens"]), be.t(inp["mask"])

    def f(x):
        out = pk.token_logprobs(x, tok, mask, temperature=temperature,
                                return_entropy=entropy, backend=be.name)
        return out

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=be.small)


def test_cpu_double_backward_raises(gen):
    """token_logprobs is first-order only on the kernels: asking for a second derivative
    raises a clear error instead of silently dropping the kernel's part."""
    inp = make_inputs(1, 2, 5, gen, dtype=torch.float64, padding="none")
    x = inp["full"][:, :2].contiguous().requires_grad_(True)
    lp = pk.token_logprobs(x, inp["tokens"], backend="cpu")
    # (at the first backward already: its gradient would have no graph of its own)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(lp.sum(), x, create_graph=True)


def test_masked_positions_not_read(gen):
    """Garbage token ids on masked positions (and NaN logits there) change nothing."""
    inp = make_inputs(3, 5, 37, gen, padding="interior")
    full = inp["full"].clone()
    full[:, :5][~inp["mask"]] = float("nan")
    leaf = full[:, :5].contiguous().requires_grad_(True)
    lp, h = pk.token_logprobs(leaf, inp["tokens"], inp["mask"], return_entropy=True,
                              backend="cpu")
    assert torch.isfinite(lp).all() and torch.isfinite(h).all()
    e_lp, _ = ref.token_logprobs(inp["base"], inp["tokens"], inp["mask"])
    assert_close_np(lp, e_lp, rtol=2e-6, atol=1e-5)
    (lp.sum() + h.sum()).backward()
    assert torch.isfinite(leaf.grad).all()
    assert torch.all(leaf.grad[~inp["mask"]] == 0)


def test_token_views_accepted(be, gen):
    """The demo's alignment, tokens = seq[:, 1:] (a non-contiguous view) and the raw
    [B, T + 1, V] logits, works on every backend and matches the reference."""
    B, T, V = 2, 6, 29
    seq = torch.randint(0, V, (B, T + 1), generator=gen)
    logits = torch.randn(B, T + 1, V, generator=gen, dtype=torch.float32)
    tokens = seq[:, 1:]
    assert not tokens.is_contiguous()
    got = pk.token_logprobs(logits.to(be.device), tokens.to(be.device), backend=be.name)
    want, _ = ref.token_logprobs(logits, tokens)
    assert_close_np(got.cpu().double().numpy(), want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ odd ids, dtypes, strides
# (CPU tensors: cpu, torch and the Triton interpreter)

@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_garbage_token_ids_on_masked_positions(be):
    """Token ids of +-10^12 on masked positions are never read: the log-probs are those
    of valid ids, and 0 on the masked positions."""
    d = small_inputs()
    tokens = d["tokens"].clone()
    tokens[0, 2], tokens[1, 0] = 10**12, -(10**12)
    lp = pk.token_logprobs(d["logits"], tokens, SMALL_MASK, backend=be.name)
    ref = pk.token_logprobs(d["logits"], d["tokens"], SMALL_MASK, backend="torch")
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-6)
    assert (lp[~SMALL_MASK] == 0).all()


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_token_and_mask_dtypes_are_equivalent(be):
    """int32 / uint8 / int16 tokens and int / float / uint8 / bool masks give
    bit-identical log-probs."""
    d = small_inputs()
    ref = pk.token_logprobs(d["logits"], d["tokens"], SMALL_MASK, backend=be.name)
    for tk in (d["tokens"].int(), d["tokens"].to(torch.uint8), d["tokens"].short()):
        for m in (SMALL_MASK.int(), SMALL_MASK.float(), SMALL_MASK.to(torch.uint8), SMALL_MASK):
            assert torch.equal(pk.token_logprobs(d["logits"], tk, m, backend=be.name), ref)


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_strided_logits_views(be):
    """Strided views of the logits (every other position, every other vocabulary
    entry, a transposed batch) give their contiguous copies' log-probs, bit for bit."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 6, 10, generator=g)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    views = (full[:, ::2, :5], full[:, :3, ::2],
             full.transpose(0, 1)[:3].transpose(0, 1)[..., :5])
    for view in views:
        lp = pk.token_logprobs(view, tokens, backend=be.name)
        ref = pk.token_logprobs(view.contiguous(), tokens, backend=be.name)
        assert torch.equal(lp, ref)
