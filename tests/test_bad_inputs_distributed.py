"""Bad inputs of the packed-sequence (cu_seqlens / max_seqlen), tensor-parallel
(tp_group / vocab_start / DTensor) and context-parallel (cp_group) arguments, and
pk.distributed.reduce_metrics: each must be a ValueError or TypeError whose message names
the argument, never a crash, an AttributeError / IndexError or a silent result.

A 1-process gloo group (world size 1) also checks that tp_group / cp_group / a DTensor
give the plain op's results. The last tests launch 2 gloo processes (a script written to a
temporary folder) for what needs a vocabulary really split: a whole shard of -inf logits,
shards that overlap or leave a gap.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import ppo_kernels as pk

V, H = 11, 6
LENS = [3, 0, 2]  # total 5, S = 3, the longest 3
TOTAL, S = sum(LENS), len(LENS)
CU = torch.tensor([0, 3, 3, 5], dtype=torch.int32)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def group1():
    """A 1-process gloo group, destroyed after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", world_size=1, rank=0,
                            init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def _raises(fn, name, types=(ValueError, TypeError)):
    """fn() raises one of types (exactly those, not a subclass such as IndexError: the
    exception's type must be ValueError or TypeError) naming ``name``."""
    with pytest.raises(Exception) as info:
        fn()
    e = info.value
    assert type(e) in types, f"expected ValueError / TypeError naming {name!r}, got " \
                             f"{type(e).__name__}: {e}"
    assert name in str(e), f"the message does not name {name!r}: {e}"
    return e


def _data(seed=0, total=TOTAL):
    g = torch.Generator().manual_seed(seed)
    return dict(
        logits=torch.randn(total, V, generator=g),
        tokens=torch.randint(0, V, (total,), generator=g),
        old=torch.randn(total, generator=g) * 0.3 - 2.0,
        adv=torch.randn(total, generator=g),
        mask=torch.rand(total, generator=g) > 0.2,
        values=torch.randn(total, generator=g),
        hidden=torch.randn(total, H, generator=g),
        weight=torch.randn(V, H, generator=g),
        scores=torch.randn(S, generator=g),
    )


def _packed_ops(d):
    """name -> f(**packing kwargs): every op that takes cu_seqlens, on the packed batch."""
    return {
        "ppo_loss-cpu": lambda **kw: pk.ppo_loss(d["logits"], d["tokens"], d["old"], d["adv"],
                                                 d["mask"], backend="cpu", **kw),
        "ppo_loss-torch-gspo": lambda **kw: pk.ppo_loss(
            d["logits"], d["tokens"], d["old"], d["adv"], d["mask"], policy_loss="gspo",
            backend="torch", **kw),
        "ppo_loss_from_hidden": lambda **kw: pk.ppo_loss_from_hidden(
            d["hidden"], d["weight"], d["tokens"], d["old"], d["adv"], d["mask"], **kw),
        "score_rollout": lambda **kw: pk.score_rollout(
            d["logits"], d["tokens"], d["old"], d["values"], d["scores"], d["mask"],
            kl_coef=0.1, **kw),
        "gae": lambda **kw: pk.gae(d["adv"], d["values"], d["mask"], **kw),
        "kl_penalized_rewards": lambda **kw: pk.kl_penalized_rewards(
            d["scores"], d["old"], d["values"], d["mask"], kl_coef=0.1, **kw),
        "whiten": lambda **kw: pk.whiten(d["adv"], d["mask"], **kw),
    }


OPS = sorted(_packed_ops(_data()))


def test_the_packed_batch_is_fine():
    """The good batch the bad inputs below start from runs on every op."""
    for name, op in _packed_ops(_data()).items():
        op(cu_seqlens=CU)
        op(cu_seqlens=CU.long(), max_seqlen=3)
        op(cu_seqlens=CU, max_seqlen=7)


