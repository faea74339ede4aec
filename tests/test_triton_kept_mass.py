"""Sampling replay's kept mass in one launch (triton_kernels/kept_mass.py) against the eager
formula (ppo_kernels/kept.py kept_mass), on a CUDA device where one is present, else under
the Triton interpreter (CPU tensors): float32 and float64, a number and per-row
temperatures, masked positions holding garbage (NaN, inf), sets equal to the whole row
(mass 1) and tiny ones, shapes spanning several of the interpreter's 8-wide blocks; and
ppo_loss with a kept set on the path that uses it (_backends.device_eager forced)."""

import math

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels.kept import kept_mass
from ppo_kernels.triton_kernels import kept_mass as tk

from helpers import device_path
from helpers.backends import TRITON_DEVICE as DEV, triton_ops

pytestmark = triton_ops


def _stats(b, t, dtype, seed):
    """(kept_max, kept_log_sum, row_max, log_sum, mask): the kept max at most the row max,
    a fifth of the sets the whole row; masked positions hold NaN / inf (never read)."""
    g = torch.Generator().manual_seed(seed)
    row_max = torch.randn(b, t, generator=g, dtype=torch.float64) * 5
    log_sum = torch.rand(b, t, generator=g, dtype=torch.float64) * 8
    kept_max = row_max - torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    kept_log_sum = torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    whole = torch.rand(b, t, generator=g) < 0.2  # the set is the row: mass 1
    kept_max = torch.where(whole, row_max, kept_max)
    kept_log_sum = torch.where(whole, log_sum, kept_log_sum)
    mask = torch.rand(b, t, generator=g) > 0.3
    for v in (kept_max, log_sum):
        v[~mask] = math.nan
    row_max[~mask] = math.inf
    return [v.to(dtype).to(DEV) for v in (kept_max, kept_log_sum, row_max, log_sum)] + [
        mask.to(DEV)]


@pytest.mark.parametrize("shape", [(3, 11), (1, 1), (5, 40), (0, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_row", [False, True])
def test_kept_mass_matches_the_eager_formula(shape, dtype, per_row):
    kmax, kls, rmax, ls, mask = _stats(*shape, dtype, seed=sum(shape) + per_row)
    if per_row:
        g = torch.Generator().manual_seed(7)
        temp = (0.5 + torch.rand(shape, generator=g, dtype=torch.float64)).to(dtype).to(DEV)
    else:
        temp = 0.7
    got = tk.kept_mass(kmax, kls, rmax, ls, temp, mask)
    want = kept_mass(kmax, kls, rmax, ls, temp, mask)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    tol = 2e-7 if dtype == torch.float32 else 1e-15
    torch.testing.assert_close(got, want, rtol=tol, atol=0.0)
    assert (got[mask] > 0).all()
    whole = mask & (kmax == rmax) & (kls == ls)  # the set is the row
    assert torch.equal(got[whole], torch.ones_like(got[whole]))


def test_ppo_loss_with_a_kept_set_on_the_device_path(monkeypatch):
    """A given kept set on the device path: the kept mass from the one launch, the loss and
    gradient unchanged, the kept_mass metric the eager one's within float32 rounding."""
    g = torch.Generator().manual_seed(41)
    B, T, V, k = 2, 9, 23, 5
    logits = torch.randn(B, T, V, generator=g).to(DEV)
    tokens = torch.randint(0, V, (B, T), generator=g)
    ids = (tokens.reshape(-1, 1) + torch.arange(k) * 3) % V
    sm = pk.SamplingMask(ids.reshape(-1).to(DEV), torch.arange(0, ids.numel() + 1, k).to(DEV))
    old, adv = -torch.rand(B, T, generator=g) * 2, torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    want, got, calls = device_path.eager_and_device(
        monkeypatch, tk, "kept_mass", logits, tokens.to(DEV), old.to(DEV), adv.to(DEV),
        mask.to(DEV), backend="triton", sampling_mask=sm)
    assert calls, "the device kept mass did not run"
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)
    assert 0.0 < float(want[2]["kept_mass"]) < 1.0
    torch.testing.assert_close(got[2]["kept_mass"], want[2]["kept_mass"], rtol=1e-6,
                               atol=0.0)
