"""The two-process cases of tests/test_distill_tp.py, run as a script on 2 gloo processes
(helpers/ranks.py):

    python tests/distill_rank_cases.py RANK PORT OUT_DIR

Each rank writes OUT_DIR/rank<r>.json: {case: [relative errors of loss, metrics and this
rank's gradient against the single-process distill_loss on the whole vocabulary] or
"raised <type>: <message>" / "no error"}. Cases: "uneven/<dtype>/tail=<>/<mode>" (a
[0, 5) / [5, 13) split, -inf shards, empty / single / whole-vocabulary / confident sets,
masked rows), "even_raw/<dtype>" (the default vocab_start, the raw [B, T + 1, V] output),
"dtensor" (a Shard(-1) DTensor), "hidden/<dtype>/cap=<>" (the head's rows, a bias, a soft
cap), "bf16", "packed/<mode>" (cu_seqlens), "random_splits" (the worst float64 error over
12 random splits), "confident" (V = 1000 float32 against float64, next to the kernel's
error), "bad/..." (bad inputs, on one rank or all) and "after" (the group still works).
"""

import torch
import torch.distributed as dist

import ppo_kernels as pk

from helpers.asserts import max_rel_err
from helpers.inputs import teacher_of
from helpers.ranks import rank_main

B, T, V, CUT = 3, 5, 13, 5


def compare(res, name, full, teacher, mask, v0, v1, group, kw, shard_fn=None, raw=False):
    try:
        a_in = full.clone().requires_grad_()
        loc = full[..., v0:v1].clone().requires_grad_()
        a_loss, a_m = pk.distill_loss(a_in, teacher, mask, backend="cpu", **kw)
        x = loc if shard_fn is None else shard_fn(full.clone().requires_grad_())
        b_loss, b_m = pk.distill_loss(x, teacher, mask, **kw) if shard_fn is not None else \
            pk.distill_loss(loc, teacher, mask, tp_group=group, vocab_start=v0, **kw)
        w = torch.linspace(0.5, 1.5, a_loss.numel(), dtype=a_loss.dtype).view_as(a_loss)
        (a_loss * w).sum().backward()
        (b_loss * w).sum().backward()
        errs = [max_rel_err(b_loss.detach(), a_loss.detach())]
        errs += [max_rel_err(b_m[k], a_m[k]) for k in ("kl", "student_mass", "teacher_tail_mass",
                                               "num_tokens", "num_seqs")]
        if shard_fn is None:
            gl = loc.grad
        else:
            gl = x.grad.to_local() if hasattr(x.grad, "to_local") else x.grad
            gl = gl[..., v0:v1] if gl.shape[-1] == full.shape[-1] else gl
        errs.append(max_rel_err(gl, a_in.grad[..., v0:v1]))
        errs.append(float(a_in.grad[..., v0:v1].abs().max()))  # (a nonzero gradient)
        res[name] = [e if e == e else 1e30 for e in errs]
    except Exception as e:  # reported, the test fails on it
        res[name] = f"raised {type(e).__name__}: {e}"


def raises(res, name, fn):
    try:
        fn()
        res[name] = "no error"
    except Exception as e:
        res[name] = f"raised {type(e).__name__}: {e}"


def _start(r):
    return r.rank, dist.group.WORLD, {}


def uneven_and_even_raw(r):
    """The uneven split (per dtype, tail, mode) and an even split of the raw [B, T + 1, V]
    output with the default vocab_start."""
    rank, group, res = _start(r)
    for dtype in (torch.float32, torch.float64):
        g = torch.Generator().manual_seed(0)
        lg = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3).to(dtype)
        lg[0, 1, 0] = 40.0  # a confident token (the teacher's confident id 0)
        lg[1, 0, CUT:] = float("-inf")  # a whole shard banned on a row
        lg[2, 2, :CUT] = float("-inf")
        teacher = teacher_of(B, T, V, g, dtype)
        # the banned rows' sets hold ids of the live shard only
        ids = teacher.token_ids.clone()
        for (bb, tt, lo, hi) in ((1, 0, 0, CUT), (2, 2, CUT, V)):
            i = bb * T + tt
            s, e = int(teacher.offsets[i]), int(teacher.offsets[i + 1])
            ids[s:e] = torch.arange(lo, hi)[:e - s] if e - s <= hi - lo else ids[s:e]
        # (a whole-vocabulary set on a banned row would put mass on -inf logits: keep k small)
        teacher = pk.SparseLogprobs(ids, teacher.offsets, teacher.logprobs)
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[2, 4] = False
        # the banned rows are sized 0 / 1 / 3 / 5 / V by position: position 5 (b 1, t 0) has
        # size 0, position 12 (b 2, t 2) size 3; both fit their live shard
        v0, v1 = ((0, CUT), (CUT, V))[rank]
        d = str(dtype).split(".")[-1]
        for tail in (True, False):
            for mode in ("token-mean", "seq-mean-token-sum", "none"):
                compare(res, f"uneven/{d}/tail={tail}/{mode}", lg, teacher, mask, v0, v1, group,
                        dict(tail=tail, loss_agg_mode=mode, temperature=0.7))
        # an even split with the default vocab_start, and the raw [B, T + 1, V] output
        V2 = 12
        g2 = torch.Generator().manual_seed(1)
        lg2 = (torch.randn(B, T + 1, V2, generator=g2, dtype=torch.float64) * 2).to(dtype)
        t2 = teacher_of(B, T, V2, g2, dtype)
        e0, e1 = rank * 6, rank * 6 + 6
        try:
            a_in = lg2.clone().requires_grad_()
            loc = lg2[..., e0:e1].clone().requires_grad_()
            la, _ = pk.distill_loss(a_in, t2, None, backend="cpu")
            lb, _ = pk.distill_loss(loc, t2, None, tp_group=group)
            la.backward()
            lb.backward()
            res[f"even_raw/{d}"] = [max_rel_err(lb.detach(), la.detach()),
                                    max_rel_err(loc.grad, a_in.grad[..., e0:e1]),
                                    float(loc.grad[:, -1].abs().max())]
        except Exception as e:
            res[f"even_raw/{d}"] = f"raised {type(e).__name__}: {e}"
    return res