BAD_CU = {
    "float": torch.tensor([0.0, 3.0, 3.0, 5.0]),
    "bool": torch.tensor([False, True, True, True]),
    "list": [0, 3, 3, 5],
    "2-D": torch.tensor([[0, 3, 3, 5]], dtype=torch.int32),
    "2-D-column": torch.tensor([[0], [3], [3], [5]], dtype=torch.int32),
    "0-D": torch.tensor(5, dtype=torch.int32),
    "empty": torch.tensor([], dtype=torch.int32),
    "not-starting-at-0": torch.tensor([1, 3, 3, 5], dtype=torch.int32),
    "negative-start": torch.tensor([-1, 3, 3, 5], dtype=torch.int32),
    "decreasing": torch.tensor([0, 4, 3, 5], dtype=torch.int32),
    "short-of-total": torch.tensor([0, 3, 3, 4], dtype=torch.int32),
    "past-total": torch.tensor([0, 3, 3, 6], dtype=torch.int32),
    "only-zero": torch.tensor([0], dtype=torch.int32),
}


@pytest.mark.parametrize("case", sorted(BAD_CU))
@pytest.mark.parametrize("op", OPS)
def test_bad_cu_seqlens(op, case):
    fn = _packed_ops(_data())[op]
    _raises(lambda: fn(cu_seqlens=BAD_CU[case]), "cu_seqlens")
    _raises(lambda: fn(cu_seqlens=BAD_CU[case], max_seqlen=5), "cu_seqlens")


@pytest.mark.parametrize("value", [2, 0, -1, 2.5, 3.0, "3", True, torch.tensor(3)])
@pytest.mark.parametrize("op", OPS)
def test_bad_max_seqlen(op, value):
    """Shorter than the longest sequence (3), negative, not an int."""
    fn = _packed_ops(_data())[op]
    _raises(lambda: fn(cu_seqlens=CU, max_seqlen=value), "max_seqlen")


def test_max_seqlen_without_cu_seqlens():
    g = torch.Generator().manual_seed(1)
    B, T = 2, 4
    lg, tok = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    x = torch.randn(B, T, generator=g)
    m = torch.ones(B, T, dtype=torch.bool)
    calls = [
        lambda: pk.ppo_loss(lg, tok, x, x, m, max_seqlen=4),
        lambda: pk.ppo_loss_from_hidden(torch.randn(B, T, H), torch.randn(V, H), tok, x, x, m,
                                        max_seqlen=4),
        lambda: pk.score_rollout(lg, tok, x, x, torch.randn(B), m, kl_coef=0.1, max_seqlen=4),
        lambda: pk.gae(x, x, m, max_seqlen=4),
        lambda: pk.kl_penalized_rewards(torch.randn(B), x, x, m, kl_coef=0.1, max_seqlen=4),
        lambda: pk.whiten(x, m, max_seqlen=4),
    ]
    for c in calls:
        _raises(c, "max_seqlen")


def test_cu_seqlens_with_a_padded_batch():
    """[B, T] inputs with B > 1 are not a packed layout."""
    g = torch.Generator().manual_seed(2)
    B, T = 2, 4
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)  # total = B * T: still not packed
    lg, tok = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    x = torch.randn(B, T, generator=g)
    m = torch.ones(B, T, dtype=torch.bool)
    for c, name in [
        (lambda: pk.ppo_loss(lg, tok, x, x, m, cu_seqlens=cu), "tokens"),
        (lambda: pk.ppo_loss(lg, tok, x, x, m, cu_seqlens=cu, policy_loss="gspo",
                             backend="torch"), "tokens"),
        (lambda: pk.ppo_loss_from_hidden(torch.randn(B, T, H), torch.randn(V, H), tok, x, x,
                                         m, cu_seqlens=cu), "tokens"),
        (lambda: pk.score_rollout(lg, tok, x, x, torch.randn(2), m, kl_coef=0.1,
                                  cu_seqlens=cu), "tokens"),
        (lambda: pk.gae(x, x, m, cu_seqlens=cu), "rewards"),
        (lambda: pk.kl_penalized_rewards(torch.randn(2), x, x, m, kl_coef=0.1,
                                         cu_seqlens=cu), "logprobs"),
        (lambda: pk.whiten(x, m, cu_seqlens=cu), "x"),
    ]:
        e = _raises(c, name)
        assert "cu_seqlens" in str(e), e


