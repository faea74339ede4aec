"""Tests of ppo_kernels/head_chunks.py's masked-row skip (live_rows, HeadRows.each_block,
Grads.add): where a chunk's masked rows skip the LM head's matmuls, every from-hidden op
gives what it gives with them computed (loss, metrics, the per-token outputs of masked
positions, every gradient), the matmuls see the kept rows alone, and whatever a masked
row's hidden state holds stays out. The rule is steered through LIVE_ROWS_BALANCE: 0
skips every masked row, inf none."""

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import head_chunks
from ppo_kernels._backends import get_backend

from helpers.backends import backend_params
from helpers.inputs import head_inputs, make_teacher, random_csr

SKIP, COMPUTE = 0, float("inf")
# the compiled kernels: cpu, and cuda / triton_cuda on a GPU (skipped without one)
KERNELS = [p for p in backend_params(interp=False) if p.values[0].name != "torch"]


def _on(d, be):
    """head_inputs' dict on the backend's device (the head's tensors fresh leaves)."""
    out = {k: be.t(v.detach()) if isinstance(v, torch.Tensor) else v for k, v in d.items()}
    for k in ("hidden", "W", "b"):
        if out[k] is not None:
            out[k].requires_grad_()
    return out


def test_live_rows_rule():
    keep = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 1, 0], dtype=torch.bool)
    lives = head_chunks.live_rows(keep, 4, 64)
    assert lives[0] is None  # nothing masked
    assert lives[1] is None  # 1 masked * 64 < 64 * 3 kept: the gather would cost more
    assert lives[2].tolist() == []  # all masked: no matmul at all
    assert lives[3].tolist() == [0]  # 1 masked * 64 >= 64 * 1 kept
    assert head_chunks.live_rows(keep, 4, 192)[1].tolist() == [0, 2, 3]
    assert head_chunks.live_rows(keep[:0], 4, 64) == []
    assert len(head_chunks.live_rows(keep, 100, 64)) == 1  # one chunk larger than N


