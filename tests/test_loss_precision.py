"""Precision of token_logprobs / ppo_loss / score_rollout (ppo_kernels/loss.py, advantages.py)
where LLM policies live, on every kernel backend, against the float64 reference:

- k3 (and its gradient) at small and large log-ratios: given the same float32 delta, the
  per-token KL and d kl / d delta keep their digits for every |delta| in [1e-6, 20];
- confident tokens (p -> 1): logp, entropy and dlogits keep their relative digits down to
  1 - p ~ 1e-12 (the non-top mass is summed apart and enters through log1p);
- the token_logprobs backward at tiny temperatures and huge logits (it rebuilds log p_v
  from the forward's row max and log-sum, not from the rounded lse);
- a leading vocabulary block at finfo.min (HF-style masks) gives finite results;
- the approx_kl metric (also exp(d) - 1 - d) keeps its digits;
- logits of magnitude 1e30, float16 logits at +-65504, a temperature of 1e-10.

The eager composite (backend "torch") is today's log_softmax -> gather: it is held to the
k3 / approx_kl rules (its formulas are ours) but not to the confident-token ones, which no
log_softmax-based code meets in float32.
"""

import math

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import _backends
from ppo_kernels import reference as ref

from conftest import BACKENDS, BACKENDS_CPU, assert_close_np, assert_grad_close, loss_params

KERNELS = [p for p in BACKENDS if p.values[0].name != "torch"]
F32_ULP = 2.0 ** -23


def _params(**kw):
    return loss_params(**kw)


def _backend_loss(be, logits, tokens, old, adv, ref_lp, p, weights=None):
    """(loss, loss_tok, logp, ent) of the backend's fused loss, as pk.ppo_loss calls it."""
    mask = torch.ones(tokens.shape, dtype=torch.bool, device=logits.device)
    w = torch.ones(tokens.shape, device=logits.device) if weights is None else weights
    return _backends.get_backend(be.name, logits.device).ppo_loss(
        logits, tokens, mask, old, adv, w, ref_lp, None, p)


def _leaf(be, x):
    """A fresh leaf copy of x on be's device that requires grad (never x itself)."""
    return be.t(x).detach().clone().requires_grad_(True)


def _log_uniform_deltas(n, gen):
    mag = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(1e-6), math.log(20.0),
                                                                generator=gen))
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return (mag * sign).float()


@pytest.mark.parametrize("be", BACKENDS)
def test_k3_and_its_gradient_keep_their_digits(be, gen):
    """Per-token k3 = exp(-d) - 1 + d and its d-derivative 1 - exp(-d), d the float32
    log-ratio the kernel formed, for |d| from 1e-6 to 20 (both signs): relative error within
    a few float32 ulp of the float64 value of the same d (k3 cancelled: 5% off at 1e-3)."""
    n, V = 16, 7
    logits = torch.randn(n, 1, V, generator=gen)
    tokens = torch.randint(0, V, (n, 1), generator=gen)
    lg = _leaf(be, logits)
    tok = be.t(tokens)
    logp = pk.token_logprobs(lg.detach(), tok, backend=be.name)
    delta = be.t(_log_uniform_deltas(n, gen)[:, None])
    ref_lp = logp - delta
    d32 = (logp - ref_lp).cpu()  # the float32 delta every backend forms from its own logp
    p = _params(kl_coef=1.0)
    zero = torch.zeros_like(logp)
    loss, loss_tok, _, _ = _backend_loss(be, lg, tok, logp.detach(), zero, ref_lp, p)
    want, dwant = ref.kl_terms(d32.double(), np.zeros((n, 1)), "k3")
    got = loss_tok.detach().cpu().double().numpy()
    rel = np.abs(got - want) / np.abs(want)
    assert rel.max() < 8 * F32_ULP, f"k3 relative error {rel.max():.2e} at d={d32.flatten()}"
    # the gradient: dlogits = dk3 (onehot - p), each row against its own scale
    loss.backward()
    g_want = ref.token_logprobs_grad(logits, tokens, None, 1.0, dwant)
    g = lg.grad.cpu()
    for i in range(n):
        assert_grad_close(g[i], g_want[i], 4e-6, what=f"dlogits row {i}, d={float(d32[i]):.3g}")


