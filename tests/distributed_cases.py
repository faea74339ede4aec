"""The multi-process checks of tests/test_distributed.py, run as a script:

    python tests/distributed_cases.py --world 2 --out DIR [--device cuda --backend nccl]

starts ``world`` processes (helpers/ranks.run_ranks; each runs its suites through
rank_main) on the gloo backend (CPU). Every rank draws the same inputs
(same seed), computes the single-process op on the whole batch / vocabulary / sequence
itself, then the distributed op on its own part, and writes {check: [error, tolerance]}
(errors relative to the largest reference entry) or {check: "error: ..."} to
DIR/rank<r>.json. The test file asserts every entry of every rank.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.distributed as dist

import ppo_kernels as pk

from helpers.asserts import max_rel_err
from helpers.ranks import rank_main, run_ranks

F32, BF16 = 1e-5, 2e-2  # relative to the largest reference entry
DEVICE = "cpu"  # --device cuda: each rank on GPU (rank % device_count), e.g. gpu_check.sh

POLICIES = [
    ("vanilla", dict(dual_clip_c=3.0)),
    ("vanilla", dict(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, temperature=0.7)),
    ("cispo", dict(clip_eps_low=1.0, clip_eps_high=4.0)),
    ("sapo", dict(kl_coef=0.05, kl_estimator="k1+", kl_bias_correction=True)),
    ("gspo", dict(clip_eps_low=3e-3, clip_eps_high=4e-3)),
    ("gspo-token", dict(entropy_coef=0.02)),
    ("vanilla", dict(rollout_correction="tis-seq", rollout_is_threshold=(0.5, 2.0))),
    ("vanilla", dict(off_policy_mask_threshold=0.01)),
    ("dppo-tv", dict(clip_eps_low=0.005, clip_eps_high=0.01, dual_clip_c=1.5)),
    ("vespo", dict(kl_coef=0.05, off_policy_mask_threshold=0.01)),
]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm"]


# max |a - b| over max |b|, absolute below a scale of 1e-6; a reference holding +-inf (masked
# logits) compares those entries equal and takes a scale of 1
err = functools.partial(max_rel_err, floor=1e-6, nonfinite=True)


def batch(b=7, t=9, v=53, h=12, dtype=torch.float32, seed=0):
    """Random inputs over the ranges that matter: confident tokens, an empty sequence,
    ragged masks, per-sequence advantages."""
    g = torch.Generator().manual_seed(seed)
    x = {}
    logits = torch.randn(b, t, v, generator=g) * 3
    tokens = torch.randint(0, v, (b, t), generator=g)
    conf = torch.rand(b, t, generator=g) < 0.25  # confident sampled tokens
    logits[conf, :] -= 0  # (keeps the shape)
    rows = conf.nonzero()
    logits[rows[:, 0], rows[:, 1], tokens[conf]] = 40.0
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[1] = False  # an empty sequence
    x["logits"] = logits.to(dtype)
    x["tokens"], x["mask"] = tokens, mask
    x["old"] = torch.randn(b, t, generator=g) * 0.3 - 1.5
    x["ref"] = x["old"] + 0.2 * torch.randn(b, t, generator=g)
    x["rollout"] = x["old"] + 0.1 * torch.randn(b, t, generator=g)
    x["adv"] = torch.randn(b, generator=g)
    x["hidden"] = torch.randn(b, t, h, generator=g).to(dtype)
    x["weight"] = (torch.randn(v, h, generator=g) * 0.4).to(dtype)
    x["bias"] = (torch.randn(v, generator=g) * 0.1).to(dtype)
    x["values"] = torch.randn(b, t, generator=g)
    x["scores"] = torch.randn(b, generator=g)
    return {k: v.to(DEVICE) for k, v in x.items()}


def split(n, world, rank):
    """An uneven contiguous split of n: (start, stop) of rank."""
    cuts = [n * r // world + (1 if r and n % world else 0) for r in range(world)] + [n]
    cuts = sorted(min(c, n) for c in cuts)
    return cuts[rank], cuts[rank + 1]


def loss_kwargs(x, pl, kw, sl=slice(None), tsl=slice(None)):
    kw = dict(kw)
    if kw.get("kl_coef"):
        kw["ref_logprobs"] = x["ref"][sl, tsl]
    if "rollout_correction" in kw or "off_policy_mask_threshold" in kw:
        kw["rollout_logprobs"] = x["rollout"][sl, tsl]
    return dict(policy_loss=pl, **kw)


def compare_loss(out, name, ref_loss, ref_metrics, loss, metrics, tol):
    out[name + "/loss"] = [err(loss, ref_loss), tol]
    for k, v in ref_metrics.items():
        out[f"{name}/metric:{k}"] = [err(metrics[k], v), tol]


# ---------------------------------------------------------------- tensor parallel

def tp_checks(rank, world, group=None, out=None, tag="tp"):
    out = {} if out is None else out
    group = group or dist.group.WORLD
    r, n = dist.get_rank(group), dist.get_world_size(group)
    for dtype, tol in ((torch.float32, F32), (torch.bfloat16, BF16)):
        x = batch(dtype=dtype)
        v0, v1 = split(x["logits"].shape[-1], n, r)
        d = f"{tag}/{str(dtype)[6:]}"
        # token_logprobs
        full = x["logits"].clone().requires_grad_()
        lp, en = pk.token_logprobs(full, x["tokens"], x["mask"], return_entropy=True)
        w1, w2 = torch.randn_like(lp), torch.randn_like(lp)
        (w1 * lp + w2 * en).sum().backward()
        loc = x["logits"][..., v0:v1].clone().requires_grad_()
        lq, eq = pk.token_logprobs(loc, x["tokens"], x["mask"], return_entropy=True,
                                   tp_group=group, vocab_start=v0)
        (w1 * lq + w2 * eq).sum().backward()
        out[d + "/token_logprobs/logp"] = [err(lq, lp), tol]
        out[d + "/token_logprobs/entropy"] = [err(eq, en), tol]
        out[d + "/token_logprobs/grad"] = [err(loc.grad, full.grad[..., v0:v1]), tol]
        # ppo_loss, every policy loss, one aggregation mode each (the modes: DP, CP)
        cases = POLICIES if dtype == torch.float32 else POLICIES[:1] + POLICIES[4:5]
        for i, (pl, kw) in enumerate(cases):
            agg = AGG_MODES[i % len(AGG_MODES)]
            kwargs = loss_kwargs(x, pl, kw)
            full = x["logits"].clone().requires_grad_()
            lf, mf = pk.ppo_loss(full, x["tokens"], x["old"], x["adv"], x["mask"],
                                 loss_agg_mode=agg, **kwargs)
            lf.backward()
            loc = x["logits"][..., v0:v1].clone().requires_grad_()
            ls, ms = pk.ppo_loss(loc, x["tokens"], x["old"], x["adv"], x["mask"],
                                 loss_agg_mode=agg, tp_group=group, vocab_start=v0, **kwargs)
            ls.backward()
            name = f"{d}/ppo_loss/{pl}-{i}-{agg}"
            compare_loss(out, name, lf, mf, ls, ms, tol)
            out[name + "/grad"] = [err(loc.grad, full.grad[..., v0:v1]), tol]
        # loss_agg_mode="none" and on-policy (old_logprobs=None)
        full = x["logits"].clone().requires_grad_()
        lf, _ = pk.ppo_loss(full, x["tokens"], None, x["adv"], x["mask"], loss_agg_mode="none")
        lf.sum().backward()
        loc = x["logits"][..., v0:v1].clone().requires_grad_()
        ls, _ = pk.ppo_loss(loc, x["tokens"], None, x["adv"], x["mask"], loss_agg_mode="none",
                            tp_group=group, vocab_start=v0)
        ls.sum().backward()
        out[d + "/ppo_loss/none/loss"] = [err(ls, lf), tol]
        out[d + "/ppo_loss/none/grad"] = [err(loc.grad, full.grad[..., v0:v1]), tol]
        # score_rollout
        ro = pk.score_rollout(x["logits"], x["tokens"], x["ref"], x["values"], x["scores"],
                              x["mask"], kl_coef=0.1)
        rq = pk.score_rollout(x["logits"][..., v0:v1], x["tokens"], x["ref"], x["values"],
                              x["scores"], x["mask"], kl_coef=0.1, tp_group=group,
                              vocab_start=v0)
        for f in ro._fields:
            out[f"{d}/score_rollout/{f}"] = [err(getattr(rq, f), getattr(ro, f)), tol]
        from_hidden_tp(out, d, x, group, v0, v1, tol)
    return out


def from_hidden_tp(out, d, x, group, v0, v1, tol):
    for pl, kw in (("vanilla", dict(entropy_coef=0.01)), ("gspo", dict(logit_softcap=8.0))):
        h1, w1, b1 = (t.clone().requires_grad_() for t in (x["hidden"], x["weight"], x["bias"]))
        lf, mf = pk.ppo_loss_from_hidden(h1, w1, x["tokens"], x["old"], x["adv"], x["mask"],
                                         lm_head_bias=b1, policy_loss=pl, chunk_size=10, **kw)
        lf.backward()
        h2 = x["hidden"].clone().requires_grad_()
        w2 = x["weight"][v0:v1].clone().requires_grad_()
        b2 = x["bias"][v0:v1].clone().requires_grad_()
        ls, ms = pk.ppo_loss_from_hidden(h2, w2, x["tokens"], x["old"], x["adv"], x["mask"],
                                         lm_head_bias=b2, policy_loss=pl, chunk_size=7,
                                         tp_group=group, vocab_start=v0, **kw)
        ls.backward()
        name = f"{d}/ppo_loss_from_hidden/{pl}"
        compare_loss(out, name, lf, mf, ls, ms, tol)
        out[name + "/grad_hidden"] = [err(h2.grad, h1.grad), tol]
        out[name + "/grad_weight"] = [err(w2.grad, w1.grad[v0:v1]), tol]
        out[name + "/grad_bias"] = [err(b2.grad, b1.grad[v0:v1]), tol]
    h1 = x["hidden"].clone().requires_grad_()
    lp, en = pk.token_logprobs_from_hidden(h1, x["weight"], x["tokens"], x["mask"],
                                           return_entropy=True)
    (lp.sum() + en.sum()).backward()
    h2 = x["hidden"].clone().requires_grad_()
    lq, eq = pk.token_logprobs_from_hidden(h2, x["weight"][v0:v1], x["tokens"], x["mask"],
                                           return_entropy=True, chunk_size=5, tp_group=group,
                                           vocab_start=v0)
    (lq.sum() + eq.sum()).backward()
    out[f"{d}/token_logprobs_from_hidden/logp"] = [err(lq, lp), tol]
    out[f"{d}/token_logprobs_from_hidden/entropy"] = [err(eq, en), tol]
    out[f"{d}/token_logprobs_from_hidden/grad_hidden"] = [err(h2.grad, h1.grad), tol]
    ro = pk.score_rollout_from_hidden(x["hidden"], x["weight"], x["tokens"], x["ref"],
                                      x["values"], x["scores"], x["mask"], kl_coef=0.1)
    rq = pk.score_rollout_from_hidden(x["hidden"], x["weight"][v0:v1], x["tokens"], x["ref"],
                                      x["values"], x["scores"], x["mask"], kl_coef=0.1,
                                      tp_group=group, vocab_start=v0)
    for f in ro._fields:
        out[f"{d}/score_rollout_from_hidden/{f}"] = [err(getattr(rq, f), getattr(ro, f)), tol]


def dtensor_checks(rank, world):
    """torch's tensor parallel: DTensors sharded on the vocabulary take the same path."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    mesh = init_device_mesh(torch.device(DEVICE).type, (world,))
    x = batch(v=50)
    full = x["logits"].clone().requires_grad_()
    lf, mf = pk.ppo_loss(full, x["tokens"], x["old"], x["adv"], x["mask"], policy_loss="gspo")
    lf.backward()
    dt = distribute_tensor(x["logits"].clone(), mesh, [Shard(-1)]).requires_grad_()
    ls, ms = pk.ppo_loss(dt, x["tokens"], x["old"], x["adv"], x["mask"], policy_loss="gspo")
    ls.backward()
    compare_loss(out, "dtensor/ppo_loss", lf, mf, ls, ms, F32)
    out["dtensor/ppo_loss/grad"] = [err(dt.grad.full_tensor(), full.grad), F32]
    h1, w1 = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    lf, _ = pk.ppo_loss_from_hidden(h1, w1, x["tokens"], x["old"], x["adv"], x["mask"])
    lf.backward()
    h2 = x["hidden"].clone().requires_grad_()
    w2 = distribute_tensor(x["weight"].clone(), mesh, [Shard(0)]).requires_grad_()
    # (a head sharded on its rows needs its group: FSDP2's shards look the same)
    ls, _ = pk.ppo_loss_from_hidden(h2, w2, x["tokens"], x["old"], x["adv"], x["mask"],
                                    tp_group=mesh.get_group())
    ls.backward()
    out["dtensor/ppo_loss_from_hidden/loss"] = [err(ls, lf), F32]
    out["dtensor/ppo_loss_from_hidden/grad_hidden"] = [err(h2.grad, h1.grad), F32]
    out["dtensor/ppo_loss_from_hidden/grad_weight"] = [err(w2.grad.full_tensor(), w1.grad),
                                                        F32]
    # a token id outside the whole vocabulary: a ValueError on every rank
    bad = x["tokens"].clone()
    bad[0, 0] = 50
    m = x["mask"].clone()
    m[0, 0] = True
    try:
        pk.ppo_loss(dt, bad, x["old"], x["adv"], m)
        out["dtensor/bad_token_raises"] = [1.0, 0.0]
    except ValueError as e:
        out["dtensor/bad_token_raises"] = [0.0 if "tokens" in str(e) else 1.0, 0.5]
    return out


