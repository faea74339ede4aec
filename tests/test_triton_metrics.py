"""The device metrics kernel (triton_kernels/metrics.py) against the CPU op
ppo_kernels::ppo_loss_metrics and the eager formulas, under the Triton interpreter (CPU
tensors), for every policy loss and the inputs whose rules differ: on- and off-policy, the
rollout corrections, NaN on masked and on valid positions, empty sequences, an all-masked
batch, float64; and the KL on log-probs of its own (sampling replay)."""

import os

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import _torch_impl
from ppo_kernels import loss as loss_module
from ppo_kernels import rollout_correction as rc
from ppo_kernels.loss import METRIC_SLOTS
from ppo_kernels.spec import LossSpec

from helpers import device_path

try:
    from ppo_kernels.triton_kernels import metrics as tm
except Exception as e:  # noqa: BLE001 (triton missing or not starting: skipped, said why)
    tm, _WHY = None, f"ppo_kernels.triton_kernels does not import: {e}"
else:
    _WHY = "the Triton interpreter runs CPU tensors only with TRITON_INTERPRET=1 and no GPU"

pytestmark = pytest.mark.skipif(
    tm is None or os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
    reason=_WHY)

POLICIES = [("vanilla", dict(dual_clip_c=3.0)), ("cispo", {}), ("sapo", {}),
            ("dppo-tv", dict(clip_eps_low=0.05, dual_clip_c=2.0)),
            ("dppo-kl", dict(clip_eps_low=0.05)), ("gspo", dict(dual_clip_c=3.0)),
            ("gspo-token", {}), ("vespo", {})]
INPUTS = ["plain", "on-policy", "tis", "mis", "nan", "empty", "float64"]


def _case(policy, extra, inputs):
    g = torch.Generator().manual_seed(7 * len(policy) + len(inputs))
    dt = torch.float64 if inputs == "float64" else torch.float32
    b, t = 5, 19  # 19: more than two blocks of the interpreter's 8, the last one partial
    logp = -torch.rand(b, t, generator=g, dtype=dt) * 4
    ent = torch.rand(b, t, generator=g, dtype=dt) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=g, dtype=dt)
    old[0, 0] = logp[0, 0] + 30.0  # a log-ratio beyond the clamp
    adv = torch.randn(b, t, generator=g, dtype=dt)
    ref = logp + 0.2 * torch.randn(b, t, generator=g, dtype=dt)
    roll = old + 0.2 * torch.randn(b, t, generator=g, dtype=dt)
    isw = torch.rand(b, t, generator=g, dtype=dt) * 2
    isw[1, :3] = 0.0
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[2] = False  # an empty sequence
    opts = dict(policy_loss=policy, kl_coef=0.1, kl_estimator="k3", **extra)
    if inputs == "on-policy":
        old = roll = isw = None
    if inputs not in ("tis", "mis"):
        roll = isw = None
    if inputs == "nan":
        old = old.masked_fill(~mask, float("nan"))
        adv = adv.masked_fill(~mask, float("nan"))
        valid = mask.nonzero()[0].tolist()
        logp[valid[0], valid[1]] = float("nan")  # reaches the means it enters
    if inputs == "empty":
        mask[:] = False
    return logp, ent, mask, old, adv, ref, roll, isw, LossSpec.build(dt, **opts)


def _eager(logp, ent, mask, old, adv, ref, roll, isw, spec):
    m = _torch_impl.metrics(logp, ent, old, adv, ref, mask, spec)
    if roll is not None and old is not None:
        m.update(rc.metrics(old, roll, mask, torch.ones_like(old) if isw is None else isw))
    return m


# every policy loss with plain inputs and with NaN; the inputs whose rules do not depend on
# the policy loss with a token loss and the two kinds of sequence loss (each case is ~2 s
# of the interpreter)
CASES = ([(p, e, i) for p, e in POLICIES for i in ("plain", "nan")]
         + [(p, e, i) for p, e in POLICIES if p in ("vanilla", "gspo", "vespo")
            for i in INPUTS if i not in ("plain", "nan")])


@pytest.mark.parametrize("policy,extra,inputs", CASES,
                         ids=[f"{p}-{i}" for p, _, i in CASES])
def test_device_metrics_match_the_cpu_op_and_the_eager_formulas(policy, extra, inputs):
    logp, ent, mask, old, adv, ref, roll, isw, spec = _case(policy, extra, inputs)
    scalars, codes = spec.kernel_args(logp.dtype)
    got = tm.ppo_loss_metrics(logp, ent, mask, old, adv, ref, roll, isw, scalars, codes)
    assert got.dtype == torch.float32 and got.shape == (len(METRIC_SLOTS),)
    want = _eager(logp, ent, mask, old, adv, ref, roll, isw, spec)
    assert want, "the eager formulas gave no metric"
    for name, value in want.items():
        torch.testing.assert_close(got[METRIC_SLOTS.index(name)], value.float(), rtol=2e-6,
                                   atol=2e-6, equal_nan=True, msg=name)
    # every slot (the ones the options leave out too: 0) against the CPU op, which takes
    # the slots it returns
    if hasattr(torch.ops.ppo_kernels, "ppo_loss_metrics"):
        every = torch.ops.ppo_kernels.ppo_loss_metrics(
            logp, ent, mask, old, adv, ref, roll, isw, scalars, codes,
            list(range(len(METRIC_SLOTS))))
        torch.testing.assert_close(got, every, rtol=2e-6, atol=2e-6, equal_nan=True)
    if inputs == "empty":
        assert (got == 0).all()
    if inputs == "nan":
        assert got[METRIC_SLOTS.index("ratio_max")].isnan()