@pytest.mark.parametrize("be", BACKENDS)
def test_score_rollout_kl_keeps_its_digits(be, gen):
    n = 16
    logits = torch.randn(1, n, 5, generator=gen)
    tokens = torch.randint(0, 5, (1, n), generator=gen)
    logp = pk.token_logprobs(be.t(logits), be.t(tokens), backend=be.name)
    ref_lp = logp - be.t(_log_uniform_deltas(n, gen)[None])
    d32 = (logp - ref_lp).cpu().double()
    out = pk.score_rollout(be.t(logits), be.t(tokens), ref_lp, be.t(torch.zeros(1, n)),
                           be.t(torch.zeros(1)), None, kl_coef=0.1, kl_estimator="k3",
                           backend=be.name)
    want, _ = ref.kl_terms(d32, np.zeros((1, n)), "k3")
    rel = np.abs(out.kl.cpu().double().numpy() - want) / np.abs(want)
    assert rel.max() < 8 * F32_ULP


@pytest.mark.parametrize("be", BACKENDS)
def test_approx_kl_metric_at_small_log_ratios(be, gen):
    """approx_kl = mean((rho - 1) - log rho) from float32 log-ratios of 1e-5: it was 0 or
    noise (1 - rho cancels); now within float32 rounding of the float64 value."""
    n = 16
    logits = torch.randn(1, n, 7, generator=gen)
    tokens = torch.randint(0, 7, (1, n), generator=gen)
    logp = pk.token_logprobs(be.t(logits), be.t(tokens), backend=be.name)
    old = logp - 1e-5 * be.t(torch.randn(1, n, generator=gen))
    _, met = pk.ppo_loss(be.t(logits), be.t(tokens), old, torch.zeros_like(logp),
                         backend=be.name)
    d = (logp - old).cpu().double().numpy()
    want = ref.expm1_minus_x(d).mean()
    assert float(met["approx_kl"]) == pytest.approx(want, rel=2e-5)


def _confident_rows(V, gen, dtype=torch.float32):
    """Rows whose sampled token has 1 - p = 10^-k, k = 3 .. 12 (one row per k), plus
    random rows; returns float logits [1, R, V] (rounded to dtype) and tokens [1, R]."""
    ks = list(range(3, 13))
    rows, toks = [], []
    for k in ks:
        x = torch.randn(V, generator=gen, dtype=torch.float64)
        tok = int(torch.randint(0, V, (1,), generator=gen))
        others = torch.cat([x[:tok], x[tok + 1:]])
        x[tok] = torch.logsumexp(others, 0) + k * math.log(10.0)
        rows.append(x)
        toks.append(tok)
    return torch.stack(rows)[None].to(dtype), torch.tensor(toks)[None]


@pytest.mark.parametrize("be", KERNELS)
def test_confident_tokens_keep_relative_digits(be, gen):
    """logp, entropy and the row gradient of tokens with 1 - p from 1e-3 down to 1e-12:
    relative error ~1e-6 (the exp's own), and the gradient row still sums to 0. With the
    top entry's 1 inside the sum, logp came back 0 and H lost percents below 1 - p ~ 6e-8."""
    V = 37
    logits, tokens = _confident_rows(V, gen)
    n = tokens.shape[1]
    lp_want, h_want = ref.token_logprobs(logits, tokens)
    lg = _leaf(be, logits)
    lp, h = pk.token_logprobs(lg, be.t(tokens), return_entropy=True, backend=be.name)
    for name, got, want in (("logp", lp, lp_want), ("entropy", h, h_want)):
        rel = np.abs(got.detach().cpu().double().numpy() - want) / np.abs(want)
        assert rel.max() < 1e-5, f"{name}: relative error {rel.max():.2e}"
    g_lp = torch.randn(1, n, generator=gen)
    g_h = torch.randn(1, n, generator=gen)
    (lp * be.t(g_lp) + h * be.t(g_h)).sum().backward()
    g_want = ref.token_logprobs_grad(logits, tokens, None, 1.0, g_lp, g_h)
    g = lg.grad.cpu().double().numpy()
    big = np.abs(g_want) > 1e-30
    rel = np.abs(g - g_want)[big] / np.abs(g_want)[big]
    assert rel.max() < 2e-5, f"dlogits: max relative error per entry {rel.max():.2e}"
    tok_entry = np.take_along_axis(g[0], tokens[0, :, None].numpy(), -1)[:, 0]
    assert (np.abs(g[0].sum(-1)) <= 1e-5 * np.abs(tok_entry)).all(), "row sums"


