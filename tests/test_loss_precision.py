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
from ppo_kernels.loss import KernelInputs
from ppo_kernels import reference as ref

from helpers.asserts import assert_close_np, assert_grad_close, expm1_minus_x64, grad_tol, rel_err
from helpers.backends import BACKENDS, BACKENDS_CPU, GENUINE_INF, TRITON_DEVICE, triton_ops
from helpers.inputs import k3_deltas, make_case, ppo_inputs, rand_tok
from helpers.raw_ops import check_ppo, loss_params, ref_ppo, run_ppo, slot_args

KERNELS = [p for p in BACKENDS if p.values[0].name != "torch"]
OPS = torch.ops.ppo_kernels
DEV = TRITON_DEVICE  # the raw Triton ops' tensors
F32_ULP = 2.0 ** -23


def _params(**kw):
    return loss_params(**kw)


def _backend_loss(be, logits, tokens, old, adv, ref_lp, p, weights=None):
    """(loss, loss_tok, logp, ent) of the backend's fused loss, as pk.ppo_loss calls it."""
    mask = torch.ones(tokens.shape, dtype=torch.bool, device=logits.device)
    w = torch.ones(tokens.shape, device=logits.device) if weights is None else weights
    kin = KernelInputs(tokens, mask, old, adv, w, ref_lp, None, None)
    return _backends.get_backend(be.name, logits.device).ppo_loss(logits, kin, p)


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
def test_huge_logits_agree_with_reference(be):
    """Logits of magnitude ~1e30 (float32): the log-probs equal the float64 reference's
    to 1e-6 relative, and the entropy is 0 (one entry dominates) on both."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 4, 7, generator=g, dtype=torch.float64).float() * 1e30
    tokens = torch.tensor([[0, 1, 2, 3]])
    lp, ent = pk.token_logprobs(logits, tokens, return_entropy=True, backend=be.name)
    e_lp, e_ent = ref.token_logprobs(logits.double(), tokens)
    np.testing.assert_allclose(lp.double().numpy(), e_lp, rtol=1e-6, atol=0)
    assert (ent.abs() == 0).all() and (np.abs(e_ent) == 0).all()


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
    """temperature 1e-10: logp <= 0 and equal to the float64 reference's (x / T does
    not overflow into a positive log-probability)."""
    logits = torch.tensor([[[1.5410, -0.2934, -2.1788, 0.5684, -1.0845]]])
    tokens = torch.tensor([[2]])
    lp = pk.token_logprobs(logits, tokens, temperature=1e-10, backend=be.name)
    e_lp, _ = ref.token_logprobs(logits.double(), tokens, temperature=1e-10)
    assert lp.item() <= 0
    assert lp.item() == pytest.approx(float(e_lp[0, 0]), rel=1e-5, abs=0)


# ------------------------------------------------------------------ the raw Triton ops
# ppo_kernels::triton_* called directly (on CUDA when a device is present, else under the
# interpreter): the same properties at the ops' own outputs (row_max, log_sum, loss_tok),
# at the kernels' block boundaries and with tighter bounds where the interpreter's exp
# allows them.

# tl.exp lowers to ex2.approx(x * log2(e)) on a GPU, whose relative error grows like
# |x| * 1e-7: the exps of a confident row (d ~ -30) are then ~3e-6 off. The interpreter
# uses numpy's exp (1 ulp), which is what the tight bounds below assume.
EXP_RTOL = 2e-6 if DEV == "cpu" else 1e-5


def stable_stats(logits, temp):
    """float64 (log_sum, entropy, log p of every entry) of rows of raw logits [..., V],
    with the non-top mass kept apart (log1p), as the kernels do: a float64 softmax rounds
    1 + 1e-12 to 4 digits, too coarse to check a confident row against."""
    x = ref.as_f64(logits)
    d = (x - x.max(-1, keepdims=True)) / temp
    e = np.exp(d)
    top = d == 0
    rest = np.where(top, 0.0, e).sum(-1) + (top.sum(-1) - 1.0)
    log_sum = np.log1p(rest)
    t = (e * np.where(e > 0, d, 0.0)).sum(-1)
    return log_sum, log_sum - t / (1.0 + rest), d - log_sum[..., None]


@triton_ops
@GENUINE_INF
@pytest.mark.parametrize("temp", [1.0, 0.7])
@pytest.mark.parametrize("ent_coef", [0.0, 0.05])
def test_finfo_min_leading_block_is_finite(temp, ent_coef):
    """a leading vocabulary block masked with finfo.min (HF-style masks) and the
    token in a later block: the merge must not form 0 * inf. Entropy, loss and dlogits are
    finite and equal to the reference, also with entropy_coef = 0 (where a NaN entropy
    would leak into the loss and dlogits through 0 * NaN)."""
    B, T, V = 2, 3, 96  # the interpreter's block is 32: two finfo.min blocks, then a mixed one
    logits, tokens, mask = make_case(B=B, T=T, V=V, padding="none", seed=11)
    logits[..., :72] = torch.finfo(torch.float32).min
    gen = torch.Generator().manual_seed(12)
    tokens = torch.randint(72, V, (B, T), generator=gen).to(DEV)
    logp, ent, row_max, log_sum = OPS.triton_token_logprobs_fwd(logits, tokens, mask, temp,
                                                                 True)
    rl, re_ = ref.token_logprobs(logits, tokens, mask, temp)
    assert_close_np(logp, rl, 1e-5, 1e-6, "logprobs")
    assert_close_np(ent, re_, 1e-5, 1e-6, "entropy")
    g = rand_tok(B, T, torch.float32, 13)
    d = OPS.triton_token_logprobs_bwd(g, g, logits, tokens, mask, row_max, log_sum, ent, temp)
    rd = ref.token_logprobs_grad(logits, tokens, mask, temp, g, g)
    assert_close_np(d, rd, *grad_tol(torch.float32, rd), "token_logprobs dlogits")
    assert (d[..., :72] == 0).all()
    inp = ppo_inputs(logits, tokens, mask, seed=14)
    out = run_ppo(logits, tokens, mask, inp, ent_coef=ent_coef, temp=temp)
    rout = ref_ppo(logits, tokens, mask, inp, ent_coef=ent_coef, temp=temp)
    check_ppo(out, rout, logits, tokens, mask, torch.float32, temp=temp)
    assert torch.isfinite(out[0]) and (out[4][..., :72] == 0).all()


CONFIDENT = (1e-3, 1e-5, 1e-7, 1e-9, 1e-11, 1e-12)  # 1 - p of the top token, one per row


def confident_case(V, temp, seed):
    """float32 logits [1, 6, V] whose top entry (the token) has 1 - p = CONFIDENT[i] on
    row i (computed from the rounded logits, so it is only close to those values)."""
    gen = np.random.default_rng(seed)
    x = gen.normal(0.0, 1.0, (1, len(CONFIDENT), V))
    top = gen.integers(0, V, len(CONFIDENT))
    for i, q in enumerate(CONFIDENT):
        others = np.delete(x[0, i], top[i])
        # sum over v != top of exp((x_v - L) / temp) = q
        x[0, i, top[i]] = temp * (np.log(np.exp(others / temp).sum()) - np.log(q))
    logits = torch.tensor(x, dtype=torch.float32).to(DEV)
    tokens = torch.tensor(top[None], dtype=torch.int64).to(DEV)
    mask = torch.ones(1, len(CONFIDENT), dtype=torch.bool, device=DEV)
    return logits, tokens, mask


@triton_ops
@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_confident_tokens_keep_their_digits(temp):
    """With 1 - p from 1e-3 down to 1e-12 (far below float32 epsilon),
    logp (= -log1p(rest)), the entropy and the token's dlogit (dlogp (1 - p)) keep their
    relative digits, and a row's gradient still sums to ~0 relative to its token entry.
    With log(1 + rest) logp came back 0 and the entropy lost percents."""
    logits, tokens, mask = confident_case(100, temp, seed=15)
    log_sum, ent64, logp_all = stable_stats(logits, temp)
    tok = tokens.cpu().numpy()
    logp64 = np.take_along_axis(logp_all, tok[..., None], -1)[..., 0]
    logp, ent, row_max, ls = OPS.triton_token_logprobs_fwd(logits, tokens, mask, temp, True)
    assert (logp < 0).all(), "a confident token's logp must not round to 0"
    assert rel_err(logp, logp64) < EXP_RTOL, "logprobs"
    assert rel_err(ls, log_sum) < EXP_RTOL, "log_sum"
    assert rel_err(ent, ent64) < EXP_RTOL, "entropy"
    # backward of sum(logp): token entry (1 - p) / T = -expm1(logp) / T, others -p_v / T
    one = torch.ones(1, len(CONFIDENT), device=DEV)
    d = OPS.triton_token_logprobs_bwd(one, None, logits, tokens, mask, row_max, ls, ent, temp)
    d64 = d.double().cpu().numpy()
    g_tok = np.take_along_axis(d64, tok[..., None], -1)[..., 0]
    assert rel_err(g_tok, -np.expm1(logp64) / temp) < EXP_RTOL, "token dlogit"
    assert (np.abs(d64.sum(-1)) < 1e-5 * np.abs(g_tok)).all(), "row gradient sums to 0"
    # the fused loss: rho = 1, A = 1, an entropy bonus; w = 1 on every row
    inp = dict(old=logp64, adv=np.ones_like(logp64), ref=None, isw=None,
               w=np.ones_like(logp64), acc=torch.float32)
    _, _, lp2, ent2, dl = run_ppo(logits, tokens, mask, inp, eps_low=0.2, eps_high=0.2,
                                   kl_coef=0.0, ent_coef=0.01, temp=temp)
    assert rel_err(lp2, logp64) < EXP_RTOL and rel_err(ent2, ent64) < EXP_RTOL
    p64 = np.exp(logp64)
    dlogp, dent = -1.0, -0.01  # d loss / d logp = -rho A w, d loss / d H = -w entropy_coef
    want = (-dlogp * np.expm1(logp64) - p64 * dent * (logp64 + ent64)) / temp
    got = np.take_along_axis(dl.double().cpu().numpy(), tok[..., None], -1)[..., 0]
    assert rel_err(got, want) < EXP_RTOL, "fused loss: token dlogit"


# the row of test_token_logprobs_backward_at_tiny_temperature, and one with close maxima
# (p non-trivial)
TINY_TEMPERATURE_ROWS = [[1.5410, -0.2934, -2.1788, 0.5684, -1.0845],
                         [1.5410, 1.5405, 1.5400, 0.5684, -1.0845]]


@triton_ops
@GENUINE_INF
@pytest.mark.parametrize("temp", [1e-3, 1e-10])
def test_token_logprobs_bwd_small_temperature(temp):
    """the backward rebuilds log p_v = (x_v - row_max) / T - log_sum from the
    forward's (row_max, log_sum), never x_v / T - lse: at T = 1e-10 the max entry's
    log p came back +213.8 (p = inf) on a GPU, at 1e-3 8.6e-6 off."""
    logits = torch.tensor([TINY_TEMPERATURE_ROWS], dtype=torch.float32).to(DEV)
    tokens = torch.tensor([[2, 0]], device=DEV)
    mask = torch.ones(1, 2, dtype=torch.bool, device=DEV)
    logp, ent, row_max, log_sum = OPS.triton_token_logprobs_fwd(logits, tokens, mask, temp,
                                                                 True)
    rl, re_ = ref.token_logprobs(logits, tokens, mask, temp)
    assert_close_np(logp, rl, 1e-6, 0, "logprobs")
    assert (logp <= 0).all()
    g = torch.tensor([[1.0, -0.5]], device=DEV)
    gh = torch.tensor([[0.25, 0.5]], device=DEV)
    d = OPS.triton_token_logprobs_bwd(g, gh, logits, tokens, mask, row_max, log_sum, ent, temp)
    rd = ref.token_logprobs_grad(logits, tokens, mask, temp, g, gh)
    assert torch.isfinite(d).all()
    assert_close_np(d, rd, 1e-6, 1e-6 * np.abs(rd).max(), "dlogits")


@triton_ops
@pytest.mark.parametrize("temp", [1.0, 30.0])
def test_token_logprobs_huge_fp16_logits(temp):
    """Logits at the fp16 limit (65504, spacing 32): forward and backward match the
    float64 reference (z - lse would lose the digits of d = x - max at this scale)."""
    row = [65504.0, 65472.0, 65440.0, 60000.0, -65504.0, 0.0, 65504.0 - 96.0]
    logits = torch.tensor([[row, row[::-1]]], dtype=torch.float16).to(DEV)
    tokens = torch.tensor([[1, 0]], device=DEV)
    mask = torch.ones(1, 2, dtype=torch.bool, device=DEV)
    logp, ent, row_max, log_sum = OPS.triton_token_logprobs_fwd(logits, tokens, mask, temp,
                                                                 True)
    assert (row_max == 65504.0).all()
    rl, re_ = ref.token_logprobs(logits, tokens, mask, temp)
    assert_close_np(logp, rl, 1e-6, 1e-7, "logprobs")
    assert_close_np(ent, re_, 1e-6, 1e-7, "entropy")
    g = torch.tensor([[1.0, 0.5]], device=DEV)
    d = OPS.triton_token_logprobs_bwd(g, g, logits, tokens, mask, row_max, log_sum, ent, temp)
    rd = ref.token_logprobs_grad(logits, tokens, mask, temp, g, g)
    assert_close_np(d, rd, *grad_tol(torch.float16, rd), "dlogits")


@triton_ops
def test_k3_through_the_ops():
    """k3 (score_rollout's kl, the loss's loss_tok) and its derivative (the fused loss's
    dlogit of a token with p ~ 1e-13, where it is dlogp exactly) vs float64 on the float32
    delta = logp - ref the kernel formed."""
    B, T = 2, 8
    logits = torch.tensor([0.0, -30.0]).expand(B, T, 2).contiguous().to(DEV)
    tokens = torch.ones(B, T, dtype=torch.int64, device=DEV)
    mask = torch.ones(B, T, dtype=torch.bool, device=DEV)
    logp, _, _, _ = OPS.triton_token_logprobs_fwd(logits, tokens, mask, 1.0, False)
    target = torch.as_tensor(k3_deltas(0, seed=19)).reshape(B, T).to(DEV)  # the 16 edges
    refl = (logp - target).contiguous()
    delta = (logp - refl).cpu().double().numpy()  # float32 subtraction, as in the kernel
    zero = torch.zeros(B, T, device=DEV)
    out = OPS.triton_score_rollout(logits, tokens, mask, refl, zero, torch.zeros(B, device=DEV),
                                   1.0, 2, 1.0, 1.0, 1.0)
    assert torch.equal(out[0], logp)
    assert rel_err(out[1], expm1_minus_x64(-delta)) < 5e-7, "score_rollout kl"
    w = torch.ones(B, T, device=DEV)
    loss, loss_tok, _, _, dl = OPS.triton_ppo_loss_fwd(
        logits, tokens, mask, logp, zero, w, refl, None, None,
        *slot_args(0.2, 0.2, 0.0, 1.0, 2, 0.0, 1.0, 1.0, 0, 1.0, 1.05, False), True)
    assert rel_err(loss_tok, expm1_minus_x64(-delta)) < 5e-7, "loss_tok = k3"
    assert rel_err(dl[..., 1], -np.expm1(-delta)) < 5e-7, "dlogit = d k3 / d delta"
