"""Batch invariance, across the kernels: a row's logp, entropy, per-token loss and dlogits
are bitwise the same whether the row is alone, permuted, or inside a larger batch (given
the same normaliser, global_num_tokens), on every backend through the fused loss, and for
the raw Triton ops. The kernels reduce each row on its own, in an order that depends on V
only (CUDA: also when the row count switches the vocabulary split;
tests/gpu/batch_invariance.py checks that case on a GPU)."""

import numpy as np
import pytest
import torch

from ppo_kernels import _backends
from ppo_kernels.loss import KernelInputs

from helpers.backends import BACKENDS, triton_ops
from helpers.inputs import make_case, make_inputs, ppo_inputs
from helpers.raw_ops import loss_params, run_ppo

OPS = torch.ops.ppo_kernels


def _rows(be, logits, tokens, old, adv, ref_lp, n_global):
    """(logp, entropy, loss_tok, dlogits) of every row, [N] / [N, V], flat."""
    x = be.t(logits).detach().clone().requires_grad_(True)
    mask = torch.ones(tokens.shape, dtype=torch.bool, device=x.device)
    w = torch.full(tokens.shape, 1.0 / n_global, device=x.device)
    p = loss_params(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0, kl_coef=0.1,
                    entropy_coef=0.01, temperature=0.9)
    kin = KernelInputs(be.t(tokens), mask, be.t(old), be.t(adv), w, be.t(ref_lp), None, None)
    loss, loss_tok, logp, ent = _backends.get_backend(be.name, x.device).ppo_loss(x, kin, p)
    loss.backward()
    V = logits.shape[-1]
    return (logp.reshape(-1).cpu(), ent.reshape(-1).cpu(), loss_tok.reshape(-1).cpu(),
            x.grad.reshape(-1, V).cpu())


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("V", [37, 300])
def test_row_bits_do_not_depend_on_the_batch(be, V, gen):
    B, T = (2, 4) if be.small else (16, 64)
    inp = make_inputs(B, T, V, gen, padding="none")
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    logits, tokens = flat(inp["full"][:, :T]), flat(inp["tokens"])
    old, adv, ref_lp = flat(inp["old"]), flat(inp["adv"]), flat(inp["ref"])
    n = B * T
    whole = _rows(be, logits[None], tokens[None], old[None], adv[None], ref_lp[None], n)
    perm = torch.randperm(n, generator=gen)
    permuted = _rows(be, logits[perm][None], tokens[perm][None], old[perm][None],
                     adv[perm][None], ref_lp[perm][None], n)
    for k, i in enumerate(torch.randperm(n, generator=gen)[:3].tolist()):
        alone = _rows(be, logits[i:i + 1][None], tokens[i:i + 1][None], old[i:i + 1][None],
                      adv[i:i + 1][None], ref_lp[i:i + 1][None], n)
        for name, a, w in zip(("logp", "entropy", "loss_tok", "dlogits"), alone, whole):
            assert torch.equal(a[0], w[i]), f"{name} of row {i}: alone != in the batch"
    shaped = _rows(be, logits.reshape(B, T, V), tokens.reshape(B, T), old.reshape(B, T),
                   adv.reshape(B, T), ref_lp.reshape(B, T), n)
    for name, a, w in zip(("logp", "entropy", "loss_tok", "dlogits"), shaped, whole):
        assert torch.equal(a, w), f"{name}: [B, T] batch != [1, B * T] batch"
    inv = torch.argsort(perm)
    for name, a, w in zip(("logp", "entropy", "loss_tok", "dlogits"), permuted, whole):
        assert torch.equal(a[inv], w), f"{name}: permuted batch != batch"


# ------------------------------------------------------------------ the raw Triton ops
# ppo_kernels::triton_* called directly (on CUDA when a device is present, else under the
# interpreter): the fused loss's and token_logprobs_fwd's own outputs, -inf logits and IS
# weights, a row alone, in a permuted batch and after other sequences.

def _row_outputs(logits, tokens, mask, inp, rows):
    """For each (b, t) in rows: (logp, entropy, loss_tok, dlogits row) of the fused loss
    run on that row alone (a [1, 1, V] view of the same logits), plus token_logprobs."""
    acc = inp["acc"]
    res = []
    for b, t in rows:
        sub = {k: (None if inp[k] is None else np.asarray(inp[k])[b:b + 1, t:t + 1])
               for k in ("old", "adv", "ref", "isw", "w")}
        sub["acc"] = acc
        out = run_ppo(logits[b:b + 1, t:t + 1], tokens[b:b + 1, t:t + 1].contiguous(),
                       mask[b:b + 1, t:t + 1].contiguous(), sub, ent_coef=0.05)
        lp = OPS.triton_token_logprobs_fwd(logits[b:b + 1, t:t + 1],
                                           tokens[b:b + 1, t:t + 1].contiguous(),
                                           mask[b:b + 1, t:t + 1].contiguous(), 1.0, True)
        res.append((out[2][0, 0], out[3][0, 0], out[1][0, 0], out[4][0, 0], lp[0][0, 0],
                    lp[1][0, 0]))
    return res


@triton_ops
def test_triton_ops_batch_invariance_bitwise():
    """A row's logp, entropy, loss_tok and dlogits are bitwise the same
    alone, in a permuted batch, and inside a bigger batch (one program per row; the
    autotune key has no row count, so the block size - the reduction order - is that of V
    alone)."""
    logits, tokens, mask = make_case(B=3, T=4, V=100, padding="none", neginf=True, seed=25)
    inp = ppo_inputs(logits, tokens, mask, seed=26, with_isw=True)
    full = run_ppo(logits, tokens, mask, inp, ent_coef=0.05)
    lp_full = OPS.triton_token_logprobs_fwd(logits, tokens, mask, 1.0, True)
    rows = [(0, 0), (1, 2), (2, 3)]
    for (b, t), alone in zip(rows, _row_outputs(logits, tokens, mask, inp, rows)):
        want = (full[2][b, t], full[3][b, t], full[1][b, t], full[4][b, t], lp_full[0][b, t],
                lp_full[1][b, t])
        for a, w in zip(alone, want):
            assert torch.equal(a, w), (b, t)
    perm = torch.tensor([2, 0, 1])
    pinp = {k: (v if k == "acc" or v is None else np.asarray(v)[perm.numpy()])
            for k, v in inp.items()}
    pout = run_ppo(logits[perm], tokens[perm], mask[perm], pinp, ent_coef=0.05)
    for i in (1, 2, 3, 4):
        assert torch.equal(pout[i], full[i][perm]), i
    # a bigger batch: the same rows after three more sequences
    more, mtok, mmask = make_case(B=3, T=4, V=100, padding="none", seed=27)
    big = torch.cat([more, logits]), torch.cat([mtok, tokens]), torch.cat([mmask, mask])
    minp = ppo_inputs(more, mtok, mmask, seed=28, with_isw=True)
    binp = {k: (v if k == "acc" else np.concatenate([minp[k], inp[k]])) for k, v in inp.items()}
    bout = run_ppo(*big, binp, ent_coef=0.05)
    for i in (1, 2, 3, 4):
        assert torch.equal(bout[i][3:], full[i]), i