def dtensor(r):
    rank, group, res = _start(r)
    # a DTensor sharded on the vocabulary (torch.chunk's split of 12: 6 / 6)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = init_device_mesh("cpu", (2,))
        g3 = torch.Generator().manual_seed(2)
        lg3 = torch.randn(B, T, 12, generator=g3) * 2
        t3 = teacher_of(B, T, 12, g3, torch.float32)
        full = lg3.clone().requires_grad_()
        la, ma = pk.distill_loss(full, t3, None, backend="cpu")
        leaf = distribute_tensor(lg3.clone(), mesh, [Shard(-1)]).requires_grad_()
        lb, mb = pk.distill_loss(leaf, t3, None)
        la.backward()
        lb.backward()
        e0 = rank * 6
        res["dtensor"] = [max_rel_err(lb.detach(), la.detach()), max_rel_err(mb["kl"], ma["kl"]),
                          max_rel_err(leaf.grad.to_local(), full.grad[..., e0:e0 + 6])]
    except Exception as e:
        res["dtensor"] = f"raised {type(e).__name__}: {e}"
    return res


def hidden(r):
    rank, group, res = _start(r)
    # from hidden states: the LM head's rows split [0, 5) / [5, 13), with a bias and a
    # soft cap; d hidden summed over the group
    for dtype in (torch.float32, torch.float64):
        d = str(dtype).split(".")[-1]
        g5 = torch.Generator().manual_seed(4)
        H, V5 = 6, 13
        hid = torch.randn(B, T, H, generator=g5, dtype=torch.float64).to(dtype)
        wt = torch.randn(V5, H, generator=g5, dtype=torch.float64).to(dtype)
        bs = torch.randn(V5, generator=g5, dtype=torch.float64).to(dtype)
        t5 = teacher_of(B, T, V5, g5, dtype)
        m5 = torch.ones(B, T, dtype=torch.bool)
        m5[0, 3] = False
        v0, v1 = ((0, CUT), (CUT, V5))[rank]
        for cap in (None, 4.0):
            name = f"hidden/{d}/cap={cap}"
            try:
                ha, wa, ba = (x.clone().requires_grad_() for x in (hid, wt, bs))
                hb, wb, bb = (x.clone().requires_grad_() for x in (hid, wt[v0:v1], bs[v0:v1]))
                la, _ = pk.distill_loss_from_hidden(ha, wa, t5, m5, lm_head_bias=ba,
                                                    logit_softcap=cap, temperature=0.9,
                                                    backend="cpu")
                lb, _ = pk.distill_loss_from_hidden(hb, wb, t5, m5, lm_head_bias=bb,
                                                    logit_softcap=cap, temperature=0.9,
                                                    tp_group=group, vocab_start=v0)
                la.backward()
                lb.backward()
                res[name] = [max_rel_err(lb.detach(), la.detach()), max_rel_err(hb.grad, ha.grad),
                             max_rel_err(wb.grad, wa.grad[v0:v1]),
                             max_rel_err(bb.grad, ba.grad[v0:v1])]
            except Exception as e:
                res[name] = f"raised {type(e).__name__}: {e}"
    # from hidden states, loss_agg_mode="none" (the torch path runs it with tp_group)
    try:
        ha, wa = hid.double().clone().requires_grad_(), wt.double().clone().requires_grad_()
        hb = hid.double().clone().requires_grad_()
        wb = wt.double()[v0:v1].clone().requires_grad_()
        t5d = pk.SparseLogprobs(t5.token_ids, t5.offsets, t5.logprobs.double())
        la, _ = pk.distill_loss_from_hidden(ha, wa, t5d, m5, loss_agg_mode="none",
                                            backend="torch")
        lb, _ = pk.distill_loss_from_hidden(hb, wb, t5d, m5, loss_agg_mode="none",
                                            tp_group=group, vocab_start=v0)
        wn = torch.linspace(0.5, 1.5, la.numel(), dtype=la.dtype).view_as(la)
        (la * wn).sum().backward()
        (lb * wn).sum().backward()
        res["hidden/none"] = [max_rel_err(lb.detach(), la.detach()), max_rel_err(hb.grad, ha.grad),
                              max_rel_err(wb.grad, wa.grad[v0:v1])]
    except Exception as e:
        res["hidden/none"] = f"raised {type(e).__name__}: {e}"
    return res


