"""ppo_kernels/rank_agreement.py: a bad input on one rank of tp_group or cp_group makes
every rank raise a ValueError naming the argument (and the rank), within seconds: no rank
waits in a collective until the process group's timeout, none aborts, none returns a
silent result. Two gloo processes (a script written to a temporary folder) whose process
group times out after 30 s, so a hang fails the test instead of stalling it; the healthy
control is the same calls without the fault, equal to the unsharded op."""

import textwrap

import pytest

from helpers.ranks import run_ranks

_SCRIPT = r'''
import datetime, json, os, sys, time
import torch
import torch.distributed as dist
import ppo_kernels as pk

def worker(rank, port, out):
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=30))
    g = torch.Generator().manual_seed(0)
    B, T, V, H = 2, 4, 12, 5
    full = torch.randn(B, T, V, generator=g)
    tok = torch.randint(0, V, (B, T), generator=g)
    old = torch.randn(B, T, generator=g) * 0.3 - 2.0
    adv = torch.randn(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    v0, v1 = (0, 6) if rank == 0 else (6, 12)
    loc, wloc = full[..., v0:v1].clone(), weight[v0:v1].clone()
    tp, cp = dist.group.WORLD, dist.group.WORLD
    res = {}

    def case(name, fn):
        t0 = time.time()
        try:
            fn()
            res[name] = ["ok", time.time() - t0]
        except Exception as e:
            res[name] = [f"{type(e).__name__}: {e}", time.time() - t0]
        dist.barrier()  # (every case starts together)

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
    cu_bad = torch.tensor([0, 3, 2]) if one else cu_ok
    case("cp/cu_seqlens", lambda: pk.ppo_loss(
        flat, tok[:, t0:t1].reshape(-1), old[:, t0:t1].reshape(-1), adv[:, t0:t1].reshape(-1),
        cu_seqlens=cu_bad, cp_group=cp, policy_loss="gspo"))
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
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
'''


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("agree")
    script = d / "agree.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    return run_ranks(script, d, timeout=240)


FAULTS = {  # case -> the argument the message names
    "tp/advantages_shape": "advantages",
    "tp/batch_sizes": "tokens",
    "tp/token_differs": "tokens",
    "tp/empty_shard": "logits",
    "tp/token_logprobs_mask": "response_mask",
    "tp/from_hidden_shape": "lm_head_weight",
    "tp/token_logprobs_from_hidden_shape": "lm_head_weight",
    "tp/score_rollout_scores": "scores",
    "tp/score_rollout_packed_cu_seqlens": "cu_seqlens",
    "tp/score_rollout_packed_scores": "scores",
    "tp/score_rollout_packed_num_seqs": "tokens",
    "tp/score_rollout_from_hidden_packed_cu_seqlens": "cu_seqlens",
    "tp/score_rollout_from_hidden_scores": "scores",
    "cp/token_range": "tokens",
    "cp/batch_sizes": "tokens",
    "cp/cu_seqlens": "cu_seqlens",
    "dtensor/head_without_tp_group": "tp_group",
}


@pytest.mark.parametrize("case", ["tp/healthy", "cp/healthy", "dtensor/head_with_tp_group",
                                  "tp/packed_healthy"])
def test_healthy_calls_run(ranks, case):
    for rank in range(2):
        assert ranks[rank][case][0] == "ok", f"rank {rank}: {ranks[rank][case][0]}"


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_a_fault_on_one_rank_is_an_error_on_every_rank(ranks, case):
    for rank in range(2):
        msg, seconds = ranks[rank][case]
        assert msg.startswith("ValueError:"), f"rank {rank}: {msg}"
        assert FAULTS[case] in msg, f"rank {rank}: the message does not name " \
                                    f"{FAULTS[case]!r}: {msg}"
        assert seconds < 10, f"rank {rank} took {seconds:.1f} s: it waited for a timeout"
    # the healthy rank says which rank's inputs were bad (a fault of both, such as a size
    # the ranks disagree on or the DTensor head, is each rank's own)
    if case not in ("tp/batch_sizes", "cp/batch_sizes", "tp/token_differs",
                    "tp/score_rollout_packed_num_seqs",
                    "dtensor/head_without_tp_group"):
        assert "rank 1" in ranks[0][case][0], ranks[0][case][0]
