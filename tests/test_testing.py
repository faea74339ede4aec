"""Tests of ppo_kernels.testing, the CI user's tools: the user's own CI file
(examples/user_ci/test_my_config.py) passes when run from a folder outside the checkout;
the reference behind ppo_loss's signature agrees with reference.py in every layout; the
input makers draw what they say; the assert helpers fail on a wrong result; gradcheck
knows the stop-gradient options."""

import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as ref
from ppo_kernels import testing

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_user_ci_file_passes_outside_the_checkout(tmp_path):
    src = REPO / "examples" / "user_ci" / "test_my_config.py"
    (tmp_path / src.name).write_text(src.read_text())
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("PYTEST_ADDOPTS", None)
    where = subprocess.run([sys.executable, "-c", "import ppo_kernels; print(ppo_kernels.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert pathlib.Path(where.stdout.strip()).resolve() == REPO / "ppo_kernels" / "__init__.py"
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          src.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    print(f"user CI file: {time.perf_counter() - t0:.1f} s")  # (reported, not asserted)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_reference_has_the_ops_signature_and_agrees_with_reference_py():
    b = testing.make_batch(2, 4, 9, seed=1)
    kw = dict(policy_loss="vanilla", dual_clip_c=3.0, kl_coef=0.1, entropy_coef=0.01,
              backend="cpu", grad_scale=0.5, inplace_backward=True)
    got = testing.reference_ppo_loss(b["logits"], b["tokens"], b["old_logprobs"],
                                     b["advantages"], b["response_mask"], b["ref_logprobs"],
                                     **kw)
    m = b["response_mask"]
    e_loss, e_met, e_grad = ref.ppo_loss(b["logits"], torch.where(m, b["tokens"], 0),
                                         b["old_logprobs"], b["advantages"], m,
                                         b["ref_logprobs"], dual_clip_c=3.0, kl_coef=0.1,
                                         entropy_coef=0.01)
    assert got.loss.dtype == torch.float64 and float(got.loss) == e_loss
    assert set(got.metrics) == set(e_met)
    np.testing.assert_array_equal(got.grad.numpy(), e_grad)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm", "none"])
def test_reference_packed_and_flat_layouts_match_the_op(agg):
    """Packed rows (cu_seqlens, an empty sequence among them) and flat [N, V] logits: the
    reference and the cpu op agree (assert_matches_reference with the batch given)."""
    packed = testing.make_batch(3, 4, 7, kind="packed", seed=2)
    assert int(packed["cu_seqlens"][-1]) == packed["logits"].shape[0]
    testing.assert_matches_reference(dict(loss_agg_mode=agg, policy_loss="gspo"),
                                     batch=packed)
    flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in testing.make_batch(2, 3, 7).items()}
    testing.assert_matches_reference(dict(loss_agg_mode=agg), batch=flat)


def test_make_batch_draws_what_it_says():
    def lp(b):
        m = b["response_mask"]
        return torch.from_numpy(ref.token_logprobs(b["logits"].double(),
                                                   torch.where(m, b["tokens"], 0), m)[0]), m
    c = testing.make_batch(3, 5, 11, kind="confident")
    logp, m = lp(c)
    assert (-logp[m] < 1e-2).all() and (-logp[m] < 1e-8).any() and (-logp[m] > 0).all()
    t = testing.make_batch(3, 5, 11, kind="ties")
    x, tok, m = t["logits"], t["tokens"], t["response_mask"]
    top = x.gather(2, torch.where(m, tok, 0)[..., None])[..., 0]
    assert ((x == top[..., None]).sum(-1)[m] >= 1).all() and len(torch.unique(x)) == 3
    tiny = testing.make_batch(3, 5, 11, kind="tiny_ratio")
    logp, m = lp(tiny)
    d = (logp - tiny["old_logprobs"].double())[m].abs()
    assert (d < 2e-4).all()
    huge = testing.make_batch(3, 5, 11, kind="huge_ratio")
    logp, m = lp(huge)
    assert ((logp - huge["old_logprobs"].double())[m].abs() > 20).any()
    e = testing.make_batch(3, 5, 11, kind="empty")
    assert (~e["response_mask"].any(1)).any()
    with pytest.raises(ValueError, match="kind"):
        testing.make_batch(kind="nope")


def test_assert_matches_reference_catches_a_wrong_result(monkeypatch):
    testing.assert_matches_reference(dict(kl_coef=0.1))
    real = pk.ppo_loss

    def off(*a, **k):
        loss, met = real(*a, **k)
        return loss * (1 + 1e-4), met

    monkeypatch.setattr(pk, "ppo_loss", off)
    with pytest.raises(AssertionError, match="loss"):
        testing.assert_matches_reference(dict(kl_coef=0.1))
    monkeypatch.setattr(pk, "ppo_loss", real)

    def off_grad(x, *a, **k):
        return real(x * 1.001, *a, **k)

    monkeypatch.setattr(pk, "ppo_loss", off_grad)
    with pytest.raises(AssertionError):
        testing.assert_matches_reference({})


def test_tolerance_table():
    assert testing.tolerance(torch.bfloat16, "cpu").grad == 1e-2
    assert testing.tolerance(torch.float64, "torch").loss == 1e-10
    # metrics are float32 whatever the logits' dtype: float64's are that rounding
    assert testing.tolerance(torch.float64, "cpu").metrics == 1e-7
    with pytest.raises(ValueError, match="backend"):
        testing.tolerance(torch.float32, "auto")


@pytest.mark.parametrize("be", ["cpu", "torch"])
def test_float64_default_batch_matches(be):
    """assert_matches_reference in float64 on its own default batch (its metrics, float32 as
    every metric, within their rounding)."""
    testing.assert_matches_reference({}, backend=be, dtype=torch.float64)


@pytest.mark.parametrize("kept", ["sampling_mask", "top_k"])
def test_reference_counts_tokens_missing_from_the_kept_set(kept):
    """reference_ppo_loss's mask_missing_token_frac: the valid tokens whose kept set lacked
    them (before with_token added them), as the op's metric."""
    logits = torch.tensor([[[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]]])
    tokens, old, adv = torch.tensor([[0, 0]]), torch.tensor([[-2.0, -1.0]]), \
        torch.tensor([[1.0, -1.0]])
    kw = (dict(sampling_mask=pk.SamplingMask(torch.tensor([2, 0]), torch.tensor([0, 1, 2])))
          if kept == "sampling_mask" else dict(top_k=1))
    _, metrics = pk.ppo_loss(logits, tokens, old, adv, backend="cpu", **kw)
    ref = testing.reference_ppo_loss(logits, tokens, old, adv, **kw)
    assert float(metrics["mask_missing_token_frac"]) == 0.5  # the first row's token only
    assert float(ref.metrics["mask_missing_token_frac"]) == 0.5


def test_reference_bad_options():
    b = testing.make_batch()
    args = (b["logits"], b["tokens"], b["old_logprobs"], b["advantages"])
    with pytest.raises(TypeError, match="whiten"):
        testing.reference_ppo_loss(*args, whiten=True)
    with pytest.raises(ValueError, match="tp_group"):
        testing.reference_ppo_loss(*args, tp_group=object())


@pytest.mark.parametrize("options,rows", [
    (dict(), 0), (dict(policy_loss="gspo"), 0), (dict(old_logprobs=None), 1),
    (dict(policy_loss="cispo"), 1), (dict(policy_loss="vespo"), 1),
    (dict(kl_coef=0.1, kl_estimator="k3+"), 1),
    (dict(old_logprobs=None, kl_coef=0.1, kl_estimator="k1+"), 2)])
def test_gradcheck_knows_the_stop_gradient_options(options, rows):
    assert len(testing.gradcheck(options)) == rows


@pytest.mark.parametrize("options", [dict(policy_loss="cispo"), dict(old_logprobs=None),
                                     dict(kl_coef=0.3, kl_estimator="k3+")])
def test_plain_autograd_gradcheck_fails_for_stop_gradient_options(options):
    """Why gradcheck() needs the table: finite differences of the loss's value are not its
    gradient under these options."""
    b = testing.make_batch(2, 3, 5, dtype=torch.float64)
    args, kw = testing._call_kwargs(b, options)
    f = lambda x: pk.ppo_loss(x, *args[1:], backend="cpu", **kw)[0]  # noqa: E731
    assert not torch.autograd.gradcheck(f, (args[0].clone().requires_grad_(True),),
                                        eps=1e-6, atol=1e-7, raise_exception=False)


def test_strategies_draw_valid_options():
    hyp = pytest.importorskip("hypothesis")

    @hyp.settings(max_examples=15, deadline=None, derandomize=True, database=None)
    @hyp.given(testing.loss_options(), testing.batches(max_B=2, max_T=3, max_V=5))
    def check(options, batch):
        pk.LossSpec.build(**options)
        args, kw = testing._call_kwargs(batch, options)
        pk.ppo_loss(*args, backend="cpu", **kw)

    check()
