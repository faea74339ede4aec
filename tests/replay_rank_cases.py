"""The two-process cases of sampling replay over a tensor-parallel vocabulary, run by
tests/test_sampling.py on 2 gloo processes (CPU):

    python tests/replay_rank_cases.py RANK PORT OUT_DIR   (helpers/ranks.py)

Each rank writes OUT_DIR/rank<r>.json: {case: max relative error against the unsharded op,
or "raised <message>"}. Tensor parallel: the vocabulary [0, 13) is split [0, 6) / [6, 13);
context parallel ("cp/..."): the positions [0, 2) / [2, 4) of every sequence.
"""

import types

import torch
import torch.distributed as dist

import ppo_kernels as pk

from helpers.asserts import max_rel_err
from helpers.inputs import random_csr
from helpers.ranks import rank_main

B, T, V, CUT = 2, 4, 13, 6


def setup(r):
    """The inputs every rank draws alike, and this rank's vocabulary slice."""
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    tok = torch.randint(0, V, (B, T), generator=g)
    # rows that lack their token (lacks_token below: rows 0, 3 and 6) at the shards' edges:
    # the first id of rank 1's shard, the last of rank 0's and of the vocabulary (each must
    # have exactly one owner)
    tok[0, 0], tok[0, 3], tok[1, 2] = CUT, CUT - 1, V - 1
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 0] = False
    old = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 1.0
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = torch.randn(B, T, generator=g, dtype=torch.float64) - 2
    sm, dense = random_csr(B, T, V, g, kmax=7, tokens=tok, lacks_token=lambda i: i % 3 == 0)
    # ties at the top of a kept set within one shard: in the first row with two kept ids on
    # rank 0's side, and in the first with two on rank 1's, both get the row's max + 1
    for lo, hi in ((0, CUT), (CUT, V)):
        for i in range(B * T):
            ids = dense.view(B * T, V)[i, lo:hi].nonzero()[:, 0] + lo
            if len(ids) >= 2:
                row = lg.view(B * T, V)[i]
                row[ids[:2]] = row.max() + 1.0
                break
        else:
            raise AssertionError(f"no row keeps two ids of [{lo}, {hi})")
    temp_tok = 0.5 + torch.rand(B, T, generator=g, dtype=torch.float64)
    sl = slice(0, CUT) if r.rank == 0 else slice(CUT, V)
    return types.SimpleNamespace(lg=lg, tok=tok, mask=mask, old=old, adv=adv, ref=ref, sm=sm,
                                 temp_tok=temp_tok, sl=sl)


def tp_ppo_loss(r):
    d, res = r.state, {}
    lg, tok, mask, old, adv, ref, sm, sl = (d.lg, d.tok, d.mask, d.old, d.adv, d.ref,
                                            d.sm, d.sl)
    for case, kw in (("vanilla", dict(kl_coef=0.1)),
                     ("gspo_kept", dict(policy_loss="gspo", kl_coef=0.1, kl_logprobs="kept",
                                        entropy_coef=0.01, entropy_over="kept")),
                     ("entropy_full", dict(entropy_coef=0.02)),
                     # per-row temperatures: per sequence [B] and per token [B, T]
                     ("gspo_kept_seq_temp", dict(policy_loss="gspo", kl_coef=0.1,
                                                 kl_logprobs="kept", entropy_coef=0.01,
                                                 entropy_over="kept",
                                                 temperature=torch.tensor([0.6, 1.4],
                                                                          dtype=torch.float64))),
                     ("vanilla_token_temp", dict(kl_coef=0.1, entropy_coef=0.02,
                                                 temperature=d.temp_tok))):
        x = lg.clone().requires_grad_(True)
        loss, m = pk.ppo_loss(x, tok, old, adv, mask, ref, sampling_mask=sm, backend="cpu",
                              **kw)
        loss.backward()
        xs = lg[..., sl].clone().requires_grad_(True)
        loss_s, m_s = pk.ppo_loss(xs, tok, old, adv, mask, ref, sampling_mask=sm,
                                  tp_group=dist.group.WORLD, vocab_start=sl.start, backend="cpu",
                                  **kw)
        loss_s.backward()
        res[f"{case}/loss"] = max_rel_err(loss_s.detach(), loss.detach())
        res[f"{case}/grad"] = max_rel_err(xs.grad, x.grad[..., sl])
        res[f"{case}/metrics"] = max(abs(float(m_s[k]) - float(m[k])) for k in m)
    return res


