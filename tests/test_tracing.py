"""The ops under the tracers of every supported torch (2.6 to the newest): torch.jit.trace
of a call whose logits require grad records and replays the loss and its gradient; nothing
in the package calls locals() (dynamo in torch 2.11 cannot trace it: "Unsupported: builtin
locals"; 2.14 can), and ppo_loss's written-out keyword record stays complete.
torch.compile itself: tests/test_autograd_contract.py."""

import ast
import inspect
import os
import warnings

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import loss as loss_module

PACKAGE = os.path.dirname(os.path.abspath(pk.__file__))


def _package_sources():
    for root, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    yield path, ast.parse(fh.read())


def test_no_locals_call_in_the_package():
    calls = [f"{os.path.relpath(p, PACKAGE)}:{n.lineno}" for p, tree in _package_sources()
             for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id in ("locals", "vars")]
    assert not calls, calls


def test_ppo_loss_option_record_names_every_argument():
    tree = ast.parse(inspect.getsource(loss_module.ppo_loss))
    records = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and [getattr(t, "id", None) for t in n.targets] == ["options"]]
    assert len(records) == 1
    keys = [k.arg for k in records[0].keywords]
    assert all(isinstance(k.value, ast.Name) and k.value.id == k.arg
               for k in records[0].keywords)
    assert keys == list(inspect.signature(loss_module.ppo_loss).parameters)


def _inputs(seed=0, B=2, T=5, V=11):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T + 1, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = torch.log_softmax(x[:, :T], -1).gather(-1, tokens[..., None])[..., 0] \
        + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    return x, tokens, old, adv, mask


@pytest.mark.parametrize("kw", [dict(clip_eps_low=0.1), dict(kl_coef=0.1, entropy_coef=0.01)])
def test_jit_trace_with_grad_records_loss_and_gradient(kw):
    """The fused single pass: the trace's check re-runs the call under no_grad, where the
    logits made inside it do not require grad; the recorded call writes the gradient all
    the same, and the replay's backward gives the eager gradient."""
    x, tokens, old, adv, mask = _inputs()
    fresh = lambda: x.clone().requires_grad_(True)  # noqa: E731

    def f(z):
        return pk.ppo_loss(z * 1.0, tokens, old, adv, mask, old, backend="cpu", **kw)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(f, (fresh(),))  # check_trace on
    want_in, got_in = fresh(), fresh()
    want = f(want_in)
    want.backward()
    got = traced(got_in)
    got.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_in.grad, want_in.grad, rtol=0, atol=0)
    assert want_in.grad.abs().max() > 0


def test_jit_trace_of_the_two_phase_path_says_so():
    """The two-phase path (here GSPO) differentiates its [B, T] middle by autograd inside
    the call, with or without grad: torch.jit.trace cannot record that, so a
    NotImplementedError names the path and torch.compile (not a TracingCheckError)."""
    x, tokens, old, adv, mask = _inputs()

    def f(z):
        return pk.ppo_loss(z * 1.0, tokens, old, adv, mask, backend="cpu", policy_loss="gspo",
                           clip_eps_low=3e-3, clip_eps_high=4e-3)[0]

    for z in (x.clone().requires_grad_(True), x.clone()):
        with pytest.raises(NotImplementedError, match="two-phase.*torch.compile"):
            torch.jit.trace(f, (z,))


def test_jit_trace_of_inplace_backward():
    """inplace_backward=True writes the gradient into the logits: with grad, a trace says
    it cannot record that; without grad it records the ordinary call."""
    x, tokens, old, adv, mask = _inputs()

    def f(z):
        return pk.ppo_loss(z * 1.0, tokens, old, adv, mask, backend="cpu",
                           inplace_backward=True)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        with pytest.raises(NotImplementedError, match="inplace_backward.*torch.compile"):
            torch.jit.trace(f, (x.clone().requires_grad_(True),))
        traced = torch.jit.trace(f, (x.clone(),))
    torch.testing.assert_close(traced(x.clone()), f(x.clone()), rtol=0, atol=0)


def test_jit_trace_of_token_logprobs_with_grad():
    x, tokens, _, adv, mask = _inputs(1)

    def f(z):
        return (pk.token_logprobs(z, tokens, mask, backend="cpu") * adv).sum()

    a = x.clone().requires_grad_(True)
    b = x.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(f, (a,))
    f(a).backward()
    traced(b).backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)


def test_jit_trace_records_the_metrics():
    """The metrics are recorded as the metrics op, not computed once while tracing: a
    replay on other logits gives that call's metrics (entropy and ratio_mean follow the
    logits), as eager mode does."""
    x, tokens, old, adv, mask = _inputs()

    def f(z):
        loss, m = pk.ppo_loss(z, tokens, old, adv, mask, backend="cpu")
        return loss, m["entropy"], m["ratio_mean"]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(f, (x.clone(),))
    other = x * 3.0 + 1.0
    want, got = f(other), traced(other)
    assert not torch.equal(want[1], f(x)[1])  # (the entropy does change with the logits)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
