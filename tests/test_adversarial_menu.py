"""Adversarial inputs against the loss menu (docs/LOSSES.md): the policy losses cispo / sapo /
gspo / gspo-token, the k1+ / k3+ estimators, kl_bias_correction, entropy_agg_mode,
on-policy old_logprobs=None, per-sequence arguments, the global denominators, rollout
correction, grad_scale, inplace_backward, odd shapes / dtypes / layouts, torch.compile,
retain_graph and no_grad, on the cpu, torch and triton (interpreter) backends, against the
numpy float64 reference.

Tests under a `# fixed:` comment pinned real bugs (xfail until they were fixed); the
others pin behaviour that holds.
"""

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_kernels as pk
from ppo_kernels import reference as R

from conftest import TOL, TORCH, backend_params, make_inputs

BES = backend_params(cuda=False)  # cpu, torch, triton (interpreter)
KERNEL_BES = [p for p in BES if p.values[0].name != "torch"]
POLICY_LOSSES = ["vanilla", "cispo", "sapo", "gspo", "gspo-token"]
TOKEN_LOSSES = ["vanilla", "cispo", "sapo"]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _np(x):
    return x.detach().cpu().double().numpy()


def _compare(be, logits, tokens, old, adv, mask, ref, *, grad_rel=3e-6, loss_rel=2e-6,
             metric_tol=2e-5, ref_kw=None, **kw):
    """Runs pk.ppo_loss on backend ``be`` and the reference on the same inputs; asserts
    loss, metrics (those the reference has) and dlogits agree. ``ref_kw`` overrides
    arguments for the reference only (it takes [B, T, V] only)."""
    leaf = logits.detach().clone().requires_grad_(True)
    loss, met = pk.ppo_loss(leaf, tokens, old, adv, mask, ref, backend=be.name, **kw)
    (loss.sum() if loss.dim() else loss).backward()
    rk = dict(logits=logits.detach().double(), tokens=tokens, old=old, adv=adv, mask=mask,
              ref=ref, kw=kw)
    rk.update(ref_kw or {})
    e_loss, e_met, e_grad = R.ppo_loss(rk["logits"], rk["tokens"], rk["old"], rk["adv"],
                                       rk["mask"], rk["ref"], **rk["kw"])
    e_loss = np.asarray(e_loss).reshape(loss.shape)
    got = _np(loss)
    assert np.isfinite(got).all(), "non-finite loss"
    np.testing.assert_allclose(got, e_loss, rtol=loss_rel,
                               atol=loss_rel * max(1.0, float(np.abs(e_loss).max(initial=0))))
    for k, v in met.items():
        assert v.dim() == 0 and v.dtype == torch.float32 and not v.requires_grad, k
        if k in e_met:
            assert math.isfinite(float(v)), k
            assert float(v) == pytest.approx(e_met[k], rel=metric_tol, abs=metric_tol), k
    g = _np(leaf.grad).reshape(e_grad.shape)
    assert np.isfinite(g).all(), "non-finite dlogits"
    scale = float(np.abs(e_grad).max(initial=0.0))
    err = float(np.abs(g - e_grad).max(initial=0.0))
    assert err <= grad_rel * scale + 1e-30, f"dlogits: err {err:.3e} vs scale {scale:.3e}"
    return loss, met, leaf.grad


def _inp(B, T, V, seed, **kw):
    return make_inputs(B, T, V, _gen(seed), **kw)


# ====================================================================== behaviour that holds