@pytest.mark.parametrize("shape", [(S + 1,), (TOTAL + 1,), (S, 2), (1, TOTAL + 1), (S, 3),
                                   (TOTAL, 1), (2, TOTAL)])
def test_per_token_inputs_of_a_wrong_length(shape):
    """advantages, rollout_is_weights, old_logprobs, ref_logprobs, rollout_logprobs,
    response_mask of a shape neither [total], [1, total] nor (the first two) [S] / [S, 1]."""
    d = _data()
    bad = torch.randn(shape)
    base = dict(old_logprobs=d["old"], advantages=d["adv"], response_mask=d["mask"],
                cu_seqlens=CU)
    for name, extra in [("advantages", {}), ("rollout_is_weights", {}),
                        ("old_logprobs", {}), ("ref_logprobs", dict(kl_coef=0.1)),
                        ("rollout_logprobs", dict(rollout_correction="tis")),
                        ("response_mask", {})]:
        for be, pl in (("cpu", "vanilla"), ("cpu", "gspo"), ("torch", "gspo")):
            kw = dict(base, policy_loss=pl, backend=be, **extra)
            if name == "ref_logprobs" or name == "rollout_logprobs":
                kw.setdefault("ref_logprobs", d["old"])
                kw.setdefault("rollout_logprobs", d["old"])
            kw[name] = bad if name != "response_mask" else bad > 0
            _raises(lambda: pk.ppo_loss(d["logits"], d["tokens"], **kw), name)


def test_rollout_side_inputs_of_a_wrong_length():
    d = _data()
    bad = torch.randn(TOTAL + 1)
    _raises(lambda: pk.gae(d["adv"], bad, d["mask"], cu_seqlens=CU), "values")
    _raises(lambda: pk.gae(d["adv"], d["values"], d["mask"], cu_seqlens=CU,
                           bootstrap_values=torch.randn(S + 1)), "bootstrap_values")
    _raises(lambda: pk.kl_penalized_rewards(torch.randn(S + 1), d["old"], d["values"],
                                            d["mask"], kl_coef=0.1, cu_seqlens=CU), "scores")
    _raises(lambda: pk.kl_penalized_rewards(d["scores"], d["old"], bad, d["mask"],
                                            kl_coef=0.1, cu_seqlens=CU), "ref_logprobs")
    _raises(lambda: pk.score_rollout(d["logits"], d["tokens"], d["old"], d["values"],
                                     torch.randn(S - 1), d["mask"], kl_coef=0.1,
                                     cu_seqlens=CU), "scores")
    _raises(lambda: pk.score_rollout(d["logits"], d["tokens"], d["old"], bad, d["scores"],
                                     d["mask"], kl_coef=0.1, cu_seqlens=CU), "values")
    _raises(lambda: pk.whiten(d["adv"], bad > 0, cu_seqlens=CU), "response_mask")


# ------------------------------------------------------------------ tp / cp, no group


def test_vocab_start_without_tp_group():
    d = _data()
    _raises(lambda: pk.ppo_loss(d["logits"], d["tokens"], d["old"], d["adv"], vocab_start=0),
            "vocab_start")
    _raises(lambda: pk.token_logprobs(d["logits"], d["tokens"], vocab_start=3), "vocab_start")
    _raises(lambda: pk.ppo_loss_from_hidden(d["hidden"], d["weight"], d["tokens"], d["old"],
                                            d["adv"], vocab_start=0), "vocab_start")