def bf16_and_packed(r):
    rank, group, res = _start(r)
    # bfloat16 logits (the partials in float32, as the kernels), and packed sequences
    # (cu_seqlens, the seq-mean modes read them) on the uneven split
    g8 = torch.Generator().manual_seed(7)
    x8 = torch.randn(1, 10, V, generator=g8) * 3
    t8 = teacher_of(1, 10, V, g8, torch.float32)
    v0, v1 = ((0, CUT), (CUT, V))[rank]
    compare(res, "bf16", x8.bfloat16(), t8, None, v0, v1, group, dict(tail=True))
    cu = torch.tensor([0, 3, 3, 7, 10])
    # (a float64 teacher: the float32 one's whole-vocabulary set has a mass of 1 + 3e-8,
    # where the CPU kernel's gradient takes the mass as 1 and autograd's does not)
    t8d = teacher_of(1, 10, V, torch.Generator().manual_seed(8), torch.float64)
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        compare(res, f"packed/{mode}", x8.double(), t8d, None, v0, v1, group,
                dict(loss_agg_mode=mode, cu_seqlens=cu, max_seqlen=4))
    return res


def random_splits(r):
    rank, group, res = _start(r)
    # random splits: V in [2, 40] CUT anywhere (a shard of one entry included), random set
    # sizes 0..V, masks, temperatures, float64 against the single-process kernel
    g7 = torch.Generator().manual_seed(6)
    worst = 0.0
    for trial in range(12):
        V7 = int(torch.randint(2, 41, (1,), generator=g7))
        cut7 = (1, V7 - 1)[trial % 2] if trial < 4 else \
            int(torch.randint(1, V7, (1,), generator=g7))
        B7 = int(torch.randint(1, 4, (1,), generator=g7))
        T7 = int(torch.randint(1, 5, (1,), generator=g7))
        x7 = torch.randn(B7, T7, V7, generator=g7, dtype=torch.float64) * float(
            torch.rand(1, generator=g7) * 8)
        ids7, lps7, off7 = [], [], [0]
        for i in range(B7 * T7):
            kk = int(torch.randint(0, V7 + 1, (1,), generator=g7))
            lt7 = torch.log_softmax(torch.randn(V7, generator=g7, dtype=torch.float64) * 3, 0)
            sel = torch.randperm(V7, generator=g7)[:kk]
            ids7.append(sel)
            lps7.append(lt7[sel])
            off7.append(off7[-1] + kk)
        t7 = pk.SparseLogprobs(torch.cat(ids7), torch.tensor(off7), torch.cat(lps7))
        m7 = torch.rand(B7, T7, generator=g7) > 0.2
        w0, w1 = ((0, cut7), (cut7, V7))[rank]
        sub = {}
        compare(sub, "r", x7, t7, m7, w0, w1, group,
                dict(tail=bool(trial % 3), temperature=float(0.5 + torch.rand(1, generator=g7)),
                     loss_agg_mode=("token-mean", "none", "seq-mean-token-mean")[trial % 3]))
        if isinstance(sub["r"], str):
            worst = sub["r"]
            break
        worst = max(worst, max(sub["r"][:-1]))
    res["random_splits"] = worst
    return res