@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.parametrize("agg", ["token-sum", "seq-mean-token-sum-norm", "none"])
def test_every_loss_with_every_option_at_once(be, policy_loss, agg):
    """k3+ with the bias correction, a separate entropy aggregation, per-sequence
    advantages [B, 1] and IS weights [B, 1]: all at once, per aggregation."""
    inp = _inp(2, 4, 19, 11)
    kw = dict(policy_loss=policy_loss, loss_agg_mode=agg, kl_coef=0.15, kl_estimator="k3+",
              kl_bias_correction=True, entropy_coef=0.03,
              entropy_agg_mode=None if agg == "none" else "token-mean",
              rollout_is_weights=inp["isw"][:, :1], sapo_tau_pos=2.0, sapo_tau_neg=0.5,
              dual_clip_c=3.0 if policy_loss not in ("cispo", "sapo") else None)
    _compare(be, inp["full"][:, :4], inp["tokens"], inp["old"], inp["adv"][:, :1],
             inp["mask"], inp["ref"], **kw)


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_on_policy_with_k1plus_and_per_sequence_advantages(be, policy_loss):
    inp = _inp(2, 4, 17, 12)
    _compare(be, inp["full"][:, :4], inp["tokens"], None, inp["adv"][:, 0], inp["mask"],
             inp["ref"], policy_loss=policy_loss, kl_coef=0.3, kl_estimator="k1+",
             kl_bias_correction=True, loss_agg_mode="seq-mean-token-mean")


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_flat_logits_with_rollout_correction(be, policy_loss):
    """[N, V] logits: one sequence; rollout_logprobs [N] with tis-seq and the off-policy
    mask."""
    g = _gen(13)
    N, V = 6, 13
    x = torch.randn(N, V, generator=g) * 2
    tok = torch.randint(0, V, (N,), generator=g)
    lp = torch.log_softmax(x.double(), -1).gather(-1, tok[:, None])[:, 0]
    old = (lp + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)).float()
    ref = (lp + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)).float()
    roll = old + 0.1 * torch.randn(N, generator=g)
    adv = torch.randn(N, generator=g)
    mask = torch.tensor([1, 1, 0, 1, 1, 0], dtype=torch.bool)
    kw = dict(policy_loss=policy_loss, kl_coef=0.1, kl_bias_correction=True, entropy_coef=0.01,
              entropy_agg_mode="token-mean", loss_agg_mode="seq-mean-token-mean",
              rollout_logprobs=roll, rollout_correction="tis-seq",
              rollout_is_threshold=(0.5, 1.5), off_policy_mask_threshold=0.01)
    ref_kw = dict(logits=x[None].double(), tokens=tok[None], old=old[None], adv=adv[None],
                  mask=mask[None], ref=ref[None], kw=dict(kw, rollout_logprobs=roll[None]))
    _compare(be, x, tok, old, adv, mask, ref, ref_kw=ref_kw, **kw)


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.parametrize("mode,threshold", [("geo-seq", 1.5), ("mis", (0.7, 1.4))])
def test_raw_t_plus_one_logits_with_rollout_correction(be, policy_loss, mode, threshold):
    """[B, T + 1, V] logits (the last position gets a zero gradient)."""
    inp = _inp(2, 4, 9, 14, layout="raw")
    roll = inp["old"] + 0.2 * torch.randn(2, 4, generator=_gen(1))
    _, _, grad = _compare(be, inp["full"], inp["tokens"], inp["old"], inp["adv"][:, 0],
                          inp["mask"], inp["ref"], policy_loss=policy_loss, kl_coef=0.2,
                          kl_estimator="k1+", entropy_coef=0.02, rollout_logprobs=roll,
                          rollout_correction=mode, rollout_is_threshold=threshold,
                          off_policy_mask_threshold=0.0)
    assert (grad[:, -1] == 0).all()


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", ["cispo", "gspo", "gspo-token"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16],
                         ids=["f64", "bf16", "f16"])
def test_logits_dtypes(be, policy_loss, dtype):
    inp = _inp(2, 4, 19, 15, dtype=dtype)
    rtol, _, grel = TOL[dtype]
    roll = inp["old"] + 0.1
    _compare(be, inp["full"][:, :4], inp["tokens"], inp["old"], inp["adv"][:, :1],
             inp["mask"], inp["ref"], grad_rel=grel, loss_rel=max(rtol, 2e-6),
             policy_loss=policy_loss, kl_coef=0.1, kl_bias_correction=True,
             kl_estimator="k3+", entropy_coef=0.02, entropy_agg_mode="seq-mean-token-sum",
             loss_agg_mode="token-sum", rollout_logprobs=roll, rollout_correction="mis",
             rollout_is_threshold=(0.7, 1.4))


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.parametrize("shape", [(3, 4, 7, "empty_row"), (2, 3, 7, "all"), (4, 1, 7, "none"),
                                   (2, 3, 1, "mixed")], ids=["empty-row", "all-masked", "T1", "V1"])
