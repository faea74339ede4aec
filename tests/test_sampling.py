"""Sampling replay (ppo_kernels/sampling.py, docs/SAMPLING.md): the kept-set log-probs,
entropy, gradients and metrics of every op that reads logits, given (CSR SamplingMask) and
re-derived (top-k / top-p / min-p), against the numpy float64 reference; the re-derived
sets against an independent torch transcription of vLLM v1's sampler."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import strategies as st

import ppo_kernels as pk
from ppo_kernels import reference as ref

from helpers import device_path
from helpers.asserts import TOL, assert_close_np, assert_grad_close
from helpers.backends import BACKENDS_CPU, TRITON_DEVICE
from helpers.inputs import random_csr

# cpu, torch and triton (the interpreter, small shapes: V <= 300, B * T <= 16)
REPLAY_BACKENDS = BACKENDS_CPU


# ------------------------------------------------------------------ helpers

def inputs(B, T, V, gen, dtype=torch.float64, scale=2.0):
    logits = (torch.randn(B, T, V, generator=gen, dtype=torch.float64) * scale).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    if T > 2:
        mask[0, :1] = False
        mask[-1, -1] = False
    return logits, tokens, mask


def ck_acc(dtype):
    """The kernels' accumulation dtype of logits of dtype (float64 or float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def vllm_kept(logits, temperature, top_k=None, top_p=None, min_p=None):
    """An independent transcription of vLLM v1's sampler (vllm/v1/sample/sampler.py:
    temperature, then the min-p logits processor, then ops/topk_topp_sampler.py
    apply_top_k_top_p / apply_top_k_only), on rows [N, V] in float64: bool [N, V], the
    entries left above -inf. top_k / top_p / min_p: [N] tensors or None."""
    x = logits.double() / temperature
    if min_p is not None:  # MinPLogitsProcessor: drop probability < min_p * max probability
        probs = x.softmax(-1)
        adjusted = min_p.double().unsqueeze(1) * probs.amax(-1, keepdim=True)
        x = x.masked_fill(probs < adjusted, -math.inf)
    if top_p is None:
        if top_k is not None:  # apply_top_k_only
            v = x.shape[1]
            kth = x.topk(int(top_k.max()), dim=1).values.gather(1, (top_k - 1).unsqueeze(1))
            kth = torch.where((top_k == v).unsqueeze(1), -math.inf, kth)
            x = x.masked_fill(x < kth, -math.inf)
        return x > -math.inf
    srt, idx = x.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = srt.gather(1, (srt.shape[1] - top_k).unsqueeze(1))
        srt = srt.masked_fill(srt < kth, -math.inf)
    probs = srt.softmax(-1)
    csum = probs.cumsum(-1)
    drop = csum <= 1 - top_p.double().unsqueeze(1)
    drop[:, -1] = False  # at least one
    srt = srt.masked_fill(drop, -math.inf)
    return srt.scatter(-1, idx, srt) > -math.inf


def kernel_kept(be, logits, tokens, mask, temperature, **params):
    """The backend's kept set (dense, with the token) through the public op: logp_kept ==
    the reference's over that set identifies it; here read from the threshold op (cpu) or
    the eager composite's mask (torch)."""
    from ppo_kernels import sampling as sm
    rp = sm.check_replay(None, params.get("top_k"), params.get("top_p"), params.get("min_p"),
                         tokens, logits.shape[2])
    if be.name in ("cpu", "triton"):
        from ppo_kernels._backends import get_backend
        get_backend(be.name, logits.device)  # (loads the Triton ops)
        op = getattr(torch.ops.ppo_kernels, ("triton_" if be.name == "triton" else "") +
                     "sampling_threshold")
        thr = op(logits, mask, temperature, rp.top_k, rp.top_p, rp.min_p)
        kept = logits[:, :tokens.shape[1]].double() >= thr.unsqueeze(-1)
    else:
        thr = sm.threshold_torch(logits, mask, temperature, rp)
        kept = logits[:, :tokens.shape[1]].double() >= thr.unsqueeze(-1)
    return kept & mask.unsqueeze(-1)


# ------------------------------------------------------------------ the reference itself

def test_reference_kept_gradient_matches_finite_differences():
    gen = torch.Generator().manual_seed(0)
    logits, tokens, mask = inputs(2, 3, 7, gen)
    sm, dense = random_csr(2, 3, 7, gen, tokens=tokens)
    kept, _ = ref.with_token(dense.numpy(), tokens, mask)
    g = np.random.default_rng(0).normal(size=(2, 3))
    gh = np.random.default_rng(1).normal(size=(2, 3))

    def f(x):
        lp, h = ref.kept_logprobs(x, tokens, mask, 0.7, kept)
        return (g * lp + gh * h).sum()

    x0 = logits.numpy()
    num = np.zeros_like(x0)
    eps = 1e-6
    for idx in np.ndindex(*x0.shape):
        xp, xm = x0.copy(), x0.copy()
        xp[idx] += eps
        xm[idx] -= eps
        num[idx] = (f(xp) - f(xm)) / (2 * eps)
    ana = ref.kept_logprobs_grad(x0, tokens, mask, 0.7, kept, g, gh)
    np.testing.assert_allclose(ana, num, atol=1e-7, rtol=1e-6)
    assert (ana[~np.broadcast_to(kept, ana.shape)] == 0).all()  # nothing off the kept set


def test_reference_sampling_kept_is_vllm_on_tie_free_rows():
    gen = torch.Generator().manual_seed(1)
    logits, tokens, _ = inputs(3, 4, 50, gen, scale=3.0)
    for kw in (dict(top_k=5), dict(top_p=0.8), dict(min_p=0.05), dict(top_k=20, top_p=0.7),
               dict(top_k=10, top_p=0.9, min_p=0.01)):
        kept = ref.sampling_kept(logits, tokens, None, 0.8, **kw)
        n = 12
        t = {k: torch.full((n,), v) for k, v in kw.items()}
        if "top_k" in t:
            t["top_k"] = t["top_k"].long()
        want = vllm_kept(logits.reshape(n, 50), 0.8, **t)
        assert (kept.reshape(n, 50) == want.numpy()).all(), kw


# ------------------------------------------------------------------ token_logprobs

