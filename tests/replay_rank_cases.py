"""The two-process cases of sampling replay over a tensor-parallel vocabulary, run by
tests/test_sampling.py on 2 gloo processes (CPU):

    python tests/replay_rank_cases.py RANK PORT OUT_DIR

Each rank writes OUT_DIR/rank<r>.json: {case: max relative error against the unsharded op,
or "raised <message>"}. Tensor parallel: the vocabulary [0, 13) is split [0, 6) / [6, 13);
context parallel ("cp/..."): the positions [0, 2) / [2, 4) of every sequence.
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import ppo_kernels as pk


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def worker(rank, port, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(0)
    B, T, V, cut = 2, 4, 13, 6
    lg = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    tok = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 0] = False
    old = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 1.0
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = torch.randn(B, T, generator=g, dtype=torch.float64) - 2
    ids, offs = [], [0]
    for i in range(B * T):
        k = int(torch.randint(1, 8, (), generator=g))
        row = torch.randperm(V, generator=g)[:k]
        if i % 3:  # every third set lacks its token
            row = torch.cat([row[row != tok.view(-1)[i]], tok.view(-1)[i:i + 1]])
        else:
            row = row[row != tok.view(-1)[i]]
        ids.append(row)
        offs.append(offs[-1] + len(row))
    sm = pk.SamplingMask(torch.cat(ids), torch.tensor(offs))
    sl = slice(0, cut) if rank == 0 else slice(cut, V)
    res = {}
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
                                                 temperature=0.5 + torch.rand(
                                                     B, T, generator=g,
                                                     dtype=torch.float64)))):
        x = lg.clone().requires_grad_(True)
        loss, m = pk.ppo_loss(x, tok, old, adv, mask, ref, sampling_mask=sm, backend="cpu",
                              **kw)
        loss.backward()
        xs = lg[..., sl].clone().requires_grad_(True)
        loss_s, m_s = pk.ppo_loss(xs, tok, old, adv, mask, ref, sampling_mask=sm,
                                  tp_group=dist.group.WORLD, vocab_start=sl.start, backend="cpu",
                                  **kw)
        loss_s.backward()
        res[f"{case}/loss"] = rel(loss_s.detach(), loss.detach())
        res[f"{case}/grad"] = rel(xs.grad, x.grad[..., sl])
        res[f"{case}/metrics"] = max(abs(float(m_s[k]) - float(m[k])) for k in m)
    x = lg.clone().requires_grad_(True)
    a = pk.token_logprobs(x, tok, mask, sampling_mask=sm, return_full=True,
                          return_entropy=True, entropy_over="kept", backend="cpu")
    sum(v.sum() * (i + 1) for i, v in enumerate(a)).backward()
    xs = lg[..., sl].clone().requires_grad_(True)
    b = pk.token_logprobs(xs, tok, mask, sampling_mask=sm, return_full=True,
                          return_entropy=True, entropy_over="kept",
                          tp_group=dist.group.WORLD, vocab_start=sl.start, backend="cpu")
    sum(v.sum() * (i + 1) for i, v in enumerate(b)).backward()
    res["token_logprobs/values"] = max(rel(u.detach(), v.detach()) for u, v in zip(b, a))
    res["token_logprobs/grad"] = rel(xs.grad, x.grad[..., sl])
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
    res["token_logprobs_seq_temp/values"] = max(rel(u.detach(), v.detach())
                                                for u, v in zip(b, a))
    res["token_logprobs_seq_temp/grad"] = rel(xs.grad, x.grad[..., sl])
    bad = pk.SamplingMask(torch.tensor([0, V]), torch.tensor([0, 2] + [2] * (B * T - 1)))
    try:
        pk.token_logprobs(lg[..., sl], tok, mask, sampling_mask=bad,
                          tp_group=dist.group.WORLD, vocab_start=sl.start)
        res["out_of_range"] = "no error"
    except ValueError as e:
        res["out_of_range"] = f"raised {e}"
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
        res[f"{case}/loss"] = rel(total, loss.detach())
        res[f"{case}/grad"] = rel(xc.grad, x.grad[:, t0:t1])
        # (a rank's own loss is its part only: the reductions did run over the group)
        res[f"{case}/own_part"] = "partial" if float(abs(loss_c - total)) > 0 else "whole"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run_then_exit

    run_then_exit(worker, int(sys.argv[1]), sys.argv[2], sys.argv[3])