def test_degenerate_shapes(be, policy_loss, shape):
    B, T, V, padding = shape
    inp = _inp(B, T, V, 16, padding=padding)
    _compare(be, inp["full"][:, :T], inp["tokens"], inp["old"], inp["adv"][:, 0],
             inp["mask"], inp["ref"], policy_loss=policy_loss, kl_coef=0.1,
             kl_bias_correction=True, entropy_coef=0.01, entropy_agg_mode="token-sum",
             loss_agg_mode="seq-mean-token-mean", rollout_logprobs=inp["old"] + 0.2,
             rollout_correction="tis", off_policy_mask_threshold=0.1,
             global_num_seqs=torch.tensor(5))


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_banned_neginf_logits(be, policy_loss):
    inp = _inp(2, 4, 23, 17, neginf=True)
    _compare(be, inp["full"][:, :4], inp["tokens"], inp["old"], inp["adv"], inp["mask"],
             inp["ref"], policy_loss=policy_loss, kl_coef=0.1, kl_bias_correction=True,
             entropy_coef=0.05, entropy_agg_mode="token-mean")


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", ["vanilla", "cispo", "sapo", "gspo"])
@pytest.mark.parametrize("est", ["k1+", "k3+", "k3"])
def test_huge_log_ratios(be, policy_loss, est):
    """|logp - old| of 25-40 nats (clamped at 20), also as the KL's reference."""
    inp = _inp(2, 4, 23, 18, padding="none")
    old = inp["old"].clone()
    old[0, 0] -= 25
    old[0, 1] += 30
    old[1] -= 40
    _compare(be, inp["full"][:, :4], inp["tokens"], old, inp["adv"], inp["mask"], old,
             policy_loss=policy_loss, kl_coef=0.1, kl_estimator=est, kl_bias_correction=True,
             dual_clip_c=None if policy_loss in ("cispo", "sapo") else 3.0)


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_ties_on_policy_with_a_zero_width_band(be, policy_loss):
    """On-policy rho = 1 exactly with clip_eps 0: every token sits on both clip edges (the
    unclipped branch is the active one on ties)."""
    inp = _inp(2, 4, 23, 19, padding="none")
    _compare(be, inp["full"][:, :4], inp["tokens"], None, inp["adv"], None, inp["ref"],
             policy_loss=policy_loss, kl_coef=0.1, kl_bias_correction=True,
             clip_eps_low=0.0, clip_eps_high=0.0)


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("count", [7, 7.5, torch.tensor(7), torch.tensor(7.5),
                                   torch.tensor(7.5, dtype=torch.float64),
                                   torch.tensor(3, dtype=torch.int8)],
                         ids=["int", "float", "t-int", "t-f32", "t-f64", "t-int8"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_global_counts_numbers_and_tensors(be, count, agg):
    inp = _inp(2, 4, 13, 20)
    _compare(be, inp["full"][:, :4], inp["tokens"], inp["old"], inp["adv"], inp["mask"],
             inp["ref"], policy_loss="gspo" if agg == "token-mean" else "cispo",
             loss_agg_mode=agg, global_num_tokens=count, global_num_seqs=count,
             entropy_coef=0.1, entropy_agg_mode="token-mean")


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", TOKEN_LOSSES)
def test_inplace_backward_token_level_losses(be, policy_loss):
    inp = _inp(2, 4, 13, 21)
    kw = dict(policy_loss=policy_loss, kl_coef=0.1, kl_estimator="k3+", kl_bias_correction=True,
              entropy_coef=0.02, entropy_agg_mode="token-mean", old=None)
    e_loss, _, e_grad = R.ppo_loss(inp["base"], inp["tokens"], None, inp["adv"], inp["mask"],
                                   inp["ref"], **{k: v for k, v in kw.items() if k != "old"})
    leaf = inp["full"][:, :4].clone().requires_grad_(True)
    loss, _ = pk.ppo_loss(leaf * 1, inp["tokens"], None, inp["adv"], inp["mask"], inp["ref"],
                          inplace_backward=True, backend=be.name,
                          **{k: v for k, v in kw.items() if k != "old"})
    (loss * 3).backward()
    assert float(loss.detach()) == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert np.abs(_np(leaf.grad) - 3 * e_grad).max() <= 3e-6 * 3 * np.abs(e_grad).max()


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", ["gspo", "gspo-token"])
def test_retain_graph_twice_sequence_losses_any_grad_outputs(be, policy_loss):
    inp = _inp(2, 4, 11, 22)
    args = (inp["tokens"], inp["old"], inp["adv"], inp["mask"])
    x0 = inp["full"][:, :4].clone().requires_grad_(True)
    pk.ppo_loss(x0, *args, policy_loss=policy_loss, backend=be.name)[0].backward()
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, _ = pk.ppo_loss(x, *args, policy_loss=policy_loss, grad_scale=0.5, backend=be.name)
    (loss * 2).backward(retain_graph=True)
    loss.backward(retain_graph=True)
    (loss * 0.25).backward()
    torch.testing.assert_close(x.grad, 3.25 * x0.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_no_grad_call_matches_grad_call(be, policy_loss):
    inp = _inp(2, 4, 11, 23)
    args = (inp["tokens"], inp["old"], inp["adv"][:, :1], inp["mask"], inp["ref"])
    kw = dict(policy_loss=policy_loss, kl_coef=0.1, kl_bias_correction=True,
              off_policy_mask_threshold=0.05, backend=be.name)
    x = inp["full"][:, :4].clone().requires_grad_(True)
    with torch.no_grad():
        l0, m0 = pk.ppo_loss(x, *args, **kw)
    l1, m1 = pk.ppo_loss(x, *args, **kw)
    assert not l0.requires_grad and l1.requires_grad
    assert float(l0) == float(l1.detach())
    assert all(float(m0[k]) == float(m1[k]) for k in m1)


@pytest.mark.parametrize("backend", ["cpu"])
@pytest.mark.parametrize("kw", [dict(policy_loss="gspo", off_policy_mask_threshold=0.05),
                                dict(policy_loss="gspo-token", entropy_coef=0.01,
                                     entropy_agg_mode="token-mean", global_num_tokens="t"),
                                dict(policy_loss="sapo", kl_coef=0.1, kl_estimator="k3+",
                                     kl_bias_correction=True)],
                         ids=["gspo-offpolicy", "gspo-token-global", "sapo-k3plus-bias"])
def test_compile_fullgraph(backend, kw):
    torch._dynamo.reset()
    inp = _inp(2, 4, 11, 24)
    kw = dict(kw)
    if kw.get("global_num_tokens") == "t":
        kw["global_num_tokens"] = torch.tensor(9.0)

    def f(x, tok, old, adv, mask, ref):
        return pk.ppo_loss(x, tok, old, adv, mask, ref, backend=backend, **kw)

    args = (inp["tokens"], inp["old"], inp["adv"][:, 0], inp["mask"], inp["ref"])
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, met = torch.compile(f, fullgraph=True, backend="aot_eager")(x, *args)
    loss.backward()
    y = inp["full"][:, :4].clone().requires_grad_(True)
    loss2, met2 = f(y, *args)
    loss2.backward()
    torch.testing.assert_close(loss.detach(), loss2.detach())
    torch.testing.assert_close(x.grad, y.grad)


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", TOKEN_LOSSES + ["gspo-token"])
@pytest.mark.parametrize("field", ["adv", "old", "ref", "isw"])
def test_nan_on_masked_positions_token_losses(be, policy_loss, field):
    """NaN in old / ref / advantages / IS weights on masked positions reaches neither loss
    nor gradient (gspo: see the xfail below)."""
    inp = _inp(2, 4, 11, 25)
    m = inp["mask"]
    clean = dict(old=inp["old"], ref=inp["ref"], adv=inp["adv"], isw=inp["isw"])
    dirty = dict(clean)
    dirty[field] = torch.where(m, clean[field], float("nan"))
    kw = dict(policy_loss=policy_loss, kl_coef=0.1, kl_bias_correction=True, entropy_coef=0.01)
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, met = pk.ppo_loss(x, inp["tokens"], dirty["old"], dirty["adv"], m, dirty["ref"],
                            rollout_is_weights=dirty["isw"], backend=be.name, **kw)
    loss.backward()
    e_loss, _, e_grad = R.ppo_loss(inp["base"], inp["tokens"], clean["old"], clean["adv"], m,
                                   clean["ref"], rollout_is_weights=clean["isw"], **kw)
    assert float(loss.detach()) == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert all(math.isfinite(float(v)) for v in met.values())
    assert np.abs(_np(x.grad) - e_grad).max() <= 3e-6 * np.abs(e_grad).max()


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.parametrize("mode", ["tis", "tis-seq", "mis", "mis-seq", "geo-seq"])
def test_nan_rollout_logprobs_on_masked_positions(be, policy_loss, mode):
    inp = _inp(2, 4, 11, 26)
    m = inp["mask"]
    roll = inp["old"] + 0.1
    kw = dict(policy_loss=policy_loss, rollout_correction=mode, rollout_is_threshold=(0.5, 1.5),
              off_policy_mask_threshold=0.05)
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, met = pk.ppo_loss(x, inp["tokens"], inp["old"], inp["adv"], m,
                            rollout_logprobs=torch.where(m, roll, float("nan")),
                            backend=be.name, **kw)
    loss.backward()
    e_loss, _, e_grad = R.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"], m,
                                   rollout_logprobs=roll, **kw)
    assert float(loss.detach()) == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert all(math.isfinite(float(v)) for v in met.values())
    assert np.abs(_np(x.grad) - e_grad).max() <= 3e-6 * np.abs(e_grad).max()


_B, _T, _V = 2, 3, 5
_ROLL = -torch.rand(_B, _T, generator=_gen(0)) - 0.4

BAD_ARGS = [
    ("policy_loss", dict(policy_loss="GSPO")),
    ("policy_loss", dict(policy_loss=None)),
    ("sapo_tau_pos", dict(policy_loss="sapo", sapo_tau_pos=0.0)),
    ("sapo_tau_neg", dict(policy_loss="sapo", sapo_tau_neg=True)),
    ("sapo_tau_pos", dict(policy_loss="sapo", sapo_tau_pos=torch.tensor(1.0))),
    ("kl_estimator", dict(kl_estimator="k2+")),
    ("kl_bias_correction", dict(kl_bias_correction="yes")),
    ("entropy_agg_mode", dict(entropy_agg_mode="none")),
    ("global_num_tokens", dict(global_num_tokens=0)),
    ("global_num_tokens", dict(global_num_tokens=float("nan"))),
    ("global_num_tokens", dict(global_num_tokens=torch.tensor(0.0))),
    ("global_num_tokens", dict(global_num_tokens=torch.tensor(float("inf")))),
    ("global_num_tokens", dict(global_num_tokens=torch.tensor(True))),
    ("global_num_tokens", dict(global_num_tokens=torch.tensor([2.0, 3.0]))),
    ("global_num_tokens", dict(global_num_tokens=torch.tensor(1e-50, dtype=torch.float64))),
    ("global_num_tokens", dict(global_num_tokens=True)),
    ("global_num_seqs", dict(loss_agg_mode="seq-mean-token-mean",
                             global_num_seqs=torch.tensor(-1))),
    ("global_num_seqs", dict(global_num_seqs=torch.tensor(2 + 0j))),
    ("grad_scale", dict(grad_scale=0.0)),
    ("grad_scale", dict(grad_scale=True)),
    ("rollout_is_threshold", dict(rollout_correction="tis", rollout_is_threshold=(1.0,))),
    ("rollout_is_threshold", dict(rollout_correction="tis", rollout_is_threshold="2")),
    ("rollout_is_threshold", dict(rollout_correction="tis", rollout_is_threshold=(-0.5, 2.0))),
    ("rollout_is_threshold", dict(rollout_correction="tis",
                                  rollout_is_threshold=torch.tensor(2.0))),
    ("rollout_is_threshold", dict(rollout_correction="geo-seq", rollout_is_threshold=1.0)),
    ("rollout_correction", dict(rollout_correction="TIS")),
    ("rollout_logprobs", dict(rollout_correction="tis", rollout_logprobs=_ROLL[:, :2])),
    ("rollout_logprobs", dict(rollout_correction="tis", rollout_logprobs=_ROLL.long())),
    ("off_policy_mask_threshold", dict(off_policy_mask_threshold="0.1")),
    ("off_policy_mask_threshold", dict(off_policy_mask_threshold=float("inf"))),
    ("inplace_backward", dict(inplace_backward="no")),
    ("advantages", dict(adv=torch.randn(_B, 2))),
    ("advantages", dict(adv=torch.randn(1, _T))),
    ("advantages", dict(adv=torch.randn(_B, 1, 1))),
    ("advantages", dict(adv=torch.randn(_B).long())),
    ("rollout_is_weights", dict(rollout_is_weights=torch.rand(1, _T))),
    ("rollout_is_weights", dict(rollout_is_weights=torch.rand(_B, _T, 1))),
    ("clip_eps_high", dict(policy_loss="cispo", clip_eps_high=-0.1)),
    ("clip_eps_low", dict(policy_loss="cispo", clip_eps_low=1.5)),
    ("clip_eps_high", dict(policy_loss="gspo", clip_eps_high=1.0)),
    ("dual_clip_c", dict(policy_loss="sapo", dual_clip_c=3.0)),
    ("dual_clip_c", dict(policy_loss="gspo", dual_clip_c=1.1)),
]


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("name,kw", BAD_ARGS, ids=[f"{n}-{i}" for i, (n, _) in
                                                   enumerate(BAD_ARGS)])
def test_bad_menu_arguments_name_themselves(be, name, kw):
    g = _gen(27)
    kw = dict(kw)
    adv = kw.pop("adv", torch.randn(_B, _T, generator=g))
    if "rollout_correction" in kw:
        kw.setdefault("rollout_logprobs", _ROLL)
    with pytest.raises((ValueError, TypeError), match=name):
        pk.ppo_loss(torch.randn(_B, _T, _V, generator=g), torch.randint(0, _V, (_B, _T)),
                    _ROLL + 0.05, adv, backend=be.name, **kw)


# ====================================================================== bugs (xfail)

# fixed: gspo: NaN in advantages / IS weights / ref (with kl_bias_correction) on a MASKED position
#   makes the whole sequence's gradient NaN (0 * NaN through the expanded sequence ratio)
@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("field", ["adv", "ref", "isw"])
def test_gspo_nan_on_masked_positions(be, field):
    inp = _inp(2, 4, 11, 25)
    m = inp["mask"]
    clean = dict(ref=inp["ref"], adv=inp["adv"], isw=inp["isw"])
    dirty = dict(clean)
    dirty[field] = torch.where(m, clean[field], float("nan"))
    kw = dict(policy_loss="gspo", kl_coef=0.1, kl_bias_correction=True)
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, _ = pk.ppo_loss(x, inp["tokens"], inp["old"], dirty["adv"], m, dirty["ref"],
                          rollout_is_weights=dirty["isw"], backend=be.name, **kw)
    loss.backward()
    _, _, e_grad = R.ppo_loss(inp["base"], inp["tokens"], inp["old"], clean["adv"], m,
                              clean["ref"], rollout_is_weights=clean["isw"], **kw)
    assert torch.isfinite(x.grad).all()
    assert np.abs(_np(x.grad) - e_grad).max() <= 3e-6 * np.abs(e_grad).max()


# fixed: gspo-token: where the sequence log-ratio is clamped (|mean| > 20) the backends still give
#   the gradient -A s (~1e8); the reference (and every other ratio) gives 0
@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("bias", [False, True], ids=["pg", "kl-bias"])
def test_gspo_token_clamped_sequence_ratio_has_no_gradient(be, bias):
    inp = _inp(1, 2, 5, 28, padding="none")
    old = inp["old"] - 25.0  # mean log-ratio ~ +25: clamped at 20
    adv = torch.zeros(1, 2) if bias else -torch.ones(1, 2)
    kw = dict(kl_coef=0.1, kl_bias_correction=True) if bias else {}
    _compare(be, inp["full"][:, :2], inp["tokens"], old, adv, None, old + 1.0,
             policy_loss="gspo-token", **kw)


# fixed: k1+/k3+ value computed as k2 + (k - k2).detach() (_torch_impl.kl_terms): the kl_ref metric
#   (every backend) and the torch loss lose digits at large |delta| and are NaN for ref_logprobs =
#   -inf
@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("est,delta", [("k1+", 1000.37), ("k1+", -1000.37),
                                       ("k3+", math.inf)], ids=["k1p-pos", "k1p-neg", "k3p-inf"])
def test_straight_through_kl_value_keeps_its_digits(be, est, delta):
    x = torch.zeros(1, 1, 3)
    tok = torch.zeros(1, 1, dtype=torch.long)
    ref = torch.tensor([[-math.log(3) - delta]])
    loss, met = pk.ppo_loss(x, tok, None, torch.zeros(1, 1), None, ref, kl_coef=1.0,
                            kl_estimator=est, loss_agg_mode="token-sum", backend=be.name)
    e_loss, e_met, _ = R.ppo_loss(x.double(), tok, None, torch.zeros(1, 1), None, ref,
                                  kl_coef=1.0, kl_estimator=est, loss_agg_mode="token-sum")
    assert float(met["kl_ref"]) == pytest.approx(e_met["kl_ref"], rel=2e-6)
    assert float(loss) == pytest.approx(e_loss, rel=2e-6)


# fixed: rollout metrics: `1.0 if mask.any() else 0.0` (rollout_correction.py, rollout_chi2) is
#   data-dependent control flow: torch.compile(fullgraph=True) fails with rollout_logprobs
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kw", [dict(rollout_correction="tis"),
                                dict(policy_loss="gspo", rollout_correction="geo-seq",
                                     rollout_is_threshold=1.5),
                                dict()], ids=["tis", "gspo-geo", "metrics-only"])
