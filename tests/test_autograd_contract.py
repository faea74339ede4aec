"""The autograd contract of the fused ops (ppo_kernels/_autograd.py): every backward gives
exactly its own gradient when autograd is driven beyond one plain loss.backward()
(retained graphs, autograd.grad, tensor hooks, copying saved-tensor hooks), a second
derivative is a clear error on the kernel backends, inplace_backward refuses overlapping or
changed logits, and torch.func / torch.compile(dynamic=True) / torch.jit.trace either work
or say they do not. Each case runs its control on backend="torch"."""

import io

import pytest
import torch

import ppo_kernels as pk
from helpers.backends import BACKENDS_NO_INTERP, backend_params
from helpers.inputs import make_inputs

B, T, V, H = 3, 5, 13, 8
BACKENDS = backend_params(cuda=True)  # triton under the interpreter at these small shapes
KERNELS = [p for p in BACKENDS if p.values[0].name != "torch"]
PATHS = ["vanilla", "gspo", "hidden", "hidden-gspo", "inplace"]


def _inputs(seed=0):
    return make_inputs(B, T, V, torch.Generator().manual_seed(seed), layout="raw")


def _loss_fn(be, path, inp, gs=1.0):
    """(leaves, f): f() is the loss of ``path`` on be, a fresh forward each call, with the
    leaves (logits, or hidden and head) whose gradients the tests read."""
    kw = dict(backend=be.name, grad_scale=gs, kl_coef=0.1, entropy_coef=0.01)
    if "gspo" in path:
        kw.update(policy_loss="gspo", clip_eps_low=3e-3, clip_eps_high=4e-3)
    args = [be.t(inp[k]) for k in ("tokens", "old", "adv", "mask", "ref")]
    if path.startswith("hidden"):
        g = torch.Generator().manual_seed(1)
        h = torch.randn(B, T + 1, H, generator=g).to(be.device).requires_grad_(True)
        w = (0.5 * torch.randn(V, H, generator=g)).to(be.device).requires_grad_(True)
        return [h, w], lambda: pk.ppo_loss_from_hidden(h, w, *args, chunk_size=4, **kw)[0]
    x = be.t(inp["full"]).float().detach().clone().requires_grad_(True)
    if path == "inplace":
        # the gradient is written over a non-leaf copy (the caller promises not to read it)
        return [x], lambda: pk.ppo_loss(x * 1.0, *args, inplace_backward=True, **kw)[0]
    return [x], lambda: pk.ppo_loss(x, *args, **kw)[0]


def _grads(leaves):
    out = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    return out


def _assert_multiple(got, base, k, what):
    for a, b in zip(got, base):
        torch.testing.assert_close(a, k * b, rtol=2e-6, atol=1e-7, msg=what)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("gs", [1.0, 0.5])
def test_retained_graph_sums_exactly(be, path, gs):
    """backward(retain_graph=True) then (2 * loss).backward(): .grad is 3x the gradient."""
    inp = _inputs()
    leaves, f = _loss_fn(be, path, inp, gs)
    f().backward()
    base = _grads(leaves)
    loss = f()
    loss.backward(retain_graph=True)
    (2 * loss).backward()
    _assert_multiple(_grads(leaves), base, 3.0, f"{be} {path}")
    loss = f()  # three backwards through one graph
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    (0.5 * loss).backward()
    _assert_multiple(_grads(leaves), base, 2.5, f"{be} {path} x3")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("be", BACKENDS)
def test_autograd_grad_results_stay_put(be, path):
    """A gradient returned by autograd.grad(..., retain_graph=True) and one captured by a
    tensor hook are not changed by a later backward through the same graph."""
    inp = _inputs(1)
    leaves, f = _loss_fn(be, path, inp)
    f().backward()
    base = _grads(leaves)
    loss = f()
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    kept = [g.clone() for g in first]
    captured = []
    handle = leaves[0].register_hook(lambda g: captured.append(g) or g)
    second = torch.autograd.grad(3 * loss, leaves)
    handle.remove()
    _assert_multiple(first, kept, 1.0, "first result rescaled by the second backward")
    _assert_multiple(first, base, 1.0, "first")
    _assert_multiple(second, base, 3.0, "second")
    _assert_multiple(captured, base[:1], 3.0, "hook")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("be", BACKENDS)