# ---------------------------------------------------------------- data parallel

def dp_checks(rank, world, group=None, tp=None, out=None, tag="dp"):
    """The batch split by sequences; global counts; gradients summed over ranks. With tp
    (a (group, start, stop) triple), each rank also holds one vocabulary shard."""
    out = {} if out is None else out
    group = group or dist.group.WORLD
    r, n = dist.get_rank(group), dist.get_world_size(group)
    x = batch()
    b0, b1 = split(x["tokens"].shape[0], n, r)
    v0, v1 = (0, x["logits"].shape[-1]) if tp is None else tp[1:]
    tpk = {} if tp is None else dict(tp_group=tp[0], vocab_start=v0)
    n_tok = x["mask"].sum().float()
    nonempty = x["mask"].any(1).sum().float()
    # (DP: the first six and the rollout-correction case, whose metrics include the raw
    # ratio's minimum, the one metric reduced by a minimum)
    cases = [(pl, kw, agg) for pl, kw in POLICIES[:7] for agg in AGG_MODES] if tp is None \
        else [(pl, kw, AGG_MODES[i % 5]) for i, (pl, kw) in enumerate(POLICIES)]
    for pl, kw, agg in cases:
        kwargs = loss_kwargs(x, pl, kw)
        counts = dict(global_num_tokens=n_tok,
                      global_num_seqs=nonempty if agg == "seq-mean-token-mean" else
                      float(x["tokens"].shape[0]))
        full = x["logits"].clone().requires_grad_()
        lf, mf = pk.ppo_loss(full, x["tokens"], x["old"], x["adv"], x["mask"],
                             loss_agg_mode=agg, **kwargs)
        lf.backward()
        sl = slice(b0, b1)
        loc = x["logits"][sl, :, v0:v1].clone().requires_grad_()
        kl = loss_kwargs(x, pl, kw, sl)
        ls, ms = pk.ppo_loss(loc, x["tokens"][sl], x["old"][sl], x["adv"][sl], x["mask"][sl],
                             loss_agg_mode=agg, **counts, **kl, **tpk)
        ls.backward()
        total = ls.detach().clone()
        dist.all_reduce(total, group=group)
        name = f"{tag}/ppo_loss/{pl}-{agg}-{sorted(kw)}"
        compare_loss(out, name, lf, mf, total, pk.distributed.reduce_metrics(ms, group), F32)
        out[name + "/grad"] = [err(loc.grad, full.grad[sl, :, v0:v1]), F32]
    return out


