"""ppo_kernels.integrations.verl against the real verl 0.9 package (docs/VERL.md).

* the registered policy losses against verl's own (vanilla with the dual clip, gspo,
  cispo, sapo; every loss_agg_mode; rollout IS weights; verl's global_batch_info): the
  loss, verl's three metrics and d loss / d log_prob, float32 and float64;
* the full actor loss of verl's workers/utils/losses.py::ppo_loss (policy + entropy bonus +
  KL loss, rollout correction weights) against pk.ppo_loss / pk.ppo_loss_from_hidden with
  from_verl_config's keyword arguments, gradients w.r.t. the logits / hidden / head;
* the fused hook (FusedLinearForPPO, linear_cross_entropy) against verl's own chunked
  reference FusedLinearForPPOFunction, the materialised logits, and verl's model forward
  (dense_common.forward_with_torch_backend on a tiny Llama built locally);
* from_verl_config's mapping, including the options it must refuse.

verl is heavy; scripts/install_verl.sh installs it with only what these modules import.
"""

import math
import warnings
import zlib

import pytest
import torch

verl = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl is not installed (bash scripts/install_verl.sh installs verl 0.9.1 with "
           "--no-deps plus ray, tensordict, omegaconf, hydra-core, codetiming)")

import ppo_kernels as pk  # noqa: E402
from ppo_kernels.integrations import verl as pv  # noqa: E402
from verl.trainer.ppo import core_algos as ca  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402
import verl.utils.experimental.torch_functional as verl_tf  # noqa: E402

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm"]
MODES = ["vanilla", "gspo", "cispo", "sapo"]
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-7), torch.float64: dict(rtol=1e-12, atol=1e-14)}


def actor_config(**kw):
    policy = kw.pop("loss_mode", "vanilla")
    kw.setdefault("ppo_micro_batch_size_per_gpu", 1)
    return FSDPActorConfig(strategy="fsdp", rollout_n=1,
                           policy_loss=PolicyLossConfig(loss_mode=policy), **kw)


def batch(seed, b=5, t=13, dtype=torch.float32, spread=0.3, wild=0.0):
    """Random verl-shaped inputs: old log-probs in [-8, 0), current = old + N(0, spread)
    (wild: the fraction of tokens moved by up to +-25, beyond every clamp), advantages
    N(0, 1) with some exact zeros, a random mask with row 1 empty, IS weights in [0.5, 2]."""
    g = torch.Generator().manual_seed(seed)
    old = -8.0 * torch.rand(b, t, generator=g, dtype=torch.float64)
    lp = old + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    if wild:
        far = torch.rand(b, t, generator=g) < wild
        lp = torch.where(far, old + 50.0 * (torch.rand(b, t, generator=g,
                                                       dtype=torch.float64) - 0.5), lp)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.where(torch.rand(b, t, generator=g) < 0.1, 0.0, adv)
    mask = torch.rand(b, t, generator=g) < 0.75
    if b > 1:
        mask[1] = False
    isw = 0.5 + 1.5 * torch.rand(b, t, generator=g, dtype=torch.float64)
    return (old.to(dtype), lp.to(dtype), (adv * mask).to(dtype), mask, isw.to(dtype))


def run(fn, old, lp0, adv, mask, agg, cfg, isw):
    lp = lp0.clone().requires_grad_()
    loss, metrics = fn(old, lp, adv, mask, agg, cfg, isw)
    loss.backward()
    return loss.detach(), metrics, lp.grad


def assert_same(ours, theirs, dtype, loss_atol=None):
    (lo, mo, go), (lt, mt, gt) = ours, theirs
    tol = TOL[dtype]
    torch.testing.assert_close(lo, lt, rtol=tol["rtol"], atol=loss_atol or tol["atol"])
    assert set(mo) == set(mt)
    for k in mt:  # verl takes the clip fractions' mean in float32 (.float()) at any dtype
        rel = 1e-7 if "clipfrac" in k and dtype == torch.float64 else tol["rtol"]
        assert mo[k] == pytest.approx(mt[k], rel=rel, abs=10 * tol["atol"]), k
    scale = gt.abs().max().item() or 1.0
    torch.testing.assert_close(go, gt, rtol=tol["rtol"], atol=tol["rtol"] * scale)


# ------------------------------------------------------------------ the registry

def test_registered_names_resolve_through_verl():
    for name, mode in pv.REGISTERED_LOSS_MODES.items():
        fn = ca.get_policy_loss_fn(name)
        assert fn.__name__ == f"policy_loss_{name}"
        assert mode in pv.VERL_LOSS_MODES
    assert pv.register_policy_losses() == tuple(pv.REGISTERED_LOSS_MODES)  # idempotent
    with pytest.raises(ValueError, match="Unsupported loss mode"):
        ca.get_policy_loss_fn("ppo_kernels_nope")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_matches_verl(mode, agg, dtype):
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
    if mode == "sapo":
        kw.update(tau_pos=1.0, tau_neg=1.05)
    cfg = actor_config(loss_mode=mode, **kw)
    seed = zlib.crc32(f"{mode} {agg}".encode()) % 1000
    # cispo's value -w A lp is not zero-centred (|lp| up to 8): terms of size ~10 cancel
    loss_atol = 10 * TOL[dtype]["rtol"] if mode == "cispo" else None
    for shape in [(5, 13), (3, 37), (7, 1)]:
        for use_isw in (False, True):
            old, lp, adv, mask, isw = batch(seed, *shape, dtype=dtype, spread=0.3)
            isw = isw if use_isw else None
            theirs = run(ca.get_policy_loss_fn(mode), old, lp, adv, mask, agg, cfg, isw)
            ours = run(ca.get_policy_loss_fn("ppo_kernels_" + mode), old, lp, adv, mask, agg,
                       cfg, isw)
            assert_same(ours, theirs, dtype, loss_atol)
            assert ours[2].abs().sum() > 0  # a real gradient was compared


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "token-sum"])
@pytest.mark.parametrize("mode,kw", [
    ("dppo_tv", dict(clip_ratio_low=0.2, clip_ratio_high=0.28)),
    ("dppo_tv", dict(clip_ratio=0.05, clip_ratio_c=1.5)),
    ("dppo_kl", dict(clip_ratio_low=0.05, clip_ratio_high=0.08)),
    ("dppo_kl", dict(clip_ratio=0.002, clip_ratio_c=1.2))], ids=["tv", "tv-c", "kl", "kl-c"])
def test_dppo_matches_verl(mode, kw, agg, dtype):
    """DPPO (Qi et al. 2026) against verl's compute_policy_loss_dppo_tv / _kl: loss, the
    three metrics (the masked fraction, ppo_kl, the capped fraction) and d loss / d
    log_prob, with and without IS weights; the batches mask tokens both ways."""
    cfg = actor_config(loss_mode=mode, **kw)
    seed = zlib.crc32(f"{mode} {agg} {kw}".encode()) % 1000
    masked_any = 0.0
    for shape in [(5, 13), (3, 37)]:
        for use_isw in (False, True):
            old, lp, adv, mask, isw = batch(seed, *shape, dtype=dtype, spread=0.6)
            isw = isw if use_isw else None
            theirs = run(ca.get_policy_loss_fn(mode), old, lp, adv, mask, agg, cfg, isw)
            ours = run(ca.get_policy_loss_fn("ppo_kernels_" + mode), old, lp, adv, mask, agg,
                       cfg, isw)
            assert_same(ours, theirs, dtype, loss_atol=10 * TOL[dtype]["rtol"])
            masked_any += theirs[1]["actor/pg_clipfrac"]
    assert masked_any > 0  # the trust region was active


