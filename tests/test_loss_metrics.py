"""ppo_loss's metrics dict filled at its first read on the cpu backend
(ppo_kernels/loss_metrics.py): nothing computed for a caller that reads none, the same keys,
order and bits as the eager computation for one that reads any, every dict operation
reading the filled values, and an in-place change of a watched input named at that first
read instead of giving other metrics than the call's."""

from __future__ import annotations

import collections
import copy
import io
import pickle

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_kernels as pk
from ppo_kernels import from_hidden as FH
from ppo_kernels import loss as L
from ppo_kernels._extension import HAS_CPU

pytestmark = pytest.mark.skipif(not HAS_CPU, reason="the C++ extension is not built")

B, T, V = 3, 7, 37


def _call(seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T + 1, V, generator=g).requires_grad_()
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[2] = False  # an empty sequence
    ref = -torch.rand(B, T, generator=g) * 3
    roll = old + 0.05 * torch.randn(B, T, generator=g)
    args = dict(logits=logits, tokens=tokens, old_logprobs=old, advantages=adv,
                response_mask=mask, ref_logprobs=ref, kl_coef=0.1, entropy_coef=0.01)
    if kw.pop("rollout", False):
        args.update(rollout_logprobs=roll, rollout_correction="tis")
    args.update(kw, backend="cpu")
    return args


def _loss(args):
    """pk.ppo_loss(**args), or with hidden=True pk.ppo_loss_from_hidden on hidden states
    and a head made from the same seed."""
    if not args.pop("hidden", False):
        return pk.ppo_loss(**args)
    g = torch.Generator().manual_seed(1)
    logits = args.pop("logits")
    hidden = torch.randn(*logits.shape[:2], 16, generator=g).requires_grad_()
    head = (torch.randn(V, 16, generator=g) * 0.3).requires_grad_()
    return pk.ppo_loss_from_hidden(hidden, head, **args)


def _eager_metrics(args):
    return _eager(args)[1]


def _eager(args):
    """(loss, metrics) of the same call with the metrics computed at once (loss_metrics ->
    metrics_now, in both modules that call it)."""
    real = L.loss_metrics
    L.loss_metrics = FH.loss_metrics = L.metrics_now
    try:
        return _loss(args)
    finally:
        L.loss_metrics = FH.loss_metrics = real