def test_copying_saved_tensor_hooks(be, path):
    """Activation offloading copies every saved tensor on unpack: grad_scale=0.5,
    backward(1) then (3 * loss).backward() gives 4x."""
    inp = _inputs(2)
    leaves, f = _loss_fn(be, path, inp, gs=0.5)
    f().backward()
    base = _grads(leaves)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t.clone()):
        loss = f()
    loss.backward(retain_graph=True)
    (3 * loss).backward()
    _assert_multiple(_grads(leaves), base, 4.0, f"{be} {path}")


@pytest.mark.parametrize("path", ["vanilla", "gspo", "hidden", "inplace"])
@pytest.mark.parametrize("be", KERNELS)
def test_second_derivative_is_a_clear_error(be, path):
    leaves, f = _loss_fn(be, path, _inputs(3))
    with pytest.raises(RuntimeError, match="differentiable once.*backend='torch'"):
        torch.autograd.grad(f(), leaves, create_graph=True)


def test_second_derivative_token_logprobs_is_a_clear_error():
    inp = _inputs(3)
    x = inp["full"].float().requires_grad_(True)
    logp = pk.token_logprobs(x, inp["tokens"], inp["mask"], backend="cpu")
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(logp.sum(), x, create_graph=True)


def test_second_derivative_on_torch_is_exact():
    """The control: the eager composite has its second derivative (gradgradcheck)."""
    inp = make_inputs(2, 3, 5, torch.Generator().manual_seed(4), dtype=torch.float64)
    x = inp["full"].requires_grad_(True)

    def f(z):
        return pk.ppo_loss(z, inp["tokens"], inp["old"], inp["adv"], inp["mask"], inp["ref"],
                           kl_coef=0.1, entropy_coef=0.01, backend="torch")[0]

    assert torch.autograd.gradgradcheck(f, (x,))


def test_inplace_backward_refuses_overlapping_rows():
    inp = _inputs(5)
    base = torch.randn(64, dtype=torch.float32)
    x = base.as_strided((2, 3, 7), (12, 4, 1)).requires_grad_(True)
    tok = inp["tokens"][:2, :3] % 7
    for ok, view in ((False, x), (True, inp["full"][:2, :3, :7].float().clone())):
        args = (tok, inp["old"][:2, :3], inp["adv"][:2, :3])
        if ok:  # the control: a plain tensor of the same shape is accepted
            pk.ppo_loss(view.requires_grad_(True) * 1.0, *args, inplace_backward=True,
                        backend="cpu")
        else:
            with pytest.raises(ValueError, match="logits"):
                pk.ppo_loss(view, *args, inplace_backward=True, backend="cpu")
    # a slice of the raw [B, T + 1, V] output has gaps, not overlaps: accepted
    raw = inp["full"].float().clone().requires_grad_(True)
    pk.ppo_loss(raw[:, :T] * 1.0, inp["tokens"], inp["old"], inp["adv"], inp["mask"],
                inplace_backward=True, backend="cpu")[0].backward()


def test_rows_disjoint_at_its_edges():
    """The stride rule behind that refusal at its edges: a stride equal to what the smaller
    dimensions span overlaps (a row's last entry is the next row's first); dimensions of
    size 1 are left out, whatever their stride."""
    from ppo_kernels._checks import rows_disjoint

    base = torch.zeros(64)
    assert not rows_disjoint(base.as_strided((2, 3), (2, 1)))  # [0, 2] is [1, 0]
    assert rows_disjoint(base.as_strided((2, 3), (3, 1)))
    assert rows_disjoint(base.as_strided((1, 3), (0, 1)))  # one row: its stride is not used
    assert rows_disjoint(base.as_strided((2, 1, 3), (3, 0, 1)))


@pytest.mark.parametrize("be", KERNELS)
def test_inplace_backward_detects_logits_changed_before_backward(be):
    inp = _inputs(6)
    x = be.t(inp["full"]).float().requires_grad_(True)
    y = x * 1.0
    loss, _ = pk.ppo_loss(y, be.t(inp["tokens"]), be.t(inp["old"]), be.t(inp["adv"]),
                          be.t(inp["mask"]), inplace_backward=True, backend=be.name)
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError, match="logits"):
        loss.backward()


