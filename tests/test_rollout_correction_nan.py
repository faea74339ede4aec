"""A NaN in rollout_logprobs (or old_logprobs) on a valid token follows DESIGN.md's rule in
every rollout_correction mode: the loss is NaN and so is that token's gradient row (the
sequence modes: the whole sequence's rows), never a silent mask; on a masked position the
same NaN changes nothing."""

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import rollout_correction as rc
from ppo_kernels.spec import ROLLOUT_CORRECTIONS

B, T, V = 2, 4, 7


def _batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) - 1
    adv = torch.randn(B, T, generator=g)
    rollout = old + 0.05 * torch.randn(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3] = False
    return logits, tokens, old, adv, rollout, mask


def _run(mode, backend, nan_at, which="rollout"):
    logits, tokens, old, adv, rollout, mask = _batch()
    if which is not None:
        (rollout if which == "rollout" else old)[nan_at] = float("nan")
    x = logits.clone().requires_grad_(True)
    loss, met = pk.ppo_loss(x, tokens, old, adv, mask, rollout_logprobs=rollout,
                            rollout_correction=mode, backend=backend)
    loss.backward()
    return loss.detach(), met, x.grad


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("which", ["rollout", "old"])
@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_nan_on_a_valid_token_propagates_in_every_mode(mode, which, backend):
    loss, _, grad = _run(mode, backend, (0, 1), which)
    assert torch.isnan(loss), f"{mode}: a NaN {which} log-prob on a valid token gave a finite loss"
    assert torch.isnan(grad[0, 1]).any(), f"{mode}: the token's gradient row is not NaN"
    assert torch.isfinite(grad[1]).all(), f"{mode}: the NaN reached another sequence"


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_nan_on_a_masked_token_is_ignored(mode):
    clean = _run(mode, "cpu", None, None)
    dirty = _run(mode, "cpu", (1, 3), "rollout")  # (1, 3) is masked
    assert torch.isfinite(dirty[0])
    torch.testing.assert_close(dirty[0], clean[0])
    torch.testing.assert_close(dirty[2], clean[2])


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_weights_nan_where_the_ratio_is_nan(mode):
    """The weights themselves: NaN on the token (token modes) or its sequence (sequence
    modes), finite elsewhere."""
    _, _, old, _, rollout, mask = _batch()
    rollout[0, 1] = float("nan")
    lo, hi = rc.bounds(mode, 2.0)
    w = rc.weights(old.double(), rollout.double(), mask, mode, lo, hi)
    nan_rows = w[0].isnan() if mode.endswith("seq") else w[0, 1:2].isnan()
    assert nan_rows.all(), w
    assert torch.isfinite(w[1]).all()