def low_precision_checks(rank, world):
    """DP and CP with bfloat16 logits (vanilla and gspo): the split ops against the
    single-process op on the same bf16 inputs."""
    out = {}
    group = dist.group.WORLD
    x = batch(dtype=torch.bfloat16)
    b0, b1 = split(x["tokens"].shape[0], world, rank)
    t0, t1 = split(x["tokens"].shape[1], world, rank)
    n_tok = x["mask"].sum().float()
    for pl, kw in (POLICIES[0], POLICIES[4]):
        kwargs = loss_kwargs(x, pl, kw)
        full = x["logits"].clone().requires_grad_()
        lf, mf = pk.ppo_loss(full, x["tokens"], x["old"], x["adv"], x["mask"], **kwargs)
        lf.backward()
        for tag, sl, tsl, extra in (("dp", slice(b0, b1), slice(None),
                                     dict(global_num_tokens=n_tok, return_per_token=True)),
                                    ("cp", slice(None), slice(t0, t1), dict(cp_group=group))):
            loc = x["logits"][sl, tsl].clone().requires_grad_()
            ls, ms = pk.ppo_loss(loc, x["tokens"][sl, tsl], x["old"][sl, tsl], x["adv"][sl],
                                 x["mask"][sl, tsl], **loss_kwargs(x, pl, kw, sl, tsl),
                                 **extra)
            ls.backward()
            total = ls.detach().clone()
            dist.all_reduce(total)
            name = f"{tag}/bfloat16/ppo_loss/{pl}"
            compare_loss(out, name, lf, mf, total, pk.distributed.reduce_metrics(
                ms, group, cp_group=group if tag == "cp" else None), BF16)
            out[name + "/grad"] = [err(loc.grad, full.grad[sl, tsl]), BF16]
    return out


