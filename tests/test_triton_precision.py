"""Precision of the Triton row statistics on confident rows (docs/DESIGN.md, "Precision").

A confident row (one logit 16-30 above the rest, as LLM policies give) carries its non-top
mass in blocks whose own max lies far below the row's. The Triton sweep takes each block's
exps against the block's max and merges blocks with al = exp((m_lo - m_hi) / temperature)
(_math.stats_merge). With that shift rounded to float32 (error up to 2^-24 |dm|, 4.8e-7
relative at |dm| = 16, one error for every entry of the low side) logp and H of such rows
came out 3x less accurate than the entries' own exps allow; the shift is now formed in
float64 and its rounding error folded into al.

The bounds are float32 roundings of the sums and exps (a few 6e-8 ulps), not the shift's:
logp and H relative to the float64 reference (ppo_kernels/reference.py). Under the
interpreter the vocabulary block is 32 wide (_config.INTERPRET_BLOCK_V); on a GPU the
blocks are wider, fewer merges, the same bound.
"""

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as ref

from helpers.backends import TRITON_DEVICE, triton_ops

DEV = TRITON_DEVICE


def _rel(got, want):
    got = got.detach().double().cpu().numpy()
    want = np.asarray(want, dtype=np.float64)
    return np.abs(got - want) / np.abs(want)


@triton_ops
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_confident_row_pinned_merge_shift():
    """32 logits at a = 1 + 2^-21 in the first block, the token alone at 17 in the next:
    a - 17 = -(16 - 2^-21) lies halfway between two float32 neighbours (spacing 2^-20), so
    a float32 shift is off by 2^-21 = 4.8e-7 and so was logp (5.0e-7 relative, measured
    with the float32 shift); now 7e-8 (logp) and 9e-8 (H). (The CPU kernel, which rounds
    x - max once per entry, gives 5.0e-7 here too: every entry shares that rounding.)"""
    a = 1.0 + 2.0 ** -21
    x = torch.full((1, 1, 33), a, dtype=torch.float32)
    x[0, 0, 32] = 17.0
    assert float(x[0, 0, 0]) - 17.0 != float(torch.tensor(a) - 17.0)  # the shift rounds
    tokens = torch.tensor([[32]])
    mask = torch.ones(1, 1)
    rlp, rent = ref.token_logprobs(x.double(), tokens, mask, 1.0)
    lp, ent = pk.token_logprobs(x.to(DEV), tokens.to(DEV), mask.to(DEV),
                                return_entropy=True, backend="triton")
    assert _rel(lp, rlp).max() < 1.5e-7, _rel(lp, rlp)
    assert _rel(ent, rent).max() < 1.5e-7, _rel(ent, rent)


@triton_ops
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_confident_rows_logp_entropy_relative():
    """32 rows of randn * 2 logits (V = 1000) with the token 20-30 above: logp and H within
    5e-7 relative of the reference, H's RMS within 2e-7. Measured here: 2.3e-7 and 2.6e-7,
    RMS 1.1e-7 (over seeds 0-5 of a 48-row variant, at most 3.0e-7 and 3.3e-7); with the
    float32 shift 8.8e-7 and 9.3e-7 (the CPU kernel: 9.7e-7 and 8.6e-7, RMS 2.9e-7)."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 1, 32, 1000
    x = torch.randn(B, T, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, T), generator=g)
    top = 20 + 10 * torch.rand(B, T, generator=g)
    x.scatter_(-1, tokens[..., None], top[..., None])
    mask = torch.ones(B, T)
    rlp, rent = ref.token_logprobs(x.double(), tokens, mask, 1.0)
    lp, ent = pk.token_logprobs(x.to(DEV), tokens.to(DEV), mask.to(DEV),
                                return_entropy=True, backend="triton")
    e_lp, e_h = _rel(lp, rlp), _rel(ent, rent)
    assert e_lp.max() < 5e-7 and e_h.max() < 5e-7, (e_lp.max(), e_h.max())
    assert np.sqrt((e_h ** 2).mean()) < 2e-7, np.sqrt((e_h ** 2).mean())
