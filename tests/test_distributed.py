"""Tests of ppo_kernels/distributed.py (reduce_metrics) and of the parallel paths together
(vocab_parallel.py, context_parallel.py): data, tensor (vocabulary), TP x DP and context
parallel on torch.distributed's gloo backend with 2, 3 and 4 processes
(tests/distributed_cases.py), every op against the single-process result (loss, metrics,
every gradient), float32 and bfloat16, uneven splits; one launch per world size, each
check its own test. In this process: the parallel arguments' errors without
torch.distributed and reduce_metrics' bad arguments, and a 1-process gloo group with
cp_group, tp_group or DTensor logits giving the plain op's results."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import distributed_cases as cases
import ppo_kernels as pk

from helpers.asserts import raises_naming
from helpers.inputs import PK_CU, PK_H, PK_S, PK_V, packed_batch
from helpers.ranks import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def _launch(world, out_dir):
    return run_ranks(os.path.join(HERE, "distributed_cases.py"), out_dir, n=world, timeout=600)


@pytest.fixture(scope="module", params=sorted(cases.SUITES))
def world_results(request, tmp_path_factory):
    world = request.param
    return world, _launch(world, tmp_path_factory.mktemp(f"world{world}"))


def test_every_check_within_tolerance(world_results):
    world, results = world_results
    failures = []
    for rank, res in enumerate(results):
        assert res, f"rank {rank} reported no checks"
        for name, val in res.items():
            if isinstance(val, str):
                failures.append(f"rank {rank} {name}: {val[-2000:]}")
            elif not val[0] <= val[1]:
                failures.append(f"rank {rank} {name}: error {val[0]:.3g} > tolerance {val[1]}")
    assert not failures, f"{len(failures)} of {sum(map(len, results))} failed:\n" + \
        "\n".join(failures[:30])


def test_every_suite_ran(world_results):
    """Each suite's checks are present on every rank (a suite that stopped early would
    report fewer)."""
    world, results = world_results
    prefixes = {"tp_checks": "tp/", "dtensor_checks": "dtensor/", "dp_checks": "dp/ppo_loss",
                "dp_from_hidden_checks": "dp/ppo_loss_from_hidden", "cp_checks": "cp/",
                "tp_dp_checks": "tp_x_dp/", "cp_dp_checks": "cp_x_dp/",
                "tp_packed_checks": "tp_packed/", "low_precision_checks": "dp/bfloat16",
                "temperature_checks": "temperature/"}
    for fn in cases.SUITES[world]:
        for rank, res in enumerate(results):
            n = sum(k.startswith(prefixes[fn.__name__]) for k in res)
            assert n >= 3, f"world {world}, rank {rank}: {fn.__name__} gave {n} checks"
    # the replicated results of tensor parallel are the same on every rank
    assert len({len(r) for r in results}) == 1


def test_split_is_uneven():
    """The splits the cases use are uneven for 2, 3 and 4 ranks (V = 53, B = 7, T = 9)."""
    for world in (2, 3, 4):
        for n in (53, 7, 9):
            sizes = [b - a for a, b in (cases.split(n, world, r) for r in range(world))]
            assert sum(sizes) == n and min(sizes) >= 1
        assert len({b - a for a, b in (cases.split(53, world, r) for r in range(world))}) > 1


# ------------------------------------------------------------------ bad arguments
# In this process.

def test_tp_and_cp_group_without_torch_distributed():
    """tp_group / cp_group (any object) and reduce_metrics without torch.distributed
    initialised: errors naming tp_group / cp_group / group."""
    assert not dist.is_initialized()
    d = packed_batch()
    grp = object()  # anything: torch.distributed is not even initialised
    lg = d["logits"][None]
    tok, old, adv, m = d["tokens"][None], d["old"][None], d["adv"][None], d["mask"][None]
    raises_naming(lambda: pk.ppo_loss(lg, tok, old, adv, m, tp_group=grp), "tp_group")
    raises_naming(lambda: pk.token_logprobs(lg, tok, tp_group=grp), "tp_group")
    raises_naming(lambda: pk.score_rollout(lg, tok, old, old, torch.randn(1), m, kl_coef=0.1,
                                           tp_group=grp), "tp_group")
    raises_naming(lambda: pk.ppo_loss_from_hidden(d["hidden"][None], d["weight"], tok, old, adv, m,
                                                  tp_group=grp), "tp_group")
    raises_naming(lambda: pk.ppo_loss(lg, tok, old, adv, m, cp_group=grp), "cp_group")
    raises_naming(lambda: pk.ppo_loss(lg, tok, old, adv, m, cp_group=grp, policy_loss="gspo"),
                  "cp_group")
    raises_naming(lambda: pk.ppo_loss_from_hidden(d["hidden"][None], d["weight"], tok, old, adv, m,
                                                  cp_group=grp), "cp_group")
    _, metrics = pk.ppo_loss(lg, tok, old, adv, m)
    raises_naming(lambda: pk.distributed.reduce_metrics(metrics), "group")


def test_reduce_metrics_bad_arguments(group1):
    """reduce_metrics of what is not ppo_loss's metrics (a partial dict, a list): an
    error naming metrics; with a world of one, the reduced metrics are the metrics."""
    d = packed_batch()
    _, metrics = pk.ppo_loss(d["logits"], d["tokens"], d["old"], d["adv"], d["mask"])
    raises_naming(lambda: pk.distributed.reduce_metrics({"clip_frac": torch.tensor(0.0)}),
                  "metrics")
    raises_naming(lambda: pk.distributed.reduce_metrics([metrics]), "metrics")
    # with a world of one, the reduced metrics are the metrics
    out = pk.distributed.reduce_metrics(metrics, cp_group=group1)
    assert set(out) == set(metrics)
    for k in metrics:
        assert torch.equal(out[k], metrics[k].float()), k


def test_reduce_metrics_cp_group_not_a_group(group1):
    """cp_group that is not a process group: an error naming cp_group (not an
    AttributeError from inside torch.distributed)."""
    d = packed_batch()
    _, metrics = pk.ppo_loss(d["logits"], d["tokens"], d["old"], d["adv"], d["mask"])
    raises_naming(lambda: pk.distributed.reduce_metrics(metrics, cp_group="x"), "cp_group")


# ------------------------------------------------------------------ a world of one
# In this process, on a 1-process gloo group: cp_group, tp_group and DTensor logits give the
# plain op's results.

def _close(a, b, what="", rel=5e-7):
    """Within a few float32 roundings of the largest entry."""
    assert a.shape == b.shape, what
    assert torch.isfinite(a).all(), what
    e = float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)
    assert e <= rel, (what, e)


def _loss_run(fn, logits, mode):
    x = logits.clone().requires_grad_()
    loss, metrics = fn(x)
    w = torch.linspace(-1, 1, loss.numel()).reshape(loss.shape)
    (loss * w if mode == "none" else loss).sum().backward()
    return loss.detach(), metrics, x.grad


def _batch3(seed=3, B=3, T=5):
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(B, T, PK_V, generator=g) * 3
    tok = torch.randint(0, PK_V, (B, T), generator=g)
    lg[0, 0, tok[0, 0]] = 40.0  # a confident token
    mask = torch.rand(B, T, generator=g) > 0.2
    old = torch.randn(B, T, generator=g) * 0.3 - 2.5
    roll = old + 0.1 * torch.randn(B, T, generator=g)
    return lg, tok, mask, old, roll, torch.randn(B, generator=g)


@pytest.mark.parametrize("policy", ["vanilla", "cispo", "sapo", "gspo", "gspo-token",
                                    "dppo-tv", "vespo"])
def test_world_of_one_equals_the_plain_op(group1, policy):
    """A 1-process group: cp_group gives the plain op's loss and gradient bit for bit, and
    its metrics bit for bit on the eager composite, within float32 rounding on the cpu
    backend (whose metrics op sums in float64, where the group's metrics are torch's
    float32 sums across ranks); tp_group the same where it runs the same path (the
    sequence-level losses, "none", token_logprobs), and within a few float32 roundings where
    it swaps the fused single pass for the two-phase path. On the cpu backend cp_group's
    GSPO middle is the eager formulas (its sequence sums cross the group) where the plain
    op's is one C++ op (_two_phase.fused_middle): its gradient within float32 rounding."""
    lg, tok, mask, old, roll, adv = _batch3()
    opts = dict(policy_loss=policy, entropy_coef=0.01, rollout_logprobs=roll,
                rollout_correction="tis-seq", rollout_is_threshold=(0.5, 2.0))
    if policy == "cispo":
        opts.update(clip_eps_low=1.0, clip_eps_high=4.0)
    if policy == "dppo-tv":
        opts.update(clip_eps_low=0.005, clip_eps_high=0.01)
    if policy == "vespo":  # (VESPO refuses a rollout correction: TRL folds it)
        opts.update(rollout_correction=None)
    for mode in ("token-mean", "seq-mean-token-mean", "none"):
        for be in ("cpu", "torch"):
            def plain(x, **kw):
                return pk.ppo_loss(x, tok, old, adv, mask, loss_agg_mode=mode, backend=be,
                                   **opts, **kw)
            ref = _loss_run(plain, lg, mode)
            cp = _loss_run(lambda x: plain(x, cp_group=group1), lg, mode)
            if be == "cpu" and policy in ("gspo", "gspo-token") and mode != "none":
                _close(cp[0], ref[0], (mode, be), rel=5e-7)
                _close(cp[2], ref[2], (mode, be), rel=5e-7)
            else:
                assert torch.equal(cp[0], ref[0]), (mode, be)
                assert torch.equal(cp[2], ref[2]), (mode, be)
            for k in ref[1]:
                if be == "torch":
                    assert torch.equal(cp[1][k], ref[1][k]), (mode, be, k)
                else:
                    torch.testing.assert_close(cp[1][k], ref[1][k], rtol=1e-6, atol=1e-7,
                                               msg=lambda m: f"{mode} {be} {k}: {m}")
            if be == "torch":
                continue
            tp = _loss_run(lambda x: plain(x, tp_group=group1), lg, mode)
            tpv = _loss_run(lambda x: plain(x, tp_group=group1, vocab_start=0), lg, mode)
            exact = policy in ("gspo", "gspo-token") or mode == "none"
            for got in (tp, tpv):
                for a, b, what in ((got[0], ref[0], "loss"), (got[2], ref[2], "dlogits")):
                    if exact:
                        assert torch.equal(a, b), (mode, what)
                    else:
                        # dppo's value -w A logp sums terms of size |A logp| ~ 2.5 into a
                        # loss ~10x smaller: float32 rounding relative to the loss is larger
                        _close(a, b, (mode, what),
                               rel=5e-6 if policy == "dppo-tv" and what == "loss" else 5e-7)
                for k in ref[1]:
                    assert torch.equal(got[1][k], ref[1][k]), (mode, k)