@pytest.mark.parametrize("mode", ["vanilla", "cispo", "sapo"])
def test_log_ratio_beyond_the_clamps_matches_verl(mode):
    """Token log-ratios up to +-25: both clamp them to +-20 (value and zero gradient).
    (cispo's terms -w A lp reach |lp| ~ 30 and cancel: the loss is compared to 1e-6 absolute,
    float32 rounding of terms of that size.)"""
    cfg = actor_config(loss_mode=mode, clip_ratio_c=1.5, clip_ratio_high=0.28)
    for seed in range(3):
        old, lp, adv, mask, isw = batch(100 + seed, 6, 29, spread=0.5, wild=0.3)
        for agg in ("token-mean", "seq-mean-token-mean"):
            assert_same(run(pv.compute_policy_loss, old, lp, adv, mask, agg, cfg, isw),
                        run(ca.get_policy_loss_fn(mode), old, lp, adv, mask, agg, cfg, isw),
                        torch.float32, loss_atol=1e-6 if mode == "cispo" else None)


def test_dual_clip_and_clip_options_match_verl():
    """A tight dual clip (c = 1.5) and asymmetric / plain clip_ratio settings."""
    old, lp, adv, mask, _ = batch(7, 8, 21, spread=0.8)
    for kw in [dict(clip_ratio_c=1.5, clip_ratio_low=0.1, clip_ratio_high=0.3),
               dict(clip_ratio=0.15, clip_ratio_low=None, clip_ratio_high=None),
               dict(clip_ratio_c=10.0)]:
        cfg = actor_config(**kw)
        ours = run(ca.get_policy_loss_fn("ppo_kernels"), old, lp, adv, mask, "token-mean",
                   cfg, None)
        theirs = run(ca.get_policy_loss_fn("vanilla"), old, lp, adv, mask, "token-mean", cfg,
                     None)
        assert_same(ours, theirs, torch.float32)
    assert ours[1]["actor/pg_clipfrac"] > 0


@pytest.mark.parametrize("agg", AGG_MODES)
def test_global_batch_info_matches_verl(agg):
    """verl's data-parallel / micro-batch normalisers: dp_size, batch_num_tokens (an int or
    a 0-d tensor), global_batch_size, loss_scale_factor."""
    old, lp, adv, mask, isw = batch(11, 6, 17)
    for info in [dict(dp_size=2, batch_num_tokens=173, global_batch_size=16),
                 dict(dp_size=4, batch_num_tokens=torch.tensor(311), global_batch_size=24,
                      loss_scale_factor=40),
                 dict(dp_size=1, batch_num_tokens=None, global_batch_size=None,
                      loss_scale_factor=9)]:
        for mode in MODES:
            cfg = actor_config(loss_mode=mode)
            cfg.global_batch_info.update(info)
            assert_same(run(pv.compute_policy_loss, old, lp, adv, mask, agg, cfg, isw),
                        run(ca.get_policy_loss_fn(mode), old, lp, adv, mask, agg, cfg, isw),
                        torch.float32)


def test_global_batch_info_missing_counts_raise_like_verl():
    old, lp, adv, mask, _ = batch(3)
    cfg = actor_config()
    cfg.global_batch_info.update(dp_size=2)
    with pytest.raises(ValueError, match="batch_num_tokens is required"):
        pv.compute_policy_loss(old, lp, adv, mask, "token-mean", cfg)
    with pytest.raises(ValueError, match="global_batch_size is required"):
        pv.compute_policy_loss(old, lp, adv, mask, "seq-mean-token-mean", cfg)
    with pytest.raises(ValueError, match="config"):
        pv.compute_policy_loss(old, lp, adv, mask, "token-mean", None)


def test_empty_batch_gives_zero_loss_and_gradient():
    """No valid token: loss 0, gradient 0 (verl's token-mean is 0 / 0 = NaN here)."""
    old, lp, adv, mask, _ = batch(5)
    mask = torch.zeros_like(mask)
    for mode in MODES:
        for agg in AGG_MODES:
            loss, metrics, grad = run(pv.compute_policy_loss, old, lp, adv, mask, agg,
                                      actor_config(loss_mode=mode), None)
            assert loss.item() == 0.0 and grad.abs().sum().item() == 0.0
            assert all(v == 0.0 for v in metrics.values())