def test_chunk_size_above_the_rows_is_one_chunk():
    """A chunk_size above the rows there are (up to one that no tensor could hold) is one
    chunk of them: the same loss and gradient as chunk_size=N, nothing sized by it."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 3, 4, generator=g)
    w = torch.randn(5, 4, generator=g)
    assert head_chunks.head_options(hidden, w, None, 10**30).chunk == 6
    tok, old, adv = torch.randint(0, 5, (2, 3), generator=g), -torch.rand(2, 3, generator=g) - 1, \
        torch.randn(2, 3, generator=g)
    out = []
    for chunk in (6, 10**30):
        h = hidden.clone().requires_grad_()
        loss, _ = pk.ppo_loss_from_hidden(h, w, tok, old, adv, chunk_size=chunk, backend="cpu")
        loss.backward()
        out.append((loss.detach(), h.grad))
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


def _skip_and_compute(monkeypatch, run):
    """run() with every masked row skipped, then with every row computed."""
    monkeypatch.setattr(head_chunks, "LIVE_ROWS_BALANCE", SKIP)
    a = run()
    monkeypatch.setattr(head_chunks, "LIVE_ROWS_BALANCE", COMPUTE)
    return a, run()


def _leaves(d):
    return [x for x in (d["hidden"], d["W"], d["b"]) if x is not None]


def _close(a, b, exact=False, **tol):
    """Nested outputs alike; exact: bit for bit (NaN where NaN)."""
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _close(a[k], b[k], exact, **tol)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _close(x, y, exact, **tol)
    elif isinstance(a, torch.Tensor):
        if exact:
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        else:
            torch.testing.assert_close(a, b, equal_nan=True, **tol)
    else:
        assert a == b


def _ppo(d, policy_loss, cap, chunk, backend="auto", **kw):
    def run():
        leaves = _leaves(d)
        loss, m = pk.ppo_loss_from_hidden(
            d["hidden"], d["W"], d["tokens"], d["old"], d["adv"], d["mask"], d["ref"],
            lm_head_bias=d["b"], logit_softcap=cap, chunk_size=chunk,
            policy_loss=policy_loss, kl_coef=0.1, entropy_coef=0.02, return_per_token=True,
            backend=backend, **kw)
        g = torch.autograd.grad(loss, leaves)
        return loss.detach(), {k: v.detach() for k, v in m.items()}, g
    return run


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])  # fused, two-phase
@pytest.mark.parametrize("cap", [None, 2.5])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_ppo_loss_from_hidden(monkeypatch, policy_loss, cap, chunk):
    d = head_inputs(B=4, T=7, H=24, V=37, seed=11 + chunk, bias=True)
    skipped, computed = _skip_and_compute(monkeypatch, _ppo(d, policy_loss, cap, chunk))
    _close(skipped, computed, rtol=1e-5, atol=1e-6)
    assert (skipped[2][0][~d["mask"]] == 0).all()  # d hidden of masked rows


@pytest.mark.parametrize("cap", [None, 2.5])
def test_masked_rows_logits_are_a_zero_hidden_states(monkeypatch, cap):
    """The row source's contract, whichever path a chunk takes: every row the kernels get
    is finite and a masked row's logits are those of a zero hidden state (the bias,
    soft-capped), whatever its hidden state holds; the kept rows' are h W^T + b."""
    d = head_inputs(B=3, T=7, H=24, V=19, seed=7, bias=True)
    h = d["hidden"].detach().clone()
    h[~d["mask"]] = float("nan")
    w, b = d["W"].detach(), d["b"].detach()
    keep = d["mask"].reshape(-1)
    want = torch.nn.functional.linear(torch.where(keep[:, None], h.reshape(-1, 24), 0.0), w, b)
    if cap is not None:
        want = cap * torch.tanh(want / cap)
    be = get_backend("cpu", h.device)
    for balance in (SKIP, COMPUTE):
        monkeypatch.setattr(head_chunks, "LIVE_ROWS_BALANCE", balance)
        head = head_chunks.HeadOptions(cap, 4, None, torch.float32)
        src = head_chunks.HeadRows(be, head, d["tokens"], d["mask"], 1.0, torch.float32)
        rows, lives = [], []
        src.each_block((h, w, b), lambda blk, hc, z: (rows.append(z[0].clone()),
                                                      lives.append(blk.live)))
        assert (any(x is not None for x in lives)) == (balance == SKIP)
        torch.testing.assert_close(torch.cat(rows), want)


@pytest.mark.parametrize("be", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_ppo_loss_from_hidden_dtypes(monkeypatch, dtype, be):
    """bfloat16 over several chunks (dW through the float32 accumulator: on CUDA cuBLAS's
    addmm into it) and float64, on each device; and against the materialised logits."""
    if dtype == torch.float64 and be.name == "triton":
        pytest.skip("the Triton kernels take float32 / 16-bit logits")
    d = _on(head_inputs(B=3, T=9, H=16, V=29, seed=3, bias=True, dtype=dtype), be)
    skipped, computed = _skip_and_compute(monkeypatch, _ppo(d, "vanilla", None, 4, be.name))
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-12,
                                                                           atol=1e-12)
    _close(skipped, computed, **tol)
    leaves = _leaves(d)
    logits = torch.nn.functional.linear(d["hidden"], d["W"], d["b"])
    loss, _ = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], d["mask"], d["ref"],
                          kl_coef=0.1, entropy_coef=0.02, backend="torch")
    _close((loss.detach(), torch.autograd.grad(loss, leaves)), (skipped[0], skipped[2]),
           **tol)


def test_token_logprobs_and_score_rollout_from_hidden(monkeypatch):
    d = head_inputs(B=3, T=8, H=20, V=31, seed=5, bias=True)
    vals = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    scores = torch.randn(3, generator=torch.Generator().manual_seed(2))

    def run():
        leaves = _leaves(d)
        lp, ent = pk.token_logprobs_from_hidden(d["hidden"], d["W"], d["tokens"], d["mask"],
                                                lm_head_bias=d["b"], logit_softcap=3.0,
                                                chunk_size=3, return_entropy=True)
        g = torch.autograd.grad((lp * 1.3 + ent * 0.4).sum(), leaves)
        sc = pk.score_rollout_from_hidden(d["hidden"].detach(), d["W"].detach(), d["tokens"],
                                          d["ref"], vals, scores, d["mask"],
                                          lm_head_bias=d["b"].detach(), chunk_size=2,
                                          kl_coef=0.05)
        return lp.detach(), ent.detach(), g, sc
    skipped, computed = _skip_and_compute(monkeypatch, run)
    _close(skipped, computed, rtol=1e-5, atol=1e-6)