@pytest.mark.parametrize("be", REPLAY_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_token_logprobs_given_mask(be, dtype):
    gen = torch.Generator().manual_seed(2)
    B, T, V = 3, 5, 37
    logits, tokens, mask = inputs(B, T, V, gen, dtype=dtype)
    sm, dense = random_csr(B, T, V, gen, tokens=tokens, drop_token_frac=0.3, empty_frac=0.1)
    kept, missing = ref.with_token(dense.numpy(), tokens, mask)
    x = logits.clone().requires_grad_(True)
    lp_k, lp, ent = pk.token_logprobs(x, tokens, mask, temperature=0.9, sampling_mask=sm,
                                      return_full=True, return_entropy=True,
                                      backend=be.name)
    e_lpk, e_entk = ref.kept_logprobs(logits, tokens, mask, 0.9, kept)
    e_lp, e_ent = ref.token_logprobs(logits, tokens, mask, 0.9)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype != torch.float64 else dict(rtol=1e-12, atol=1e-12)
    assert_close_np(lp_k, e_lpk, what="logp_kept", **tol)
    assert_close_np(lp, e_lp, what="logp", **tol)
    assert_close_np(ent, e_ent, what="entropy", **tol)
    assert torch.isfinite(lp_k).all()
    g1 = torch.randn(B, T, generator=gen, dtype=torch.float64)
    g2 = torch.randn(B, T, generator=gen, dtype=torch.float64)
    g3 = torch.randn(B, T, generator=gen, dtype=torch.float64)
    (g1 * lp_k + g2 * lp + g3 * ent).sum().backward()
    want = ref.kept_logprobs_grad(logits, tokens, mask, 0.9, kept, g1) + \
        ref.token_logprobs_grad(logits, tokens, mask, 0.9, g2, g3)
    assert_grad_close(x.grad, want, 1e-2 if dtype == torch.bfloat16 else
                      (3e-6 if dtype == torch.float32 else 1e-12))
    # entropy over the kept set
    lp_k2, ent_k = pk.token_logprobs(logits, tokens, mask, temperature=0.9, sampling_mask=sm,
                                     return_entropy=True, entropy_over="kept", backend=be.name)
    assert_close_np(ent_k, e_entk, what="entropy_kept", **tol)
    assert_close_np(lp_k2, e_lpk, what="logp_kept", **tol)


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
@pytest.mark.parametrize("temperature", ["scalar", "per_sequence", "per_token"])
def test_gradcheck_float64(be, temperature):
    """gradcheck of the kept-set log-probs, full log-probs and both entropies, given and
    re-derived sets, at a scalar temperature (0.8), a [B] one or a [B, T] one. The Triton
    interpreter runs gradcheck's fast mode (the Jacobian against a random vector pair, one
    directional derivative instead of one per logit: 2 forward calls instead of 108, about
    2 min less per case); the cpu and torch backends the full Jacobian."""
    gen = torch.Generator().manual_seed(3 if temperature == "scalar" else 23)
    B, T, V = 2, 3, 9
    logits, tokens, mask = inputs(B, T, V, gen)
    sm, _ = random_csr(B, T, V, gen, tokens=tokens, drop_token_frac=0.3)
    if temperature == "scalar":
        temp = 0.8
    else:
        t_seq, t_tok = _row_temps(B, T, gen)
        temp = t_seq if temperature == "per_sequence" else t_tok
    for kw in (dict(sampling_mask=sm), dict(top_k=4, top_p=0.8)):
        def f(x):
            a, b, c = pk.token_logprobs(x, tokens, mask, temperature=temp, return_full=True,
                                        return_entropy=True, backend=be.name, **kw)
            _, d = pk.token_logprobs(x, tokens, mask, temperature=temp, return_entropy=True,
                                     entropy_over="kept", backend=be.name, **kw)
            return a, b, c, d
        assert torch.autograd.gradcheck(f, (logits.clone().requires_grad_(True),),
                                        fast_mode=be.name == "triton")


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
def test_full_vocabulary_set_is_no_mask(be):
    """The whole vocabulary as the kept set gives the plain op's numbers."""
    gen = torch.Generator().manual_seed(4)
    B, T, V = 2, 4, 11
    logits, tokens, mask = inputs(B, T, V, gen, dtype=torch.float32)
    sm = pk.SamplingMask(torch.arange(V).repeat(B * T), torch.arange(B * T + 1) * V)
    a = pk.token_logprobs(logits, tokens, mask, sampling_mask=sm, backend=be.name)
    b = pk.token_logprobs(logits, tokens, mask, backend=be.name)
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    for kw in (dict(top_k=V), dict(top_p=1.0), dict(min_p=0.0)):
        torch.testing.assert_close(
            pk.token_logprobs(logits, tokens, mask, backend=be.name, **kw), b,
            rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
def test_one_token_set_and_v1(be):
    gen = torch.Generator().manual_seed(5)
    B, T, V = 2, 3, 8
    logits, tokens, mask = inputs(B, T, V, gen)
    sm = pk.SamplingMask(tokens.reshape(-1).clone(), torch.arange(B * T + 1))
    x = logits.clone().requires_grad_(True)
    lp = pk.token_logprobs(x, tokens, mask, sampling_mask=sm, backend=be.name)
    assert (lp == 0).all()  # a set of one token: log 1
    lp.sum().backward()
    assert (x.grad == 0).all()
    # an empty set on every row: the token alone (added), counted missing
    empty = pk.SamplingMask(torch.zeros(0, dtype=torch.long), torch.zeros(B * T + 1,
                                                                           dtype=torch.long))
    _, m = pk.ppo_loss(logits, tokens, None, torch.ones(B, T, dtype=torch.float64), mask,
                       sampling_mask=empty, backend=be.name)
    assert m["mask_missing_token_frac"] == 1.0 and m["kept_size_mean"] == 1.0
    # V = 1
    l1 = torch.randn(B, T, 1, generator=gen, dtype=torch.float64)
    t1 = torch.zeros(B, T, dtype=torch.long)
    for kw in (dict(top_p=0.5), dict(top_k=1), dict(min_p=0.5),
               dict(sampling_mask=pk.SamplingMask(torch.zeros(B * T, dtype=torch.long),
                                                  torch.arange(B * T + 1)))):
        out = pk.token_logprobs(l1, t1, backend=be.name, **kw)
        assert (out == 0).all(), kw


# ------------------------------------------------------------------ re-derived sets

@pytest.mark.parametrize("be", REPLAY_BACKENDS)
@pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_p=0.7), dict(min_p=0.1),
                                dict(top_k=8, top_p=0.9), dict(top_k=5, min_p=0.02),
                                dict(top_k=12, top_p=0.6, min_p=0.05)])
def test_rederived_sets_are_vllms(be, kw):
    gen = torch.Generator().manual_seed(6)
    B, T, V = 3, 4, 40
    logits, tokens, mask = inputs(B, T, V, gen, scale=2.5)
    mask[:] = True
    kept = kernel_kept(be, logits, tokens, mask, 0.7, **kw)
    n = B * T
    t = {k: torch.full((n,), v) for k, v in kw.items()}
    if "top_k" in t:
        t["top_k"] = t["top_k"].long()
    want = vllm_kept(logits.reshape(n, V), 0.7, **t)
    assert (kept.reshape(n, V) == want).all()
    # and the public op's log-probs are those over that set (with the token)
    k2, _ = ref.with_token(want.reshape(B, T, V).numpy(), tokens, mask)
    lp = pk.token_logprobs(logits, tokens, mask, temperature=0.7, backend=be.name, **kw)
    assert_close_np(lp, ref.kept_logprobs(logits, tokens, mask, 0.7, k2)[0], rtol=1e-12,
                    atol=1e-12)


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
def test_rederived_per_sequence_parameters(be):
    gen = torch.Generator().manual_seed(7)
    B, T, V = 3, 4, 30
    logits, tokens, mask = inputs(B, T, V, gen)
    top_k = torch.tensor([2, 30, 7])
    top_p = torch.tensor([0.5, 0.9, 1.0], dtype=torch.float64)
    lp = pk.token_logprobs(logits, tokens, mask, top_k=top_k, top_p=top_p, backend=be.name)
    kept = ref.sampling_kept(logits, tokens, mask, 1.0, top_k=top_k, top_p=top_p)
    kept, _ = ref.with_token(kept, tokens, mask)
    assert_close_np(lp, ref.kept_logprobs(logits, tokens, mask, 1.0, kept)[0], rtol=1e-12,
                    atol=1e-12)


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
def test_ties_follow_the_value_threshold(be):
    """Integer logits (many ties): top-k keeps every tie of the k-th value, top-p every tie
    of the last kept value (docs/SAMPLING.md: keep j iff the mass strictly above z_j is <
    top_p)."""
    gen = torch.Generator().manual_seed(8)
    B, T, V = 2, 5, 24
    logits = torch.randint(-3, 3, (B, T, V), generator=gen).double()
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    for kw in (dict(top_k=3), dict(top_p=0.4), dict(top_p=0.75, top_k=10), dict(min_p=0.3)):
        kept = kernel_kept(be, logits, tokens, mask, 1.0, **kw)
        want = ref.sampling_kept(logits, tokens, mask, 1.0, **kw)
        assert (kept.numpy() == want).all(), kw


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(V=st.integers(1, 40), T=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
       top_k=st.one_of(st.none(), st.integers(1, 45)),
       top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
       min_p=st.one_of(st.none(), st.floats(0.0, 0.9)),
       temperature=st.floats(0.3, 2.0), integer_logits=st.booleans())
def test_hypothesis_rederived_matches_reference(V, T, seed, top_k, top_p, min_p, temperature,
                                                integer_logits):
    gen = torch.Generator().manual_seed(seed)
    B = 2
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3
    if integer_logits:
        logits = logits.round()
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.2
    kw = {k: v for k, v in dict(top_k=top_k, top_p=top_p, min_p=min_p).items()
          if v is not None}
    if not kw:
        kw = dict(top_k=1)
    kept = ref.sampling_kept(logits, tokens, mask, temperature, **kw)
    kept, _ = ref.with_token(kept, tokens, mask)
    want, want_h = ref.kept_logprobs(logits, tokens, mask, temperature, kept)
    g = torch.randn(B, T, generator=gen, dtype=torch.float64)
    gh = torch.randn(B, T, generator=gen, dtype=torch.float64)
    want_g = ref.kept_logprobs_grad(logits, tokens, mask, temperature, kept, g, gh)
    for be in ("cpu", "torch"):
        x = logits.clone().requires_grad_(True)
        lp, h = pk.token_logprobs(x, tokens, mask, temperature=temperature, backend=be,
                                  return_entropy=True, entropy_over="kept", **kw)
        assert_close_np(lp, want, rtol=1e-10, atol=1e-10, what=be)
        assert_close_np(h, want_h, rtol=1e-10, atol=1e-10, what=be)
        (g * lp + gh * h).sum().backward()
        assert_grad_close(x.grad, want_g, 1e-10)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(V=st.integers(1, 30), T=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
       kmax=st.integers(1, 30), drop=st.floats(0.0, 1.0), empty=st.floats(0.0, 0.5))