def dp_from_hidden_checks(rank, world):
    out = {}
    x = batch()
    b0, b1 = split(x["tokens"].shape[0], world, rank)
    sl = slice(b0, b1)
    n_tok = x["mask"].sum().float()
    # whiten over the data-parallel batch, the value loss with the global count
    w = pk.whiten(x["values"], x["mask"])
    out["dp/whiten"] = [err(pk.whiten(x["values"][sl], x["mask"][sl],
                                      group=dist.group.WORLD), w[sl]), F32]
    v = x["values"].clone().requires_grad_()
    lf, _ = pk.value_loss(v, x["old"], x["ref"], x["mask"], clip_range=0.2)
    lf.backward()
    vl = x["values"][sl].clone().requires_grad_()
    ls, _ = pk.value_loss(vl, x["old"][sl], x["ref"][sl], x["mask"][sl], clip_range=0.2,
                          global_num_tokens=n_tok)
    ls.backward()
    total = ls.detach().clone()
    dist.all_reduce(total)
    out["dp/value_loss/loss"] = [err(total, lf), F32]
    out["dp/value_loss/grad"] = [err(vl.grad, v.grad[sl]), F32]
    h1, w1 = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    lf, _ = pk.ppo_loss_from_hidden(h1, w1, x["tokens"], x["old"], x["adv"], x["mask"],
                                    policy_loss="gspo")
    lf.backward()
    h2, w2 = x["hidden"][sl].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    ls, _ = pk.ppo_loss_from_hidden(h2, w2, x["tokens"][sl], x["old"][sl], x["adv"][sl],
                                    x["mask"][sl], policy_loss="gspo", global_num_tokens=n_tok)
    ls.backward()
    dist.all_reduce(w2.grad)
    total = ls.detach().clone()
    dist.all_reduce(total)
    out["dp/ppo_loss_from_hidden/loss"] = [err(total, lf), F32]
    out["dp/ppo_loss_from_hidden/grad_hidden"] = [err(h2.grad, h1.grad[sl]), F32]
    out["dp/ppo_loss_from_hidden/grad_weight"] = [err(w2.grad, w1.grad), F32]
    return out