@pytest.mark.parametrize("be", backend_params(interp=False, cuda=True))
def test_torch_func(be):
    """torch.func.grad / vjp / vmap: exact on the eager composite (against autograd);
    a clear error naming the limitation on the kernel backends."""
    inp = _inputs(7)
    x = be.t(inp["full"]).float()
    args = [be.t(inp[k]) for k in ("tokens", "old", "adv", "mask")]

    def f(z):
        return pk.ppo_loss(z, *args, backend=be.name)[0]

    calls = {"grad": lambda: torch.func.grad(f)(x),
             "vjp": lambda: torch.func.vjp(f, x)[1](torch.ones((), device=x.device))[0],
             "vmap": lambda: torch.func.vmap(lambda z, t, o, a, m: pk.ppo_loss(
                 z, t, o, a, m, backend=be.name)[0])(x[:, :T], *args)}
    if be.name != "torch":
        for name, call in calls.items():
            with pytest.raises(NotImplementedError, match="torch.func.*backend='torch'"):
                call()
        return
    xg = x.clone().requires_grad_(True)
    f(xg).backward()
    torch.testing.assert_close(calls["grad"](), xg.grad)
    torch.testing.assert_close(calls["vjp"](), xg.grad)
    per_row = torch.stack([pk.ppo_loss(x[b, :T], *(a[b] for a in args), backend="torch")[0]
                           for b in range(B)])
    torch.testing.assert_close(calls["vmap"](), per_row)


@pytest.mark.parametrize("be", BACKENDS_NO_INTERP)
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_compile_dynamic_matches_eager(be, policy_loss):
    torch._dynamo.reset()
    inp = _inputs(8)
    args = [be.t(inp[k]) for k in ("tokens", "old", "adv", "mask", "ref")]
    kw = dict(backend=be.name, policy_loss=policy_loss, kl_coef=0.1, clip_eps_low=0.1)

    def f(z):
        return pk.ppo_loss(z, *args, **kw)[0]

    x1 = be.t(inp["full"]).float().requires_grad_(True)
    x2 = x1.detach().clone().requires_grad_(True)
    f(x1).backward()
    # (inductor's on-disk graph cache, once it holds an entry of another test's dynamic
    # graph, fails its own guard lookup with KeyError 'args' in torch 2.14: compile afresh)
    with torch._inductor.config.patch(fx_graph_cache=False):
        out = torch.compile(f, fullgraph=True, dynamic=True)(x2)
        out.backward()
    torch.testing.assert_close(out, f(x1.detach()))
    torch.testing.assert_close(x2.grad, x1.grad)


def test_jit_trace_matches_eager():
    inp = _inputs(9)
    x = inp["full"].float()

    def f(z):
        return pk.ppo_loss(z, inp["tokens"], inp["old"], inp["adv"], inp["mask"],
                           backend="cpu")[0]

    with pytest.warns(torch.jit.TracerWarning):
        traced = torch.jit.trace(f, (x,))
    torch.testing.assert_close(traced(x), f(x))


def test_rollout_loads_with_weights_only():
    inp = _inputs(10)
    r = pk.score_rollout(inp["full"].float(), inp["tokens"], inp["ref"], inp["adv"],
                         inp["adv"][:, 0], inp["mask"], kl_coef=0.1)
    buf = io.BytesIO()
    torch.save(r, buf)
    buf.seek(0)
    back = torch.load(buf)  # weights_only=True, torch's default
    assert isinstance(back, pk.Rollout)
    for a, b in zip(back, r):
        torch.testing.assert_close(a, b)


def test_whiten_constant_input_with_eps_zero():
    mask = torch.ones(2, 4, dtype=torch.bool)
    out = pk.whiten(torch.full((2, 4), 3.0), mask, eps=0.0)
    assert torch.equal(out, torch.zeros(2, 4))
    # the control: a varying input is whitened as with eps = 0 exactly
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    want = (x - x.mean()) / x.flatten().std()
    torch.testing.assert_close(pk.whiten(x, mask, eps=0.0), want)
