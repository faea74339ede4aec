"""Adversarial inputs against the public API and the raw ops (cpu, torch, triton under the
interpreter): empty batches, extreme values, garbage on masked positions, odd layouts,
autograd corner cases, determinism.

Each test pins the behaviour the contract asks for; every one of them began as a bug
found by attacking the kernels (an xfail) and was fixed.
"""

import math

import pytest
import torch

import ppo_kernels as pk

from conftest import backend_params, kernel_args

BES = backend_params(cuda=False)  # cpu, torch, triton (interpreter)
KERNEL_BES = [p for p in BES if p.values[0].name != "torch"]  # those with an in-place path


def _inputs(B=2, T=3, V=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(logits=torch.randn(B, T, V, generator=g) * 2,
                tokens=torch.randint(0, V, (B, T), generator=g),
                old=-torch.rand(B, T, generator=g) - 1,
                adv=torch.randn(B, T, generator=g),
                ref=-torch.rand(B, T, generator=g) - 1)


MASK = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)


# ============================================================== behaviour that holds

@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("B,T", [(0, 3), (2, 0), (0, 0)])
def test_empty_batch_ppo_loss_and_logprobs(be, B, T):
    d = _inputs(B, T)
    logits = d["logits"].requires_grad_()
    loss, metrics = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], backend=be.name)
    loss.backward()
    assert loss.item() == 0.0
    assert logits.grad.shape == (B, T, 5)
    assert all(v.item() == 0.0 for v in metrics.values())
    lp, ent = pk.token_logprobs(d["logits"].detach(), d["tokens"], return_entropy=True,
                                backend=be.name)
    assert lp.shape == ent.shape == (B, T)
    adv, ret = pk.gae(torch.randn(B, T), torch.randn(B, T), backend=be.name)
    assert adv.shape == ret.shape == (B, T)


@pytest.mark.parametrize("be", [p for p in BES if p.values[0].name != "torch"])
def test_empty_batch_score_rollout_kernels(be):
    for B, T in [(0, 3), (2, 0)]:
        d = _inputs(B, T)
        out = pk.score_rollout(d["logits"], d["tokens"], d["ref"], torch.randn(B, T),
                               torch.randn(B), torch.ones(B, T, dtype=torch.bool),
                               kl_coef=0.1, backend=be.name)
        assert out.advantages.shape == (B, T)


@pytest.mark.parametrize("be", BES)
def test_nan_logits_on_masked_rows_are_never_read(be):
    d = _inputs()
    logits = d["logits"].clone()
    logits[~MASK] = float("nan")
    logits.requires_grad_()
    loss, metrics = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], MASK,
                                entropy_coef=0.01, backend=be.name)
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(math.isfinite(v.item()) for v in metrics.values())
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[~MASK] == 0).all()


@pytest.mark.parametrize("be", BES)
def test_garbage_token_ids_on_masked_positions(be):
    d = _inputs()
    tokens = d["tokens"].clone()
    tokens[0, 2], tokens[1, 0] = 10**12, -(10**12)
    lp = pk.token_logprobs(d["logits"], tokens, MASK, backend=be.name)
    ref = pk.token_logprobs(d["logits"], d["tokens"], MASK, backend="torch")
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-6)
    assert (lp[~MASK] == 0).all()


@pytest.mark.parametrize("be", BES)
def test_all_neginf_row_except_token(be):
    d = _inputs(1, 3, 7)
    logits = torch.full((1, 3, 7), float("-inf"))
    logits[0, torch.arange(3), d["tokens"][0]] = 1.5
    logits.requires_grad_()
    loss, m = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], entropy_coef=0.1,
                          backend=be.name)
    loss.backward()
    lp, ent = pk.token_logprobs(logits.detach(), d["tokens"], return_entropy=True,
                                backend=be.name)
    assert (lp == 0).all() and (ent.abs() == 0).all()
    assert torch.isfinite(logits.grad).all()
    assert m["entropy"].item() == 0.0