def test_tp_and_cp_group_without_torch_distributed():
    assert not dist.is_initialized()
    d = _data()
    grp = object()  # anything: torch.distributed is not even initialised
    lg = d["logits"][None]
    tok, old, adv, m = d["tokens"][None], d["old"][None], d["adv"][None], d["mask"][None]
    _raises(lambda: pk.ppo_loss(lg, tok, old, adv, m, tp_group=grp), "tp_group")
    _raises(lambda: pk.token_logprobs(lg, tok, tp_group=grp), "tp_group")
    _raises(lambda: pk.score_rollout(lg, tok, old, old, torch.randn(1), m, kl_coef=0.1,
                                     tp_group=grp), "tp_group")
    _raises(lambda: pk.ppo_loss_from_hidden(d["hidden"][None], d["weight"], tok, old, adv, m,
                                            tp_group=grp), "tp_group")
    _raises(lambda: pk.ppo_loss(lg, tok, old, adv, m, cp_group=grp), "cp_group")
    _raises(lambda: pk.ppo_loss(lg, tok, old, adv, m, cp_group=grp, policy_loss="gspo"),
            "cp_group")
    _raises(lambda: pk.ppo_loss_from_hidden(d["hidden"][None], d["weight"], tok, old, adv, m,
                                            cp_group=grp), "cp_group")
    _, metrics = pk.ppo_loss(lg, tok, old, adv, m)
    _raises(lambda: pk.distributed.reduce_metrics(metrics), "group")


# ------------------------------------------------------------------ 1-process group


def test_tp_group_with_the_torch_backend(group1):
    d = _data()
    lg, tok = d["logits"][None], d["tokens"][None]
    old, adv, m = d["old"][None], d["adv"][None], d["mask"][None]
    for pl in ("vanilla", "gspo"):
        _raises(lambda: pk.ppo_loss(lg, tok, old, adv, m, tp_group=group1, policy_loss=pl,
                                    backend="torch"), "backend")
    _raises(lambda: pk.token_logprobs(lg, tok, tp_group=group1, backend="torch"), "backend")
    _raises(lambda: pk.score_rollout(lg, tok, old, old, torch.randn(1), m, kl_coef=0.1,
                                     tp_group=group1, backend="torch"), "backend")
    _raises(lambda: pk.ppo_loss_from_hidden(d["hidden"][None], d["weight"], tok, old, adv, m,
                                            tp_group=group1, backend="torch"), "backend")


@pytest.mark.parametrize("value", [-1, 1.5, 0.0, "0", True, None])
def test_bad_vocab_start(group1, value):
    d = _data()
    lg, tok = d["logits"][None], d["tokens"][None]
    old, adv = d["old"][None], d["adv"][None]
    if value is None:  # numpy / tensor ints are not python ints either
        value = torch.tensor(0)
    _raises(lambda: pk.ppo_loss(lg, tok, old, adv, tp_group=group1, vocab_start=value),
            "vocab_start")
    _raises(lambda: pk.token_logprobs(lg, tok, tp_group=group1, vocab_start=value),
            "vocab_start")
    _raises(lambda: pk.ppo_loss_from_hidden(d["hidden"][None], d["weight"], tok, old, adv,
                                            tp_group=group1, vocab_start=value), "vocab_start")


def test_vocab_start_leaving_tokens_out(group1):
    """One rank whose shard starts at 3: the shards do not tile the vocabulary (ids below 3
    belong to no shard), named as vocab_start on every op."""
    d = _data()
    tok = d["tokens"].clone()
    tok[0] = 1
    m = torch.ones(TOTAL, dtype=torch.bool)
    _raises(lambda: pk.ppo_loss(d["logits"], tok, d["old"], d["adv"], m, tp_group=group1,
                                vocab_start=3), "vocab_start")
    _raises(lambda: pk.token_logprobs(d["logits"], tok, m, tp_group=group1, vocab_start=3),
            "vocab_start")
    # a valid id outside the whole vocabulary names the tokens ...
    v = d["logits"].shape[-1]
    bad = tok.clone()
    bad[0] = v
    _raises(lambda: pk.token_logprobs(d["logits"], bad, m, tp_group=group1), "tokens")
    # ... but a masked position may hold any id
    m[0] = False
    pk.token_logprobs(d["logits"], bad, m, tp_group=group1)