def test_compile_fullgraph_with_rollout_logprobs(backend, kw):
    torch._dynamo.reset()
    inp = _inp(2, 4, 11, 29)
    roll = inp["old"] + 0.2

    def f(x, tok, old, adv, mask, roll):
        return pk.ppo_loss(x, tok, old, adv, mask, rollout_logprobs=roll, backend=backend, **kw)

    x = inp["full"][:, :4].clone().requires_grad_(True)
    args = (inp["tokens"], inp["old"], inp["adv"], inp["mask"], roll)
    loss, _ = torch.compile(f, fullgraph=True, backend="aot_eager")(x, *args)
    loss.backward()
    y = inp["full"][:, :4].clone().requires_grad_(True)
    f(y, *args)[0].backward()
    torch.testing.assert_close(x.grad, y.grad)


def _retain_twice(be, policy_loss):
    inp = _inp(2, 4, 11, 30)
    args = (inp["tokens"], inp["old"], inp["adv"], inp["mask"])
    x0 = inp["full"][:, :4].clone().requires_grad_(True)
    pk.ppo_loss(x0, *args, policy_loss=policy_loss, backend=be.name)[0].backward()
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, _ = pk.ppo_loss(x, *args, policy_loss=policy_loss, backend=be.name)
    (loss * 2).backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(x.grad, 3 * x0.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy_loss", TOKEN_LOSSES)
def test_retain_graph_different_grad_outputs_torch(policy_loss):
    _retain_twice(TORCH, policy_loss)


# fixed: fused path, retain_graph: the saved dlogits becomes leaf.grad without a copy, and the
#   second backward rescales it in place: (2 * loss).backward(retain_graph=True); loss.backward()
#   gives 2x, not 3x
@pytest.mark.parametrize("be", KERNEL_BES)
@pytest.mark.parametrize("policy_loss", TOKEN_LOSSES)
def test_retain_graph_different_grad_outputs_kernels(be, policy_loss):
    _retain_twice(be, policy_loss)


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# fixed: two-phase path under no_grad: `if logits.requires_grad` (_two_phase.py) still runs
#   token_logprobs_bwd, a second pass over the logits and an [N, V] gradient nobody can use
@pytest.mark.parametrize("be", KERNEL_BES)
@pytest.mark.parametrize("kw", [dict(policy_loss="gspo"), dict(policy_loss="gspo-token"),
                                dict(off_policy_mask_threshold=0.05)],
                         ids=["gspo", "gspo-token", "off-policy-mask"])
def test_no_grad_sequence_loss_skips_the_gradient_pass(be, kw):
    inp = _inp(2, 4, 11, 31)
    x = inp["full"][:, :4].clone().requires_grad_(True)
    with torch.no_grad(), _RecordOps() as rec:
        pk.ppo_loss(x, inp["tokens"], inp["old"], inp["adv"], inp["mask"], backend=be.name,
                    **kw)
    assert not [op for op in rec.ops if "token_logprobs_bwd" in op]


# fixed: inplace_backward=True with gspo / gspo-token: the kernel backends raise ValueError, the
#   torch backend (and the docstring: 'gspo and gspo-token allocate as usual') accept it
@pytest.mark.parametrize("be", KERNEL_BES)
@pytest.mark.parametrize("policy_loss", ["gspo", "gspo-token"])
def test_inplace_backward_sequence_losses_agree_with_torch(be, policy_loss):
    inp = _inp(2, 4, 11, 32)
    args = (inp["tokens"], inp["old"], inp["adv"], inp["mask"])

    def run(backend):
        leaf = inp["full"][:, :4].clone().requires_grad_(True)
        try:
            loss, _ = pk.ppo_loss(leaf * 1, *args, policy_loss=policy_loss,
                                  inplace_backward=True, backend=backend)
        except ValueError:
            return "ValueError"
        loss.backward()
        return leaf.grad

    got, want = run(be.name), run("torch")
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def _grad_scale_run(be, grad_scale, dtype=torch.float32, logits=None, adv=None):
    """(dlogits of loss.backward() with the grad_scale hint, the reference's), or "raised"
    for a ValueError naming grad_scale at the call."""
    inp = _inp(2, 4, 11, 33)
    x = (inp["full"][:, :4] if logits is None else logits).to(dtype)
    adv = inp["adv"] if adv is None else adv
    tok = inp["tokens"] if logits is None else torch.zeros(x.shape[:2], dtype=torch.long)
    mask = inp["mask"] if logits is None else None
    leaf = x.clone().requires_grad_(True)
    try:
        loss, _ = pk.ppo_loss(leaf, tok, None, adv, mask, loss_agg_mode="token-sum",
                              grad_scale=grad_scale, backend=be.name)
    except ValueError as e:
        assert "grad_scale" in str(e)
        return "raised", None
    loss.backward()
    _, _, e_grad = R.ppo_loss(x.double(), tok, None, adv, mask, loss_agg_mode="token-sum")
    return leaf.grad, e_grad


@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("grad_scale", [1e-30, 0.125, 1e30])
def test_grad_scale_is_only_a_hint(be, grad_scale):
    got, want = _grad_scale_run(be, grad_scale)
    assert np.abs(_np(got) - want).max() <= 3e-6 * np.abs(want).max()


@pytest.mark.parametrize("grad_scale", [1e-50, 1e50])
def test_grad_scale_outside_float32_torch(grad_scale):
    got, want = _grad_scale_run(TORCH,
                                grad_scale)
    assert isinstance(got, str) or np.abs(_np(got) - want).max() <= 3e-6 * np.abs(want).max()


# fixed: grad_scale outside float32's range (1e-50 -> 0, 1e50 -> inf) is accepted; the kernel
#   backends then give NaN or a RuntimeError at backward instead of a ValueError naming grad_scale
@pytest.mark.parametrize("be", KERNEL_BES)
@pytest.mark.parametrize("grad_scale", [1e-50, 1e50])
def test_grad_scale_outside_float32_kernels(be, grad_scale):
    got, want = _grad_scale_run(be, grad_scale)
    assert isinstance(got, str) or np.abs(_np(got) - want).max() <= 3e-6 * np.abs(want).max()


def _fp16_big_grad_inputs():
    x = torch.zeros(1, 1, 2)
    x[0, 0, 1] = 3.0
    return x, torch.tensor([[3.0]])  # d loss / d logits ~ 2.86: times 2^16 overflows fp16


def test_fp16_grad_scale_torch():
    x, adv = _fp16_big_grad_inputs()
    got, want = _grad_scale_run(TORCH,
                                2.0 ** 16, torch.float16, x, adv)
    assert np.abs(_np(got) - want).max() <= 1e-2 * np.abs(want).max()


# fixed: float16 logits with grad_scale=2**16 (a GradScaler scale) then loss.backward(): dlogits
#   are written pre-scaled in float16, overflow to inf, and stay inf after the rescale
@pytest.mark.parametrize("be", KERNEL_BES)
def test_fp16_grad_scale_kernels(be):
    x, adv = _fp16_big_grad_inputs()
    got, want = _grad_scale_run(be, 2.0 ** 16, torch.float16, x, adv)
    assert torch.isfinite(got).all()
    assert np.abs(_np(got) - want).max() <= 1e-2 * np.abs(want).max()


# fixed: sapo_tau_pos/neg outside float32's range are accepted (1e-40: 4 / tau = inf -> -inf loss
#   and NaN gradient; 1e39: RuntimeError 'cannot be converted to type float') instead of a
#   ValueError naming them
@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("tau", [1e-40, 1e39])
def test_sapo_tau_outside_float32(be, tau):
    inp = _inp(2, 3, 5, 34)
    x = inp["full"][:, :3].clone().requires_grad_(True)
    try:
        loss, _ = pk.ppo_loss(x, inp["tokens"], None, inp["adv"], inp["mask"],
                              policy_loss="sapo", sapo_tau_pos=tau, sapo_tau_neg=tau,
                              backend=be.name)
    except ValueError as e:
        assert "sapo_tau" in str(e)
        return
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


# fixed: global_num_tokens / global_num_seqs as a Python number below float32's range (1e-50) is
#   accepted and gives a NaN loss; the same value as a tensor is rejected (ValueError)
@pytest.mark.parametrize("be", BES)
@pytest.mark.parametrize("name,agg", [("global_num_tokens", "token-mean"),
                                      ("global_num_seqs", "seq-mean-token-sum")])
def test_global_count_number_underflowing_float32(be, name, agg):
    inp = _inp(2, 3, 5, 35)
    try:
        loss, _ = pk.ppo_loss(inp["full"][:, :3], inp["tokens"], inp["old"], inp["adv"],
                              inp["mask"], loss_agg_mode=agg, backend=be.name, **{name: 1e-50})
    except ValueError as e:
        assert name in str(e)
        return
    assert torch.isfinite(loss)