@pytest.mark.parametrize("be", BES)
def test_token_own_logit_neginf(be):
    """logp = -inf; the log-ratio clamp keeps the loss and gradient finite."""
    d = _inputs(1, 3, 7)
    logits = d["logits"][:1].clone()
    logits[0, torch.arange(3), d["tokens"][0]] = float("-inf")
    logits.requires_grad_()
    loss, m = pk.ppo_loss(logits, d["tokens"][:1], d["old"][:1], d["adv"][:1],
                          entropy_coef=0.1, backend=be.name)
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(logits.grad).all()
    assert math.isfinite(m["approx_kl"].item()) and math.isfinite(m["ratio_max"].item())


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("old", [1e30, -1e30, float("inf"), float("-inf")])
def test_extreme_old_logprobs_are_clamped(be, old):
    d = _inputs()
    logits = d["logits"].requires_grad_()
    loss, m = pk.ppo_loss(logits, d["tokens"], torch.full((2, 3), old), d["adv"],
                          backend=be.name)
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad == 0).all()  # the log-ratio clamp is active everywhere: no gradient
    ref, _ = pk.ppo_loss(d["logits"].detach(), d["tokens"], torch.full((2, 3), old), d["adv"],
                         backend="torch")
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("be", BES)
def test_huge_logits_agree_with_torch(be):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 4, 7, generator=g, dtype=torch.float64).float() * 1e30
    tokens = torch.tensor([[0, 1, 2, 3]])
    lp, ent = pk.token_logprobs(logits, tokens, return_entropy=True, backend=be.name)
    ref, rent = pk.token_logprobs(logits, tokens, return_entropy=True, backend="torch")
    torch.testing.assert_close(lp, ref, rtol=1e-6, atol=0)
    assert (ent.abs() == 0).all() and (rent.abs() == 0).all()


@pytest.mark.parametrize("be", BES)
def test_token_and_mask_dtypes_are_equivalent(be):
    d = _inputs()
    ref = pk.token_logprobs(d["logits"], d["tokens"], MASK, backend=be.name)
    for tk in (d["tokens"].int(), d["tokens"].to(torch.uint8), d["tokens"].short()):
        for m in (MASK.int(), MASK.float(), MASK.to(torch.uint8), MASK):
            assert torch.equal(pk.token_logprobs(d["logits"], tk, m, backend=be.name), ref)


@pytest.mark.parametrize("be", BES)
def test_strided_logits_views(be):
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 6, 10, generator=g)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    views = (full[:, ::2, :5], full[:, :3, ::2],
             full.transpose(0, 1)[:3].transpose(0, 1)[..., :5])
    for view in views:
        lp = pk.token_logprobs(view, tokens, backend=be.name)
        ref = pk.token_logprobs(view.contiguous(), tokens, backend=be.name)
        assert torch.equal(lp, ref)


@pytest.mark.parametrize("be", BES)
def test_no_grad_and_inference_mode_leave_inplace_logits_alone(be):
    d = _inputs()
    logits = d["logits"].clone().requires_grad_()
    with torch.no_grad():
        a, _ = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], inplace_backward=True,
                           backend=be.name)
    with torch.inference_mode():
        b, _ = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], inplace_backward=True,
                           backend=be.name)
    assert torch.equal(logits.detach(), d["logits"])
    assert a.item() == b.item() and not a.requires_grad


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("inplace", [False, True])
def test_grad_output_zero_gives_zero_gradient(be, inplace):
    d = _inputs()
    leaf = d["logits"].clone().requires_grad_()
    loss, _ = pk.ppo_loss(leaf * 1, d["tokens"], d["old"], d["adv"], inplace_backward=inplace,
                          backend=be.name)
    loss.backward(torch.tensor(0.0))
    assert (leaf.grad == 0).all()


@pytest.mark.parametrize("be", BES)
def test_retain_graph_twice_accumulates(be):
    d = _inputs()
    leaf = d["logits"].clone().requires_grad_()
    loss, _ = pk.ppo_loss(leaf, d["tokens"], d["old"], d["adv"], backend=be.name)
    loss.backward(retain_graph=True)
    g1 = leaf.grad.clone()
    loss.backward()
    torch.testing.assert_close(leaf.grad, 2 * g1)