def test_replay_from_hidden(monkeypatch):
    """Sampling replay (a given kept set, and a re-derived top-k) on the same chunks."""
    B, T, V = 3, 6, 23
    d = head_inputs(B=B, T=T, H=16, V=V, seed=8)
    g = torch.Generator().manual_seed(4)
    sm, _ = random_csr(B, T, V, g, tokens=d["tokens"])

    def run():
        out = []
        for kw in (dict(sampling_mask=sm), dict(top_k=5)):
            loss, _ = pk.ppo_loss_from_hidden(d["hidden"], d["W"], d["tokens"], d["old"],
                                              d["adv"], d["mask"], chunk_size=4, **kw)
            out.append((loss.detach(), torch.autograd.grad(loss, _leaves(d))))
        return out
    skipped, computed = _skip_and_compute(monkeypatch, run)
    _close(skipped, computed, rtol=1e-5, atol=1e-6)


def test_distill_loss_from_hidden(monkeypatch):
    d = head_inputs(B=3, T=5, H=16, V=19, seed=9, bias=True)
    te = make_teacher(15, 19, torch.Generator().manual_seed(3))

    def run():
        loss, m = pk.distill_loss_from_hidden(d["hidden"], d["W"], te, d["mask"],
                                              lm_head_bias=d["b"], logit_softcap=4.0,
                                              chunk_size=4, temperature=0.9)
        return loss.detach(), torch.autograd.grad(loss, _leaves(d))
    skipped, computed = _skip_and_compute(monkeypatch, run)
    _close(skipped, computed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_the_matmuls_see_kept_rows_alone(monkeypatch, policy_loss):
    """With the skip the head's forward matmul gets the kept rows (and one zero row, the
    masked rows' logits, once per pass), the gradient's matmuls their dz alone."""
    d = head_inputs(B=4, T=6, H=12, V=17, seed=2)
    rows, mm_rows = [], []
    real_logits, real_mm = head_chunks.chunk_logits, torch.mm

    def spy_logits(h, *a):
        rows.append(h.shape[0])
        return real_logits(h, *a)

    def spy_mm(a, b, **kw):
        mm_rows.append(a.shape[0])
        return real_mm(a, b, **kw)
    monkeypatch.setattr(head_chunks, "chunk_logits", spy_logits)
    monkeypatch.setattr(head_chunks.torch, "mm", spy_mm)
    monkeypatch.setattr(head_chunks, "LIVE_ROWS_BALANCE", SKIP)
    _ppo(d, policy_loss, None, 5)()
    kept, n = int(d["mask"].sum()), d["mask"].numel()
    passes = 2 if policy_loss == "gspo" else 1  # the two-phase path makes the logits twice
    assert kept < n and sum(rows) == passes * (kept + 1)
    monkeypatch.setattr(head_chunks, "LIVE_ROWS_BALANCE", COMPUTE)
    rows.clear()
    _ppo(d, policy_loss, None, 5)()
    assert sum(rows) == passes * n


def test_nan_on_masked_rows_stays_out(monkeypatch):
    """A masked row's hidden state never enters the skipped path's matmuls: NaN there
    gives the result of the clean batch."""
    d = head_inputs(B=3, T=6, H=16, V=21, seed=6, bias=True)
    monkeypatch.setattr(head_chunks, "LIVE_ROWS_BALANCE", SKIP)
    clean = _ppo(d, "vanilla", None, 4)()
    h = d["hidden"].detach().clone()
    h[~d["mask"]] = float("nan")
    d["hidden"] = h.requires_grad_()
    dirty = _ppo(d, "vanilla", None, 4)()
    for x in dirty[2]:
        assert torch.isfinite(x).all()
    _close(dirty, clean, exact=True)