def test_gspo_warns_where_verl_clamps_the_sequence_ratio():
    old, lp, adv, mask, _ = batch(9, 4, 9, spread=0.1)
    cfg = actor_config(loss_mode="gspo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pv.compute_policy_loss(old, lp, adv, mask, "token-mean", cfg)
    lp_far = torch.where(torch.arange(4)[:, None] == 0, old + 12.0, lp)
    mask[0] = True
    with pytest.warns(RuntimeWarning, match="verl clamps it there"):
        pv.compute_policy_loss(old, lp_far, adv, mask, "token-mean", cfg)


def test_unsupported_loss_modes_raise_naming_the_key():
    old, lp, adv, mask, _ = batch(1)
    for mode in ["clip_cov", "kl_cov", "geo_mean", "gpg", "dro", "bypass_mode", "nonsense"]:
        with pytest.raises(ValueError, match="actor.policy_loss.loss_mode"):
            pv.compute_policy_loss(old, lp, adv, mask, "token-mean",
                                   actor_config(loss_mode=mode))
        with pytest.raises(ValueError, match=f"loss_mode = '{mode}'"):
            pv.from_verl_config(actor_config(loss_mode=mode))


# ------------------------------------------------------------------ the whole actor loss

def verl_actor_loss(cfg, logits, tokens, old, adv, mask, ref, isw):
    """verl/workers/utils/losses.py::ppo_loss's arithmetic on [B, T] tensors (the policy
    loss of the registry, minus entropy_coeff * agg(entropy), plus kl_loss_coef *
    agg(kl_penalty)), with verl's own functions; log-probs and entropy from the logits as
    verl's logprobs_from_logits / entropy_from_logits compute them."""
    logp_all = torch.log_softmax(logits.float(), -1)
    lp = logp_all.gather(-1, tokens[..., None])[..., 0]
    ent = torch.logsumexp(logits.float(), -1) - (logp_all.exp() * logits.float()).sum(-1)
    agg = cfg.loss_agg_mode
    cfg.global_batch_info.update(loss_scale_factor=cfg.loss_scale_factor)  # as ppo_loss does
    fn = ca.get_policy_loss_fn(cfg.policy_loss.loss_mode)
    loss, _ = fn(old, lp, adv, mask, agg, cfg, isw)
    if cfg.entropy_coeff != 0:
        loss = loss - cfg.entropy_coeff * ca.agg_loss(ent, mask, agg, **cfg.global_batch_info)
    if cfg.use_kl_loss:
        kld = ca.kl_penalty(lp, ref, cfg.kl_loss_type)
        loss = loss + cfg.kl_loss_coef * ca.agg_loss(kld, mask, agg, **cfg.global_batch_info)
    return loss


ACTOR_CASES = [
    dict(loss_mode="vanilla", entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="k2",
         kl_loss_coef=0.05, clip_ratio_high=0.28),
    dict(loss_mode="vanilla", loss_agg_mode="seq-mean-token-mean", use_kl_loss=True,
         kl_loss_type="k1+", kl_loss_coef=0.1),
    dict(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4,
         clip_ratio_high=4e-4, use_kl_loss=True, kl_loss_type="abs", kl_loss_coef=0.02),
    dict(loss_mode="cispo", loss_agg_mode="token-sum", entropy_coeff=0.003,
         clip_ratio_high=4.0, clip_ratio_low=0.5),
    dict(loss_mode="sapo", loss_agg_mode="token-mean", entropy_coeff=0.02, tau_pos=1.5,
         tau_neg=0.8),
    dict(loss_mode="sapo", loss_agg_mode="seq-mean-token-mean", use_kl_loss=True,
         kl_loss_type="mse", kl_loss_coef=0.01),
    dict(loss_mode="vanilla", loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=20,
         use_kl_loss=True, kl_loss_type="kl", kl_loss_coef=0.03),
]


def actor_inputs(seed, b=4, t=11, v=37):
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(b, t, v, generator=g)
    tokens = torch.randint(0, v, (b, t), generator=g)
    with torch.no_grad():
        lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    old = lp + 0.2 * torch.randn(b, t, generator=g)
    ref = lp + 0.3 * torch.randn(b, t, generator=g)
    rollout = old + 0.2 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[-1] = False
    return logits, tokens, old, adv * mask, mask, ref, rollout


@pytest.mark.parametrize("case", range(len(ACTOR_CASES)))
def test_actor_loss_matches_verl_through_from_verl_config(case):
    kw = dict(ACTOR_CASES[case])
    cfg = actor_config(**kw)
    logits, tokens, old, adv, mask, ref, _ = actor_inputs(case)
    x = logits.clone().requires_grad_()
    theirs = verl_actor_loss(cfg, x, tokens, old, adv, mask, ref, None)
    theirs.backward()
    op = pv.from_verl_config(cfg)
    if op["loss_agg_mode"].startswith("seq-mean"):  # verl's default count (docs/VERL.md)
        op["global_num_seqs"] = mask.any(1).sum()
    y = logits.clone().requires_grad_()
    ours, _ = pk.ppo_loss(y, tokens, old, adv, mask, ref if cfg.use_kl_loss else None, **op)
    ours.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-5, atol=1e-6 * x.grad.abs().max())


@pytest.mark.parametrize("level,threshold", [("token", 2.0), ("token", "0.5_5.0"),
                                             ("sequence", 2.0), ("sequence", "0.3_3.0")])
def test_rollout_correction_matches_verl(level, threshold):
    """verl's decoupled IS weights (rollout_corr_helper.compute_rollout_correction_weights
    of old - rollout) given to its policy loss == the op computing them from
    rollout_logprobs with from_verl_config's rollout_correction."""
    cfg = actor_config(clip_ratio_high=0.28)
    rc = {"rollout_is": level, "rollout_is_threshold": threshold}
    logits, tokens, old, adv, mask, _, rollout = actor_inputs(21, t=6)
    w, _ = compute_rollout_correction_weights(old - rollout, mask.float(), level, threshold)
    x = logits.clone().requires_grad_()
    theirs = verl_actor_loss(cfg, x, tokens, old, adv, mask, None, w)
    theirs.backward()
    op = pv.from_verl_config(cfg, rollout_correction=rc)
    y = logits.clone().requires_grad_()
    ours, metrics = pk.ppo_loss(y, tokens, old, adv, mask, rollout_logprobs=rollout, **op)
    ours.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-5, atol=1e-6 * x.grad.abs().max())
    assert metrics["rollout_is_mean"].item() > 0


def test_actor_loss_from_hidden_matches_verl():
    """The fused-head op with from_verl_config's arguments == verl's loss on the
    materialised logits, gradients w.r.t. hidden and the head weight."""
    cfg = actor_config(entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="k2",
                       kl_loss_coef=0.05, loss_agg_mode="seq-mean-token-mean")
    g = torch.Generator().manual_seed(3)
    b, t, h, v = 3, 9, 16, 53
    hidden = torch.randn(b, t, h, generator=g)
    weight = 0.4 * torch.randn(v, h, generator=g)
    _, tokens, old, adv, mask, ref, _ = actor_inputs(4, b, t, v)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    theirs = verl_actor_loss(cfg, h1 @ w1.T, tokens, old, adv, mask, ref, None)
    theirs.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours, _ = pk.ppo_loss_from_hidden(h2, w2, tokens, old, adv, mask, ref, chunk_size=7,
                                      **pv.from_verl_config(cfg))
    ours.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
    for a, e in ((h2.grad, h1.grad), (w2.grad, w1.grad)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6 * e.abs().max())


# ------------------------------------------------------------------ the fused hook

def hook_inputs(shape, h=24, v=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (0.3 * torch.randn(v, h, generator=g, dtype=torch.float64)).to(dtype)
    ids = torch.randint(0, v, shape, generator=g)
    c1 = torch.randn(*shape, generator=g, dtype=torch.float64)
    c2 = torch.randn(*shape, generator=g, dtype=torch.float64)
    return hidden, weight, ids, c1, c2


def fwd_bwd(fn, hidden, weight, ids, c1, c2):
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fn(hh, ww, ids)
    ((lp.double() * c1).sum() + (ent.double() * c2).sum()).backward()
    return lp.detach(), ent.detach(), hh.grad, ww.grad


def test_hook_is_installed_on_import_and_reversible():
    import verl.utils.kernel.linear_cross_entropy as lce
    assert pv.fused_hook_installed()
    assert verl_tf.FusedLinearForPPO is pv.FusedLinearForPPO
    assert lce.linear_cross_entropy is pv.linear_cross_entropy
    pv.uninstall_fused_hook()
    try:
        assert not pv.fused_hook_installed()
        assert verl_tf.FusedLinearForPPO is not pv.FusedLinearForPPO
    finally:
        pv.install_fused_hook()
        pv.install_fused_hook()  # idempotent
    assert pv.fused_hook_installed()


@pytest.mark.parametrize("shape,temperature,chunk", [((3, 11), 1.0, None), ((3, 11), 0.7, 5),
                                                     ((37,), 1.3, 8), ((2, 1), 1.0, 1)])
def test_fused_hook_matches_verl_reference(shape, temperature, chunk):
    """FusedLinearForPPO == verl's own chunked torch reference (FusedLinearForPPOFunction):
    log-probs, entropy and the gradients w.r.t. hidden and the head weight, float32."""
    hidden, weight, ids, c1, c2 = hook_inputs(shape)
    ours = fwd_bwd(lambda h, w, i: pv.FusedLinearForPPO(chunk_size=chunk)(h, w, i, temperature),
                   hidden, weight, ids, c1, c2)
    theirs = fwd_bwd(lambda h, w, i: verl_tf.FusedLinearForPPOFunction.apply(
        h, w, i, temperature, 512), hidden, weight, ids, c1, c2)
    for a, e in zip(ours, theirs):
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * max(e.abs().max().item(), 1))