@pytest.mark.parametrize("be", BES)
def test_inplace_backward_leaf_and_bf16_view_match(be):
    d = _inputs()
    leaf = d["logits"].clone().requires_grad_()
    loss, _ = pk.ppo_loss(leaf, d["tokens"], d["old"], d["adv"], inplace_backward=True,
                          backend=be.name)
    loss.backward()
    ref = d["logits"].clone().requires_grad_()
    pk.ppo_loss(ref, d["tokens"], d["old"], d["adv"], backend="torch")[0].backward()
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=1e-5, atol=1e-7)
    full = torch.cat([d["logits"], d["logits"][:, :1]], 1).bfloat16().requires_grad_()
    loss, _ = pk.ppo_loss((full * 1)[:, :-1], d["tokens"], d["old"], d["adv"],
                          inplace_backward=True, backend=be.name)
    loss.backward()
    ref = full.detach().clone().requires_grad_()
    pk.ppo_loss(ref[:, :-1], d["tokens"], d["old"], d["adv"], backend="torch")[0].backward()
    torch.testing.assert_close(full.grad.float(), ref.grad.float(), rtol=1e-2, atol=1e-2)
    assert (full.grad[:, -1] == 0).all()


# ============================================================== confirmed bugs

def test_kl_penalized_rewards_empty_time():
    r = pk.kl_penalized_rewards(torch.randn(2), torch.randn(2, 0), torch.randn(2, 0),
                                torch.ones(2, 0, dtype=torch.bool), kl_coef=0.1)
    assert r.shape == (2, 0)


def test_score_rollout_torch_backend_empty_time():
    d = _inputs(2, 0)
    out = pk.score_rollout(d["logits"], d["tokens"], d["ref"], torch.randn(2, 0),
                           torch.randn(2), torch.ones(2, 0, dtype=torch.bool), kl_coef=0.1,
                           backend="torch")
    assert out.advantages.shape == (2, 0)


@pytest.mark.parametrize("be", BES)
def test_metrics_ignore_nan_on_masked_positions(be):
    d = _inputs()
    old, ref = d["old"].clone(), d["ref"].clone()
    old[~MASK] = float("nan")
    ref[~MASK] = float("nan")
    loss, m = pk.ppo_loss(d["logits"], d["tokens"], old, d["adv"], MASK, ref_logprobs=ref,
                          kl_coef=0.1, backend=be.name)
    assert math.isfinite(loss.item())
    bad = [k for k, v in m.items() if not math.isfinite(v.item())]
    assert not bad, bad


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_whiten_ignores_garbage_on_masked_positions(fill):
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    clean = pk.whiten(x, MASK)
    x[~MASK] = fill
    torch.testing.assert_close(pk.whiten(x, MASK), clean)


def test_value_loss_masked_nan_gives_zero_grad():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2, 3, generator=g).requires_grad_()
    returns = torch.randn(2, 3, generator=g)
    returns[~MASK] = float("nan")
    loss, _ = pk.value_loss(values, torch.randn(2, 3, generator=g), returns, MASK,
                            clip_range=0.2)
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(values.grad).all()
    assert (values.grad[~MASK] == 0).all()


def test_whiten_float16_does_not_overflow():
    x = torch.tensor([[0., 1000., 0.], [1000., 0., 1000.]])
    m = torch.ones(2, 3, dtype=torch.bool)
    torch.testing.assert_close(pk.whiten(x.half(), m).float(), pk.whiten(x, m),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("be", BES)
def test_vocab_one_with_odd_unit_stride(be):
    logits = torch.randn(1, 2, 3).permute(1, 2, 0)  # [2, 3, 1], strides (3, 1, 6)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    lp = pk.token_logprobs(logits, tokens, backend=be.name)
    assert (lp == 0).all()
    loss, _ = pk.ppo_loss(logits, tokens, torch.zeros(2, 3), torch.ones(2, 3), backend=be.name)
    assert loss.item() == -1.0


@pytest.mark.parametrize("be", BES)
def test_non_contiguous_tokens_and_mask(be):
    """DESIGN: non-contiguous inputs are accepted."""
    d = _inputs()
    tokT = d["tokens"].t().contiguous().t()
    maskT = MASK.t().contiguous().t()
    ref, _ = pk.ppo_loss(d["logits"], d["tokens"], d["old"], d["adv"], MASK, backend="torch")
    loss, _ = pk.ppo_loss(d["logits"], tokT, d["old"], d["adv"], maskT, backend=be.name)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    lp = pk.token_logprobs(d["logits"], tokT, maskT, backend=be.name)
    torch.testing.assert_close(lp, pk.token_logprobs(d["logits"], d["tokens"], MASK,
                                                     backend="torch"), rtol=1e-5, atol=1e-6)
    adv, _ = pk.gae(torch.ones(3, 2).t(), torch.zeros(3, 2).t(), maskT, backend=be.name)
    torch.testing.assert_close(adv, pk.gae(torch.ones(2, 3), torch.zeros(2, 3), MASK,
                                           backend="torch")[0])


@pytest.mark.parametrize("be", KERNEL_BES)
def test_inplace_backward_retain_graph_twice(be):
    d = _inputs()
    leaf = d["logits"].clone().requires_grad_()
    loss, _ = pk.ppo_loss(leaf * 1, d["tokens"], d["old"], d["adv"], inplace_backward=True,
                          backend=be.name)
    loss.backward(retain_graph=True)
    # the gradient lives in the logits' storage and was handed out: a replay must refuse
    with pytest.raises(RuntimeError, match="already handed out"):
        loss.backward()


@pytest.mark.parametrize("be", BES)
def test_inplace_backward_on_expanded_logits(be):
    d = _inputs()
    base = d["logits"][:1].clone().requires_grad_()
    with pytest.raises(ValueError, match="logits.*share memory"):
        pk.ppo_loss(base.expand(2, 3, 5), d["tokens"], d["old"], d["adv"],
                    inplace_backward=True, backend=be.name)


@pytest.mark.parametrize("be", KERNEL_BES)
def test_inplace_backward_bumps_version_counter(be):
    d = _inputs()
    leaf = d["logits"].clone().requires_grad_()
    logits = leaf * 1
    sq = (logits ** 2).sum()  # saves `logits` for its backward
    loss, _ = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], inplace_backward=True,
                          backend=be.name)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + sq).backward()


