"""The test suite's faster Triton interpreter (tests/helpers/triton_interpreter.py): the
kernels give the same bits with it as with Triton's own interpreter, and it is in place
(else the Triton cases run at the slow interpreter's pace, which only costs time)."""

import pytest
import torch

import ppo_kernels as pk
from helpers import triton_interpreter
from helpers.backends import triton_interpreter as needs_interpreter

B, T, V = 2, 5, 37  # V crosses the interpreter's 32-wide vocabulary block


def gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(seed):
    g = gen(seed)
    logits = torch.randn(B, T, V, generator=g) * 3
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    old = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0] + 0.1 * torch.randn(
        B, T, generator=g)
    return logits, tokens, mask, old, torch.randn(B, T, generator=g), old - 0.05


def _loss(seed, **options):
    logits, tokens, mask, old, adv, ref = _inputs(seed)
    x = logits.requires_grad_()
    loss, metrics = pk.ppo_loss(x, tokens, old, adv, mask, ref_logprobs=ref, backend="triton",
                                **options)
    loss.backward()
    return [loss.detach(), x.grad, *metrics.values()]


def _token_logprobs(seed):
    logits, tokens, mask, *_ = _inputs(seed)
    return list(pk.token_logprobs(logits, tokens, mask, temperature=0.7, return_entropy=True,
                                  backend="triton"))


def _gae(seed):
    g = gen(seed)
    rewards, values = torch.randn(B, 11, generator=g), torch.randn(B, 11, generator=g)
    mask = torch.rand(B, 11, generator=g) > 0.3
    return list(pk.gae(rewards, values, mask, gamma=0.99, lam=0.9, backend="triton"))


CASES = {
    "ppo_loss-k3-entropy": lambda: _loss(1, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01),
    "ppo_loss-top_k-replay": lambda: _loss(2, top_k=5, temperature=0.9, kl_coef=0.05),
    "token_logprobs-entropy": lambda: _token_logprobs(3),
    "gae": lambda: _gae(4),
}


@needs_interpreter
def test_installed_by_the_suite():
    from triton.runtime import interpreter

    import triton.language as tl

    assert getattr(interpreter, "_ppo_kernels_fast_path", None)  # helpers/backends.py's
    # with its two memos (the releases CI runs: both in place)
    assert interpreter._get_np_dtype.__qualname__.startswith("_memo.")
    assert tl.tensor.__init__.__qualname__.startswith("_tensor_init.")
    # and the operands shortcut, on the interpreter's semantic object alone
    assert interpreter._ppo_kernels_fast_path[-1] is True
    assert vars(interpreter.interpreter_semantic)[
        "binary_op_type_checking_impl"].__qualname__.startswith("_binary_operands.")
    # the class's (the compiler's semantic objects, the device lowering checks) is Triton's own
    assert type(interpreter.interpreter_semantic).binary_op_type_checking_impl.__qualname__ == \
        "TritonSemantic.binary_op_type_checking_impl"


@needs_interpreter
@pytest.mark.parametrize("name", sorted(CASES))
def test_same_bits_as_tritons_own_interpreter(name):
    fast = CASES[name]()
    triton_interpreter.uninstall()
    try:
        slow = CASES[name]()
    finally:
        triton_interpreter.install()
    assert len(fast) == len(slow) > 0
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@needs_interpreter
def test_operands_shortcut_only_where_the_release_agrees():
    """The shortcut checks the release's rules on its probes before it is put in place:
    Triton's own rules get it, a release that promoted one case differently (here: an
    integer division in float32) gets none."""
    import triton.language as tl
    from triton.runtime import interpreter

    # a semantic object of the interpreter's builder without the shortcut: Triton's own rules
    semantic = type(interpreter.interpreter_semantic)(interpreter.interpreter_builder)
    own = semantic.binary_op_type_checking_impl

    class Other:
        def __getattr__(self, name):
            return getattr(semantic, name)

        def binary_op_type_checking_impl(self, lhs, rhs, *flags):
            a, b = own(lhs, rhs, *flags)
            if flags[-1] and a.type.scalar.is_int():
                return semantic.cast(a, tl.float32), semantic.cast(b, tl.float32)
            return a, b

    assert triton_interpreter._binary_operands(tl, semantic) is not None
    assert triton_interpreter._binary_operands(tl, Other()) is None