def tp_token_logprobs(r):
    d, res = r.state, {}
    lg, tok, mask, sm, sl = d.lg, d.tok, d.mask, d.sm, d.sl
    x = lg.clone().requires_grad_(True)
    a = pk.token_logprobs(x, tok, mask, sampling_mask=sm, return_full=True,
                          return_entropy=True, entropy_over="kept", backend="cpu")
    sum(v.sum() * (i + 1) for i, v in enumerate(a)).backward()
    xs = lg[..., sl].clone().requires_grad_(True)
    b = pk.token_logprobs(xs, tok, mask, sampling_mask=sm, return_full=True,
                          return_entropy=True, entropy_over="kept",
                          tp_group=dist.group.WORLD, vocab_start=sl.start, backend="cpu")
    sum(v.sum() * (i + 1) for i, v in enumerate(b)).backward()
    res["token_logprobs/values"] = max(max_rel_err(u.detach(), v.detach())
                                       for u, v in zip(b, a))
    res["token_logprobs/grad"] = max_rel_err(xs.grad, x.grad[..., sl])
    temp = torch.tensor([0.7, 1.3], dtype=torch.float64)
    x = lg.clone().requires_grad_(True)
    a = pk.token_logprobs(x, tok, mask, sampling_mask=sm, return_full=True, temperature=temp,
                          return_entropy=True, entropy_over="kept", backend="cpu")
    sum(v.sum() * (i + 1) for i, v in enumerate(a)).backward()
    xs = lg[..., sl].clone().requires_grad_(True)
    b = pk.token_logprobs(xs, tok, mask, sampling_mask=sm, return_full=True, temperature=temp,
                          return_entropy=True, entropy_over="kept",
                          tp_group=dist.group.WORLD, vocab_start=sl.start, backend="cpu")
    sum(v.sum() * (i + 1) for i, v in enumerate(b)).backward()
    res["token_logprobs_seq_temp/values"] = max(max_rel_err(u.detach(), v.detach())
                                                for u, v in zip(b, a))
    res["token_logprobs_seq_temp/grad"] = max_rel_err(xs.grad, x.grad[..., sl])
    return res


def tp_out_of_range(r):
    d, res = r.state, {}
    lg, tok, mask, sl = d.lg, d.tok, d.mask, d.sl
    bad = pk.SamplingMask(torch.tensor([0, V]), torch.tensor([0, 2] + [2] * (B * T - 1)))
    try:
        pk.token_logprobs(lg[..., sl], tok, mask, sampling_mask=bad,
                          tp_group=dist.group.WORLD, vocab_start=sl.start)
        res["out_of_range"] = "no error"
    except ValueError as e:
        res["out_of_range"] = f"raised {e}"
    return res


def cp_ppo_loss(r):
    d, res, rank = r.state, {}, r.rank
    lg, tok, mask, old, adv, ref, sm = d.lg, d.tok, d.mask, d.old, d.adv, d.ref, d.sm
    # context parallel: each rank holds positions [2 r, 2 r + 2) of every sequence, and the
    # CSR rows of those positions; the ranks' losses add up to the whole batch's
    t0, t1 = 2 * rank, 2 * rank + 2
    rows = [b * T + t for b in range(B) for t in range(t0, t1)]
    cids = torch.cat([sm.token_ids[sm.offsets[i]:sm.offsets[i + 1]] for i in rows])
    coffs = torch.tensor([0] + [int(sm.offsets[i + 1] - sm.offsets[i]) for i in rows]).cumsum(0)
    for case, kw in (("cp/gspo", dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
                                      kl_coef=0.1)),
                     ("cp/vanilla", dict(entropy_coef=0.01, entropy_over="kept"))):
        x = lg.clone().requires_grad_(True)
        loss, _ = pk.ppo_loss(x, tok, old, adv, mask, ref, sampling_mask=sm, backend="cpu",
                              **kw)
        loss.backward()
        xc = lg[:, t0:t1].clone().requires_grad_(True)
        loss_c, _ = pk.ppo_loss(xc, tok[:, t0:t1], old[:, t0:t1], adv[:, t0:t1],
                                mask[:, t0:t1], ref[:, t0:t1],
                                sampling_mask=pk.SamplingMask(cids, coffs),
                                cp_group=dist.group.WORLD, backend="cpu", **kw)
        loss_c.backward()
        total = loss_c.detach().clone()
        dist.all_reduce(total)
        res[f"{case}/loss"] = max_rel_err(total, loss.detach())
        res[f"{case}/grad"] = max_rel_err(xc.grad, x.grad[:, t0:t1])
        # (a rank's own loss is its part only: the reductions did run over the group)
        res[f"{case}/own_part"] = "partial" if float(abs(loss_c - total)) > 0 else "whole"
    return res


if __name__ == "__main__":
    rank_main([tp_ppo_loss, tp_token_logprobs, tp_out_of_range, cp_ppo_loss], setup=setup)
