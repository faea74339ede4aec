"""The two-process cases of the tensor- and context-parallel tests, run as a script by the
session fixture ``two_ranks`` (tests/conftest.py) on 2 gloo processes (CPU):

    python tests/two_rank_cases.py RANK PORT OUT_DIR

Each rank writes OUT_DIR/rank<r>.json: {case: [relative errors] or a message}.

- "neginf_shard/token_logprobs", "neginf_shard/ppo_loss": a vocabulary split [0, 5) /
  [5, 12) where a row's logits are -inf on one rank's whole shard (the token in the
  other): relative errors of logp, entropy / loss and the gradient against the unsharded
  op (test_vocab_parallel.py);
- "overlap", "gap": vocab_start values whose shards overlap or leave a gap: "raised ..."
  for a ValueError / TypeError (test_vocab_parallel.py);
- "cp_packed/<policy>/<mode>": context parallel over packed sequences, one sequence per
  rank: relative errors of the summed loss and of each rank's gradient
  (test_context_parallel.py).
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

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
    from rank_exit import run_then_exit

    run_then_exit(worker, int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