@pytest.mark.parametrize("be", KERNELS)
def test_confident_tokens_in_the_fused_loss(be, gen):
    V = 37
    logits, tokens = _confident_rows(V, gen)
    n = tokens.shape[1]
    lp_want, _ = ref.token_logprobs(logits, tokens)
    old = torch.tensor(lp_want).float() - 0.05
    adv = torch.randn(1, n, generator=gen)
    lg = _leaf(be, logits)
    loss, met = pk.ppo_loss(lg, be.t(tokens), be.t(old), be.t(adv), entropy_coef=0.01,
                            backend=be.name)
    loss.backward()
    e_loss, e_met, e_grad = ref.ppo_loss(logits, tokens, old, adv, entropy_coef=0.01)
    assert float(loss.detach()) == pytest.approx(e_loss, rel=1e-6)
    assert float(met["entropy"]) == pytest.approx(e_met["entropy"], rel=1e-5)
    g = lg.grad.cpu().double().numpy()
    big = np.abs(e_grad) > 1e-30
    rel = np.abs(g - e_grad)[big] / np.abs(e_grad)[big]
    assert rel.max() < 2e-5, f"dlogits: max relative error per entry {rel.max():.2e}"


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("temperature", [1e-3, 1e-10])
def test_token_logprobs_backward_at_tiny_temperature(be, temperature):
    """A 5-logit row at temperatures 1e-3 and 1e-10, each entry the sampled token: the
    backward matches the reference. It rebuilds log p_v from the forward's row max and
    log-sum; rebuilt from the lse alone, log p of the max entry is +213.8 at 1e-10 (p = inf)
    and 8.6e-6 off at 1e-3."""
    logits = torch.tensor([[[1.5410, -0.2934, -2.1788, 0.5684, -1.0845]]])
    for tok in range(5):
        tokens = torch.tensor([[tok]])
        lg = _leaf(be, logits)
        lp = pk.token_logprobs(lg, be.t(tokens), temperature=temperature, backend=be.name)
        lp.sum().backward()
        want = ref.token_logprobs_grad(logits, tokens, None, temperature, np.ones((1, 1)))
        assert_grad_close(lg.grad.cpu(), want, 3e-6, what=f"token {tok}")


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_token_logprobs_backward_at_huge_logits(be, dtype, gen):
    V = 40
    x = torch.randn(2, 3, V, generator=gen, dtype=torch.float64)
    x = x / x.abs().amax(-1, keepdim=True) * torch.finfo(dtype).max * 0.999
    logits = x.to(dtype)
    tokens = torch.randint(0, V, (2, 3), generator=gen)
    temperature = float(torch.finfo(dtype).max) / 4.0
    lg = _leaf(be, logits)
    lp, h = pk.token_logprobs(lg, be.t(tokens), temperature=temperature, return_entropy=True,
                              backend=be.name)
    (lp + 0.5 * h).sum().backward()
    want = ref.token_logprobs_grad(logits, tokens, None, temperature, np.ones((2, 3)),
                                   0.5 * np.ones((2, 3)))
    assert_grad_close(lg.grad.cpu(), want, 1e-2 if dtype == torch.float16 else 3e-6)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_leading_block_at_finfo_min(be, temperature, entropy_coef, gen):
    """HF-style masks fill banned logits with finfo.min, not -inf: a leading block of them
    made Triton's entropy, loss and every dlogit NaN, even with entropy_coef 0."""
    V, n = 96, 4
    logits = torch.randn(1, n, V, generator=gen)
    logits[..., :64] = torch.finfo(torch.float32).min
    tokens = torch.randint(64, V, (1, n), generator=gen)
    old = -torch.rand(1, n, generator=gen) - 3.0
    adv = torch.randn(1, n, generator=gen)
    lg = _leaf(be, logits)
    loss, met = pk.ppo_loss(lg, be.t(tokens), be.t(old), be.t(adv), temperature=temperature,
                            entropy_coef=entropy_coef, backend=be.name)
    loss.backward()
    e_loss, e_met, e_grad = ref.ppo_loss(logits, tokens, old, adv, temperature=temperature,
                                         entropy_coef=entropy_coef)
    assert float(loss.detach()) == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert float(met["entropy"]) == pytest.approx(e_met["entropy"], rel=2e-6)
    assert_grad_close(lg.grad.cpu(), e_grad, 3e-6)
    lp, h = pk.token_logprobs(be.t(logits), be.t(tokens), temperature=temperature,
                              return_entropy=True, backend=be.name)
    e_lp, e_h = ref.token_logprobs(logits, tokens, temperature=temperature)
    assert_close_np(lp, e_lp, rtol=2e-6, atol=2e-6)
    assert_close_np(h, e_h, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("be", BACKENDS)
def test_float64_logits_take_tiny_temperatures(be):
    logits = torch.tensor([[[0.3, -0.2, 0.1]]], dtype=torch.float64)
    lp = pk.token_logprobs(be.t(logits), be.t(torch.tensor([[0]])), temperature=1e-39,
                           backend=be.name)
    assert float(lp) == 0.0


# ------------------------------------------------------------------ extreme logits
# (CPU tensors: cpu, torch and the Triton interpreter)

@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_huge_logits_agree_with_torch(be):
    """Logits of magnitude ~1e30 (float32): the log-probs equal the eager composite's to
    1e-6 relative, and the entropy is 0 (one entry dominates) on both."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 4, 7, generator=g, dtype=torch.float64).float() * 1e30
    tokens = torch.tensor([[0, 1, 2, 3]])
    lp, ent = pk.token_logprobs(logits, tokens, return_entropy=True, backend=be.name)
    ref, rent = pk.token_logprobs(logits, tokens, return_entropy=True, backend="torch")
    torch.testing.assert_close(lp, ref, rtol=1e-6, atol=0)
    assert (ent.abs() == 0).all() and (rent.abs() == 0).all()


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_logprob_precision_with_large_logits(be):
    """float16 logits at +-65504 (four maxima of seven): logp = -log 4 to 1e-5."""
    logits = torch.tensor([[[65504., -65504., 65504., -65504., 65504., -65504., 65504.]]],
                          dtype=torch.float16)
    tokens = torch.tensor([[0]])
    lp = pk.token_logprobs(logits, tokens, backend=be.name)
    assert abs(lp.item() + math.log(4)) < 1e-5, lp.item()


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_tiny_temperature_gives_sane_logprobs(be):
    """temperature 1e-10: logp <= 0 and equal to the eager composite's (x / T does not
    overflow into a positive log-probability)."""
    logits = torch.tensor([[[1.5410, -0.2934, -2.1788, 0.5684, -1.0845]]])
    tokens = torch.tensor([[2]])
    lp = pk.token_logprobs(logits, tokens, temperature=1e-10, backend=be.name)
    ref = pk.token_logprobs(logits, tokens, temperature=1e-10, backend="torch")
    assert lp.item() <= 0
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=0)