def materialised(h, w, i, temperature=1.0):
    z = (h @ w.T) / temperature
    logp_all = torch.log_softmax(z, -1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, i[..., None])[..., 0], ent


def test_fused_hook_float64_matches_materialised_logits():
    """float64: entropy (returned in hidden's dtype) and both gradients to 1e-10 of
    log_softmax on the materialised logits; log-probs are float32, as in verl."""
    hidden, weight, ids, c1, c2 = hook_inputs((4, 7), dtype=torch.float64)
    ours = fwd_bwd(lambda h, w, i: pv.FusedLinearForPPO(chunk_size=3)(h, w, i, 0.9),
                   hidden, weight, ids, c1.float().double(), c2)
    ref = fwd_bwd(lambda h, w, i: materialised(h, w, i, 0.9), hidden, weight, ids,
                  c1.float().double(), c2)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.float64
    torch.testing.assert_close(ours[0], ref[0].float(), rtol=1e-7, atol=1e-7)
    for a, e in zip(ours[1:], ref[1:]):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_fused_hook_bf16_close_to_verl():
    hidden, weight, ids, c1, c2 = hook_inputs((2, 9), dtype=torch.bfloat16)
    ours = fwd_bwd(lambda h, w, i: pv.FusedLinearForPPO()(h, w, i), hidden, weight, ids, c1,
                   c2)
    theirs = fwd_bwd(lambda h, w, i: verl_tf.FusedLinearForPPOFunction.apply(h, w, i, 1.0,
                                                                              512),
                     hidden, weight, ids, c1, c2)
    for a, e in zip(ours, theirs):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2,
                                   atol=2e-2 * e.float().abs().max().item())


def test_linear_cross_entropy_hook():
    """The triton-path drop-in (verl's own kernel needs a GPU): flat float32 outputs equal
    to the materialised logits; only reduction="none"."""
    hidden, weight, ids, c1, c2 = hook_inputs((2, 10))
    ours = fwd_bwd(lambda h, w, i: pv.linear_cross_entropy(h, w, i, 0.8, "none"), hidden,
                   weight, ids, c1.reshape(-1), c2.reshape(-1))
    ref = fwd_bwd(lambda h, w, i: tuple(x.reshape(-1) for x in materialised(h, w, i, 0.8)),
                  hidden, weight, ids, c1.reshape(-1), c2.reshape(-1))
    assert ours[0].shape == (20,) and ours[1].dtype == torch.float32
    for a, e in zip(ours, ref):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * max(e.abs().max().item(), 1))
    with pytest.raises(ValueError, match="reduction"):
        pv.linear_cross_entropy(hidden, weight, ids, 1.0, "mean")