@pytest.mark.parametrize("bad", ["x", 5])
def test_tp_group_not_a_process_group(group1, bad):
    """tp_group that is not a process group: an error naming tp_group (not torch's
    "Group x is not registered")."""
    d = _data()
    _raises(lambda: pk.ppo_loss(d["logits"][None], d["tokens"][None], d["old"][None],
                                d["adv"][None], tp_group=bad), "tp_group")


@pytest.mark.parametrize("bad", ["x", 5])
def test_cp_group_not_a_process_group(group1, bad):
    d = _data()
    _raises(lambda: pk.ppo_loss(d["logits"][None], d["tokens"][None], d["old"][None],
                                d["adv"][None], policy_loss="gspo", cp_group=bad), "cp_group")


def test_reduce_metrics_bad_arguments(group1):
    d = _data()
    _, metrics = pk.ppo_loss(d["logits"], d["tokens"], d["old"], d["adv"], d["mask"])
    _raises(lambda: pk.distributed.reduce_metrics({"clip_frac": torch.tensor(0.0)}),
            "metrics")
    _raises(lambda: pk.distributed.reduce_metrics([metrics]), "metrics")
    # with a world of one, the reduced metrics are the metrics
    out = pk.distributed.reduce_metrics(metrics, cp_group=group1)
    assert set(out) == set(metrics)
    for k in metrics:
        assert torch.equal(out[k], metrics[k].float()), k


def test_reduce_metrics_cp_group_not_a_group(group1):
    """(today: AttributeError: 'str' object has no attribute 'size')"""
    d = _data()
    _, metrics = pk.ppo_loss(d["logits"], d["tokens"], d["old"], d["adv"], d["mask"])
    _raises(lambda: pk.distributed.reduce_metrics(metrics, cp_group="x"), "cp_group")


