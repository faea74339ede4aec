"""The two-process cases of the tensor- and context-parallel tests, run as a script by the
session fixture ``two_ranks`` (tests/conftest.py) on 2 gloo processes (CPU):

    python tests/two_rank_cases.py RANK PORT OUT_DIR   (helpers/ranks.py)

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

import types

import torch
import torch.distributed as dist

import ppo_kernels as pk

from helpers.asserts import max_rel_err
from helpers.ranks import rank_main

B, T, V, CUT = 3, 4, 12, 5


def setup(r):
    """The inputs every rank draws alike (the packed batch's after the padded one's)."""
    g = torch.Generator().manual_seed(0)
    d = types.SimpleNamespace()
    d.lg = torch.randn(B, T, V, generator=g) * 2
    d.tok = torch.randint(0, V, (B, T), generator=g)
    d.mask = torch.ones(B, T, dtype=torch.bool)
    d.old = torch.randn(B, T, generator=g) * 0.3 - 2.0
    d.adv = torch.randn(B, generator=g)
    n = 8
    d.lgp = torch.randn(n, V, generator=g)
    d.tp_ = torch.randint(0, V, (n,), generator=g)
    d.oldp = torch.randn(n, generator=g) * 0.3 - 2.0
    return d


def neginf_shard(r):
    """A whole shard of -inf logits on some rows (a vocabulary padded to a multiple of the
    TP size and masked out, or banned tokens): the token lies in the other shard."""
    d, res = r.state, {}
    x = d.lg.clone()
    x[0, :, CUT:] = float("-inf")
    tok2 = d.tok.clone()
    tok2[0] = tok2[0] % CUT
    x[1, :, :CUT] = float("-inf")
    tok2[1] = CUT + tok2[1] % (V - CUT)
    v0, v1 = ((0, CUT), (CUT, V))[r.rank]
    mask, old, adv = d.mask, d.old, d.adv
    for what in ("token_logprobs", "ppo_loss"):
        full = x.clone().requires_grad_()
        loc = x[..., v0:v1].clone().requires_grad_()
        try:
            if what == "token_logprobs":
                a = pk.token_logprobs(full, tok2, mask, return_entropy=True)
                b = pk.token_logprobs(loc, tok2, mask, return_entropy=True,
                                      tp_group=dist.group.WORLD, vocab_start=v0)
                (a[0].sum() + a[1].sum()).backward()
                (b[0].sum() + b[1].sum()).backward()
            else:
                a = pk.ppo_loss(full, tok2, old, adv, mask, entropy_coef=0.01)[:1]
                b = pk.ppo_loss(loc, tok2, old, adv, mask, entropy_coef=0.01,
                                tp_group=dist.group.WORLD, vocab_start=v0)[:1]
                a[0].backward()
                b[0].backward()
            errs = [max_rel_err(p, q) for p, q in zip(b, a)]
            errs.append(max_rel_err(loc.grad, full.grad[..., v0:v1]))
            res["neginf_shard/" + what] = [e if e == e else 1e30 for e in errs]
        except Exception as e:
            res["neginf_shard/" + what] = f"{type(e).__name__}: {e}"
    return res


def bad_shards(r):
    """Shards that overlap ([0, 7) and [5, 12)) or leave a gap ([0, 5) and [7, 12)); no
    sampled token in the overlap / the gap."""
    d, res, rank = r.state, {}, r.rank
    lg, mask = d.lg, d.mask
    tok3 = d.tok % 5
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
    return res


def cp_packed(r):
    """Context parallel over packed sequences: sequence 0 wholly on rank 0, sequence 1 on
    rank 1 (each rank's piece of the other is empty); the sum of the ranks' losses must be
    the whole batch's."""
    d, res, rank = r.state, {}, r.rank
    lgp, tp_, oldp = d.lgp, d.tp_, d.oldp
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
            res[f"cp_packed/{pl}/{mode}"] = [max_rel_err(tot, lf),
                                             max_rel_err(loc.grad, full.grad[idx])]
    return res


if __name__ == "__main__":
    rank_main([neginf_shard, bad_shards, cp_packed], setup=setup)