def test_fused_hook_empty_and_errors():
    w = torch.randn(5, 8)
    lp, ent = pv.FusedLinearForPPO()(torch.zeros(0, 8, requires_grad=True), w,
                                      torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent.shape == (0,)
    lp, ent = pv.FusedLinearForPPO()(torch.zeros(2, 0, 8), w, torch.zeros(2, 0,
                                                                            dtype=torch.long))
    assert lp.shape == (2, 0)
    with pytest.raises(ValueError, match="impl_backend|backend"):
        pv.FusedLinearForPPO(impl_backend="cuda-magic")
    with pytest.raises(TypeError, match="lm_head_weight"):
        pv.FusedLinearForPPO()(torch.randn(3, 8), w.double(), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens"):
        pv.FusedLinearForPPO()(torch.randn(3, 8), w, torch.full((3,), 7))


def test_fused_hook_through_verl_model_forward():
    """verl's own model forward for use_fused_kernels (impl_backend=torch), called on a tiny
    Llama built locally: with the hook the same log-probs, entropy and parameter gradients
    as with verl's FusedLinearForPPO."""
    transformers = pytest.importorskip("transformers")
    from verl.models.transformers import dense_common
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    results = []
    try:
        for install in (False, True):
            (pv.install_fused_hook if install else pv.uninstall_fused_hook)()
            model.zero_grad()
            out = dense_common.forward_with_torch_backend(model, input_ids=x, return_dict=True,
                                                          temperature=0.9)
            (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
            results.append((out.log_probs.detach(), out.entropy.detach(),
                            *(p.grad.clone() for p in model.parameters())))
    finally:
        pv.install_fused_hook()
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * max(e.abs().max().item(), 1))


# ------------------------------------------------------------------ config mapping

def test_from_verl_config_defaults():
    kw = pv.from_verl_config(actor_config())
    assert kw == dict(policy_loss="vanilla", clip_eps_low=0.2, clip_eps_high=0.2,
                      dual_clip_c=3.0, loss_agg_mode="token-mean", entropy_coef=0.0)


@pytest.mark.parametrize("cfg_kw,expected", [
    (dict(loss_mode="ppo_kernels_gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4),
     dict(policy_loss="gspo-token", clip_eps_low=3e-4, clip_eps_high=4e-4)),
    (dict(loss_mode="cispo", clip_ratio_high=4.0, clip_ratio_low=0.9),
     dict(policy_loss="cispo", clip_eps_high=4.0, clip_eps_low=0.9)),
    (dict(loss_mode="sapo", tau_pos=2.0, tau_neg=0.5, entropy_coeff=0.01),
     dict(policy_loss="sapo", sapo_tau_pos=2.0, sapo_tau_neg=0.5,
          loss_agg_mode="seq-mean-token-mean", entropy_agg_mode="token-mean",
          entropy_coef=0.01)),
    (dict(clip_ratio=0.1, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=2.0),
     dict(clip_eps_low=0.1, clip_eps_high=0.1, dual_clip_c=2.0)),
    (dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=4096),
     dict(loss_agg_mode="seq-mean-token-sum-norm", norm_length=4096.0)),
    (dict(loss_agg_mode="token-mean", loss_scale_factor=4096), dict(loss_agg_mode="token-mean")),
])
def test_from_verl_config_policy_keys(cfg_kw, expected):
    kw = pv.from_verl_config(actor_config(**cfg_kw))
    for k, v in expected.items():
        assert kw[k] == v, k
    if cfg_kw.get("loss_mode", "vanilla") != "vanilla":
        assert "dual_clip_c" not in kw
    if "loss_scale_factor" in cfg_kw and cfg_kw.get("loss_agg_mode") == "token-mean":
        assert "norm_length" not in kw


@pytest.mark.parametrize("kl_type,estimator", [("kl", "k1"), ("k1", "k1"), ("mse", "k2"),
                                               ("k2", "k2"), ("k2+", "k2"), ("abs", "abs"),
                                               ("k1+", "k1+"), ("kl+", "k1+")])
def test_from_verl_config_kl(kl_type, estimator):
    kw = pv.from_verl_config(actor_config(use_kl_loss=True, kl_loss_type=kl_type,
                                          kl_loss_coef=0.02))
    assert (kw["kl_coef"], kw["kl_estimator"]) == (0.02, estimator)
    assert "kl_coef" not in pv.from_verl_config(actor_config(kl_loss_type=kl_type))


@pytest.mark.parametrize("kl_type", ["low_var_kl", "k3", "low_var_kl+", "k3+", "abs+",
                                     "full", "made_up"])
def test_from_verl_config_unsupported_kl_raises(kl_type):
    with pytest.raises(ValueError, match="actor.kl_loss_type"):
        pv.from_verl_config(actor_config(use_kl_loss=True, kl_loss_type=kl_type))
    pv.from_verl_config(actor_config(use_kl_loss=False, kl_loss_type=kl_type))  # unused


def test_from_verl_config_unexpressible_options_raise_naming_the_key():
    with pytest.raises(ValueError, match="actor.clip_ratio_c"):  # cuts into the clip band
        pv.from_verl_config(actor_config(clip_ratio_c=1.2, clip_ratio_high=0.28))
    with pytest.raises(ValueError, match="actor.clip_ratio_c"):
        pv.from_verl_config(actor_config(clip_ratio_c=1.0))
    with pytest.raises(ValueError, match="actor.clip_ratio_high"):
        pv.from_verl_config(actor_config(clip_ratio_high=1.5))
    with pytest.raises(ValueError, match="actor.clip_ratio_low"):
        pv.from_verl_config(actor_config(clip_ratio_low=-0.1))
    with pytest.raises(ValueError, match="actor.tau_neg"):
        pv.from_verl_config(actor_config(loss_mode="sapo", tau_neg=0.0))
    with pytest.raises(ValueError, match="actor.loss_agg_mode.*sapo.*use_kl_loss"):
        pv.from_verl_config(actor_config(loss_mode="sapo", use_kl_loss=True,
                                         kl_loss_type="k2"))
    with pytest.raises(ValueError, match="actor.kl_loss_coef"):
        pv.from_verl_config(actor_config(use_kl_loss=True, kl_loss_type="k2",
                                         kl_loss_coef=-1.0))
    # the registered loss refuses the same configs
    old, lp, adv, mask, _ = batch(2)
    with pytest.raises(ValueError, match="actor.clip_ratio_c"):
        pv.compute_policy_loss(old, lp, adv, mask, "token-mean",
                               actor_config(clip_ratio_c=1.1))


@pytest.mark.parametrize("rc,expected", [
    (dict(rollout_is="token", rollout_is_threshold=2.0),
     dict(rollout_correction="tis", rollout_is_threshold=2.0)),
    (dict(rollout_is="token", rollout_is_threshold="3"),
     dict(rollout_correction="tis", rollout_is_threshold=3.0)),
    (dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
     dict(rollout_correction="mis", rollout_is_threshold=(0.5, 5.0))),
    (dict(rollout_is="sequence", rollout_is_threshold=2.0),
     dict(rollout_correction="tis-seq", rollout_is_threshold=2.0)),
    (dict(rollout_is="sequence", rollout_is_threshold="0.5_2.0"),
     dict(rollout_correction="mis-seq", rollout_is_threshold=(0.5, 2.0))),
    (dict(rollout_is=None, rollout_is_threshold=2.0), {}),
])
def test_from_verl_config_rollout_correction(rc, expected):
    kw = pv.from_verl_config(actor_config(), rollout_correction=rc)
    for k in ("rollout_correction", "rollout_is_threshold"):
        assert kw.get(k) == expected.get(k)


@pytest.mark.parametrize("rc,key", [
    (dict(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
     "rollout_rs"),
    (dict(rollout_is="token", bypass_mode=True), "bypass_mode"),
    (dict(rollout_is="sequence", rollout_is_batch_normalize=True), "rollout_is_batch_normalize"),
    (dict(rollout_is="tokens"), "rollout_is"),
    (dict(rollout_is="token", rollout_is_threshold="5_0.5"), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=-1.0), "rollout_is_threshold"),
])
def test_from_verl_config_unsupported_rollout_correction_raises(rc, key):
    with pytest.raises(ValueError, match=f"algorithm.rollout_correction.{key}"):
        pv.from_verl_config(actor_config(), rollout_correction=rc)


def test_from_verl_config_whole_trainer_config():
    """The whole trainer config (an omegaconf DictConfig as verl's hydra main builds it):
    the actor section, algorithm.rollout_correction and the rollout temperature."""
    from omegaconf import OmegaConf
    cfg = OmegaConf.create({
        "actor_rollout_ref": {
            "actor": {"policy_loss": {"loss_mode": "ppo_kernels"}, "clip_ratio": 0.2,
                      "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                      "loss_agg_mode": "seq-mean-token-mean", "entropy_coeff": 0.0,
                      "use_kl_loss": True, "kl_loss_type": "k2", "kl_loss_coef": 0.001},
            "rollout": {"temperature": 0.7}},
        "algorithm": {"rollout_correction": {"rollout_is": "token",
                                             "rollout_is_threshold": 2.0,
                                             "rollout_rs": None, "bypass_mode": False}}})
    kw = pv.from_verl_config(cfg)
    assert kw == dict(policy_loss="vanilla", clip_eps_low=0.2, clip_eps_high=0.28,
                      dual_clip_c=3.0, loss_agg_mode="seq-mean-token-mean", entropy_coef=0.0,
                      kl_coef=0.001, kl_estimator="k2", rollout_correction="tis",
                      rollout_is_threshold=2.0, temperature=0.7)
    # the same mapping through the registered loss with a DictConfig actor section
    old, lp, adv, mask, isw = batch(8)
    actor = cfg.actor_rollout_ref.actor
    ours = run(ca.get_policy_loss_fn("ppo_kernels"), old, lp, adv, mask,
               "seq-mean-token-mean", actor, isw)
    theirs = run(ca.get_policy_loss_fn("vanilla"), old, lp, adv, mask, "seq-mean-token-mean",
                 actor_config(clip_ratio_high=0.28), isw)
    assert_same(ours, theirs, torch.float32)
    assert math.isfinite(ours[0].item())


# ------------------------------------------------------------------ GAE

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0)])
def test_gae_matches_verl_compute_gae_advantage_return(seed, gamma, lam):
    """pk.gae (value_lam=None) against verl's compute_gae_advantage_return, on masks with
    interior gaps (verl too carries the next value and advantage across masked tokens):
    the returns on valid tokens, and verl's whitened advantages = pk.whiten of ours. The
    decoupled value_lam gives verl's returns of lam=value_lam, with our advantages
    unchanged (VAPO's decoupled GAE = verl run twice)."""
    g = torch.Generator().manual_seed(seed)
    b, t = 5, 13
    r = torch.randn(b, t, generator=g)
    v = torch.randn(b, t, generator=g)
    m = torch.rand(b, t, generator=g) > 0.3
    m[1, :] = True
    va, vr = ca.compute_gae_advantage_return(r, v, m.float(), gamma=gamma, lam=lam)
    for value_lam in (None, lam):
        a, ret = pk.gae(r, v, m, gamma=gamma, lam=lam, value_lam=value_lam, backend="cpu")
        torch.testing.assert_close(ret[m], vr[m], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pk.whiten(a, m)[m], va[m], rtol=1e-5, atol=1e-5)
    _, vr1 = ca.compute_gae_advantage_return(r, v, m.float(), gamma=gamma, lam=1.0)
    a1, ret1 = pk.gae(r, v, m, gamma=gamma, lam=lam, value_lam=1.0, backend="cpu")
    torch.testing.assert_close(ret1[m], vr1[m], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pk.whiten(a1, m)[m], va[m], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "seq-mean-token-mean",
                                 "seq-mean-token-sum-norm", "token-mean"])