def test_world_of_one_other_ops(group1):
    """A 1-process group: token_logprobs, score_rollout, DTensor logits, packed
    sequences with tp_group and cp_group, and ppo_loss_from_hidden with tp_group / cp_group
    give the plain op's results (within a few float32 roundings where the path changes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    lg, tok, mask, old, roll, adv = _batch3(seed=4)
    lp, en = pk.token_logprobs(lg, tok, mask, return_entropy=True)
    lq, eq = pk.token_logprobs(lg, tok, mask, return_entropy=True, tp_group=group1)
    assert torch.equal(lp, lq)
    _close(eq, en)  # (the merge's entropy of a mixture of one shard: w = 1 up to rounding)
    ro = pk.score_rollout(lg, tok, old, roll, adv, mask, kl_coef=0.1)
    rq = pk.score_rollout(lg, tok, old, roll, adv, mask, kl_coef=0.1, tp_group=group1)
    for f, a, b in zip(ro._fields, rq, ro):
        _close(a, b, f)
    mesh = init_device_mesh("cpu", (1,))
    dt = distribute_tensor(lg.clone(), mesh, [Shard(-1)]).requires_grad_()
    ref = _loss_run(lambda x: pk.ppo_loss(x, tok, old, adv, mask, policy_loss="gspo"), lg,
                    "token-mean")
    ld, md = pk.ppo_loss(dt, tok, old, adv, mask, policy_loss="gspo")
    ld.backward()
    assert torch.equal(ld.detach(), ref[0])
    assert torch.equal(dt.grad.full_tensor(), ref[2])
    # packed sequences with a split vocabulary of one rank
    d = packed_batch(seed=5)
    for pl in ("vanilla", "gspo"):
        def packed(x, **kw):
            return pk.ppo_loss(x, d["tokens"], d["old"], d["adv"][:PK_S], d["mask"],
                               cu_seqlens=PK_CU, policy_loss=pl, **kw)
        a = _loss_run(packed, d["logits"], "token-mean")
        b = _loss_run(lambda x: packed(x, tp_group=group1, cp_group=group1), d["logits"],
                      "token-mean")
        _close(b[0], a[0], "packed loss")
        _close(b[2], a[2], "packed dlogits")
    # from hidden states
    h = torch.randn(3, 5, PK_H)
    w = torch.randn(PK_V, PK_H)
    for pl in ("vanilla", "gspo"):
        outs = []
        for kw in ({}, dict(tp_group=group1), dict(cp_group=group1)):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            loss, _ = pk.ppo_loss_from_hidden(hh, ww, tok, old, adv, mask, policy_loss=pl,
                                              **kw)
            loss.backward()
            outs.append((loss.detach(), hh.grad, ww.grad))
        for got in outs[1:]:
            for a, b, what in zip(got, outs[0], ("loss", "dhidden", "dW")):
                _close(a, b, what)