def confident(r):
    rank, group, res = _start(r)
    # float32 at a larger vocabulary (1000 = 500 / 500, top-20 sets): confident rows, a
    # teacher close to the student on half of the rows (a tiny kl), against float64: the
    # split's error next to the single-process kernel's own
    g6 = torch.Generator().manual_seed(5)
    N6, V6, K6 = 32, 1000, 20
    x6 = torch.randn(1, N6, V6, generator=g6) * 3
    x6[0, ::4, 7] = 30.0
    tl = torch.log_softmax(torch.randn(N6, V6, generator=g6, dtype=torch.float64) * 3, -1)
    tl[::2] = torch.log_softmax(torch.log_softmax(x6[0, ::2].double(), -1) + 1e-4 * torch.randn(
        N6 // 2, V6, generator=g6, dtype=torch.float64), -1)
    top = tl.topk(K6, -1)
    t6 = pk.SparseLogprobs(top.indices.reshape(-1), torch.arange(0, N6 * K6 + 1, K6),
                           top.values.reshape(-1).float())
    t6d = pk.SparseLogprobs(t6.token_ids, t6.offsets, t6.logprobs.double())
    try:
        l64, _ = pk.distill_loss(x6.double(), t6d, None, loss_agg_mode="none", backend="cpu")
        x64 = x6.double().requires_grad_()
        pk.distill_loss(x64, t6d, None, backend="cpu")[0].backward()
        xa = x6.clone().requires_grad_()
        la, _ = pk.distill_loss(xa, t6, None, loss_agg_mode="none", backend="cpu")
        xb = x6[..., rank * 500:(rank + 1) * 500].clone().requires_grad_()
        lb, _ = pk.distill_loss(xb, t6, None, loss_agg_mode="none", tp_group=group)
        w6 = torch.full_like(la, 1.0 / N6)
        (la * w6).sum().backward()
        (lb * w6).sum().backward()
        g64 = x64.grad[..., rank * 500:(rank + 1) * 500]
        res["confident"] = [float((la.detach().double() - l64).abs().max()),
                            float((lb.detach().double() - l64).abs().max()),
                            max_rel_err(xa.grad[..., rank * 500:(rank + 1) * 500], g64), max_rel_err(xb.grad, g64)]
    except Exception as e:
        res["confident"] = f"raised {type(e).__name__}: {e}"
    return res


def bad_inputs(r):
    rank, group, res = _start(r)
    # bad inputs: an id outside every shard (V) on both ranks, a negative id on both;
    # a teacher log-prob > 0 on rank 1 only; ranks with different ids, different masks;
    # shards that overlap
    g4 = torch.Generator().manual_seed(3)
    lg4 = torch.randn(2, 3, 12, generator=g4)
    t4 = teacher_of(2, 3, 12, g4, torch.float32)
    loc4 = lg4[..., rank * 6:rank * 6 + 6].clone()
    bad_ids = t4.token_ids.clone()
    bad_ids[t4.offsets[3]] = 12
    raises(res, "bad/id_outside", lambda: pk.distill_loss(
        loc4, pk.SparseLogprobs(bad_ids, t4.offsets, t4.logprobs), None, tp_group=group))
    neg = t4.token_ids.clone()
    neg[0] = -1
    raises(res, "bad/negative_id", lambda: pk.distill_loss(
        loc4, pk.SparseLogprobs(neg, t4.offsets, t4.logprobs), None, tp_group=group))
    lp = t4.logprobs.clone()
    if rank == 1:
        lp[2] = 0.5
    raises(res, "bad/logprob_rank1", lambda: pk.distill_loss(
        loc4, pk.SparseLogprobs(t4.token_ids, t4.offsets, lp), None, tp_group=group))
    other = t4.token_ids.clone()
    if rank == 1:
        other[1] = 9  # position 1's set {0, 7} is {0, 9} on rank 1
    raises(res, "bad/different_ids", lambda: pk.distill_loss(
        loc4, pk.SparseLogprobs(other, t4.offsets, t4.logprobs), None, tp_group=group))
    mask4 = torch.ones(2, 3, dtype=torch.bool)
    mask4[0, 0] = rank == 0
    raises(res, "bad/different_masks", lambda: pk.distill_loss(
        loc4, t4, mask4, tp_group=group))
    raises(res, "bad/hidden_id_outside", lambda: pk.distill_loss_from_hidden(
        torch.randn(2, 3, 4), torch.randn(6, 4), pk.SparseLogprobs(bad_ids, t4.offsets,
                                                                   t4.logprobs),
        tp_group=group))
    raises(res, "bad/hidden_head_rank1", lambda: pk.distill_loss_from_hidden(
        torch.randn(2, 3, 4), torch.randn(6, 4 + rank), t4, tp_group=group))
    raises(res, "bad/overlap", lambda: pk.distill_loss(
        lg4[..., (0, 4)[rank]:(6, 12)[rank]].clone(), t4, None, tp_group=group,
        vocab_start=(0, 4)[rank]))
    # after every bad call the group still works (no rank left waiting)
    x = torch.ones(1)
    dist.all_reduce(x, group=group)
    res["after"] = float(x)
    return res


if __name__ == "__main__":
    rank_main([uneven_and_even_raw, dtensor, hidden, bf16_and_packed, random_splits, confident,
               bad_inputs])