def test_dtensor_wrong_placement(group1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    d = _data()
    lg = d["logits"].reshape(1, TOTAL, V)
    tok, old, adv = d["tokens"][None], d["old"][None], d["adv"][None]
    for pl in ([Replicate()], [Shard(0)], [Shard(1)]):
        dt = distribute_tensor(lg.clone(), mesh, pl)
        _raises(lambda: pk.ppo_loss(dt, tok, old, adv), "logits")
        _raises(lambda: pk.token_logprobs(dt, tok), "logits")
        _raises(lambda: pk.score_rollout(dt, tok, old, old, torch.randn(1), None, kl_coef=0.1),
                "logits")
    good = distribute_tensor(lg.clone(), mesh, [Shard(-1)])
    _raises(lambda: pk.ppo_loss(good, tok, old, adv, tp_group=group1), "logits")
    _raises(lambda: pk.ppo_loss(good, tok, old, adv, vocab_start=0), "logits")
    for pl in ([Replicate()], [Shard(1)]):
        w = distribute_tensor(d["weight"].clone(), mesh, pl)
        _raises(lambda: pk.ppo_loss_from_hidden(d["hidden"][None], w, tok, old, adv),
                "lm_head_weight")


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
    lg = torch.randn(B, T, V, generator=g) * 3
    tok = torch.randint(0, V, (B, T), generator=g)
    lg[0, 0, tok[0, 0]] = 40.0  # a confident token
    mask = torch.rand(B, T, generator=g) > 0.2
    old = torch.randn(B, T, generator=g) * 0.3 - 2.5
    roll = old + 0.1 * torch.randn(B, T, generator=g)
    return lg, tok, mask, old, roll, torch.randn(B, generator=g)


@pytest.mark.parametrize("policy", ["vanilla", "cispo", "sapo", "gspo", "gspo-token"])
def test_world_of_one_equals_the_plain_op(group1, policy):
    """A 1-process group: cp_group gives the plain op bit for bit; tp_group too where it
    runs the same path (the sequence-level losses, "none", token_logprobs), and within a
    few float32 roundings where it swaps the fused single pass for the two-phase path."""
    lg, tok, mask, old, roll, adv = _batch3()
    opts = dict(policy_loss=policy, entropy_coef=0.01, rollout_logprobs=roll,
                rollout_correction="tis-seq", rollout_is_threshold=(0.5, 2.0))
    if policy == "cispo":
        opts.update(clip_eps_low=1.0, clip_eps_high=4.0)
    for mode in ("token-mean", "seq-mean-token-mean", "none"):
        for be in ("cpu", "torch"):
            def plain(x, **kw):
                return pk.ppo_loss(x, tok, old, adv, mask, loss_agg_mode=mode, backend=be,
                                   **opts, **kw)
            ref = _loss_run(plain, lg, mode)
            cp = _loss_run(lambda x: plain(x, cp_group=group1), lg, mode)
            assert torch.equal(cp[0], ref[0]), (mode, be)
            assert torch.equal(cp[2], ref[2]), (mode, be)
            for k in ref[1]:
                assert torch.equal(cp[1][k], ref[1][k]), (mode, be, k)
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
                        _close(a, b, (mode, what))
                for k in ref[1]:
                    assert torch.equal(got[1][k], ref[1][k]), (mode, k)


def test_world_of_one_other_ops(group1):
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
    d = _data(seed=5)
    for pl in ("vanilla", "gspo"):
        def packed(x, **kw):
            return pk.ppo_loss(x, d["tokens"], d["old"], d["adv"][:S], d["mask"],
                               cu_seqlens=CU, policy_loss=pl, **kw)
        a = _loss_run(packed, d["logits"], "token-mean")
        b = _loss_run(lambda x: packed(x, tp_group=group1, cp_group=group1), d["logits"],
                      "token-mean")
        _close(b[0], a[0], "packed loss")
        _close(b[2], a[2], "packed dlogits")
    # from hidden states
    h = torch.randn(3, 5, H)
    w = torch.randn(V, H)
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


# ------------------------------------------------------------------ 2 processes

_SCRIPT = r'''
import datetime, json, os, sys
import torch, torch.distributed as dist
import ppo_kernels as pk


def worker(rank, port, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(0)
    B, T, V, cut = 3, 4, 12, 5
    lg = torch.randn(B, T, V, generator=g) * 2
    tok = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    old = torch.randn(B, T, generator=g) * 0.3 - 2.0
    adv = torch.randn(B, generator=g)
    res = {}
    # a whole shard of -inf logits on some rows (a vocabulary padded to a multiple of the
    # TP size and masked out, or banned tokens): the token lies in the other shard
    x = lg.clone()
    x[0, :, cut:] = float("-inf")
    tok2 = tok.clone()
    tok2[0] = tok2[0] % cut
    x[1, :, :cut] = float("-inf")
    tok2[1] = cut + tok2[1] % (V - cut)
    v0, v1 = ((0, cut), (cut, V))[rank]
    for what in ("token_logprobs", "ppo_loss"):
        full = x.clone().requires_grad_()
        loc = x[..., v0:v1].clone().requires_grad_()
        try:
            if what == "token_logprobs":
                a = pk.token_logprobs(full, tok2, mask, return_entropy=True)
                b = pk.token_logprobs(loc, tok2, mask, return_entropy=True, tp_group=dist.group.WORLD,
                                      vocab_start=v0)
                (a[0].sum() + a[1].sum()).backward()
                (b[0].sum() + b[1].sum()).backward()
            else:
                a = pk.ppo_loss(full, tok2, old, adv, mask, entropy_coef=0.01)[:1]
                b = pk.ppo_loss(loc, tok2, old, adv, mask, entropy_coef=0.01,
                                tp_group=dist.group.WORLD, vocab_start=v0)[:1]
                a[0].backward()
                b[0].backward()
            errs = [float((p - q).abs().max() / q.abs().max()) for p, q in zip(b, a)]
            errs.append(float((loc.grad - full.grad[..., v0:v1]).abs().max()
                              / full.grad.abs().max()))
            res["neginf_shard/" + what] = [e if e == e else 1e30 for e in errs]
        except Exception as e:
            res["neginf_shard/" + what] = f"{type(e).__name__}: {e}"
    # shards that overlap ([0, 7) and [5, 12)) or leave a gap ([0, 5) and [7, 12)); no
    # sampled token in the overlap / the gap
    tok3 = tok % 5
    for name, (s, e) in (("overlap", ((0, 7), (5, 12))[rank]),
                         ("gap", ((0, 5), (7, 12))[rank])):
        try:
            pk.token_logprobs(lg[..., s:e].clone(), tok3, mask, tp_group=dist.group.WORLD,
                              vocab_start=s)
            res[name] = "no error"
        except (ValueError, TypeError) as err:
            res[name] = "raised " + str(err)
        except Exception as err:
            res[name] = f"{type(err).__name__}: {err}"
    # context parallel over packed sequences: sequence 0 wholly on rank 0, sequence 1 on
    # rank 1 (each rank's piece of the other is empty); the sum of the ranks' losses must
    # be the whole batch's
    lens, n = [4, 4], 8
    lgp = torch.randn(n, V, generator=g)
    tp_ = torch.randint(0, V, (n,), generator=g)
    oldp = torch.randn(n, generator=g) * 0.3 - 2.0
    advs = torch.tensor([1.0, -0.5])
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    idx = slice(0, 4) if rank == 0 else slice(4, 8)
    cu_loc = torch.tensor([0, 4, 4] if rank == 0 else [0, 0, 4], dtype=torch.int32)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        for pl in ("vanilla", "gspo"):
            full = lgp.clone().requires_grad_()
            lf, _ = pk.ppo_loss(full, tp_, oldp, advs, None, policy_loss=pl,
                                loss_agg_mode=mode, cu_seqlens=cu)
            lf.backward()
            loc = lgp[idx].clone().requires_grad_()
            ls, _ = pk.ppo_loss(loc, tp_[idx], oldp[idx], advs, None, policy_loss=pl,
                                loss_agg_mode=mode, cu_seqlens=cu_loc,
                                cp_group=dist.group.WORLD)
            ls.backward()
            tot = ls.detach().clone()
            dist.all_reduce(tot)
            res[f"cp_packed/{pl}/{mode}"] = [
                float((tot - lf).abs() / lf.abs()),
                float((loc.grad - full.grad[idx]).abs().max() / full.grad.abs().max())]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
'''


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp2")
    script = d / "tp2.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(d)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in range(2)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-4000:]
    finally:
        for p in procs:  # (a rank left waiting in a collective)
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("what", ["token_logprobs", "ppo_loss"])
def test_tp_whole_shard_of_neg_inf(two_ranks, what):
    """A row whose logits are -inf on one rank's whole shard (the token in the other):
    finite results, equal to the unsharded op's (logp, entropy / loss, gradient)."""
    for rank, res in enumerate(two_ranks):
        v = res["neginf_shard/" + what]
        assert not isinstance(v, str), f"rank {rank}: {v}"
        assert max(v) <= 1e-5, f"rank {rank}: relative errors {v} (1e30: NaN)"


@pytest.mark.parametrize("case", ["overlap", "gap"])
def test_tp_shards_that_overlap_or_leave_a_gap(two_ranks, case):
    """vocab_start values whose shards overlap or leave a gap make every row's softmax
    wrong (an entry counted twice, or missing) even when no sampled token lies there: a
    ValueError naming vocab_start on every rank, not a silent result."""
    for rank, res in enumerate(two_ranks):
        v = res[case]
        assert v.startswith("raised"), f"rank {rank}: {v}"
        assert "vocab_start" in v, f"rank {rank}: {v}"


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_cp_over_packed_sequences(two_ranks, mode):
    """cp_group with cu_seqlens, the pieces of unequal lengths on the ranks: the sum of the
    ranks' losses is the whole batch's, each rank's gradient that loss's. (The
    seq-mean-token-sum-norm length must be the whole sequences' longest, not the sum of
    each rank's padded width.)"""
    for rank, res in enumerate(two_ranks):
        for pl in ("vanilla", "gspo"):
            e = res[f"cp_packed/{pl}/{mode}"]
            assert max(e) <= 1e-5, f"rank {rank} {pl}: relative errors (loss, grad) {e}"
