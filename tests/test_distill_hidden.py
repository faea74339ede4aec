"""pk.distill_loss_from_hidden: the chunked LM-head path against pk.distill_loss on the
materialised logits and the numpy reference (loss, metrics, gradients to hidden, the head
weight and its bias), chunk sizes that do not divide N, the soft cap, grad_scale, and its
argument checks."""

import numpy as np
import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import reference as ref

from helpers.asserts import raises_naming
from helpers.backends import BACKENDS_CPU, KERNELS_CPU
from helpers.inputs import make_teacher
from test_distill import on


def _inputs(gen, b=2, t=3, h=6, v=23, dtype=torch.float32, raw=True):
    hidden = torch.randn(b, t + (1 if raw else 0), h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) * 0.7).to(dtype)
    bias = (torch.randn(v, generator=gen) * 0.3).to(dtype)
    te = make_teacher(b * t, v, gen, sizes=[3, 0, v, 1, 5, 2][:b * t])
    mask = torch.tensor([[True, True, False], [True, False, True]])[:b, :t]
    return hidden, w, bias, te, mask


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("chunk", [1, 4, None])
@pytest.mark.parametrize("cap", [None, 4.0])
def test_matches_reference(be, chunk, cap, gen):
    hidden, w, bias, te, mask = _inputs(gen)
    leaves = [be.t(x).clone().requires_grad_() for x in (hidden, w, bias)]
    loss, m = pk.distill_loss_from_hidden(*leaves[:2], on(be, te), be.t(mask),
                                          lm_head_bias=leaves[2], logit_softcap=cap,
                                          chunk_size=chunk, temperature=0.9,
                                          loss_agg_mode="seq-mean-token-mean",
                                          grad_scale=0.5, backend=be.name)
    (loss * 0.5).backward()
    # the reference on the float64 logits, chained through the head by hand
    hd, wd, bd = hidden.double(), w.double(), bias.double()
    x = hd @ wd.T + bd
    zc = x if cap is None else cap * torch.tanh(x / cap)
    rl, rg, rm = ref.distill_loss(zc, te.offsets, te.token_ids, te.logprobs.double(), mask,
                                  temperature=0.9, loss_agg_mode="seq-mean-token-mean")
    dz = torch.from_numpy(rg) * 0.5
    if cap is not None:
        dz = dz * (1 - torch.tanh(x / cap) ** 2)
    assert float(loss) == pytest.approx(rl, rel=2e-6)
    for k, v in rm.items():
        assert float(m[k]) == pytest.approx(v, rel=1e-5, abs=1e-6), k
    for got, want in ((leaves[0].grad, dz @ wd),
                      (leaves[1].grad, torch.einsum("btv,bth->vh", dz, hd)),
                      (leaves[2].grad, dz.sum((0, 1)))):
        got = got.cpu().double()
        assert float((got - want).abs().max()) <= 2e-5 * float(want.abs().max()) + 1e-9


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_same_as_distill_loss_on_logits(be, gen):
    hidden, w, _, te, mask = _inputs(gen, raw=False)
    a = be.t(hidden).clone().requires_grad_()
    loss_h, m_h = pk.distill_loss_from_hidden(a, be.t(w), on(be, te), be.t(mask), chunk_size=2,
                                              backend=be.name)
    loss_h.backward()
    x = be.t(hidden).clone().requires_grad_()
    logits = x @ be.t(w).T
    loss_l, m_l = pk.distill_loss(logits, on(be, te), be.t(mask), backend=be.name)
    loss_l.backward()
    assert float(loss_h) == pytest.approx(float(loss_l), rel=1e-6)
    torch.testing.assert_close(a.grad, x.grad, rtol=1e-5, atol=1e-6)
    assert {k: float(v) for k, v in m_h.items()} == pytest.approx(
        {k: float(v) for k, v in m_l.items()}, rel=1e-6)


