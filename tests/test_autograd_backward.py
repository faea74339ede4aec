"""The backward of the fused loss: grad_output != 1 (gradient accumulation, loss scaling,
every backward under torch.compile) must cost no [N, V] allocation and scale in float32,
and a grad_scale known before the forward must cost no pass at all. Plus: no host read of
a tensor value anywhere in forward or backward (CUDA-graph capture, no stalls)."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_kernels as pk
from ppo_kernels import _checks
from ppo_kernels import reference as ref

from conftest import BACKENDS, assert_grad_close, make_inputs

CASES = [(1.0, 1.0), (1.0, 1 / 3), (1 / 3, 1 / 3), (1 / 3, 1.0), (0.5, 2.0)]


def _run(be, inp, dtype, grad_scale, mult, inplace):
    leaf = be.t(inp["full"][:, :-1]).to(dtype).detach().clone().requires_grad_(True)
    x = leaf * 1.0  # a non-leaf in front of the loss, as a model's output is
    seen = {}
    x.register_hook(lambda g: seen.setdefault("ptr", g.data_ptr()) and None)
    loss, _ = pk.ppo_loss(x, be.t(inp["tokens"]), be.t(inp["old"]), be.t(inp["adv"]),
                          be.t(inp["mask"]), be.t(inp["ref"]), kl_coef=0.1,
                          entropy_coef=0.01, grad_scale=grad_scale,
                          inplace_backward=inplace, backend=be.name)
    # the forward's dlogits buffer (the loss's autograd node saved it for the backward)
    saved = getattr(loss.grad_fn, "saved_tensors", ())
    kept = saved[0].data_ptr() if saved else None
    del saved
    (loss * mult).backward()
    return leaf.grad, loss.detach(), seen["ptr"], kept, x.data_ptr()


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("inplace", [False, True], ids=["fresh", "inplace"])
@pytest.mark.parametrize("grad_scale,mult", CASES, ids=[f"gs{a:.2f}-x{b:.2f}" for a, b in CASES])
def test_any_grad_output_any_grad_scale(be, inplace, grad_scale, mult, gen):
    inp = make_inputs(2, 5, 37, gen)
    grad, loss, ptr, kept, x_ptr = _run(be, inp, torch.float32, grad_scale, mult, inplace)
    e_loss, _, e_grad = ref.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"],
                                     inp["mask"], inp["ref"], kl_coef=0.1, entropy_coef=0.01)
    assert float(loss) == pytest.approx(e_loss, rel=2e-6, abs=2e-6)  # grad_scale: a hint
    assert_grad_close(grad, mult * e_grad, 3e-6)
    if be.name == "torch":
        return  # plain autograd: allocates as usual
    # the gradient handed to the model is the forward's own buffer (scaled in place), or
    # the logits' storage with inplace_backward: no [N, V] allocation in the backward
    assert ptr == (x_ptr if inplace else kept)


@pytest.mark.parametrize("be", [p for p in BACKENDS if p.values[0].name != "torch"])
def test_bf16_gradient_scaled_in_float32(be, gen):
    """(loss / 3).backward() on bf16 logits: the scale is applied to the float32 value and
    rounded once. Multiplying by 1/3 rounded to bf16 (0.333984) biased every entry by
    +0.195%; over many entries the mean relative deviation shows it."""
    inp = make_inputs(2, 8, 257, gen, dtype=torch.bfloat16)
    grad, *_ = _run(be, inp, torch.bfloat16, 1.0, 1 / 3, False)
    _, _, e_grad = ref.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"], inp["mask"],
                                inp["ref"], kl_coef=0.1, entropy_coef=0.01)
    e = e_grad / 3
    big = np.abs(e) > 1e-3 * np.abs(e).max()
    dev = (grad.float().cpu().numpy()[big] / e[big]) - 1.0
    assert abs(dev.mean()) < 5e-4, f"mean relative deviation {dev.mean():.2e}"


def test_retained_graph_replays_with_other_scales(gen):
    inp = make_inputs(2, 4, 31, gen)
    x = inp["full"][:, :-1].clone().requires_grad_(True)
    loss, _ = pk.ppo_loss(x, inp["tokens"], inp["old"], inp["adv"], inp["mask"], backend="cpu")
    _, _, e_grad = ref.ppo_loss(inp["base"], inp["tokens"], inp["old"], inp["adv"], inp["mask"])
    for mult in (0.25, 1.0, 3.0):
        x.grad = None
        (loss * mult).backward(retain_graph=True)
        assert_grad_close(x.grad, mult * e_grad, 3e-6, what=f"x{mult}")


class _ScalarReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (what .item(), float(),
    bool() and boolean indexing dispatch to)."""

    HOST_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero",
                  "aten::item", "aten::masked_select"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.HOST_READS:
            self.reads.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("be", BACKENDS)
def test_no_host_read_in_forward_or_backward(be, gen, monkeypatch):
    """Every op as it runs on a device: the values of tokens and grad_output are never
    read on the host (checked here by treating CPU tensors as device tensors)."""
    monkeypatch.setattr(_checks, "host_readable", lambda x: False)
    inp = make_inputs(2, 5, 37, gen)
    x = be.t(inp["full"]).detach().clone().requires_grad_(True)
    tok, mask = be.t(inp["tokens"]), be.t(inp["mask"])
    vals = be.t(torch.randn(2, 5, generator=gen))
    with _ScalarReads() as mode:
        loss, met = pk.ppo_loss(x, tok, be.t(inp["old"]), be.t(inp["adv"]), mask,
                                be.t(inp["ref"]), kl_coef=0.1, entropy_coef=0.01,
                                backend=be.name)
        (loss / 3).backward()
        lp, h = pk.token_logprobs(x, tok, mask, return_entropy=True, backend=be.name)
        (lp.sum() + h.sum()).backward()
        out = pk.score_rollout(x.detach(), tok, be.t(inp["ref"]), vals, be.t(torch.ones(2)),
                               mask, kl_coef=0.05, backend=be.name)
        pk.gae(out.rewards, vals, mask, backend=be.name)
        pk.kl_penalized_rewards(be.t(torch.ones(2)), out.logprobs, be.t(inp["ref"]), mask,
                                kl_coef=0.1)
        pk.value_loss(vals.requires_grad_(True), vals.detach(), out.returns, mask)[0].backward()
    assert mode.reads == []
