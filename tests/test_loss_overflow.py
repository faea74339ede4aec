"""float16 logits whose true gradient leaves float16's range (|g| > 65504): every backend
computes the gradient in float32 and rounds it to float16, so those entries are +-inf and
the rest are the reference's rounded values (docs/DESIGN.md, "Precision"). No error is
raised: the overflow is the caller's loss scale, as in any float16 training step."""

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from helpers.backends import BACKENDS
from ppo_kernels import reference as ref

F16_MAX = float(torch.finfo(torch.float16).max)


def _case(per_row_temperature):
    g = torch.Generator().manual_seed(3)
    B, T, V = 2, 4, 9
    x = (2 * torch.randn(B, T + 1, V, generator=g)).half()
    tokens = torch.randint(0, V, (B, T), generator=g)
    temps = (0.3 + 1.7 * torch.rand(B, T, generator=g)) if per_row_temperature else None
    t = temps if temps is not None else torch.ones(B, T)
    logp = torch.log_softmax(x[:, :T].float() / t[..., None], -1).gather(
        -1, tokens[..., None])[..., 0]
    old = logp + 0.05 * torch.randn(B, T, generator=g)  # inside the clip range
    adv = torch.randn(B, T, generator=g)
    adv[0, 1] = 3e5  # one token's gradient past 65504
    mask = torch.ones(B, T, dtype=torch.bool)
    return x, tokens, old, adv, mask, temps


@pytest.mark.parametrize("per_row_temperature", [False, True])
@pytest.mark.parametrize("be", BACKENDS)
def test_float16_gradient_overflow_is_inf_where_the_true_value_overflows(be, per_row_temperature):
    x, tokens, old, adv, mask, temps = _case(per_row_temperature)
    kw = dict(loss_agg_mode="token-sum", clip_eps_low=0.2)
    rkw = dict(kw, temperature=temps.double().numpy()) if temps is not None else kw
    _, _, want = ref.ppo_loss(x.double().numpy(), tokens.numpy(), old.double().numpy(),
                              adv.double().numpy(), mask.numpy(), **rkw)
    over = np.abs(want) > F16_MAX + 16  # past 65520, float16 rounds to inf
    assert 0 < over.sum() < want[:, :-1].size  # the case overflows some entries, not all
    z = be.t(x).requires_grad_(True)
    loss, _ = pk.ppo_loss(z, be.t(tokens), be.t(old), be.t(adv), be.t(mask),
                          temperature=be.t(temps) if temps is not None else 1.0,
                          backend=be.name, **kw)
    loss.backward()
    got = z.grad.float().cpu().numpy()
    assert np.isfinite(float(loss.detach()))
    assert not np.isnan(got).any()
    assert np.array_equal(np.isinf(got), over)
    assert np.array_equal(np.sign(got[over]), np.sign(want[over]))
    fin = ~over
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-3, atol=2e-3 * np.abs(want[fin]).max())
