"""distill_loss over a tensor-parallel vocabulary (ppo_kernels/distill_tp.py): 2 gloo
processes (tests/distill_rank_cases.py) against the single-process loss, metrics and
gradients on the whole vocabulary; bad inputs a ValueError on every rank; one-process
groups for gradcheck and the argument checks."""

import os

import pytest
import torch

import ppo_kernels as pk

from helpers.asserts import raises_naming
from helpers.inputs import make_teacher
from helpers.ranks import run_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distill_rank_cases.py")
    return run_ranks(script, tmp_path_factory.mktemp("dtp2"))


def _errors(ranks, case):
    out = []
    for r, res in enumerate(ranks):
        v = res[case]
        assert isinstance(v, list), f"rank {r}, {case}: {v}"
        out.append(v)
    return out


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float64", 1e-13)])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "none"])
def test_uneven_split_matches_single_process(ranks, dtype, tol, tail, mode):
    for errs in _errors(ranks, f"uneven/{dtype}/tail={tail}/{mode}"):
        *rel, grad_max = errs
        assert max(rel) < tol, rel  # loss, 5 metrics, this rank's gradient
        assert grad_max > 1e-3  # the shard's gradient is not all zero


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float64", 1e-13)])
def test_even_split_raw_output(ranks, dtype, tol):
    for loss_err, grad_err, last in _errors(ranks, f"even_raw/{dtype}"):
        assert loss_err < tol and grad_err < tol
        assert last == 0.0  # the raw output's last position gets no gradient


def test_dtensor_shard_of_the_vocabulary(ranks):
    for errs in _errors(ranks, "dtensor"):
        assert max(errs) < 1e-6, errs


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-6), ("float64", 1e-13)])
@pytest.mark.parametrize("cap", [None, 4.0])
def test_from_hidden_head_rows_split(ranks, dtype, tol, cap):
    for errs in _errors(ranks, f"hidden/{dtype}/cap={cap}"):
        assert max(errs) < tol, errs  # loss, d hidden, d weight rows, d bias rows


def test_bfloat16_logits(ranks):
    for loss_err, *metric_errs, grad_err, grad_max in _errors(ranks, "bf16"):
        assert loss_err < 1e-5 and max(metric_errs) < 1e-5
        assert grad_err < 1e-2 and grad_max > 1e-3  # (the gradient rounds to bf16)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_sequences(ranks, mode):
    for *rel, grad_max in _errors(ranks, f"packed/{mode}"):
        assert max(rel) < 1e-13 and grad_max > 1e-3, rel


def test_random_splits_float64(ranks):
    for r, res in enumerate(ranks):
        worst = res["random_splits"]
        assert isinstance(worst, float) and worst < 1e-12, (r, worst)


def test_float32_next_to_the_kernel_against_float64(ranks):
    """Confident rows and tiny kls at V = 1000: the split's error against float64 is the
    single-process float32 kernel's (within a factor 2 and float32 rounding). The gradient
    p - q, p = exp(x - lse), takes a few float32 roundings on either path, and which path is
    luckier depends on the CPU capability's summation order (AVX-512: 1.2e-7 split vs 5e-8
    kernel; AVX2: 3.8e-7 vs 1.3e-7): so at most twice the kernel's error or 8 float32 ulps
    relative, whichever is larger."""
    eps32 = torch.finfo(torch.float32).eps
    for kern_abs, tp_abs, kern_grad, tp_grad in _errors(ranks, "confident"):
        assert tp_abs <= 2 * kern_abs + 1e-7, (tp_abs, kern_abs)
        assert tp_grad <= max(2 * kern_grad, 8 * eps32), (tp_grad, kern_grad)
        assert kern_grad <= 8 * eps32, kern_grad  # the kernel itself: float32 rounding


def test_from_hidden_per_token(ranks):
    for errs in _errors(ranks, "hidden/none"):
        assert max(errs) < 1e-13, errs


@pytest.mark.parametrize("case,name", [
    ("bad/id_outside", "teacher.token_ids"), ("bad/negative_id", "teacher.token_ids"),
    ("bad/logprob_rank1", "teacher.logprobs"), ("bad/different_ids", "teacher"),
    ("bad/different_masks", "teacher"), ("bad/overlap", "vocab_start"),
    ("bad/hidden_id_outside", "teacher.token_ids"), ("bad/hidden_head_rank1", "hidden")])
def test_bad_inputs_raise_on_every_rank(ranks, case, name):
    for r, res in enumerate(ranks):
        assert res[case].startswith("raised ValueError") and name in res[case], (r, res[case])
    assert all(res["after"] == 2.0 for res in ranks)  # the group still works afterwards


def test_one_rank_group_matches_and_gradchecks(group1, gen):
    n, v = 6, 7
    x = torch.randn(2, 3, v, generator=gen, dtype=torch.float64)
    te = make_teacher(n, v, gen, dtype=torch.float64)
    for tail in (True, False):
        for mode in ("token-mean", "none"):
            a, ma = pk.distill_loss(x, te, tail=tail, loss_agg_mode=mode, backend="cpu")
            b, mb = pk.distill_loss(x, te, tail=tail, loss_agg_mode=mode, tp_group=group1)
            torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-14)
            for k in ma:
                torch.testing.assert_close(mb[k], ma[k], rtol=1e-13, atol=1e-14)
        assert torch.autograd.gradcheck(
            lambda z: pk.distill_loss(z, te, tail=tail, temperature=0.8, tp_group=group1)[0],
            (x.clone().requires_grad_(),))


def test_argument_checks(group1, gen):
    x = torch.randn(1, 2, 5, generator=gen)
    te = make_teacher(2, 5, gen)
    raises_naming(lambda: pk.distill_loss(x, te, tp_group=object()), "tp_group")
    raises_naming(lambda: pk.distill_loss(x, te, vocab_start=0), "vocab_start")
    raises_naming(lambda: pk.distill_loss(x, te, tp_group=group1, vocab_start=-1),
                  "vocab_start")
    # a one-rank group holding [2, 7) of an id 0: no shard holds it
    bad = pk.SparseLogprobs(torch.tensor([0, 1]), torch.tensor([0, 1, 2]),
                            torch.tensor([-1.0, -1.0]))
    raises_naming(lambda: pk.distill_loss(x, bad, tp_group=group1, vocab_start=2),
                  "vocab_start")
