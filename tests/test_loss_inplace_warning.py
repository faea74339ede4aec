"""inplace_backward=True is never silently ignored: where the loss runs the two-phase path
(gspo, gspo-token, vespo, the off-policy mask) a kernel backend warns, naming
inplace_backward and the losses that honour it, and the gradient is the usual one; the
token-level losses write it over the logits without a warning."""

import warnings

import pytest
import torch

import ppo_kernels as pk

B, T, V = 2, 4, 9


def _call(policy_loss, inplace, **kw):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) - 1
    adv = torch.randn(B, T, generator=g)
    leaf = logits.clone().requires_grad_(True)
    x = leaf * 1.0
    loss, _ = pk.ppo_loss(x, tokens, old, adv, policy_loss=policy_loss,
                          inplace_backward=inplace, backend="cpu", **kw)
    loss.backward()
    return leaf.grad, x


@pytest.mark.parametrize("policy_loss,kw", [
    ("gspo", {}), ("gspo-token", {}), ("vespo", {}),
    ("vanilla", dict(off_policy_mask_threshold=0.01))])
def test_two_phase_losses_warn_and_keep_the_gradient(policy_loss, kw):
    with pytest.warns(UserWarning, match="inplace_backward") as rec:
        got, x = _call(policy_loss, True, **kw)
    msg = str(rec[0].message)
    assert "vanilla" in msg and "dppo-kl" in msg  # says which losses honour it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want, _ = _call(policy_loss, False, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("policy_loss", ["vanilla", "cispo", "sapo", "dppo-tv", "dppo-kl"])
def test_token_level_losses_write_in_place_without_a_warning(policy_loss):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, x = _call(policy_loss, True)
    want, _ = _call(policy_loss, False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(x.detach(), want)  # the logits' storage holds the gradient


def test_no_warning_without_a_gradient():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pk.ppo_loss(logits, tokens, None, torch.randn(B, T, generator=g), policy_loss="gspo",
                    inplace_backward=True, backend="cpu")