@pytest.mark.parametrize("be", KERNELS_CPU)
def test_none_mode_on_kernels_is_an_error(be, gen):
    hidden, w, _, te, mask = _inputs(gen)
    raises_naming(lambda: pk.distill_loss_from_hidden(be.t(hidden), be.t(w), on(be, te),
                                                      loss_agg_mode="none", backend=be.name),
                  "loss_agg_mode")


def test_none_mode_on_torch(gen):
    hidden, w, _, te, mask = _inputs(gen)
    per, _ = pk.distill_loss_from_hidden(hidden, w, te, mask, loss_agg_mode="none",
                                         backend="torch")
    kl = ref.distill_loss(hidden.double() @ w.double().T, te.offsets, te.token_ids,
                          te.logprobs.double(), mask, loss_agg_mode="none")[0]
    np.testing.assert_allclose(per.detach().numpy(), kl, rtol=2e-6, atol=1e-7)


def test_bad_arguments(gen):
    hidden, w, bias, te, mask = _inputs(gen)
    raises_naming(lambda: pk.distill_loss_from_hidden(hidden, w[:, :3], te), "lm_head_weight")
    raises_naming(lambda: pk.distill_loss_from_hidden(hidden, w.double(), te), "lm_head_weight")
    raises_naming(lambda: pk.distill_loss_from_hidden(hidden, w, te, lm_head_bias=bias[:3]),
                  "lm_head_bias")
    raises_naming(lambda: pk.distill_loss_from_hidden(hidden, w, te, chunk_size=0), "chunk_size")
    raises_naming(lambda: pk.distill_loss_from_hidden(hidden, w, te, logit_softcap=-1.0),
                  "logit_softcap")
    raises_naming(lambda: pk.distill_loss_from_hidden(hidden[:1], w, te), "teacher.offsets")
    raises_naming(lambda: pk.distill_loss_from_hidden(hidden, w, te._replace(
        token_ids=te.token_ids + 100)), "teacher.token_ids")
    raises_naming(lambda: pk.distill_loss_from_hidden(hidden, w, (1, 2)), "teacher")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mode", ["token-mean", "none"])
def test_head_module_equals_the_tensors(bias, mode, gen):
    """The head given as a torch.nn.Linear (the op runs as its forward, lm_head.py): the same
    loss, metrics and gradients (hidden, weight, bias) as its weight and bias as tensors;
    a module whose forward is not Linear's, or a separate lm_head_bias, a TypeError naming
    the argument."""
    hidden, w, b, te, mask = _inputs(gen)
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias)
    with torch.no_grad():
        head.weight.copy_(w)
        if bias:
            head.bias.copy_(b)
    backend = "torch" if mode == "none" else "auto"
    out = []
    for as_module in (True, False):
        head.zero_grad()
        h = hidden.clone().requires_grad_()
        wt = head if as_module else head.weight
        kw = {} if as_module else dict(lm_head_bias=head.bias)
        loss, m = pk.distill_loss_from_hidden(h, wt, te, mask, chunk_size=2,
                                              loss_agg_mode=mode, backend=backend, **kw)
        (loss.sum() if loss.dim() else loss).backward()
        grads = [h.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
        out.append((loss.detach(), m, [g.clone() for g in grads]))
    (l1, m1, g1), (l2, m2, g2) = out
    assert torch.equal(l1, l2)
    assert m1.keys() == m2.keys() and all(torch.equal(m1[k], m2[k]) for k in m1)
    for a, c in zip(g1, g2):
        assert torch.equal(a, c)

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    raises_naming(lambda: pk.distill_loss_from_hidden(hidden, Scaled(6, 23), te, mask),
                  "lm_head_weight", (TypeError,))
    raises_naming(lambda: pk.distill_loss_from_hidden(hidden, head, te, mask,
                                                      lm_head_bias=torch.zeros(23)),
                  "lm_head_bias", (TypeError,))
