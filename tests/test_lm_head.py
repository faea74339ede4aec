"""ppo_kernels/lm_head.py: the LM head given as a module (the op runs as its forward) and
forward_redirect, on one process (equal to the tensor form, errors naming the argument,
the module's forward restored), and inside DDP (find_unused_parameters False and True),
FSDP2 (the head its own unit or in the root unit, reshard_after_forward True and False,
after reshard()) and DeepSpeed ZeRO-3 on 2 gloo processes (tests/trainer_cases.py): loss
and every gradient equal to the single-process run on the concatenated batch; and the head
used after the forward of DDP(find_unused_parameters=True) (tests/ddp_after_forward_cases.py,
ppo_kernels/_ddp_unused.py), exact as well."""

import os

import pytest
import torch

import ppo_kernels as pk
from helpers.asserts import raises_naming
from helpers.ranks import run_ranks

B, T, V, H = 2, 5, 11, 4
TOL = 1e-5


def _inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    head = torch.nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    tok = torch.randint(0, V, (B, T), generator=g)
    old = torch.randn(B, T, generator=g) * 0.3 - 2.0
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    return hidden, head, tok, old, adv, mask


def _grads(*ts):
    return [None if t is None else t.grad.clone() for t in ts]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("policy", ["vanilla", "gspo"])
def test_module_form_equals_tensor_form(bias, policy):
    hidden, head, tok, old, adv, mask = _inputs(bias=bias)
    h1 = hidden.clone().requires_grad_()
    loss1, m1 = pk.ppo_loss_from_hidden(h1, head, tok, old, adv, mask, policy_loss=policy,
                                        chunk_size=3)
    loss1.backward()
    g1 = _grads(h1, head.weight, head.bias)
    head.zero_grad()
    h2 = hidden.clone().requires_grad_()
    loss2, m2 = pk.ppo_loss_from_hidden(h2, head.weight, tok, old, adv, mask,
                                        lm_head_bias=head.bias, policy_loss=policy,
                                        chunk_size=3)
    loss2.backward()
    g2 = _grads(h2, head.weight, head.bias)
    assert torch.equal(loss1, loss2)
    for a, b in zip(g1, g2):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    assert m1.keys() == m2.keys()
    for k in m1:
        if isinstance(m1[k], torch.Tensor):
            assert torch.equal(m1[k], m2[k]), k


def test_token_logprobs_and_score_rollout_module_form():
    hidden, head, tok, old, adv, mask = _inputs()
    lp1, ent1 = pk.token_logprobs_from_hidden(hidden, head, tok, mask, return_entropy=True)
    lp2, ent2 = pk.token_logprobs_from_hidden(hidden, head.weight, tok, mask,
                                              lm_head_bias=head.bias, return_entropy=True)
    assert torch.equal(lp1, lp2) and torch.equal(ent1, ent2)
    vals, scores = torch.randn(B, T), torch.randn(B)
    r1 = pk.score_rollout_from_hidden(hidden, head, tok, old, vals, scores, mask,
                                      kl_coef=0.1)
    r2 = pk.score_rollout_from_hidden(hidden, head.weight, tok, old, vals, scores, mask,
                                      lm_head_bias=head.bias, kl_coef=0.1)
    for a, b in zip(r1, r2):
        assert torch.equal(a, b)


def test_module_form_runs_inside_the_hooks_and_restores_forward():
    hidden, head, tok, old, adv, mask = _inputs()
    seen = []
    head.register_forward_pre_hook(lambda mod, args: seen.append(("pre", args[0].shape)))
    head.register_forward_hook(lambda mod, args, out: seen.append(("post", type(out))))
    loss, _ = pk.ppo_loss_from_hidden(hidden, head, tok, old, adv, mask)
    assert seen == [("pre", hidden.shape), ("post", tuple)]
    assert "forward" not in head.__dict__  # the class's forward again
    x = torch.randn(3, H)
    assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight, head.bias))


def test_forward_redirect_returns_fn_and_restores_after_an_error():
    class Wrapper(torch.nn.Module):  # like DDP: forward calls self.module
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *a, **k):
            return self.module(*a, **k)

    inner = torch.nn.Linear(2, 2)
    own = inner.forward  # a bound method; keep an instance attribute case too
    w = Wrapper(inner)
    assert pk.forward_redirect(w, lambda a, b=0: a + b, 1, b=2) == 3
    assert "forward" not in inner.__dict__

    def boom(x):
        raise ValueError("inside")
    with pytest.raises(ValueError, match="inside"):
        pk.forward_redirect(w, boom, 1)
    assert "forward" not in inner.__dict__
    inner.forward = own  # an instance forward of the caller's is put back as it was
    pk.forward_redirect(w, lambda x: x, 1)
    assert inner.__dict__["forward"] is own
    # fn may call the module itself: its own forward is back before fn runs
    x = torch.randn(1, 2)
    assert torch.equal(pk.forward_redirect(inner, lambda _: inner(x), None), own(x))