def test_hypothesis_given_masks(V, T, seed, kmax, drop, empty):
    gen = torch.Generator().manual_seed(seed)
    B = 2
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.2
    sm, dense = random_csr(B, T, V, gen, kmax=kmax, tokens=tokens, drop_token_frac=drop,
                           empty_frac=empty)
    kept, missing = ref.with_token(dense.numpy(), tokens, mask)
    want = ref.kept_logprobs(logits, tokens, mask, 1.0, kept)[0]
    g = torch.randn(B, T, generator=gen, dtype=torch.float64)
    want_g = ref.kept_logprobs_grad(logits, tokens, mask, 1.0, kept, g)
    for be in ("cpu", "torch"):
        x = logits.clone().requires_grad_(True)
        lp = pk.token_logprobs(x, tokens, mask, sampling_mask=sm, backend=be)
        assert_close_np(lp, want, rtol=1e-12, atol=1e-12, what=be)
        (g * lp).sum().backward()
        assert_grad_close(x.grad, want_g, 1e-12)


# ------------------------------------------------------------------ ppo_loss

LOSS_CASES = [
    dict(),
    dict(kl_coef=0.1, kl_estimator="k3"),
    dict(kl_coef=0.1, kl_estimator="k2", kl_logprobs="kept"),
    dict(entropy_coef=0.01),
    dict(entropy_coef=0.01, entropy_over="kept", kl_coef=0.05, kl_estimator="k1"),
    dict(policy_loss="gspo"),
    dict(policy_loss="gspo-token", kl_coef=0.1, kl_bias_correction=True),
    dict(policy_loss="cispo", loss_agg_mode="seq-mean-token-mean"),
    dict(policy_loss="sapo", off_policy_mask_threshold=0.1),
    dict(dual_clip_c=3.0, kl_coef=0.2, kl_bias_correction=True, entropy_coef=0.02),
]


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in
                                                                    c.items()) or "plain")
@pytest.mark.parametrize("given_mask", [True, False], ids=["given", "rederived"])
def test_ppo_loss_against_reference(be, case, given_mask):
    gen = torch.Generator().manual_seed(9)
    B, T, V = 3, 5, 29
    logits, tokens, mask = inputs(B, T, V, gen)
    if given_mask:
        sm, dense = random_csr(B, T, V, gen, kmax=10, tokens=tokens, drop_token_frac=0.2)
        kw = dict(sampling_mask=sm)
        kept, missing = ref.with_token(dense.numpy(), tokens, mask)
    else:
        kw = dict(top_k=12, top_p=0.85)
        kept, missing = ref.with_token(ref.sampling_kept(logits, tokens, mask, 0.9, **kw),
                                       tokens, mask)
    old = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3 - 1.5
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref_lp = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3 - 1.5
    old = ref.kept_logprobs(logits, tokens, mask, 0.9, kept)[0] + 0.1 * old.numpy()
    old = torch.as_tensor(old)
    rkw = {k: v for k, v in case.items()}
    x = logits.clone().requires_grad_(True)
    loss, metrics = pk.ppo_loss(x, tokens, old, adv, mask, ref_lp, temperature=0.9,
                                backend=be.name, **case, **kw)
    loss.backward()
    e_loss, e_metrics, e_grad = ref.ppo_loss(logits, tokens, old, adv, mask, ref_lp,
                                             temperature=0.9, kept=kept, **rkw)
    assert_close_np(loss, e_loss, rtol=1e-11, atol=1e-12, what="loss")
    assert_grad_close(x.grad, e_grad, 1e-10)
    e_metrics["mask_missing_token_frac"] = float(missing[mask.numpy()].mean())
    for k, v in e_metrics.items():
        assert k in metrics, k
        assert_close_np(metrics[k], v, rtol=2e-6, atol=2e-6, what=k)


class _KernelCalls(TorchDispatchMode):
    """The names of the ppo_kernels ops dispatched."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "ppo_kernels":
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("given_mask", [True, False], ids=["given", "rederived"])
@pytest.mark.parametrize("case,dense", [
    (dict(), False), (dict(kl_coef=0.1, kl_logprobs="kept"), False),
    (dict(entropy_coef=0.01, entropy_over="kept"), False), (dict(kl_coef=0.1), True),
    (dict(entropy_coef=0.01), True)], ids=["plain", "kl-kept", "entropy-kept", "kl-full",
                                           "entropy-full"])
@pytest.mark.parametrize("route", ["logits", "none-mode", "hidden"])
def test_gradient_pass_skips_the_dense_part(given_mask, case, dense, route):
    """The gradient pass reads the whole row (token_logprobs_bwd) only where the full
    vocabulary's logp or entropy takes a gradient, the kept part then added in place;
    otherwise its dlogits are the kept part alone, written once (kept_logprobs_bwd, no zero
    fill; the values: test_ppo_loss_against_reference and
    test_from_hidden_matches_the_logits_path): on the two-phase path (logits) and through
    the log-probs' autograd Function (loss_agg_mode="none", and from hidden states)."""
    gen = torch.Generator().manual_seed(12)
    B, T, V, H = 2, 4, 19, 6
    logits, tokens, mask = inputs(B, T, V, gen, dtype=torch.float32)
    sm, _ = random_csr(B, T, V, gen, kmax=6, tokens=tokens)
    kw = dict(sampling_mask=sm) if given_mask else dict(top_k=8, top_p=0.9)
    ref_lp = torch.randn(B, T, generator=gen) - 2
    adv = torch.randn(B, T, generator=gen)
    x = logits.clone().requires_grad_(True)
    hidden = torch.randn(B, T, H, generator=gen, requires_grad=True)
    w = torch.randn(V, H, generator=gen, requires_grad=True)
    with _KernelCalls() as calls:
        if route == "hidden":
            loss, _ = pk.ppo_loss_from_hidden(hidden, w, tokens, None, adv, mask, ref_lp,
                                              backend="cpu", **case, **kw)
        else:
            mode = dict(loss_agg_mode="none") if route == "none-mode" else {}
            loss, _ = pk.ppo_loss(x, tokens, None, adv, mask, ref_lp, backend="cpu", **mode,
                                  **case, **kw)
        loss.sum().backward()
    assert ("token_logprobs_bwd" in calls.names) == dense, calls.names
    assert "zeros_grad" not in calls.names, calls.names
    assert ("kept_logprobs_bwd_" in calls.names) == dense, calls.names
    assert ("kept_logprobs_bwd" in calls.names) != dense, calls.names