def test_per_token_inputs_get_no_gradient():
    """old_logprobs / advantages / ref_logprobs / rollout_is_weights are rollout data: on
    every backend and mode they receive no gradient, and the logits' gradient is the same."""
    d = _inputs()
    is_w = torch.rand(d["adv"].shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for be, mode in (("cpu", "token-mean"), ("torch", "token-mean"), ("cpu", "none"),
                     ("torch", "none")):
        lg = d["logits"].clone().requires_grad_()
        o, a, r, w = (x.clone().requires_grad_() for x in (d["old"], d["adv"], d["ref"], is_w))
        loss, _ = pk.ppo_loss(lg, d["tokens"], o, a, ref_logprobs=r, kl_coef=0.1,
                              rollout_is_weights=w, loss_agg_mode=mode, backend=be)
        (loss if loss.dim() == 0 else loss.sum() / loss.numel()).backward()
        assert all(x.grad is None for x in (o, a, r, w)), (be, mode)
        grads.append(lg.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("be", BES)
def test_logprob_precision_with_large_logits(be):
    logits = torch.tensor([[[65504., -65504., 65504., -65504., 65504., -65504., 65504.]]],
                          dtype=torch.float16)
    tokens = torch.tensor([[0]])
    lp = pk.token_logprobs(logits, tokens, backend=be.name)
    assert abs(lp.item() + math.log(4)) < 1e-5, lp.item()


@pytest.mark.parametrize("be", BES)
def test_tiny_temperature_gives_sane_logprobs(be):
    logits = torch.tensor([[[1.5410, -0.2934, -2.1788, 0.5684, -1.0845]]])
    tokens = torch.tensor([[2]])
    lp = pk.token_logprobs(logits, tokens, temperature=1e-10, backend=be.name)
    ref = pk.token_logprobs(logits, tokens, temperature=1e-10, backend="torch")
    assert lp.item() <= 0
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("where", ["logit", "advantage", "old"])
def test_nan_on_a_valid_token_reaches_the_gradient(be, where):
    """A NaN on a valid position makes the loss NaN and must not be hidden from the
    gradient either (a gradient-norm check is how training loops notice): every backend
    gives a NaN in the row of that token, as autograd does."""
    d = _inputs()
    logits, adv, old = d["logits"].clone(), d["adv"].clone(), d["old"].clone()
    if where == "logit":
        logits[1, 2, 3] = float("nan")
    elif where == "advantage":
        adv[1, 2] = float("nan")
    else:
        old[1, 2] = float("nan")
    x = logits.requires_grad_(True)
    loss, _ = pk.ppo_loss(x, d["tokens"], old, adv, backend=be.name)
    loss.backward()
    assert torch.isnan(loss.detach())
    assert torch.isnan(x.grad[1, 2]).any()