def test_bad_module_heads_name_the_argument():
    hidden, head, tok, old, adv, mask = _inputs()

    class Scaled(torch.nn.Linear):  # a forward of its own: bypassing it would be silent
        def forward(self, x):
            return 2 * super().forward(x)

    class LoraLike(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(V, H))

    for bad in (Scaled(H, V), LoraLike()):
        raises_naming(lambda: pk.ppo_loss_from_hidden(hidden, bad, tok, old, adv, mask),
                      "lm_head_weight", (TypeError,))
    raises_naming(lambda: pk.token_logprobs_from_hidden(hidden, head, tok, mask,
                                                        lm_head_bias=head.bias),
                  "lm_head_bias", (TypeError,))
    raises_naming(lambda: pk.forward_redirect(object(), lambda: 0), "wrapper", (TypeError,))
    raises_naming(lambda: pk.forward_redirect(head, 3), "fn", (TypeError,))
    # a wrong-shaped head still names the argument through the module form
    raises_naming(lambda: pk.ppo_loss_from_hidden(hidden, torch.nn.Linear(H + 1, V), tok,
                                                  old, adv, mask), "lm_head_weight")


@pytest.fixture(scope="module")
def trainer_ranks(tmp_path_factory):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_cases.py")
    return run_ranks(script, tmp_path_factory.mktemp("trainers"), timeout=480)


def _cases(ranks, prefix):
    out = {}
    for r, res in enumerate(ranks):
        for k, v in res.items():
            if k.startswith(prefix):
                out[(r, k)] = v
    return out


@pytest.mark.parametrize("framework", ["ddp/", "fsdp2/own_unit/", "fsdp2/root_unit/",
                                       "zero3/"])
def test_exact_inside_the_framework(trainer_ranks, framework):
    if framework == "zero3/" and "deepspeed" in trainer_ranks[0]:
        pytest.skip(f"deepspeed does not import here: {trainer_ranks[0]['deepspeed']}")
    cases = _cases(trainer_ranks, framework)
    cases = {k: v for k, v in cases.items() if "resharded_module_form" not in k[1]
             and "trap" not in k[1]}
    # every layout x op x bias (ZeRO-3: the three ops with a bias)
    want = {"ddp/": 2 * 2 * 3 * 2, "fsdp2/own_unit/": 2 * 3 * 2,
            "fsdp2/root_unit/": 2 * 3 * 2 + 1, "zero3/": 3}[framework]
    assert len(cases) == 2 * want, sorted(cases)
    for (rank, name), err in cases.items():
        assert isinstance(err, dict), f"rank {rank} {name}: {err}"
        assert err["loss"] < TOL and err["grad"] < TOL, (rank, name, err)


def test_the_trap_the_redirection_removes(trainer_ranks):
    for res in trainer_ranks:
        # FSDP2, the head in the root unit after reshard(): its weight is a shard
        msg = res["fsdp2/root_unit/resharded_module_form"]
        assert msg.startswith("ValueError") and "lm_head_weight" in msg


@pytest.fixture(scope="module")
def ddp_after_forward_ranks(tmp_path_factory):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "ddp_after_forward_cases.py")
    return run_ranks(script, tmp_path_factory.mktemp("ddp_after"), timeout=300)


def test_ddp_find_unused_head_after_the_forward_is_exact(ddp_after_forward_ranks):
    """DDP(find_unused_parameters=True), hidden = ddp(ids), then the from-hidden op with
    ddp.module.lm_head (or its weight and bias), two iterations (DDP's own error, "Expected
    to mark a variable ready only once", before): ppo_loss (vanilla, gspo),
    token_logprobs and distill_loss from hidden, with and without a bias, the hidden states
    a few autograd nodes past DDP's output, a value head used inside the forward, a
    no_sync() micro-batch first: the loss and every gradient equal the single-process run
    on the whole batch (tests/ddp_after_forward_cases.py)."""
    want = 4 * 2 * 2 + 4
    for rank, res in enumerate(ddp_after_forward_ranks):
        assert len(res) == want, sorted(res)
        for name, err in res.items():
            assert isinstance(err, dict), f"rank {rank} {name}: {err}"
            assert err["loss"] < TOL and err["grad"] < TOL, (rank, name, err)


def test_after_ddp_forward_is_a_no_op_outside_ddp():
    """Without a process group, or with hidden states from no DDP forward, the op's result
    comes back untouched (and nothing is looked at under no_grad)."""
    from ppo_kernels._ddp_unused import _sink_ddp, after_ddp_forward

    hidden, head, tok, old, adv, mask = _inputs()
    h = hidden.clone().requires_grad_()
    out = pk.ppo_loss_from_hidden(h * 2, head, tok, old, adv, mask)
    assert after_ddp_forward(h * 2, out) is out
    assert _sink_ddp((h * 2).grad_fn) is None