def test_from_verl_config_carries_the_counts(agg):
    """from_verl_config(cfg, response_mask=mask) adds verl's counts: with an empty response
    in the batch, seq-mean-token-sum divides by the non-empty sequences as verl does (the
    op's own default, B, would give 5/6 of verl's loss here)."""
    cfg = actor_config(loss_mode="vanilla", loss_agg_mode=agg)
    logits, tokens, old, adv, mask, ref, _ = actor_inputs(3, b=6)
    assert not bool(mask[-1].any()) and bool(mask[:-1].any(1).all())
    x = logits.clone().requires_grad_()
    theirs = verl_actor_loss(cfg, x, tokens, old, adv, mask, None, None)
    theirs.backward()
    op = pv.from_verl_config(cfg, response_mask=mask)
    assert ("global_num_tokens" if agg == "token-mean" else "global_num_seqs") in op
    y = logits.clone().requires_grad_()
    ours, _ = pk.ppo_loss(y, tokens, old, adv, mask, **op)
    ours.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-5, atol=1e-6 * x.grad.abs().max())
    if agg == "seq-mean-token-sum":  # the trap the counts remove
        op.pop("global_num_seqs")
        plain, _ = pk.ppo_loss(logits, tokens, old, adv, mask, **op)
        assert float(plain.detach() / theirs.detach()) == pytest.approx(5 / 6, rel=1e-5)


def test_verl_batch_kwargs_dp_and_errors():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    info = {"dp_size": 4, "batch_num_tokens": 40, "global_batch_size": 8}
    assert pv.verl_batch_kwargs(mask, "token-mean", info) == {"global_num_tokens": 10.0}
    assert pv.verl_batch_kwargs(mask, "seq-mean-token-mean", info) == {"global_num_seqs": 2.0}
    assert int(pv.verl_batch_kwargs(mask, "seq-mean-token-sum")["global_num_seqs"]) == 1
    for mode, key in (("token-mean", "batch_num_tokens"),
                      ("seq-mean-token-sum", "global_batch_size"), ("token-sum", "dp_size")):
        with pytest.raises(ValueError, match=key):
            pv.verl_batch_kwargs(mask, mode, {"dp_size": 2})
    with pytest.raises(ValueError, match="global_batch_info"):
        pv.from_verl_config(actor_config(), global_batch_info=info)


def test_fused_hook_chunk_size_from_config(monkeypatch):
    """The fused hook's rows per chunk: configure_fused_hook, verl's model config
    (fused_kernel_options.chunk_size, read after HFModelConfig.__post_init__) or
    PPO_KERNELS_VERL_CHUNK_SIZE; verl constructs FusedLinearForPPO without one."""
    from types import SimpleNamespace

    from verl.workers.config.model import HFModelConfig
    import ppo_kernels.integrations.verl as mod
    monkeypatch.setattr(mod, "_HOOK_OPTIONS", {})
    monkeypatch.setenv(pv.CHUNK_SIZE_ENV, "9")
    assert verl_tf.FusedLinearForPPO().chunk_size == 9
    assert HFModelConfig.__post_init__._ppo_kernels  # later configs are read too
    mod._read_model_config(SimpleNamespace(fused_kernel_options={"chunk_size": 5,
                                                                 "impl_backend": "torch"}))
    assert verl_tf.FusedLinearForPPO().chunk_size == 5  # the config wins over the env
    mod._read_model_config(SimpleNamespace(fused_kernel_options={"impl_backend": "torch"}))
    assert pv.fused_hook_chunk_size() == 5  # no key: unchanged
    pv.configure_fused_hook(3)
    seen = []
    real = mod.token_logprobs_from_hidden

    def spy(*a, **k):
        seen.append(k["chunk_size"])
        return real(*a, **k)
    monkeypatch.setattr(mod, "token_logprobs_from_hidden", spy)
    h, w = torch.randn(2, 7, 4), torch.randn(11, 4)
    ids = torch.randint(0, 11, (2, 7))
    verl_tf.FusedLinearForPPO()(h, w, ids, 1.0)
    pv.linear_cross_entropy(h, w, ids)
    assert seen == [3, 3]
    for bad in (0, 2.5, "x", True):
        with pytest.raises(ValueError, match="chunk_size"):
            mod._read_model_config(SimpleNamespace(fused_kernel_options={"chunk_size": bad}))
    pv.configure_fused_hook(None)
    assert verl_tf.FusedLinearForPPO().chunk_size is None


_MONKEY_PATCH_SCRIPT = r"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import ppo_kernels.integrations.verl as pv
from verl.models.transformers.monkey_patch import apply_monkey_patch
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
model = LlamaForCausalLM(cfg).float()
ids = torch.randint(0, 50, (2, 9))
with torch.no_grad():
    logits = model(input_ids=ids).logits
apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                   fused_kernels_backend="torch")
assert pv.fused_hook_installed()
out = model(input_ids=ids, return_dict=True, temperature=0.7)
want = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.roll(ids, -1, -1)[..., None])[..., 0]
err = float((out.log_probs - want).abs().max())
assert err < 1e-5, err
print("OK", err)
"""


def test_apply_monkey_patch_runs_here(tmp_path):
    """verl's apply_monkey_patch (the documented path to the fused forward) patches TRL's
    value-head class whenever TRL is installed; TRL 1.16 has none, so without the module's
    guard it raises ImportError. With it the patched Llama forward runs the fused hook.
    (A subprocess: the patch replaces LlamaForCausalLM.forward for the whole process.)"""
    import os
    import subprocess
    import sys
    script = tmp_path / "patch.py"
    script.write_text(_MONKEY_PATCH_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK" in r.stdout


@pytest.mark.parametrize("mode", MODES)
def test_registered_loss_nan_reaches_the_gradient_only_where_it_is(mode):
    """A NaN log-prob on a valid token makes the loss NaN and that token's gradient NaN
    (token_losses' guard, taken when the aggregated loss is NaN), the others finite; a
    NaN on a masked token changes nothing."""
    cfg = actor_config(loss_mode=mode)
    fn = ca.get_policy_loss_fn(f"ppo_kernels_{mode}")
    old, lp, adv, mask, _ = batch(11)
    valid = mask.nonzero()[0].tolist()
    masked = (~mask).nonzero()[0].tolist()
    clean = run(fn, old, lp, adv, mask, "token-mean", cfg, None)
    bad = lp.clone()
    bad[tuple(masked)] = float("nan")
    same = run(fn, old, bad, adv, mask, "token-mean", cfg, None)
    torch.testing.assert_close(same[0], clean[0], rtol=0, atol=0)
    # every other token's gradient is unchanged (the masked NaN token's own: 0 for vanilla
    # and sapo; gspo-token's exp(lp - sg(lp) + ...) and cispo's sg(w) * lp give it 0 * NaN
    # in the eager composite's backward, as pk.ppo_loss(backend="torch") does)
    keep = torch.ones_like(mask)
    keep[tuple(masked)] = False
    torch.testing.assert_close(same[2][keep], clean[2][keep], rtol=0, atol=0)
    if mode in ("vanilla", "sapo"):
        assert same[2][tuple(masked)] == 0
    bad = lp.clone()
    bad[tuple(valid)] = float("nan")
    loss, _, grad = run(fn, old, bad, adv, mask, "token-mean", cfg, None)
    assert torch.isnan(loss)
    assert torch.isnan(grad[tuple(valid)])
    if mode != "gspo":  # (gspo's sequence ratio spreads the NaN over its sequence)
        others = torch.ones_like(mask)
        others[tuple(valid)] = False
        assert torch.isfinite(grad[others]).all()


# ------------------------------------------------------------------ sampling replay

@pytest.fixture
def replay_off(monkeypatch):
    """A clean fused-hook configuration for the test (replay off afterwards)."""
    import ppo_kernels.integrations.verl as mod
    monkeypatch.setattr(mod, "_HOOK_OPTIONS", {})
    return mod


def replay_reference(h, w, ids, temperature, **replay):
    """pk.token_logprobs on the materialised logits (float64): kept-set log-probs and the
    full entropy."""
    z = h.double() @ w.double().T
    lp, ent = pk.token_logprobs(z, ids, temperature=temperature, return_entropy=True,
                                backend="torch", **replay)
    return lp, ent


@pytest.mark.parametrize("replay", [dict(top_k=10), dict(top_p=0.8),
                                    dict(top_k=20, top_p=0.9), dict(min_p=0.3)])
def test_fused_hook_sampling_replay_matches_token_logprobs(replay_off, replay):
    """With sampling replay configured, FusedLinearForPPO and linear_cross_entropy return the
    kept-set log-probs of pk.token_logprobs(logits, top_k / top_p / min_p, temperature) and
    the full entropy, with the same gradients w.r.t. hidden and the head weight; switched
    off again, the hook's results are those of before, bit for bit."""
    hidden, weight, ids, c1, c2 = hook_inputs((3, 11), seed=4)
    plain = fwd_bwd(lambda h, w, i: verl_tf.FusedLinearForPPO()(h, w, i, 0.7),
                    hidden, weight, ids, c1, c2)
    verl_kw = {"top_k": replay.get("top_k", -1), "top_p": replay.get("top_p", 1.0),
               "min_p": replay.get("min_p", 0.0)}
    assert pv.configure_sampling_replay(verl_kw) == replay
    ours = fwd_bwd(lambda h, w, i: verl_tf.FusedLinearForPPO()(h, w, i, 0.7),
                   hidden, weight, ids, c1, c2)
    want = fwd_bwd(lambda h, w, i: replay_reference(h, w, i, 0.7, **replay),
                   hidden.double(), weight.double(), ids, c1, c2)
    for a, e in zip(ours, want):
        torch.testing.assert_close(a.double(), e, rtol=1e-5,
                                   atol=1e-5 * max(e.abs().max().item(), 1))
    assert (ours[0] > plain[0] + 1e-4).any()  # the kept sets cut something
    torch.testing.assert_close(ours[1], plain[1], rtol=1e-6, atol=1e-6)  # full entropy
    lp, ent = pv.linear_cross_entropy(hidden, weight, ids, 0.7)
    torch.testing.assert_close(lp.double(), want[0].reshape(-1), rtol=1e-5, atol=1e-5)
    assert pv.configure_sampling_replay(None) == {}
    again = fwd_bwd(lambda h, w, i: verl_tf.FusedLinearForPPO()(h, w, i, 0.7),
                    hidden, weight, ids, c1, c2)
    for a, e in zip(again, plain):
        assert torch.equal(a, e)


def test_sampling_replay_loss_through_hook_equals_ppo_loss(replay_off):
    """verl's path with replay: the hook's old and current log-probs into the registered
    'ppo_kernels' loss give pk.ppo_loss on the logits with the same top_k / top_p and
    temperature (loss and gradient w.r.t. the hidden states)."""
    hidden, weight, ids, _, _ = hook_inputs((4, 9), seed=5)
    g = torch.Generator().manual_seed(6)
    adv = torch.randn(4, 9, generator=g)
    mask = torch.rand(4, 9, generator=g) < 0.8
    pv.configure_sampling_replay({"top_k": 12, "top_p": 0.85})
    with torch.no_grad():
        old, _ = verl_tf.FusedLinearForPPO()(hidden + 0.05 * torch.randn(
            hidden.shape, generator=g), weight, ids, 0.8)
    h1 = hidden.clone().requires_grad_()
    lp, _ = verl_tf.FusedLinearForPPO()(h1, weight, ids, 0.8)
    cfg = actor_config(loss_mode="vanilla", clip_ratio_high=0.28)
    loss, _ = ca.get_policy_loss_fn("ppo_kernels")(old, lp, adv, mask, "token-mean", cfg, None)
    loss.backward()
    h2 = hidden.clone().requires_grad_()
    kw = pv.from_verl_config(cfg)
    want, _ = pk.ppo_loss(h2 @ weight.T, ids, old, adv, mask, temperature=0.8, top_k=12,
                          top_p=0.85, backend="torch", **kw)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    plain, _ = pk.ppo_loss(hidden @ weight.T, ids, old, adv, mask, temperature=0.8,
                           backend="torch", **kw)
    assert not torch.allclose(plain, want, rtol=1e-4, atol=1e-6)


def test_sampling_replay_through_verl_model_forward(replay_off):
    """verl's use_fused_kernels forward (impl_backend=torch) of a tiny Llama with replay
    configured: log-probs = pk.token_logprobs(logits, rolled ids, top_k, top_p,
    temperature), entropy over the full vocabulary."""
    transformers = pytest.importorskip("transformers")
    from verl.models.transformers import dense_common
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    pv.configure_sampling_replay({"top_k": 7, "top_p": 0.9})
    with torch.no_grad():
        out = dense_common.forward_with_torch_backend(model, input_ids=x, return_dict=True,
                                                      temperature=0.9)
        logits = model(input_ids=x).logits
    want, ent = pk.token_logprobs(logits, torch.roll(x, -1, -1), temperature=0.9, top_k=7,
                                  top_p=0.9, return_entropy=True, backend="torch")
    torch.testing.assert_close(out.log_probs, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, ent, rtol=1e-5, atol=1e-5)


def test_sampling_replay_from_model_config(replay_off):
    """fused_kernel_options.sampling_replay with top_k / top_p next to it (verl's model
    config does not see the rollout's; hydra interpolation passes them): verl's -1 / 1 are
    off; sampling_replay without them, or bad values, a ValueError naming the key."""
    from types import SimpleNamespace
    mod = replay_off
    mod._read_model_config(SimpleNamespace(fused_kernel_options={
        "sampling_replay": True, "top_k": 50, "top_p": 1.0}))
    assert pv.sampling_replay_kwargs() == {"top_k": 50}
    mod._read_model_config(SimpleNamespace(fused_kernel_options={"impl_backend": "torch"}))
    assert pv.sampling_replay_kwargs() == {"top_k": 50}  # no key: unchanged
    mod._read_model_config(SimpleNamespace(fused_kernel_options={
        "sampling_replay": True, "top_k": -1, "top_p": 0.7}))
    assert pv.sampling_replay_kwargs() == {"top_p": 0.7}
    mod._read_model_config(SimpleNamespace(fused_kernel_options={"sampling_replay": False}))
    assert pv.sampling_replay_kwargs() == {}
    bad = [({"sampling_replay": True}, "fused_kernel_options.sampling_replay=true needs"),
           ({"sampling_replay": "yes", "top_k": 5}, "fused_kernel_options.sampling_replay"),
           ({"sampling_replay": True, "top_k": 2.5}, "fused_kernel_options.top_k"),
           ({"sampling_replay": True, "top_k": -3}, "fused_kernel_options.top_k"),
           ({"sampling_replay": True, "top_p": 0.0}, "fused_kernel_options.top_p"),
           ({"sampling_replay": True, "top_p": 1.5}, "fused_kernel_options.top_p"),
           ({"sampling_replay": True, "min_p": 1.0}, "fused_kernel_options.min_p")]
    for opts, match in bad:
        with pytest.raises(ValueError, match=match):
            mod._read_model_config(SimpleNamespace(fused_kernel_options=opts))
        assert pv.sampling_replay_kwargs() == {}  # a refused setting changes nothing
    with pytest.raises(ValueError, match="not both"):
        pv.configure_sampling_replay({"top_k": 5}, top_p=0.5)
    with pytest.raises(ValueError, match="configure_sampling_replay.top_k"):
        pv.configure_sampling_replay(top_k="five")


def test_sampling_replay_rollout_config_and_from_verl_config():
    """verl's own RolloutConfig dataclass (top_k -1 by default) and the whole trainer config
    through from_verl_config(sampling_replay=True); an actor section alone, a non-bool, or
    calculate_log_probs with raw log-probs, a ValueError / TypeError naming the key."""
    from omegaconf import OmegaConf
    from verl.workers.config import RolloutConfig
    assert pv.replay_kwargs_from_verl(RolloutConfig(name="vllm")) == {}
    assert pv.replay_kwargs_from_verl(RolloutConfig(name="vllm", top_k=32, top_p=0.95)) == \
        {"top_k": 32, "top_p": 0.95}
    cfg = OmegaConf.create({
        "actor_rollout_ref": {
            "actor": {"policy_loss": {"loss_mode": "ppo_kernels"}, "clip_ratio": 0.2,
                      "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                      "loss_agg_mode": "token-mean", "entropy_coeff": 0.0,
                      "use_kl_loss": True, "kl_loss_type": "k2", "kl_loss_coef": 0.001},
            "rollout": {"temperature": 0.7, "top_k": 40, "top_p": 0.9,
                        "calculate_log_probs": True, "logprobs_mode": "processed_logprobs"}},
        "algorithm": {}})
    plain = pv.from_verl_config(cfg)
    assert plain == pv.from_verl_config(cfg, sampling_replay=False)
    assert not {"top_k", "top_p", "kl_logprobs"} & set(plain)
    kw = pv.from_verl_config(cfg, sampling_replay=True)
    assert kw == {**plain, "top_k": 40, "top_p": 0.9, "kl_logprobs": "kept"}
    with pytest.raises(ValueError, match="whole trainer config"):
        pv.from_verl_config(cfg.actor_rollout_ref.actor, sampling_replay=True)
    with pytest.raises(TypeError, match="sampling_replay"):
        pv.from_verl_config(cfg, sampling_replay="yes")
    cfg.actor_rollout_ref.rollout.logprobs_mode = "raw_logprobs"
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.logprobs_mode"):
        pv.from_verl_config(cfg, sampling_replay=True)
    cfg.actor_rollout_ref.rollout.logprobs_mode = "processed_logprobs"
    cfg.actor_rollout_ref.rollout.name = "sglang"
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.name = 'sglang'"):
        pv.from_verl_config(cfg, sampling_replay=True)
    cfg.actor_rollout_ref.rollout.logprobs_mode = "raw_logprobs"
    cfg.actor_rollout_ref.rollout.calculate_log_probs = False  # no rollout log-probs used
    assert pv.from_verl_config(cfg, sampling_replay=True)["top_k"] == 40


ALL_MODES = MODES + ["dppo_tv", "dppo_kl"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_fast_path_is_the_checked_path_exactly(mode, dtype, monkeypatch):
    """The registry's fast path (float mask, masked inputs left as they are) gives the
    checked path's loss, metrics and gradient bit for bit: every agg mode, with and without
    IS weights and global_batch_info, lp beyond the clamps, an empty row."""
    old, lp, adv, mask, isw = batch(21, b=6, t=29, dtype=dtype, wild=0.1)
    adv = torch.where(mask, adv, 3.0)  # (masked advantages not zeroed: the fast path's case)
    infos = [None, {"dp_size": 2, "batch_num_tokens": 150, "global_batch_size": 12,
                    "loss_scale_factor": 40}]
    for agg in AGG_MODES:
        for w in (None, isw):
            for info in infos:
                cfg = actor_config(loss_mode=mode)
                if info is not None:
                    cfg.global_batch_info.update(info)
                fn = ca.get_policy_loss_fn(f"ppo_kernels_{mode}")
                assert pv._plain_inputs(old, lp, adv, mask, w) is not None  # (fast path)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    fast = run(fn, old, lp, adv, mask, agg, cfg, w)
                    with monkeypatch.context() as mp:
                        mp.setattr(pv, "_plain_inputs", lambda *a: None)
                        checked = run(fn, old, lp, adv, mask, agg, cfg, w)
                torch.testing.assert_close(fast[0], checked[0], rtol=0, atol=0)
                assert fast[1] == checked[1]
                torch.testing.assert_close(fast[2], checked[2], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_registered_loss_ignores_non_finite_masked_inputs(mode, bad):
    """NaN / inf on masked positions of old_log_prob, advantages and rollout_is_weights
    (verl's padding holds anything) change neither the loss, the metrics nor the
    gradient: the fast path sees the NaN and the checked path (masked inputs zeroed)
    redoes the call."""
    old, lp, adv, mask, isw = batch(5, b=4, t=17)
    cfg = actor_config(loss_mode=mode)
    fn = ca.get_policy_loss_fn(f"ppo_kernels_{mode}")
    for agg in ("token-mean", "seq-mean-token-sum"):
        clean = run(fn, old, lp, adv, mask, agg, cfg, isw)
        for which in range(3):
            x = [old.clone(), adv.clone(), isw.clone()]
            x[which][~mask] = bad
            got = run(fn, x[0], lp, x[1], mask, agg, cfg, x[2])
            torch.testing.assert_close(got[0], clean[0], rtol=0, atol=0)
            assert got[1] == clean[1]
            torch.testing.assert_close(got[2][mask], clean[2][mask], rtol=0, atol=0)
            assert torch.isfinite(got[2]).all()