@pytest.mark.parametrize("policy", ["vanilla", "gspo"])
def test_kl_logprobs_feed_kl_ref_alone(policy):
    """kl_logprobs (sampling replay's full log-probs, logp being the kept set's): kl_ref reads
    them, every other metric is the call's without them; the device kernel, the CPU op and
    the eager formulas (logp_kl) agree."""
    logp, ent, mask, old, adv, ref, roll, isw, spec = _case(policy, {}, "plain")
    lkl = logp - 0.5 * torch.rand(logp.shape, generator=torch.Generator().manual_seed(5))
    scalars, codes = spec.kernel_args(logp.dtype)
    args = (logp, ent, mask, old, adv, ref, roll, isw, scalars, codes)
    got = tm.ppo_loss_metrics(*args, kl_logprobs=lkl)
    without = tm.ppo_loss_metrics(*args)
    k = METRIC_SLOTS.index("kl_ref")
    assert not torch.equal(got[k], without[k])
    others = [i for i in range(len(METRIC_SLOTS)) if i != k]
    assert torch.equal(got[others], without[others])
    want = _torch_impl.metrics(logp, ent, old, adv, ref, mask, spec, lkl)
    for name, value in want.items():
        torch.testing.assert_close(got[METRIC_SLOTS.index(name)], value.float(), rtol=2e-6,
                                   atol=2e-6, msg=name)
    if hasattr(torch.ops.ppo_kernels, "ppo_loss_metrics"):
        every = torch.ops.ppo_kernels.ppo_loss_metrics(
            *args, list(range(len(METRIC_SLOTS))), kl_logprobs=lkl)
        torch.testing.assert_close(got, every, rtol=2e-6, atol=2e-6)


def test_no_sequences():
    """B = 0: no row program runs; every metric is 0."""
    e = torch.empty(0, 4)
    spec = LossSpec.build(torch.float32)
    scalars, codes = spec.kernel_args(torch.float32)
    got = tm.ppo_loss_metrics(e, e, e.bool(), None, e, None, None, None, scalars, codes)
    assert got.shape == (len(METRIC_SLOTS),) and (got == 0).all()


def test_bad_inputs_name_the_argument():
    spec = LossSpec.build(torch.float32)
    scalars, codes = spec.kernel_args(torch.float32)
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages"):
        tm.ppo_loss_metrics(x, x, m, None, torch.zeros(2, 4), None, None, None, scalars, codes)
    with pytest.raises(ValueError, match="mask"):
        tm.ppo_loss_metrics(x, x, m.float(), None, x, None, None, None, scalars, codes)
    with pytest.raises(ValueError, match="policy_loss"):
        tm.ppo_loss_metrics(x, x, m, None, x, None, None, None, scalars, [99, 2, 0])


@pytest.mark.parametrize("opts", [dict(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01),
                                  dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean"),
                                  dict(rollout_correction="mis", rollout_is_threshold=1.5)],
                         ids=["k3-entropy", "gspo", "mis"])
def test_ppo_loss_reads_its_metrics_from_the_device_kernels(monkeypatch, opts):
    """ppo_loss on the triton backend takes its metrics dict from the two launches where
    the tensors are on a CUDA device (loss._device_metrics), at the dict's first read
    (a caller that reads none launches none); here that path is forced on
    the interpreter's CPU tensors and the dict equals the eager formulas' (the torch
    backend's) name for name."""
    g = torch.Generator().manual_seed(11)
    B, T, V = 3, 6, 11
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    old = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    ref = old + 0.1 * torch.randn(B, T, generator=g)
    kw = dict(ref_logprobs=ref, **opts)
    if "rollout_correction" in opts:
        kw["rollout_logprobs"] = old + 0.3 * torch.randn(B, T, generator=g)
    calls = device_path.spy(monkeypatch, tm, "ppo_loss_metrics")
    monkeypatch.setattr(loss_module, "_device_metrics",
                        lambda spec, x, logp: x.be.name == "triton" and spec.cp_group is None)
    _, got = pk.ppo_loss(logits, tokens, old, adv, mask, backend="triton", **kw)
    assert not calls, "the metrics wait for their first read"
    got = dict(got)
    assert calls, "the device metrics kernels did not run"
    _, want = pk.ppo_loss(logits, tokens, old, adv, mask, backend="torch", **kw)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name].float(), rtol=2e-6, atol=2e-6,
                                   equal_nan=True, msg=name)


def test_device_metrics_at_the_call_while_a_cuda_graph_is_captured(monkeypatch):
    """Inside a CUDA graph's capture the device metrics launch at the call (the graph's
    replays then update the dict's tensors), not at the dict's first read."""
    g = torch.Generator().manual_seed(12)
    B, T, V = 2, 5, 7
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old, adv = -torch.rand(B, T, generator=g), torch.randn(B, T, generator=g)
    calls = device_path.spy(monkeypatch, tm, "ppo_loss_metrics")
    monkeypatch.setattr(loss_module, "_device_metrics",
                        lambda spec, x, logp: x.be.name == "triton" and spec.cp_group is None)
    monkeypatch.setattr(loss_module, "_capturing", lambda t: True)
    _, got = pk.ppo_loss(logits, tokens, old, adv, None, backend="triton")
    assert calls, "the metrics waited for their first read during a capture"
    assert type(got) is dict