# ---------------------------------------------------------------- context parallel

def cp_checks(rank, world):
    """Every sequence split over the ranks along T (uneven)."""
    out = {}
    group = dist.group.WORLD
    for backend in ("auto", "torch"):
        x = batch()
        t0, t1 = split(x["tokens"].shape[1], world, rank)
        tsl = slice(t0, t1)
        for pl, kw in POLICIES:
            for agg in AGG_MODES if backend == "auto" else AGG_MODES[3:4]:
                kwargs = loss_kwargs(x, pl, kw)
                full = x["logits"].clone().requires_grad_()
                lf, mf = pk.ppo_loss(full, x["tokens"], x["old"], x["adv"], x["mask"],
                                     loss_agg_mode=agg, backend=backend, **kwargs)
                lf.backward()
                loc = x["logits"][:, tsl].clone().requires_grad_()
                kl = loss_kwargs(x, pl, kw, slice(None), tsl)
                ls, ms = pk.ppo_loss(loc, x["tokens"][:, tsl], x["old"][:, tsl], x["adv"],
                                     x["mask"][:, tsl], loss_agg_mode=agg, cp_group=group,
                                     backend=backend, **kl)
                ls.backward()
                total = ls.detach().clone()
                dist.all_reduce(total)
                name = f"cp/{backend}/ppo_loss/{pl}-{agg}-{sorted(kw)}"
                compare_loss(out, name, lf, mf, total,
                             pk.distributed.reduce_metrics(ms, group, cp_group=group), F32)
                out[name + "/grad"] = [err(loc.grad, full.grad[:, tsl]), F32]
    x = batch()
    t0, t1 = split(x["tokens"].shape[1], world, rank)
    tsl = slice(t0, t1)
    h1, w1 = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    lf, _ = pk.ppo_loss_from_hidden(h1, w1, x["tokens"], x["old"], x["adv"], x["mask"],
                                    policy_loss="gspo", loss_agg_mode="seq-mean-token-mean")
    lf.backward()
    h2, w2 = x["hidden"][:, tsl].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    ls, _ = pk.ppo_loss_from_hidden(h2, w2, x["tokens"][:, tsl], x["old"][:, tsl], x["adv"],
                                    x["mask"][:, tsl], policy_loss="gspo",
                                    loss_agg_mode="seq-mean-token-mean", cp_group=group)
    ls.backward()
    dist.all_reduce(w2.grad)
    total = ls.detach().clone()
    dist.all_reduce(total)
    out["cp/ppo_loss_from_hidden/loss"] = [err(total, lf), F32]
    out["cp/ppo_loss_from_hidden/grad_hidden"] = [err(h2.grad, h1.grad[:, tsl]), F32]
    out["cp/ppo_loss_from_hidden/grad_weight"] = [err(w2.grad, w1.grad), F32]
    return out


