"""The two-process cases of sampling replay from hidden states over a tensor-parallel
vocabulary (the LM head's rows split [0, 6) / [6, 13)), run by tests/test_from_hidden.py on
2 gloo processes (CPU):

    python tests/replay_hidden_rank_cases.py RANK PORT OUT_DIR

Each rank writes OUT_DIR/rank<r>.json: {case: max relative error against the single-process
op on the full head (float32), or "raised <message>"}.
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import ppo_kernels as pk


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def worker(rank, port, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    grp = dist.group.WORLD
    g = torch.Generator().manual_seed(1)
    B, T, H, V, cut = 2, 5, 7, 13, 6
    dt = torch.float32
    hid = torch.randn(B, T, H, generator=g, dtype=dt)
    w = torch.randn(V, H, generator=g, dtype=dt) * 0.8
    bias = torch.randn(V, generator=g, dtype=dt) * 0.3
    tok = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 0] = False
    mask[0, 4] = False
    old = torch.randn(B, T, generator=g, dtype=dt) * 0.3 - 1.0
    adv = torch.randn(B, T, generator=g, dtype=dt)
    ref = torch.randn(B, T, generator=g, dtype=dt) - 2
    ids, offs = [], [0]
    for i in range(B * T):
        k = int(torch.randint(1, 8, (), generator=g))
        row = torch.randperm(V, generator=g)[:k]
        row = row[row != tok.view(-1)[i]]
        if i % 3:  # every third set lacks its token
            row = torch.cat([row, tok.view(-1)[i:i + 1]])
        ids.append(row)
        offs.append(offs[-1] + len(row))
    sm = pk.SamplingMask(torch.cat(ids), torch.tensor(offs))
    sl = slice(0, cut) if rank == 0 else slice(cut, V)
    tp = dict(tp_group=grp, vocab_start=sl.start)
    res = {}

    def leaves(shard):
        h = hid.clone().requires_grad_(True)
        ww = (w[sl] if shard else w).clone().requires_grad_(True)
        bb = (bias[sl] if shard else bias).clone().requires_grad_(True)
        return h, ww, bb

    def compare(case, fn):
        """fn(h, w, b, extra) -> tuple of outputs; extra: the TP keywords or {}."""
        full, sh = leaves(False), leaves(True)
        a = fn(*full, {})
        b = fn(*sh, tp)
        a = a if isinstance(a, tuple) else (a,)
        b = b if isinstance(b, tuple) else (b,)
        res[f"{case}/values"] = max(rel(u.detach(), v.detach()) for u, v in zip(b, a))
        if a[0].requires_grad:
            sum(v.sum() * (i + 1) for i, v in enumerate(a) if v.requires_grad).backward()
            sum(v.sum() * (i + 1) for i, v in enumerate(b) if v.requires_grad).backward()
            res[f"{case}/d_hidden"] = rel(sh[0].grad, full[0].grad)
            res[f"{case}/d_weight"] = rel(sh[1].grad, full[1].grad[sl])
            res[f"{case}/d_bias"] = rel(sh[2].grad, full[2].grad[sl])

    for chunk in (3, None):
        compare(f"token_logprobs/chunk{chunk}", lambda h, ww, bb, e: pk.token_logprobs_from_hidden(
            h, ww, tok, mask, lm_head_bias=bb, sampling_mask=sm, return_full=True,
            return_entropy=True, entropy_over="kept", chunk_size=chunk, logit_softcap=4.0,
            backend="cpu", **e))
    compare("token_logprobs/seq_temp", lambda h, ww, bb, e: pk.token_logprobs_from_hidden(
        h, ww, tok, mask, lm_head_bias=bb, sampling_mask=sm, return_full=True,
        return_entropy=True, temperature=torch.tensor([0.7, 1.3]), chunk_size=4,
        backend="cpu", **e))
    temp_tok = 0.5 + torch.rand(B, T, generator=g)
    for case, kw in (("vanilla", dict(kl_coef=0.1)),
                     ("gspo_kept", dict(policy_loss="gspo", kl_coef=0.1, kl_logprobs="kept",
                                        entropy_coef=0.01, entropy_over="kept")),
                     ("entropy_full", dict(entropy_coef=0.02, logit_softcap=3.0)),
                     ("token_temp", dict(kl_coef=0.1, entropy_coef=0.02,
                                         temperature=temp_tok))):
        compare(f"ppo_loss/{case}", lambda h, ww, bb, e: pk.ppo_loss_from_hidden(
            h, ww, tok, old, adv, mask, ref, lm_head_bias=bb, sampling_mask=sm, chunk_size=3,
            backend="cpu", **kw, **e)[0])
    # no [N, V] logits: every chunk_logits call makes at most chunk_size rows of this
    # shard's V_r columns
    from ppo_kernels import from_hidden as fh
    shapes, real = [], fh.chunk_logits

    def spy(*a, **k):
        z = real(*a, **k)
        shapes.append(tuple(z.shape))
        return z

    fh.chunk_logits = spy
    h, ww, bb = leaves(True)
    lp = pk.ppo_loss_from_hidden(h, ww, tok, old, adv, mask, ref, lm_head_bias=bb,
                                 sampling_mask=sm, chunk_size=3, backend="cpu", **tp)[0]
    lp.backward()
    fh.chunk_logits = real
    res["chunk_shapes"] = f"{len(shapes)} {max(r for r, _ in shapes)} " \
                          f"{sorted(set(c for _, c in shapes))}"
    for kl_lp in ("full", "kept"):
        def roll(h, ww, bb, e):
            r = pk.score_rollout_from_hidden(
                h.detach(), ww.detach(), tok, ref, torch.randn(B, T, generator=torch.Generator()
                                                               .manual_seed(5)),
                torch.tensor([1.0, -0.5]), mask, lm_head_bias=bb.detach(), kl_coef=0.05,
                sampling_mask=sm, kl_logprobs=kl_lp, chunk_size=3, backend="cpu", **e)
            return tuple(r)
        compare(f"score_rollout/{kl_lp}", roll)
    try:
        pk.token_logprobs_from_hidden(hid, w[sl], tok, mask, top_p=0.9, backend="cpu", **tp)
        res["top_p"] = "no error"
    except NotImplementedError as e:
        res["top_p"] = f"raised {e}"
    bad = pk.SamplingMask(torch.tensor([0, V]), torch.tensor([0, 2] + [2] * (B * T - 1)))
    try:
        pk.token_logprobs_from_hidden(hid, w[sl], tok, mask, sampling_mask=bad, backend="cpu",
                                      **tp)
        res["out_of_range"] = "no error"
    except ValueError as e:
        res["out_of_range"] = f"raised {e}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run_then_exit

    run_then_exit(worker, int(sys.argv[1]), sys.argv[2], sys.argv[3])
