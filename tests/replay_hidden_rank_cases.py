"""The two-process cases of sampling replay from hidden states over a tensor-parallel
vocabulary (the LM head's rows split [0, 6) / [6, 13)), run by tests/test_from_hidden.py on
2 gloo processes (CPU):

    python tests/replay_hidden_rank_cases.py RANK PORT OUT_DIR   (helpers/ranks.py)

Each rank writes OUT_DIR/rank<r>.json: {case: max relative error against the single-process
op on the full head (float32), or "raised <message>"}.
"""

import types

import torch
import torch.distributed as dist

import ppo_kernels as pk

from helpers.asserts import max_rel_err
from helpers.inputs import random_csr
from helpers.ranks import rank_main

B, T, H, V, CUT = 2, 5, 7, 13, 6


def setup(r):
    """The inputs every rank draws alike, this rank's rows of the head and its TP keywords."""
    g = torch.Generator().manual_seed(1)
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
    sm, _ = random_csr(B, T, V, g, kmax=7, tokens=tok, lacks_token=lambda i: i % 3 == 0)
    temp_tok = 0.5 + torch.rand(B, T, generator=g)
    sl = slice(0, CUT) if r.rank == 0 else slice(CUT, V)
    return types.SimpleNamespace(hid=hid, w=w, bias=bias, tok=tok, mask=mask, old=old, adv=adv,
                                 ref=ref, sm=sm, temp_tok=temp_tok, sl=sl,
                                 tp=dict(tp_group=dist.group.WORLD, vocab_start=sl.start))


def leaves(d, shard):
    h = d.hid.clone().requires_grad_(True)
    ww = (d.w[d.sl] if shard else d.w).clone().requires_grad_(True)
    bb = (d.bias[d.sl] if shard else d.bias).clone().requires_grad_(True)
    return h, ww, bb


def compare(d, res, case, fn):
    """fn(h, w, b, extra) -> tuple of outputs; extra: the TP keywords or {}."""
    full, sh = leaves(d, False), leaves(d, True)
    a = fn(*full, {})
    b = fn(*sh, d.tp)
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    res[f"{case}/values"] = max(max_rel_err(u.detach(), v.detach()) for u, v in zip(b, a))
    if a[0].requires_grad:
        sum(v.sum() * (i + 1) for i, v in enumerate(a) if v.requires_grad).backward()
        sum(v.sum() * (i + 1) for i, v in enumerate(b) if v.requires_grad).backward()
        res[f"{case}/d_hidden"] = max_rel_err(sh[0].grad, full[0].grad)
        res[f"{case}/d_weight"] = max_rel_err(sh[1].grad, full[1].grad[d.sl])
        res[f"{case}/d_bias"] = max_rel_err(sh[2].grad, full[2].grad[d.sl])


def token_logprobs(r):
    d, res = r.state, {}
    tok, mask, sm = d.tok, d.mask, d.sm
    for chunk in (3, None):
        compare(d, res, f"token_logprobs/chunk{chunk}",
                lambda h, ww, bb, e: pk.token_logprobs_from_hidden(
                    h, ww, tok, mask, lm_head_bias=bb, sampling_mask=sm, return_full=True,
                    return_entropy=True, entropy_over="kept", chunk_size=chunk,
                    logit_softcap=4.0, backend="cpu", **e))
    compare(d, res, "token_logprobs/seq_temp", lambda h, ww, bb, e: pk.token_logprobs_from_hidden(
        h, ww, tok, mask, lm_head_bias=bb, sampling_mask=sm, return_full=True,
        return_entropy=True, temperature=torch.tensor([0.7, 1.3]), chunk_size=4,
        backend="cpu", **e))
    return res


def ppo_loss(r):
    d, res = r.state, {}
    for case, kw in (("vanilla", dict(kl_coef=0.1)),
                     ("gspo_kept", dict(policy_loss="gspo", kl_coef=0.1, kl_logprobs="kept",
                                        entropy_coef=0.01, entropy_over="kept")),
                     ("entropy_full", dict(entropy_coef=0.02, logit_softcap=3.0)),
                     ("token_temp", dict(kl_coef=0.1, entropy_coef=0.02,
                                         temperature=d.temp_tok))):
        compare(d, res, f"ppo_loss/{case}", lambda h, ww, bb, e: pk.ppo_loss_from_hidden(
            h, ww, d.tok, d.old, d.adv, d.mask, d.ref, lm_head_bias=bb, sampling_mask=d.sm,
            chunk_size=3, backend="cpu", **kw, **e)[0])
    return res


def chunk_shapes(r):
    """No [N, V] logits: every chunk_logits call makes at most chunk_size rows of this
    shard's V_r columns."""
    from ppo_kernels import head_chunks
    d = r.state
    shapes, real = [], head_chunks.chunk_logits

    def spy(*a, **k):
        z = real(*a, **k)
        shapes.append(tuple(z.shape))
        return z

    head_chunks.chunk_logits = spy
    try:
        h, ww, bb = leaves(d, True)
        lp = pk.ppo_loss_from_hidden(h, ww, d.tok, d.old, d.adv, d.mask, d.ref, lm_head_bias=bb,
                                     sampling_mask=d.sm, chunk_size=3, backend="cpu", **d.tp)[0]
        lp.backward()
    finally:
        head_chunks.chunk_logits = real
    return {"chunk_shapes": f"{len(shapes)} {max(r for r, _ in shapes)} "
                            f"{sorted(set(c for _, c in shapes))}"}


def score_rollout(r):
    d, res = r.state, {}
    for kl_lp in ("full", "kept"):
        def roll(h, ww, bb, e):
            out = pk.score_rollout_from_hidden(
                h.detach(), ww.detach(), d.tok, d.ref,
                torch.randn(B, T, generator=torch.Generator().manual_seed(5)),
                torch.tensor([1.0, -0.5]), d.mask, lm_head_bias=bb.detach(), kl_coef=0.05,
                sampling_mask=d.sm, kl_logprobs=kl_lp, chunk_size=3, backend="cpu", **e)
            return tuple(out)
        compare(d, res, f"score_rollout/{kl_lp}", roll)
    return res


def refusals(r):
    d, res = r.state, {}
    try:
        pk.token_logprobs_from_hidden(d.hid, d.w[d.sl], d.tok, d.mask, top_p=0.9, backend="cpu",
                                      **d.tp)
        res["top_p"] = "no error"
    except NotImplementedError as e:
        res["top_p"] = f"raised {e}"
    bad = pk.SamplingMask(torch.tensor([0, V]), torch.tensor([0, 2] + [2] * (B * T - 1)))
    try:
        pk.token_logprobs_from_hidden(d.hid, d.w[d.sl], d.tok, d.mask, sampling_mask=bad,
                                      backend="cpu", **d.tp)
        res["out_of_range"] = "no error"
    except ValueError as e:
        res["out_of_range"] = f"raised {e}"
    return res


if __name__ == "__main__":
    rank_main([token_logprobs, ppo_loss, chunk_shapes, score_rollout, refusals], setup=setup)
