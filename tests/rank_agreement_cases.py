"""The two-process cases of tests/test_rank_agreement.py, on 2 gloo processes whose group
times out after 30 s (so a rank left waiting fails the test instead of stalling it):

    python tests/rank_agreement_cases.py RANK PORT OUT_DIR   (helpers/ranks.py)

Each rank writes OUT_DIR/rank<r>.json: {case: [message, seconds]}, the message "ok" or
"<exception type>: <message>" of the call, and the seconds it took. The faults are on
rank 1 only (``one``); the healthy controls compare with the unsharded op.
"""

import time

import torch
import torch.distributed as dist

import ppo_kernels as pk

from helpers import ranks


def timed(fn):
    """[message, seconds] of fn(): "ok", or the exception's type and message."""
    t0 = time.time()
    try:
        fn()
        return ["ok", time.time() - t0]
    except Exception as e:
        return [f"{type(e).__name__}: {e}", time.time() - t0]


def cases(r):
    g = torch.Generator().manual_seed(0)
    B, T, V, H = 2, 4, 12, 5
    full = torch.randn(B, T, V, generator=g)
    tok = torch.randint(0, V, (B, T), generator=g)
    old = torch.randn(B, T, generator=g) * 0.3 - 2.0
    adv = torch.randn(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    rank = r.rank
    v0, v1 = (0, 6) if rank == 0 else (6, 12)
    loc, wloc = full[..., v0:v1].clone(), weight[v0:v1].clone()
    tp, cp = dist.group.WORLD, dist.group.WORLD
    out = []

    def case(name, fn):
        out.append(ranks.case(name, timed, fn))

    one = rank == 1
    # tensor parallel: the healthy control, then one fault on rank 1 at a time
    def healthy():
        a = pk.ppo_loss(full, tok, old, adv, mask)[0]
        b = pk.ppo_loss(loc, tok, old, adv, mask, tp_group=tp, vocab_start=v0)[0]
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (float(a), float(b))
    case("tp/healthy", healthy)
    case("tp/advantages_shape", lambda: pk.ppo_loss(
        loc, tok, old, adv[:, :3] if one else adv, mask, tp_group=tp, vocab_start=v0))
    case("tp/batch_sizes", lambda: pk.ppo_loss(
        torch.cat([loc, loc[:1]]) if one else loc, torch.cat([tok, tok[:1]]) if one else tok,
        torch.cat([old, old[:1]]) if one else old, torch.cat([adv, adv[:1]]) if one else adv,
        None, tp_group=tp, vocab_start=v0))
    other = tok.clone()
    other[0, 0] = 2  # rank 0's shard holds id 2
    if one:
        other[0, 0] = V  # an id no rank holds, where rank 0 holds the true one
    case("tp/token_differs", lambda: pk.ppo_loss(loc, other, old, adv, mask, tp_group=tp,
                                                  vocab_start=v0))
    case("tp/empty_shard", lambda: pk.ppo_loss(
        loc[..., :0] if one else loc, tok, old, adv, mask, tp_group=tp, vocab_start=v0))
    case("tp/token_logprobs_mask", lambda: pk.token_logprobs(
        loc, tok, mask[:, :2] if one else mask, tp_group=tp, vocab_start=v0))
    case("tp/from_hidden_shape", lambda: pk.ppo_loss_from_hidden(
        hidden[..., :3] if one else hidden, wloc, tok, old, adv, mask, tp_group=tp,
        vocab_start=v0))
    case("tp/token_logprobs_from_hidden_shape", lambda: pk.token_logprobs_from_hidden(
        hidden[..., :3] if one else hidden, wloc, tok, mask, tp_group=tp, vocab_start=v0))
    case("tp/score_rollout_scores", lambda: pk.score_rollout(
        loc, tok, old, adv, torch.zeros(B + 1 if one else B), mask, kl_coef=0.1,
        tp_group=tp, vocab_start=v0))
    # packed score_rollout: the packing's checks are part of the agreed validity
    ptok, pref, pval = tok.reshape(1, -1), old.reshape(1, -1), adv.reshape(1, -1)
    ploc, pfull, phid = loc.reshape(1, B * T, -1), full.reshape(1, B * T, -1), \
        hidden.reshape(1, B * T, -1)
    cu2, cu3 = torch.tensor([0, 3, B * T]), torch.tensor([0, 3, 5, B * T])
    cu_bad = torch.tensor([0, 5, 3, B * T]) if one else cu3
    def packed_healthy():
        for lg, w in ((pfull, None), (phid, weight)):
            a = (pk.score_rollout(lg, ptok, pref, pval, torch.ones(2), None, kl_coef=0.1,
                                  cu_seqlens=cu2) if w is None else
                 pk.score_rollout_from_hidden(lg, w, ptok, pref, pval, torch.ones(2), None,
                                              kl_coef=0.1, cu_seqlens=cu2))
            b = (pk.score_rollout(ploc, ptok, pref, pval, torch.ones(2), None, kl_coef=0.1,
                                  cu_seqlens=cu2, tp_group=tp, vocab_start=v0)
                 if w is None else
                 pk.score_rollout_from_hidden(lg, wloc, ptok, pref, pval, torch.ones(2),
                                              None, kl_coef=0.1, cu_seqlens=cu2,
                                              tp_group=tp, vocab_start=v0))
            for x, y in zip(a, b):
                assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
    case("tp/packed_healthy", packed_healthy)
    case("tp/score_rollout_packed_cu_seqlens", lambda: pk.score_rollout(
        ploc, ptok, pref, pval, torch.ones(3), None, kl_coef=0.1, cu_seqlens=cu_bad,
        tp_group=tp, vocab_start=v0))
    case("tp/score_rollout_packed_scores", lambda: pk.score_rollout(
        ploc, ptok, pref, pval, torch.ones(3 if one else 2), None, kl_coef=0.1,
        cu_seqlens=cu2, tp_group=tp, vocab_start=v0))
    case("tp/score_rollout_packed_num_seqs", lambda: pk.score_rollout(
        ploc, ptok, pref, pval, torch.ones(3 if one else 2), None, kl_coef=0.1,
        cu_seqlens=cu3 if one else cu2, tp_group=tp, vocab_start=v0))
    case("tp/score_rollout_from_hidden_packed_cu_seqlens", lambda: pk.score_rollout_from_hidden(
        phid, wloc, ptok, pref, pval, torch.ones(3), None, kl_coef=0.1, cu_seqlens=cu_bad,
        tp_group=tp, vocab_start=v0))
    case("tp/score_rollout_from_hidden_scores", lambda: pk.score_rollout_from_hidden(
        hidden, wloc, tok, old, adv, torch.zeros(B + 1 if one else B), mask, kl_coef=0.1,
        tp_group=tp, vocab_start=v0))
    # context parallel: each rank holds half of every sequence
    t0, t1 = (0, 2) if rank == 0 else (2, 4)
    def cp_call(**over):
        kw = dict(logits=full[:, t0:t1], tokens=tok[:, t0:t1], old_logprobs=old[:, t0:t1],
                  advantages=adv[:, t0:t1], response_mask=mask[:, t0:t1])
        kw.update(over)
        return pk.ppo_loss(cp_group=cp, policy_loss="gspo", **kw)
    case("cp/healthy", lambda: cp_call())
    bad_tok = tok[:, t0:t1].clone()
    if one:
        bad_tok[0, 0] = V + 5
    case("cp/token_range", lambda: cp_call(tokens=bad_tok))
    case("cp/batch_sizes", lambda: cp_call(
        logits=full[:1, t0:t1] if one else full[:, t0:t1],
        tokens=tok[:1, t0:t1] if one else tok[:, t0:t1],
        old_logprobs=old[:1, t0:t1] if one else old[:, t0:t1],
        advantages=adv[:1, t0:t1] if one else adv[:, t0:t1],
        response_mask=mask[:1, t0:t1] if one else mask[:, t0:t1]))
    flat = full[:, t0:t1].reshape(-1, V)
    cu_ok = torch.tensor([0, 2, 4])
    cu_bad_cp = torch.tensor([0, 3, 2]) if one else cu_ok
    case("cp/cu_seqlens", lambda: pk.ppo_loss(
        flat, tok[:, t0:t1].reshape(-1), old[:, t0:t1].reshape(-1), adv[:, t0:t1].reshape(-1),
        cu_seqlens=cu_bad_cp, cp_group=cp, policy_loss="gspo"))
    # a head sharded on its rows as a DTensor: FSDP2's shard or a vocabulary split?
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2,))
    dw = distribute_tensor(weight.clone(), mesh, [Shard(0)])
    case("dtensor/head_without_tp_group", lambda: pk.ppo_loss_from_hidden(
        hidden, dw, tok, old, adv, mask))
    def dtensor_with_group():
        a = pk.ppo_loss_from_hidden(hidden, weight, tok, old, adv, mask)[0]
        b = pk.ppo_loss_from_hidden(hidden, dw, tok, old, adv, mask,
                                    tp_group=mesh.get_group())[0]
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (float(a), float(b))
    case("dtensor/head_with_tp_group", dtensor_with_group)
    return out


if __name__ == "__main__":
    # (barrier_each: every case starts together)
    ranks.rank_main(cases, barrier_each=True, timeout_s=30)