def tp_dp_checks(rank, world):
    """A 2 x (world / 2) mesh: TP pairs inside DP groups (world 4: 2 x 2)."""
    tp_size = 2
    tp_groups = [dist.new_group(list(range(i, i + tp_size))) for i in range(0, world, tp_size)]
    dp_groups = [dist.new_group(list(range(j, world, tp_size))) for j in range(tp_size)]
    tp_group, dp_group = tp_groups[rank // tp_size], dp_groups[rank % tp_size]
    v0, v1 = split(batch()["logits"].shape[-1], tp_size, rank % tp_size)
    return dp_checks(rank, world, group=dp_group, tp=(tp_group, v0, v1), tag="tp_x_dp")


def cp_dp_checks(rank, world):
    """A 2 x (world / 2) mesh: sequences split over CP pairs, the batch over DP groups,
    with the whole batch's counts."""
    out = {}
    cp_size = 2
    cp_groups = [dist.new_group(list(range(i, i + cp_size))) for i in range(0, world, cp_size)]
    cp_group = cp_groups[rank // cp_size]
    dp_rank, dp_size = rank // cp_size, world // cp_size
    x = batch()
    b0, b1 = split(x["tokens"].shape[0], dp_size, dp_rank)
    t0, t1 = split(x["tokens"].shape[1], cp_size, rank % cp_size)
    sl, tsl = slice(b0, b1), slice(t0, t1)
    n_tok = x["mask"].sum().float()
    nonempty = x["mask"].any(1).sum().float()
    for pl, kw in POLICIES:
        for agg in ("token-mean", "seq-mean-token-mean"):
            kwargs = loss_kwargs(x, pl, kw)
            full = x["logits"].clone().requires_grad_()
            lf, mf = pk.ppo_loss(full, x["tokens"], x["old"], x["adv"], x["mask"],
                                 loss_agg_mode=agg, **kwargs)
            lf.backward()
            loc = x["logits"][sl, tsl].clone().requires_grad_()
            ls, ms = pk.ppo_loss(loc, x["tokens"][sl, tsl], x["old"][sl, tsl], x["adv"][sl],
                                 x["mask"][sl, tsl], loss_agg_mode=agg, cp_group=cp_group,
                                 global_num_tokens=n_tok, global_num_seqs=nonempty,
                                 **loss_kwargs(x, pl, kw, sl, tsl))
            ls.backward()
            total = ls.detach().clone()
            dist.all_reduce(total)
            name = f"cp_x_dp/ppo_loss/{pl}-{agg}-{sorted(kw)}"
            compare_loss(out, name, lf, mf, total,
                         pk.distributed.reduce_metrics(ms, cp_group=cp_group), F32)
            out[name + "/grad"] = [err(loc.grad, full.grad[sl, tsl]), F32]
    return out


def tp_packed_checks(rank, world):
    """A split vocabulary over packed sequences: against the padded single-process op."""
    out = {}
    x = batch()
    v0, v1 = split(x["logits"].shape[-1], world, rank)
    lens = x["mask"].sum(1)
    keep = torch.arange(x["tokens"].shape[1], device=DEVICE)[None, :] < lens[:, None]
    cu = torch.cat([torch.zeros(1, dtype=torch.long, device=DEVICE),
                    lens.cumsum(0)]).to(torch.int32)
    mask = keep  # the valid tokens, packed to the left of each row

    def pack(t):
        return t[keep].unsqueeze(0)

    for pl, kw in POLICIES[3:6]:
        kwargs = loss_kwargs(x, pl, kw)
        full = x["logits"].clone().requires_grad_()
        lf, mf = pk.ppo_loss(full, x["tokens"], x["old"], x["adv"], mask,
                             loss_agg_mode="seq-mean-token-mean", **kwargs)
        lf.backward()
        loc = pack(x["logits"][..., v0:v1]).clone().requires_grad_()
        kp = {k: pack(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        ls, ms = pk.ppo_loss(loc, pack(x["tokens"]), pack(x["old"]), x["adv"], None,
                             loss_agg_mode="seq-mean-token-mean", cu_seqlens=cu,
                             tp_group=dist.group.WORLD, vocab_start=v0, **kp)
        ls.backward()
        name = f"tp_packed/ppo_loss/{pl}"
        compare_loss(out, name, lf, mf, ls, ms, F32)
        out[name + "/grad"] = [err(loc.grad, pack(full.grad[..., v0:v1])), F32]
    return out


def temperature_checks(rank, world):
    """A per-token temperature [B, T] (and a per-sequence [B] one) over a split vocabulary
    and over sequences split along T: the single-process result with the same tensor."""
    out = {}
    group = dist.group.WORLD
    x = batch()
    b, t = x["tokens"].shape
    g = torch.Generator().manual_seed(5)
    temp = (0.4 + 1.6 * torch.rand(b, t, generator=g)).to(DEVICE)
    seq = temp[:, 0].contiguous()
    v0, v1 = split(x["logits"].shape[-1], world, rank)
    for form, tt in (("token", temp), ("seq", seq)):
        for pl in ("vanilla", "gspo"):
            kw = dict(policy_loss=pl, entropy_coef=0.01, temperature=tt)
            full = x["logits"].clone().requires_grad_()
            lf, mf = pk.ppo_loss(full, x["tokens"], x["old"], x["adv"], x["mask"], **kw)
            lf.backward()
            loc = x["logits"][..., v0:v1].clone().requires_grad_()
            ls, ms = pk.ppo_loss(loc, x["tokens"], x["old"], x["adv"], x["mask"],
                                 tp_group=group, vocab_start=v0, **kw)
            ls.backward()
            name = f"temperature/tp/{form}/ppo_loss/{pl}"
            compare_loss(out, name, lf, mf, ls, ms, F32)
            out[name + "/grad"] = [err(loc.grad, full.grad[..., v0:v1]), F32]
        lp = pk.token_logprobs(x["logits"], x["tokens"], x["mask"], temperature=tt)
        lq = pk.token_logprobs(x["logits"][..., v0:v1], x["tokens"], x["mask"], temperature=tt,
                               tp_group=group, vocab_start=v0)
        out[f"temperature/tp/{form}/token_logprobs"] = [err(lq, lp), F32]
        h1 = x["hidden"].clone().requires_grad_()
        lf, _ = pk.ppo_loss_from_hidden(h1, x["weight"], x["tokens"], x["old"], x["adv"],
                                        x["mask"], temperature=tt, chunk_size=10)
        lf.backward()
        h2 = x["hidden"].clone().requires_grad_()
        ls, _ = pk.ppo_loss_from_hidden(h2, x["weight"][v0:v1], x["tokens"], x["old"],
                                        x["adv"], x["mask"], temperature=tt, chunk_size=7,
                                        tp_group=group, vocab_start=v0)
        ls.backward()
        out[f"temperature/tp/{form}/ppo_loss_from_hidden/loss"] = [err(ls, lf), F32]
        out[f"temperature/tp/{form}/ppo_loss_from_hidden/grad_hidden"] = [err(h2.grad, h1.grad),
                                                                          F32]
    # context parallel: each rank's piece of the per-token temperature
    t0, t1 = split(t, world, rank)
    tsl = slice(t0, t1)
    for pl in ("vanilla", "gspo"):
        full = x["logits"].clone().requires_grad_()
        lf, _ = pk.ppo_loss(full, x["tokens"], x["old"], x["adv"], x["mask"], policy_loss=pl,
                            loss_agg_mode="seq-mean-token-mean", temperature=temp)
        lf.backward()
        loc = x["logits"][:, tsl].clone().requires_grad_()
        ls, _ = pk.ppo_loss(loc, x["tokens"][:, tsl], x["old"][:, tsl], x["adv"],
                            x["mask"][:, tsl], policy_loss=pl,
                            loss_agg_mode="seq-mean-token-mean", temperature=temp[:, tsl],
                            cp_group=group)
        ls.backward()
        total = ls.detach().clone()
        dist.all_reduce(total)
        out[f"temperature/cp/ppo_loss/{pl}/loss"] = [err(total, lf), F32]
        out[f"temperature/cp/ppo_loss/{pl}/grad"] = [err(loc.grad, full.grad[:, tsl]), F32]
    return out


SUITES = {
    2: [tp_checks, dtensor_checks, dp_checks, dp_from_hidden_checks, cp_checks,
        tp_packed_checks, low_precision_checks, temperature_checks],
    3: [tp_checks, dp_checks, cp_checks, tp_packed_checks],
    4: [tp_dp_checks, cp_dp_checks],
}


def suite(fn):
    """A suite fn(rank, world) as rank_main's case function (its errors under its name)."""
    def run(r):
        return fn(r.rank, r.world)
    run.__name__ = fn.__name__
    return run


def setup(device, r):
    global DEVICE
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(r.rank % torch.cuda.device_count())
        DEVICE = f"cuda:{torch.cuda.current_device()}"


def options(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2, choices=sorted(SUITES))
    ap.add_argument("--out")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    return ap.parse_args(argv)


def main(argv=None):
    """The command line (benchmarks/gpu_check.sh): every suite of --world ranks, launched by
    helpers/ranks.run_ranks, and a summary for logs (tests/test_distributed.py asserts each
    entry itself)."""
    a = options(argv)
    if not a.out:
        raise SystemExit("--out: the folder for the ranks' results is required")
    try:
        results = run_ranks(os.path.abspath(__file__), a.out, n=a.world, timeout=600,
                            args=["--device", a.device, "--backend", a.backend])
    except AssertionError as e:  # a rank failed, or a suite raised: its message says which
        print(f"FAIL {e}")
        return 1
    bad = total = 0
    for r, res in enumerate(results):
        for name, val in res.items():
            total += 1
            if isinstance(val, str) or not val[0] <= val[1]:
                bad += 1
                print(f"FAIL rank {r} {name}: {val if isinstance(val, list) else val[-800:]}")
    print(f"distributed_cases world={a.world} device={a.device} backend={a.backend}: "
          f"{total - bad} of {total} checks within tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].isdigit():  # one rank, started by run_ranks
        opts = options(sys.argv[4:])
        rank_main(lambda r: [suite(fn) for fn in SUITES[r.world]], world=None,
                  setup=functools.partial(setup, opts.device), backend=opts.backend,
                  timeout_s=None)
    else:
        sys.exit(main())