class _MetricOps(TorchDispatchMode):
    """The ops dispatched inside it, by name (a multiset)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


OPTIONS = {
    "default": {},
    "gspo": dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean"),
    "rollout-tis": dict(rollout=True),
    "per-token": dict(return_per_token=True),
    "off-policy-mask": dict(off_policy_mask_threshold=0.5),
    "top-k-replay": dict(top_k=5),
    "from-hidden": dict(hidden=True),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_nothing_computed_until_read_then_the_eager_dict(name):
    """The ops of the metrics move from the call to the first read, all of them and no
    more (the same multiset of dispatched ops in all), and give the eager dict's keys in
    its order with its bits."""
    with _MetricOps() as eager_ops:
        loss, want = _eager(_call(**OPTIONS[name]))
        loss.backward()
    with _MetricOps() as call_ops:
        loss, metrics = _loss(_call(**OPTIONS[name]))
        loss.backward()  # (nothing the backward writes is read by the metrics)
    assert isinstance(metrics, pk.LossMetrics) and isinstance(metrics, dict)
    with _MetricOps() as read_ops:
        got = dict(metrics)
    with _MetricOps() as again:
        dict(metrics)
    assert read_ops.ops and not again.ops
    assert call_ops.ops + read_ops.ops == eager_ops.ops
    assert type(want) is dict and list(got) == list(want)
    for k in want:  # the same ops on the same tensors: the same bits
        assert torch.equal(got[k], want[k]), k


def test_every_dict_operation_reads_the_filled_values():
    args = _call()
    want = _eager_metrics(_call())

    def fresh():
        return pk.ppo_loss(**_call())[1]

    m = pk.ppo_loss(**args)[1]
    assert len(m) == len(want) and bool(m)
    assert "clip_frac" in fresh() and "nope" not in fresh()
    assert list(fresh()) == list(want) and list(reversed(fresh())) == list(reversed(want))
    assert list(fresh().keys()) == list(want)
    assert [float(v) for v in fresh().values()] == [float(v) for v in want.values()]
    assert [k for k, _ in fresh().items()] == list(want)
    assert float(fresh()["entropy"]) == float(want["entropy"])
    assert float(fresh().get("entropy")) == float(want["entropy"])
    assert fresh().get("nope", 7) == 7
    assert {**fresh()}.keys() == want.keys() and dict(fresh()).keys() == want.keys()
    assert fresh() == want and want == fresh() and not (fresh() != want)
    assert fresh() == fresh() and not (fresh() != fresh())  # two unfilled ones
    assert fresh() != {} and {} != fresh()
    assert repr(fresh()) == repr(want)
    assert (fresh() | {"x": 1}).keys() == (want | {"x": 1}).keys()
    assert ({"x": 1} | fresh()).keys() == ({"x": 1} | want).keys()
    # writes fill first: the eager keys keep their order, the new key comes last
    m = fresh()
    m["extra"] = torch.tensor(1.0)
    assert list(m) == [*want, "extra"]
    m = fresh()
    m.update(extra=1)
    assert list(m) == [*want, "extra"]
    m = fresh()
    m |= {"extra": 1}
    assert list(m) == [*want, "extra"]
    m = fresh()
    assert m.setdefault("entropy", None) is m["entropy"] and len(m) == len(want)
    m = fresh()
    m.pop("entropy")
    assert "entropy" not in m and len(m) == len(want) - 1
    m = fresh()
    del m["entropy"]
    assert "entropy" not in m
    m = fresh()
    assert m.popitem()[0] == list(want)[-1]
    m = fresh()
    m.clear()
    assert len(m) == 0 and dict(m) == {}


def test_copies_pickles_and_pytrees_are_plain_dicts():
    want = _eager_metrics(_call())

    def fresh():
        return pk.ppo_loss(**_call())[1]

    for out in (fresh().copy(), copy.copy(fresh()), copy.deepcopy(fresh())):
        assert type(out) is dict and out == want and list(out) == list(want)
    buf = io.BytesIO()
    torch.save(fresh(), buf)
    buf.seek(0)
    for out in (pickle.loads(pickle.dumps(fresh())), torch.load(buf, weights_only=True)):
        assert type(out) is collections.OrderedDict and out == want
        assert list(out) == list(want)
    leaves, spec = pytree.tree_flatten(fresh())
    assert len(leaves) == len(want) and all(isinstance(v, torch.Tensor) for v in leaves)
    floats = pytree.tree_map(float, fresh())
    assert floats == {k: float(v) for k, v in want.items()}


@pytest.mark.parametrize("arg", ["old_logprobs", "advantages", "response_mask",
                                 "ref_logprobs", "rollout_logprobs"])
def test_an_input_changed_in_place_before_the_first_read_is_named(arg):
    args = _call(rollout=True)
    metrics = pk.ppo_loss(**args)[1]
    t = args[arg]
    t.copy_(t.flip(0))  # the next batch written into the same buffer
    with pytest.raises(RuntimeError, match=f"{arg}: changed in place after ppo_loss"):
        metrics["clip_frac"]
    with pytest.raises(RuntimeError, match=arg):  # still unfilled: the next read says so too
        len(metrics)
    # read before the change: the call's metrics, whatever happens to the inputs later
    args = _call(rollout=True)
    metrics = pk.ppo_loss(**args)[1]
    first = float(metrics["clip_frac"])
    args[arg].copy_(args[arg].flip(0))
    assert float(metrics["clip_frac"]) == first
    assert metrics == _eager_metrics(_call(rollout=True))


def test_eager_where_deferring_is_not_safe():
    """The torch backend (torch.func can wrap its tensors), torch.inference_mode, inference
    tensors as inputs (no version counter to watch) and torch.jit.trace get the dict at
    once, the same values."""
    want = _eager_metrics(_call())
    args = _call()
    args["backend"] = "torch"
    assert type(pk.ppo_loss(**args)[1]) is dict
    with torch.inference_mode():
        got = pk.ppo_loss(**_call())[1]
    assert type(got) is dict and got == want
    args = _call()
    with torch.inference_mode():
        args["old_logprobs"] = args["old_logprobs"].clone()  # scored under inference_mode
    assert args["old_logprobs"].is_inference()
    got = pk.ppo_loss(**args)[1]
    assert type(got) is dict and got == want

    seen = {}

    def f(z):
        a = _call()
        a["logits"] = z
        loss, m = pk.ppo_loss(**a)
        seen["type"] = type(m)
        return loss

    with pytest.warns(torch.jit.TracerWarning):
        torch.jit.trace(f, (_call()["logits"].detach(),), check_trace=False)
    assert seen["type"] is dict