@pytest.mark.parametrize("device_fill", [False, True], ids=["zeros_grad", "torch.zeros"])
def test_zero_start_of_permuted_logits(monkeypatch, device_fill):
    """[T, B, V] logits read as [B, T, V] (a permuted view): the zero start of the gradient
    is contiguous, as the kept-set kernels require, on the CPU op and on the device's
    torch.zeros (taken here on CPU tensors), and the gradient is the contiguous logits'."""
    from ppo_kernels import rows
    if device_fill:
        monkeypatch.setattr(rows, "HAS_CPU", False)
    gen = torch.Generator().manual_seed(13)
    B, T, V = 2, 5, 23
    logits, tokens, mask = inputs(B, T, V, gen, dtype=torch.float32)
    adv = torch.randn(B, T, generator=gen)
    grads = []
    for permuted in (False, True):
        leaf = (logits.transpose(0, 1).contiguous() if permuted else logits.clone())
        leaf.requires_grad_(True)
        x = leaf.transpose(0, 1) if permuted else leaf
        loss, _ = pk.ppo_loss(x, tokens, None, adv, mask, top_k=8, top_p=0.9, backend="cpu")
        loss.backward()
        grads.append(leaf.grad.transpose(0, 1) if permuted else leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
def test_ppo_loss_none_mode_and_float32(be):
    gen = torch.Generator().manual_seed(10)
    B, T, V = 2, 4, 23
    logits, tokens, mask = inputs(B, T, V, gen, dtype=torch.float32)
    sm, dense = random_csr(B, T, V, gen, kmax=8, tokens=tokens)
    kept, _ = ref.with_token(dense.numpy(), tokens, mask)
    adv = torch.randn(B, T, generator=gen)
    ref_lp = torch.randn(B, T, generator=gen) - 2
    for mode in ("none", "token-mean"):
        x = logits.clone().requires_grad_(True)
        loss, _ = pk.ppo_loss(x, tokens, None, adv, mask, ref_lp, kl_coef=0.1,
                              loss_agg_mode=mode, sampling_mask=sm, backend=be.name)
        loss.sum().backward()
        e_loss, _, e_grad = ref.ppo_loss(logits, tokens, None, adv, mask, ref_lp, kl_coef=0.1,
                                         loss_agg_mode=mode, kept=kept)
        assert_close_np(loss, e_loss, rtol=2e-6, atol=2e-6, what=mode)
        assert_grad_close(x.grad, e_grad, 3e-6)


def test_ratio_bias_disappears_with_replay():
    """The engine's processed log-probs as old_logprobs: without replay the ratios carry
    log(kept mass); with it they are 1 (on-policy, same weights)."""
    gen = torch.Generator().manual_seed(11)
    B, T, V = 4, 8, 64
    logits, tokens, mask = inputs(B, T, V, gen, dtype=torch.float32, scale=3.0)
    mask[:] = True
    engine = pk.token_logprobs(logits, tokens, mask, top_p=0.8, top_k=16, backend="torch")
    adv = torch.ones(B, T)
    _, m_plain = pk.ppo_loss(logits, tokens, engine, adv, mask)
    _, m_replay = pk.ppo_loss(logits, tokens, engine, adv, mask, top_p=0.8, top_k=16)
    assert float(m_plain["ratio_mean"]) < 0.95  # exp(log kept mass) < 1
    assert abs(float(m_replay["ratio_mean"]) - 1.0) < 1e-5
    assert float(m_replay["kept_mass"]) < 1.0


def test_metrics_absent_without_a_kept_set():
    gen = torch.Generator().manual_seed(12)
    logits, tokens, mask = inputs(2, 3, 10, gen)
    _, m = pk.ppo_loss(logits, tokens, None, torch.ones(2, 3, dtype=torch.float64), mask)
    assert "kept_mass" not in m


# ------------------------------------------------------------------ from hidden states

# the two temperatures the from-hidden and packed replays are checked at: a scalar (with a
# soft cap on the head's logits) and one per sequence; each its own seeded inputs
ROW_TEMPERATURES = {"scalar": dict(seed=13, B=2, T=5, cap=5.0, temp=0.8, chunk=4),
                    "per_sequence": dict(seed=26, B=3, T=4, cap=None, chunk=5,
                                         temp=torch.tensor([0.5, 1.3, 0.9],
                                                           dtype=torch.float64))}


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
@pytest.mark.parametrize("given_mask", [True, False], ids=["given", "rederived"])
@pytest.mark.parametrize("temperature", sorted(ROW_TEMPERATURES))
def test_from_hidden_matches_the_logits_path(be, given_mask, temperature):
    """token_logprobs_from_hidden / ppo_loss_from_hidden / score_rollout_from_hidden with a
    kept set equal the logits ops on hidden @ W^T (chunks of rows: rows.RowLogprobs on
    head_chunks.HeadRows), with a scalar temperature and a soft cap, or a [B] temperature
    (then for token_logprobs and score_rollout too, and score_rollout on the logits on
    ``be`` as well)."""
    c = ROW_TEMPERATURES[temperature]
    per_row = temperature != "scalar"
    gen = torch.Generator().manual_seed(c["seed"])
    B, T, H, V = c["B"], c["T"], 6, 19
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 0] = False
    if given_mask:
        sm, _ = random_csr(B, T, V, gen, kmax=7, tokens=tokens, drop_token_frac=0.2)
        kw = dict(sampling_mask=sm)
    else:
        kw = dict(top_k=9, top_p=0.8, min_p=0.01)
    cap, temp = c["cap"], c["temp"]
    # the scalar case keeps token_logprobs and score_rollout at temperature 1
    row_kw = dict(temperature=temp) if per_row else {}
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref_lp = torch.randn(B, T, generator=gen, dtype=torch.float64) - 2
    vals = torch.randn(B, T, generator=gen, dtype=torch.float64)
    scores = torch.randn(B, generator=gen, dtype=torch.float64)

    def grads(f):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = f(h, w)
        out.backward()
        return out.detach(), h.grad, w.grad

    def logits_of(h, w):
        return h @ w.t() if cap is None else cap * torch.tanh(h @ w.t() / cap)

    opts = dict(kl_coef=0.1, entropy_coef=0.01, entropy_over="kept", temperature=temp)
    got = grads(lambda h, w: pk.ppo_loss_from_hidden(
        h, w, tokens, None, adv, mask, ref_lp, logit_softcap=cap, chunk_size=c["chunk"],
        backend=be.name, **opts, **kw)[0])
    want = grads(lambda h, w: pk.ppo_loss(logits_of(h, w), tokens, None, adv, mask, ref_lp,
                                          backend="torch", **opts, **kw)[0])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    got = grads(lambda h, w: sum(x.sum() for x in pk.token_logprobs_from_hidden(
        h, w, tokens, mask, logit_softcap=cap, chunk_size=3, return_full=True,
        return_entropy=True, backend=be.name, **row_kw, **kw)))
    want = grads(lambda h, w: sum(x.sum() for x in pk.token_logprobs(
        logits_of(h, w), tokens, mask, return_full=True, return_entropy=True,
        backend="torch", **row_kw, **kw)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    r1 = pk.score_rollout_from_hidden(hidden, weight, tokens, ref_lp, vals, scores, mask,
                                      logit_softcap=cap, chunk_size=4, kl_coef=0.05,
                                      backend=be.name, **row_kw, **kw)
    r2 = pk.score_rollout(logits_of(hidden, weight), tokens, ref_lp, vals, scores, mask,
                          kl_coef=0.05, backend="torch", **row_kw, **kw)
    r3 = pk.score_rollout(logits_of(hidden, weight), tokens, ref_lp, vals, scores, mask,
                          kl_coef=0.05, backend=be.name, **row_kw, **kw)
    for a, b, c_ in zip(r1, r2, r3):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c_, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
@pytest.mark.parametrize("given_mask", [True, False], ids=["given", "rederived"])
@pytest.mark.parametrize("temperature", ["none", "per_sequence"])
def test_packed_sequences(be, given_mask, temperature):
    """cu_seqlens: the CSR rows are the packed positions, per-sequence parameters [S]; GSPO's
    sequence ratio over the kept-set log-probs equals the reference on the padded batch,
    without a temperature or with a per-sequence [S] one (and then a min_p too)."""
    per_row = temperature == "per_sequence"
    gen = torch.Generator().manual_seed(27 if per_row else 14)
    lens, V = [3, 2, 4], 13
    total, S, L = sum(lens), len(lens), max(lens)
    logits = torch.randn(1, total, V, generator=gen, dtype=torch.float64) * 2
    tokens = torch.randint(0, V, (1, total), generator=gen)
    cu = torch.tensor([0, 3, 5, 9])
    adv = torch.randn(S, generator=gen, dtype=torch.float64)
    temp = torch.tensor([0.6, 1.4, 0.9], dtype=torch.float64) if per_row else None
    row_kw = dict(temperature=temp) if per_row else {}
    min_p = dict(min_p=0.02) if per_row else {}
    if given_mask:
        sm, dense = random_csr(1, total, V, gen, kmax=6, tokens=tokens, drop_token_frac=0.3)
        kw = dict(sampling_mask=sm)
    else:
        top_p = torch.tensor([0.6, 0.9, 0.75], dtype=torch.float64)
        kw = dict(top_p=top_p, top_k=7, **min_p)
    # the padded batch the reference sees
    pl = torch.zeros(S, L, V, dtype=torch.float64)
    pt = torch.zeros(S, L, dtype=torch.long)
    pm = torch.zeros(S, L, dtype=torch.bool)
    pk_dense = torch.zeros(S, L, V, dtype=torch.bool)
    for s_, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        pl[s_, :b - a], pt[s_, :b - a], pm[s_, :b - a] = logits[0, a:b], tokens[0, a:b], True
        if given_mask:
            pk_dense[s_, :b - a] = dense[0, a:b]
    tn = temp.numpy() if per_row else 1.0
    if given_mask:
        kept, _ = ref.with_token(pk_dense.numpy(), pt, pm)
    else:
        kept, _ = ref.with_token(ref.sampling_kept(pl, pt, pm, tn, top_p=top_p, top_k=7,
                                                   **min_p), pt, pm)
    old_p = torch.as_tensor(ref.kept_logprobs(pl, pt, pm, tn, kept)[0]) + 0.05
    old = torch.cat([old_p[s_, :n] for s_, n in enumerate(lens)]).view(1, total)
    x = logits.clone().requires_grad_(True)
    loss, _ = pk.ppo_loss(x, tokens, old, adv, cu_seqlens=cu, policy_loss="gspo",
                          loss_agg_mode="seq-mean-token-mean", backend=be.name, **row_kw, **kw)
    loss.backward()
    e_loss, _, e_grad = ref.ppo_loss(pl, pt, old_p, adv, pm, policy_loss="gspo",
                                     loss_agg_mode="seq-mean-token-mean",
                                     **({"temperature": tn} if per_row else {}), kept=kept)
    assert_close_np(loss, e_loss, rtol=1e-11, atol=1e-12)
    g = torch.cat([torch.as_tensor(e_grad)[s_, :n] for s_, n in enumerate(lens)])
    assert_grad_close(x.grad[0], g.numpy(), 1e-10)


def test_example_shows_the_bias_and_its_disappearance():
    """examples/sampling_replay.py (the README's example), at a small size."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "examples" / "sampling_replay.py"
    spec = importlib.util.spec_from_file_location("sampling_replay_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    results, m_plain, m_replay = mod.main(B=2, T=16, V=512, top_k=32, top_p=0.8)
    assert results["no replay"] > 0.5
    assert results["replay, given mask"] == 0.0
    assert results["replay, top_k/top_p"] == 0.0
    assert abs(float(m_replay["ratio_mean"]) - 1.0) < 1e-5 < 1.0 - float(m_plain["ratio_mean"])
    assert float(m_replay["mask_missing_token_frac"]) == 0.0


# ------------------------------------------------------------------ tensor parallel

def test_tensor_parallel_vocabulary_two_ranks(tmp_path):
    """tests/replay_rank_cases.py on 2 gloo processes: a given SamplingMask over a
    vocabulary split [0, 6) / [6, 13) (sets lacking their token included, at both sides of
    the cut and at the vocabulary's end; sets whose top is two tied ids of one shard) gives
    the unsharded op's loss, metrics and gradient (ppo_loss: vanilla, gspo with the KL and
    the entropy over the kept set, the full entropy; token_logprobs with return_full and
    the kept entropy); an id outside the whole vocabulary is a ValueError on every rank. And
    context parallel (cp_group, each rank half of every sequence with its CSR rows): the
    ranks' losses add up to the whole loss (gspo's sequence ratio over the kept log-probs
    of both halves), each rank's gradient is its slice of the whole gradient."""
    import pathlib

    from helpers.ranks import run_ranks
    script = pathlib.Path(__file__).parent / "replay_rank_cases.py"
    ranks = run_ranks(script, tmp_path, n=2)
    for res in ranks:
        for k, v in res.items():
            if k == "out_of_range":
                assert v.startswith("raised sampling_mask.token_ids"), v
            elif k.endswith("own_part"):
                assert v == "partial", (k, v)
            else:
                assert v <= 1e-12, (k, v)


def test_tensor_parallel_rederived_is_not_implemented():
    from ppo_kernels.rows import SplitVocab
    from ppo_kernels.sampling import Replay
    with pytest.raises(NotImplementedError, match="tp_group"):
        SplitVocab(None).block_kept(None, None, None, None, 1.0,
                                    Replay(top_p=torch.ones(1, 1)))


# ------------------------------------------------------------------ the raw ops

@pytest.mark.parametrize("prefix", ["", "triton_"], ids=["cpu", "triton"])
def test_opcheck_kept_ops(prefix):
    """torch.library.opcheck of the kept-set ops: schema, fake (meta) functions and their
    agreement with the kernels (CSR and threshold sets)."""
    from ppo_kernels._backends import get_backend
    # the triton ops on the device triton runs on: a GPU when there is one, else the
    # interpreter on CPU tensors
    dev = torch.device(TRITON_DEVICE if prefix else "cpu")
    get_backend("cpu" if not prefix else "triton", dev)
    ops = torch.ops.ppo_kernels
    gen = torch.Generator().manual_seed(15)
    B, T, V = 2, 3, 9
    logits, tokens, mask = inputs(B, T, V, gen, dtype=torch.float32)
    sm, _ = random_csr(B, T, V, gen, kmax=4, tokens=tokens, drop_token_frac=0.5)
    top_p = torch.full((B, T), 0.7, dtype=torch.float64)
    top_k = torch.full((B, T), 5, dtype=torch.long)
    logits, tokens, mask, top_p, top_k = (t.to(dev) for t in (logits, tokens, mask, top_p,
                                                                top_k))
    ids, offs = sm.token_ids.to(dev), sm.offsets.to(dev)
    thr_op = getattr(ops, prefix + "sampling_threshold")
    fwd = getattr(ops, prefix + "kept_logprobs_fwd")
    bwd = getattr(ops, prefix + "kept_logprobs_bwd_")
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(thr_op, (logits, mask, 1.0, top_k, top_p, None), test_utils=tests)
    thr = thr_op(logits, mask, 1.0, top_k, top_p, None)
    for kept in ((ids, offs, None), (None, None, thr)):
        torch.library.opcheck(fwd, (logits, tokens, mask, 0.8, *kept), test_utils=tests)
        lp, ent, kmax, kls, _, _ = fwd(logits, tokens, mask, 0.8, *kept)
        g = torch.randn(B, T, generator=gen).to(dev)
        torch.library.opcheck(bwd, (g, g, logits, tokens, mask, kmax, kls, ent, 0.8, *kept,
                                    torch.zeros_like(logits)), test_utils=tests)


# ------------------------------------------------------------------ per-row temperature

def _row_temps(B, T, gen):
    """A per-sequence [B] and a per-token [B, T] temperature (float64), spread over
    [0.3, 1.7] (both sides of 1)."""
    t_seq = 0.3 + 1.4 * torch.rand(B, generator=gen, dtype=torch.float64)
    t_tok = 0.3 + 1.4 * torch.rand(B, T, generator=gen, dtype=torch.float64)
    return t_seq, t_tok


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
@pytest.mark.parametrize("given_mask", [True, False], ids=["given", "rederived"])
def test_per_row_temperature_token_logprobs(be, given_mask):
    """A [B] temperature equals a loop of scalar calls per sequence (the re-derived set of
    each row on its own temperature-scaled logits); a [B, T] temperature equals the
    reference with per-token temperatures; the gradients both."""
    gen = torch.Generator().manual_seed(21)
    B, T, V = 3, 4, 31
    logits, tokens, mask = inputs(B, T, V, gen)
    t_seq, t_tok = _row_temps(B, T, gen)
    if given_mask:
        sm, dense = random_csr(B, T, V, gen, kmax=9, tokens=tokens, drop_token_frac=0.3)
        kw = dict(sampling_mask=sm)
    else:
        kw = dict(top_k=10, top_p=0.8, min_p=0.02)

    def run(x, temp, kw_):
        return pk.token_logprobs(x, tokens[:x.shape[0]], mask[:x.shape[0]], temperature=temp,
                                 return_full=True, return_entropy=True, backend=be.name,
                                 **kw_)

    got = run(logits, t_seq, kw)
    for b in range(B):
        kw_b = kw
        if given_mask:
            o = sm.offsets
            ids = sm.token_ids[o[b * T]:o[(b + 1) * T]]
            kw_b = dict(sampling_mask=pk.SamplingMask(ids, o[b * T:(b + 1) * T + 1] - o[b * T]))
        lb = logits[b:b + 1]
        one = pk.token_logprobs(lb, tokens[b:b + 1], mask[b:b + 1],
                                temperature=float(t_seq[b]), return_full=True,
                                return_entropy=True, backend=be.name, **kw_b)
        for a, e in zip(got, one):
            torch.testing.assert_close(a[b:b + 1], e, rtol=1e-12, atol=1e-12)
    # [B, T] against the reference (its kept sets re-derived per token)
    if given_mask:
        kept, _ = ref.with_token(dense.numpy(), tokens, mask)
    else:
        kept, _ = ref.with_token(ref.sampling_kept(logits, tokens, mask, t_tok.numpy(), **kw),
                                 tokens, mask)
    x = logits.clone().requires_grad_(True)
    lp_k, lp, ent = run(x, t_tok, kw)
    e_lpk, _ = ref.kept_logprobs(logits, tokens, mask, t_tok.numpy(), kept)
    e_lp, e_ent = ref.token_logprobs(logits, tokens, mask, t_tok.numpy())
    assert_close_np(lp_k, e_lpk, rtol=1e-12, atol=1e-12, what="logp_kept")
    assert_close_np(lp, e_lp, rtol=1e-12, atol=1e-12, what="logp")
    assert_close_np(ent, e_ent, rtol=1e-12, atol=1e-12, what="entropy")
    g1, g2, g3 = (torch.randn(B, T, generator=gen, dtype=torch.float64) for _ in range(3))
    (g1 * lp_k + g2 * lp + g3 * ent).sum().backward()
    want = ref.kept_logprobs_grad(logits, tokens, mask, t_tok.numpy(), kept, g1) + \
        ref.token_logprobs_grad(logits, tokens, mask, t_tok.numpy(), g2, g3)
    assert_grad_close(x.grad, want, 1e-12)
    _, ent_k = pk.token_logprobs(logits, tokens, mask, temperature=t_tok, return_entropy=True,
                                 entropy_over="kept", backend=be.name, **kw)
    assert_close_np(ent_k, ref.kept_logprobs(logits, tokens, mask, t_tok.numpy(), kept)[1],
                    rtol=1e-12, atol=1e-12, what="entropy_kept")


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
def test_per_row_temperature_rederived_sets_differ_per_row(be):
    """The same logits row under two temperatures keeps different min-p / top-p sets: each
    row's set is the reference's on its own z (kernel_kept reads the threshold op)."""
    gen = torch.Generator().manual_seed(22)
    B, T, V = 2, 3, 40
    row = torch.randn(V, generator=gen, dtype=torch.float64) * 2
    logits = row.expand(B, T, V).contiguous()
    tokens = torch.full((B, T), int(row.argmax()))
    mask = torch.ones(B, T, dtype=torch.bool)
    temp = torch.tensor([0.4, 1.6], dtype=torch.float64)
    for kw in (dict(min_p=0.05), dict(top_p=0.7), dict(top_k=6, top_p=0.9, min_p=0.01)):
        from ppo_kernels import sampling as sm
        rp = sm.check_replay(None, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"), tokens, V)
        t_bt = temp[:, None].expand(B, T).contiguous()
        if be.name == "torch":
            thr = sm.threshold_torch(logits, mask, t_bt, rp)
        else:
            from ppo_kernels._backends import get_backend
            get_backend(be.name, logits.device)
            op = getattr(torch.ops.ppo_kernels, ("triton_" if be.name == "triton" else "") +
                         "sampling_threshold")
            thr = op(logits, mask, 1.0, rp.top_k, rp.top_p, rp.min_p, t_bt)
        kept = (logits.double() >= thr.unsqueeze(-1)).numpy()
        want = ref.sampling_kept(logits, tokens, mask, temp.numpy(), **kw)
        np.testing.assert_array_equal(kept, want)
        assert kept[0].sum() < kept[1].sum(), kw  # the colder row keeps fewer
        lp = pk.token_logprobs(logits, tokens, mask, temperature=temp, backend=be.name, **kw)
        e_lp, _ = ref.kept_logprobs(logits, tokens, mask, temp.numpy(),
                                    ref.with_token(want, tokens, mask)[0])
        assert_close_np(lp, e_lp, rtol=1e-12, atol=1e-12, what="logp_kept")


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
@pytest.mark.parametrize("case", [dict(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01),
                                  dict(policy_loss="gspo", kl_coef=0.1, kl_logprobs="kept",
                                       entropy_coef=0.02, entropy_over="kept")],
                         ids=["k3,entropy", "gspo,kept"])
@pytest.mark.parametrize("given_mask", [True, False], ids=["given", "rederived"])
def test_per_row_temperature_ppo_loss(be, case, given_mask):
    """ppo_loss with a [B] and a [B, T] temperature and a kept set against the reference
    (the two-phase path: token-mean; autograd: loss_agg_mode="none")."""
    gen = torch.Generator().manual_seed(24)
    B, T, V = 3, 5, 29
    logits, tokens, mask = inputs(B, T, V, gen)
    t_seq, t_tok = _row_temps(B, T, gen)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref_lp = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3 - 1.5
    if given_mask:
        sm, dense = random_csr(B, T, V, gen, kmax=10, tokens=tokens, drop_token_frac=0.2)
        kw = dict(sampling_mask=sm)
    for temp in (t_seq, t_tok):
        tn = temp.numpy()
        if given_mask:
            kept, missing = ref.with_token(dense.numpy(), tokens, mask)
        else:
            kw = dict(top_k=12, top_p=0.85)
            kept, missing = ref.with_token(ref.sampling_kept(logits, tokens, mask, tn, **kw),
                                           tokens, mask)
        old = torch.as_tensor(ref.kept_logprobs(logits, tokens, mask, tn, kept)[0]) + 0.1 * \
            torch.randn(B, T, generator=gen, dtype=torch.float64)
        for mode in ("token-mean", "none"):
            x = logits.clone().requires_grad_(True)
            loss, metrics = pk.ppo_loss(x, tokens, old, adv, mask, ref_lp, temperature=temp,
                                        loss_agg_mode=mode, backend=be.name, **case, **kw)
            loss.sum().backward()
            e_loss, e_metrics, e_grad = ref.ppo_loss(logits, tokens, old, adv, mask, ref_lp,
                                                     temperature=tn, kept=kept,
                                                     loss_agg_mode=mode, **case)
            assert_close_np(loss, e_loss, rtol=1e-11, atol=1e-12, what=mode)
            assert_grad_close(x.grad, e_grad, 1e-10)
            if mode == "token-mean":
                for k in ("kept_mass", "kept_size_mean"):
                    assert_close_np(metrics[k], e_metrics[k], rtol=2e-6, atol=2e-6, what=k)


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_per_row_temperature_scalar_bits(be):
    """A 0-d / constant [B] temperature tensor gives the number's bits with a kept set
    (float64 logits)."""
    gen = torch.Generator().manual_seed(25)
    B, T, V = 2, 4, 17
    logits, tokens, mask = inputs(B, T, V, gen)
    sm, _ = random_csr(B, T, V, gen, kmax=6, tokens=tokens, drop_token_frac=0.3)
    for kw in (dict(sampling_mask=sm), dict(top_k=5, top_p=0.8, min_p=0.05)):
        want = pk.token_logprobs(logits, tokens, mask, temperature=0.7, return_full=True,
                                 return_entropy=True, backend=be.name, **kw)
        for temp in (torch.tensor(0.7, dtype=torch.float64),
                     torch.full((B,), 0.7, dtype=torch.float64)):
            got = pk.token_logprobs(logits, tokens, mask, temperature=temp, return_full=True,
                                    return_entropy=True, backend=be.name, **kw)
            for a, e in zip(got, want):
                assert torch.equal(a, e)


@pytest.mark.parametrize("be", REPLAY_BACKENDS)
def test_per_row_temperature_bad_inputs(be):
    """A bad per-row temperature with a kept set: a ValueError naming temperature (a value
    <= 0, NaN, a wrong shape), as without one."""
    gen = torch.Generator().manual_seed(28)
    B, T, V = 2, 3, 11
    logits, tokens, mask = inputs(B, T, V, gen)
    sm, _ = random_csr(B, T, V, gen, kmax=4, tokens=tokens)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    for kw in (dict(sampling_mask=sm), dict(top_p=0.8)):
        for bad in (torch.tensor([0.5, 0.0]), torch.tensor([float("nan"), 1.0]),
                    torch.tensor([-1.0, 1.0]), torch.ones(B + 1), torch.ones(B, T + 1)):
            with pytest.raises(ValueError, match="temperature"):
                pk.token_logprobs(logits, tokens, mask, temperature=bad, backend=be.name, **kw)
            with pytest.raises(ValueError, match="temperature"):
                pk.ppo_loss(logits, tokens, None, adv, mask, temperature=bad,
                            backend=be.name, **kw)


@pytest.mark.parametrize("prefix", ["", "triton_"], ids=["cpu", "triton"])
def test_opcheck_kept_ops_per_row_temperature(prefix):
    """The kept-set ops' trailing `temperatures`: opcheck, equal values give the float's
    results, and a bad tensor is an error (the raw ops' defence)."""
    from ppo_kernels._backends import get_backend
    # the triton ops on the device triton runs on: a GPU when there is one, else the
    # interpreter on CPU tensors
    dev = torch.device(TRITON_DEVICE if prefix else "cpu")
    get_backend("cpu" if not prefix else "triton", dev)
    ops = torch.ops.ppo_kernels
    gen = torch.Generator().manual_seed(29)
    B, T, V = 2, 3, 9
    logits, tokens, mask = inputs(B, T, V, gen, dtype=torch.float32)
    sm, _ = random_csr(B, T, V, gen, kmax=4, tokens=tokens, drop_token_frac=0.5)
    top_p = torch.full((B, T), 0.7, dtype=torch.float64)
    top_k = torch.full((B, T), 5, dtype=torch.long)
    logits, tokens, mask, top_p, top_k = (t.to(dev) for t in (logits, tokens, mask, top_p,
                                                                top_k))
    ids, offs = sm.token_ids.to(dev), sm.offsets.to(dev)
    temps = (0.5 + torch.rand(B, T, generator=gen)).to(dev)
    thr_op = getattr(ops, prefix + "sampling_threshold")
    fwd = getattr(ops, prefix + "kept_logprobs_fwd")
    bwd = getattr(ops, prefix + "kept_logprobs_bwd_")
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(thr_op, (logits, mask, 1.0, top_k, top_p, None, temps),
                          test_utils=tests)
    thr = thr_op(logits, mask, 1.0, top_k, top_p, None, temps)
    eq = torch.full((B, T), 0.8, device=dev)
    for kept in ((ids, offs, None), (None, None, thr)):
        torch.library.opcheck(fwd, (logits, tokens, mask, 1.0, *kept, temps), test_utils=tests)
        lp, ent, kmax, kls, _, _ = fwd(logits, tokens, mask, 1.0, *kept, temps)
        g = torch.randn(B, T, generator=gen).to(dev)
        torch.library.opcheck(bwd, (g, g, logits, tokens, mask, kmax, kls, ent, 1.0, *kept,
                                    torch.zeros_like(logits), temps), test_utils=tests)
        a = fwd(logits, tokens, mask, 0.8, *kept)
        b = fwd(logits, tokens, mask, 1.0, *kept, eq)
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)
        with pytest.raises((RuntimeError, TypeError), match="temperatures"):
            fwd(logits, tokens, mask, 1.0, *kept, temps.double())


# every rule of a given kept set's CSR broken once: (token_ids, offsets) over N = 4 positions
BAD_CSR = {
    "offsets-start": ([0, 1], [1, 1, 2, 2, 2]),
    "offsets-end": ([0, 1], [0, 1, 1, 1, 1]),
    "offsets-order": ([0, 1], [0, 2, 1, 2, 2]),
    "id-above-V": ([0, 5], [0, 1, 2, 2, 2]),
    "id-negative": ([0, -1], [0, 1, 2, 2, 2]),
    "id-twice": ([3, 1, 3], [0, 3, 3, 3, 3]),
}


@pytest.mark.parametrize("name", list(BAD_CSR))
def test_bad_kept_sets_the_same_error_with_and_without_the_cpu_op(monkeypatch, name):
    """check_replay's one CPU op (ppo_kernels::check_kept_ids) and its eager checks (a build
    without the op) raise the same ValueError for each broken rule; a good set passes
    both."""
    from ppo_kernels import sampling
    tokens = torch.zeros(2, 2, dtype=torch.long)
    ids, offs = (torch.tensor(v) for v in BAD_CSR[name])
    errors = []
    for with_op in (True, False):
        with monkeypatch.context() as mp:
            if not with_op:
                mp.setattr(sampling, "csr_check_op", lambda: None)
            calls = device_path.spy(mp, torch.ops.ppo_kernels, "check_kept_ids")
            with pytest.raises(ValueError) as e:
                sampling.check_replay(pk.SamplingMask(ids, offs), None, None, None, tokens, 5)
            errors.append(str(e.value))
            good = sampling.check_replay(pk.SamplingMask(torch.tensor([0, 1, 4]),
                                                         torch.tensor([0, 2, 2, 3, 3])),
                                         None, None, None, tokens, 5)
            assert good.ids.tolist() == [0, 1, 4]
            assert len(calls) == (2 if with_op else 0)
    assert errors[0] == errors[1], errors


@pytest.mark.parametrize("dtype,own", [(torch.bfloat16, True), (torch.float16, True),
                                       (torch.float32, False), (torch.float64, False)])
def test_threshold_op_of_the_cuda_backend(monkeypatch, dtype, own):
    """kept_rows.threshold_op: the cuda backend takes its own op for 16-bit logits (the
    shared-memory histogram select, csrc/cuda/threshold_select.cuh, checked on the host by
    tests/test_csrc.py's emulate_threshold), the Triton select on the device path for wider
    dtypes, and its own op (ATen sorts) off that path; the other backends their own op."""
    from ppo_kernels import _backends, kept_rows
    from ppo_kernels.triton_kernels import threshold

    class Backend:
        def __init__(self, name):
            self.name = name

        def op(self, name):
            return (self.name, name)

    x = torch.zeros(1, 2, 5, dtype=dtype)
    monkeypatch.setattr(_backends, "device_eager", lambda be, t: be.name in ("triton", "cuda"))
    got = kept_rows.threshold_op(Backend("cuda"), x)
    assert got == ("cuda", "sampling_threshold") if own else got is threshold.sampling_threshold
    assert kept_rows.threshold_op(Backend("triton"), x) is threshold.sampling_threshold
    monkeypatch.setattr(_backends, "device_eager", lambda be, t: False)
    assert kept_rows.threshold_op(Backend("cuda"), x) == ("cuda", "sampling_threshold")
    assert kept_rows.threshold_op(Backend("cpu"), x) == ("cpu", "sampling_threshold")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_threshold_radix_select_and_mass_buckets(dtype):
    """The CPU op's threshold (csrc/cpu/sampling.cpp row_threshold) keeps the same set as a
    float64 sort of the row (kept.threshold_torch) where its faster paths run: top-k's radix
    select over the float keys (k > 128: the bucket of the k-th entry, then a partial sort
    of that bucket), and top-p's walk from the bucket of its mass histogram that reaches the
    target (the next buckets where the sums' rounding falls short, every survivor where
    top_p is one ulp below 1), on rows with ties, +0 and -0 entries (two float keys of one
    value: a cut at 0 keeps both), -inf entries, flat rows and large values."""
    from ppo_kernels import kept, sampling

    g = torch.Generator().manual_seed(41)
    ops = torch.ops.ppo_kernels
    seen = 0
    for V in (300, 5003):
        for kind in ("normal", "ties", "zeros", "neginf", "flat", "large"):
            B, T = 2, 5
            x = torch.randn(B, T, V, generator=g) * 2
            if kind == "ties":
                x = torch.randint(-4, 5, (B, T, V), generator=g).float()
            elif kind == "zeros":
                x = torch.randint(-1, 2, (B, T, V), generator=g).float()
                x[(x == 0) & (torch.rand(B, T, V, generator=g) < 0.5)] = -0.0
            elif kind == "neginf":
                x[torch.rand(B, T, V, generator=g) < 0.3] = float("-inf")
            elif kind == "flat":
                x = x * 0.005
            elif kind == "large":
                x = x * 10 + 40
            x = x.to(dtype)
            mask = torch.ones(B, T, dtype=torch.bool)
            k = torch.tensor([129, 200, V // 3, V - 1, V] * 2).view(B, T)
            p = torch.tensor([0.5, 0.9, 0.999, 0.999999, 1.0] * 2,
                             dtype=torch.float64).view(B, T)
            xx = x.double()
            for rule in ((k, None), (None, p), (k, p)):
                got = ops.sampling_threshold(x, mask, 0.8, *rule, None, None)
                want = kept.threshold_torch(x, mask, 0.8,
                                            sampling.Replay(top_k=rule[0], top_p=rule[1]))
                assert torch.equal(xx >= got[..., None], xx >= want[..., None]), (V, kind, rule)
                seen += int((got > float("-inf")).sum())
            # top_p one ulp below 1: the target within rounding of the total, where the
            # sums' order decides (the walk past every bucket); a set at least top_p 0.999's
            one_ulp = torch.full((B, T), 1 - 2.0 ** -52, dtype=torch.float64)
            wide = ops.sampling_threshold(x, mask, 0.8, None, one_ulp, None, None)
            narrow = ops.sampling_threshold(x, mask, 0.8, None, torch.full_like(one_ulp, 0.999),
                                            None, None)
            assert not wide.isnan().any() and (wide <= narrow).all(), (V, kind)
    assert seen > 150  # most rows are cut


@pytest.mark.parametrize("prefix", ["", "triton_"], ids=["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_kept_ops_against_the_reference(prefix, dtype):
    """The kept-set ops on their own, against the float64 reference, where their row sweeps
    run in vectors (V past several vectors, never a multiple of one; the CPU's threshold
    rows: csrc/cpu/sampling.cpp kept_max_count, kept_mass_sums, kept_grad_sweep): CSR and
    threshold sets (every entry kept, top-k / top-p sets, sets that lack the token), ties at
    the top, -inf entries, per-row temperatures, masked rows, zero gradients, and logits of
    T + 1 positions. kept_logprobs_bwd (the gradient written whole) equals
    kept_logprobs_bwd_ added into zeros bit for bit, and into a random start that start
    plus it. (The thresholds come from the CPU op on both backends: the Triton select has
    its own tests, tests/test_triton_threshold.py, and is slow under the interpreter.)"""
    from ppo_kernels._backends import get_backend
    dev = torch.device(TRITON_DEVICE if prefix else "cpu")
    get_backend("cpu" if not prefix else "triton", dev)
    ops = torch.ops.ppo_kernels
    op = {n: getattr(ops, prefix + n) for n in ("kept_logprobs_fwd", "kept_logprobs_bwd",
                                                "kept_logprobs_bwd_")}
    rtol, atol, rel = TOL[dtype]
    rtol, atol = max(rtol, 1e-5), max(atol, 1e-5)  # (the float sweeps' exp_u20: 1.2e-6)
    if dtype == torch.float64:
        rtol, atol = 1e-10, 1e-11
    gen = torch.Generator().manual_seed(47)
    B, T = 3, 4
    for V in ((45, 301) if prefix else (45, 301, 4099)):
        for kind in ("normal", "ties", "neginf", "large"):
            x = torch.randn(B, T + 1, V, generator=gen, dtype=torch.float64) * 2
            if kind == "ties":  # several entries at the top value
                x = torch.randint(-3, 3, (B, T + 1, V), generator=gen).double()
            elif kind == "neginf":
                x[torch.rand(B, T + 1, V, generator=gen) < 0.3] = -math.inf
            elif kind == "large":
                x = x * 10 + 40
            x = x.to(dtype)
            tokens = torch.randint(0, V, (B, T), generator=gen)
            if kind == "neginf":  # (a token on a -inf entry has logp -inf)
                xt = x[:, :T].gather(2, tokens[..., None])[..., 0]
                tokens = torch.where(xt == -math.inf, x[:, :T].argmax(-1), tokens)
            mask = torch.ones(B, T, dtype=torch.bool)
            mask[0, 1] = mask[2, 3] = False
            temps = (0.5 + torch.rand(B, T, generator=gen)).to(ck_acc(dtype))
            top_k = torch.randint(1, V + 1, (B, T), generator=gen)
            top_p = torch.rand(B, T, generator=gen, dtype=torch.float64) * 0.9 + 0.05
            thr = ops.sampling_threshold(x, mask, 1.0, top_k, top_p, None, temps)
            thr[1, 0] = -math.inf  # every entry kept
            thr[1, 1] = float(x[1, 1].double().max())  # the top values alone: ties at the top
            sm, _ = random_csr(B, T, V, gen, kmax=min(V, 40), tokens=tokens,
                               drop_token_frac=0.3)
            g = torch.randn(B, T, generator=gen, dtype=torch.float64).to(ck_acc(dtype))
            ge = torch.randn(B, T, generator=gen, dtype=torch.float64).to(ck_acc(dtype))
            g[0, 2] = ge[0, 2] = 0.0
            for kept_args, dense in (((sm.token_ids, sm.offsets, None),
                                      ref.kept_from_csr(sm.token_ids.numpy(),
                                                        sm.offsets.numpy(), (B, T, V))),
                                     ((None, None, thr),
                                      x[:, :T].double().numpy() >= thr[..., None].numpy())):
                kept, _ = ref.with_token(dense, tokens, mask)
                a = [t if t is None else t.to(dev) for t in kept_args]
                dv = [t.to(dev) for t in (x, tokens, mask, temps)]
                fwd = op["kept_logprobs_fwd"](dv[0], dv[1], dv[2], 1.0, *a, dv[3])
                lp, ent, kmax, kls, size, _ = (t.cpu() for t in fwd)
                r_lp, r_ent = ref.kept_logprobs(x.double().numpy(), tokens, mask,
                                                temps.double().numpy(), kept)
                what = (V, kind, "csr" if kept_args[0] is not None else "threshold")
                assert_close_np(lp, r_lp, rtol, atol, f"logp_kept {what}")
                assert_close_np(ent, r_ent, rtol, atol, f"H_kept {what}")
                assert (size.numpy() == np.where(mask, kept.sum(-1), 0)).all(), what
                bwd_args = (g.to(dev), ge.to(dev), *dv[:3], fwd[2], fwd[3], fwd[1], 1.0, *a)
                got = op["kept_logprobs_bwd"](*bwd_args, dv[3])
                r_g = ref.kept_logprobs_grad(x.double().numpy(), tokens, mask,
                                             temps.double().numpy(), kept, g.double().numpy(),
                                             ge.double().numpy())
                assert_grad_close(got.cpu(), r_g, rel, f"dlogits {what}")
                zero = torch.zeros_like(dv[0])
                op["kept_logprobs_bwd_"](*bwd_args, zero, dv[3])
                assert torch.equal(got, zero), what
                start = torch.randn(x.shape, generator=gen).to(dtype).to(dev)
                into = start.clone()
                op["kept_logprobs_bwd_"](*bwd_args, into, dv[3])
                torch.testing.assert_close(into.double(), (start.double() + got.double()),
                                           rtol=rel, atol=rel * float(got.abs().max()))


@pytest.mark.parametrize("prefix", ["", "triton_"], ids=["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threshold_kept_fwd_is_the_two_ops(prefix, dtype):
    """threshold_kept_fwd (the re-derived sets' threshold and kept statistics in one op, as
    kept_rows.kernel_stats takes them) equals sampling_threshold and then kept_logprobs_fwd
    on its threshold, bit for bit: every rule on, rules off on some rows (top_k = V, top_p =
    1, min_p = 0), per-row temperatures, masked rows, tokens below the threshold (missing);
    and its schema and fake function pass opcheck."""
    from ppo_kernels._backends import get_backend
    dev = torch.device(TRITON_DEVICE if prefix else "cpu")
    get_backend("cpu" if not prefix else "triton", dev)
    ops = torch.ops.ppo_kernels
    thr_op, fwd, fused = (getattr(ops, prefix + n) for n in (
        "sampling_threshold", "kept_logprobs_fwd", "threshold_kept_fwd"))
    gen = torch.Generator().manual_seed(53)
    B, T, V = 3, 5, 301 if prefix else 1031
    x = (torch.randn(B, T, V, generator=gen) * 3).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 2] = False
    top_k = torch.randint(1, V // 4, (B, T), generator=gen)
    top_k[0, 0] = V
    top_p = torch.rand(B, T, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    top_p[0, 0] = top_p[2, 1] = 1.0
    min_p = torch.rand(B, T, generator=gen, dtype=torch.float64) * 0.1
    min_p[0, 0] = 0.0
    temps = (0.5 + torch.rand(B, T, generator=gen)).to(ck_acc(dtype))
    args = [t.to(dev) for t in (x, tokens, mask, top_k, top_p, min_p, temps)]
    x_, tok_, m_, k_, p_, mp_, tt_ = args
    cases = [(rules, temp_kw)
             for rules in ((k_, p_, mp_), (k_, None, None), (None, p_, None), (None, None, mp_))
             for temp_kw in ({}, {"temperatures": tt_})]
    if prefix:  # (Triton's op is the two launches in Python: one case under the interpreter)
        cases = cases[1:2]
    for rules, temp_kw in cases:
        got = fused(x_, tok_, m_, 0.9, *rules, **temp_kw)
        thr = thr_op(x_, m_, 0.9, *rules, **temp_kw)
        want = (*fwd(x_, tok_, m_, 0.9, None, None, thr, **temp_kw), thr)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (rules, temp_kw)
        assert bool(got[5][m_].any()) or rules[1] is None  # some tokens missing
    torch.library.opcheck(fused, (x_, tok_, m_, 0.9, k_, p_, mp_),
                          test_utils=("test_schema", "test_faketensor"))
