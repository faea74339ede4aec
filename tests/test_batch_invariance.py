"""Batch invariance: a row's logp, entropy, per-token loss and dlogits are bitwise the same
whether the row is alone, permuted, or inside a larger batch (given the same normaliser,
global_num_tokens). The kernels reduce each row on its own, in an order that depends on V
only (CUDA: also when the row count switches the vocabulary split; gpu_check.sh runs that
case on a GPU)."""

import pytest
import torch

from ppo_kernels import _backends

from conftest import BACKENDS, loss_params, make_inputs


def _rows(be, logits, tokens, old, adv, ref_lp, n_global):
    """(logp, entropy, loss_tok, dlogits) of every row, [N] / [N, V], flat."""
    x = be.t(logits).detach().clone().requires_grad_(True)
    mask = torch.ones(tokens.shape, dtype=torch.bool, device=x.device)
    w = torch.full(tokens.shape, 1.0 / n_global, device=x.device)
    p = loss_params(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0, kl_coef=0.1,
                    entropy_coef=0.01, temperature=0.9)
    loss, loss_tok, logp, ent = _backends.get_backend(be.name, x.device).ppo_loss(
        x, be.t(tokens), mask, be.t(old), be.t(adv), w, be.t(ref_lp), None, p)
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
