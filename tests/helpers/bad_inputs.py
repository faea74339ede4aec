"""The bad-input tables' base calls: every public function on valid inputs ([B, T] =
[2, 3], V = 5, the cpu backend); a row of a bad-input table (test_loss_bad_inputs.py,
test_advantages.py) replaces one argument."""

import pytest
import torch

import ppo_kernels as pk

BAD_B, BAD_T, BAD_V = 2, 3, 5
META = torch.device("meta")


def base_ppo():
    B, T, V = BAD_B, BAD_T, BAD_V
    g = torch.Generator().manual_seed(0)
    return dict(logits=torch.randn(B, T, V, generator=g), tokens=torch.randint(0, V, (B, T),
                                                                               generator=g),
                old_logprobs=-torch.rand(B, T, generator=g) - 1,
                advantages=torch.randn(B, T, generator=g),
                response_mask=torch.ones(B, T, dtype=torch.bool),
                ref_logprobs=-torch.rand(B, T, generator=g) - 1, backend="cpu")


def base_tlp():
    d = base_ppo()
    return dict(logits=d["logits"], tokens=d["tokens"], response_mask=d["response_mask"],
                backend="cpu")


def base_gae():
    B, T = BAD_B, BAD_T
    return dict(rewards=torch.randn(B, T), values=torch.randn(B, T),
                response_mask=torch.ones(B, T, dtype=torch.bool), backend="cpu")


def base_klr():
    B, T = BAD_B, BAD_T
    return dict(scores=torch.randn(B), logprobs=-torch.rand(B, T), ref_logprobs=-torch.rand(B, T),
                response_mask=torch.ones(B, T, dtype=torch.bool), kl_coef=0.1)


def base_whiten():
    B, T = BAD_B, BAD_T
    return dict(x=torch.randn(B, T), response_mask=torch.ones(B, T, dtype=torch.bool))


def base_score():
    B, T = BAD_B, BAD_T
    d = base_ppo()
    return dict(logits=d["logits"], tokens=d["tokens"], ref_logprobs=d["ref_logprobs"],
                values=torch.randn(B, T), scores=torch.randn(B),
                response_mask=d["response_mask"], kl_coef=0.1, backend="cpu")


def base_vl():
    B, T = BAD_B, BAD_T
    return dict(values=torch.randn(B, T), old_values=torch.randn(B, T), returns=torch.randn(B, T),
                response_mask=torch.ones(B, T, dtype=torch.bool))


PUBLIC_FUNCS = {"ppo_loss": (pk.ppo_loss, base_ppo),
                "token_logprobs": (pk.token_logprobs, base_tlp),
                "gae": (pk.gae, base_gae),
                "kl_penalized_rewards": (pk.kl_penalized_rewards, base_klr),
                "whiten": (pk.whiten, base_whiten),
                "score_rollout": (pk.score_rollout, base_score),
                "value_loss": (pk.value_loss, base_vl)}


def oob(value, pos=(1, 2)):
    """f(base dict) -> its tokens with ``value`` at ``pos`` (a row's derived value)."""
    def f(d):
        t = d["tokens"].clone()
        t[pos] = value
        return t
    return f


def bad_row_id(row):
    """A bad-input row's test id: function-argument-value."""
    fn, arg, val, exc, _ = row
    if callable(val) and not isinstance(val, torch.Tensor):
        desc = "derived"
    elif isinstance(val, torch.Tensor):
        desc = f"{str(val.dtype)[6:]}{list(val.shape)}" + ("meta" if val.is_meta else "")
    else:
        desc = repr(val)[:20]
    return f"{fn}-{arg}-{desc}"


def assert_bad_input_raises(row, funcs=PUBLIC_FUNCS):
    """row = (function, argument to replace, new value or f(base dict) -> value, exception,
    match): the call raises the exception, its message names the argument and says more."""
    fn_name, arg, val, exc, match = row
    fn, base = funcs[fn_name]
    kwargs = base()
    if callable(val) and not isinstance(val, torch.Tensor):
        val = val(kwargs)
    kwargs[arg] = val
    with pytest.raises(exc, match=match) as info:
        fn(**kwargs)
    msg = str(info.value)
    assert msg.split(":")[0].strip() == match or match in msg
    assert len(msg) > len(match) + 10  # says what was expected / given
