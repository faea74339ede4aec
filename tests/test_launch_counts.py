"""The fixed per-call cost of ppo_loss on the CPU kernels: the eager aten ops one forward +
backward dispatches beside the kernel ops (ppo_kernels::*), counted with a
TorchDispatchMode (views and detach not counted). Each one is a kernel launch on a device,
so their number is the floor of a small call's time. Run with -s to see the counts."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_kernels as pk
from ppo_kernels._extension import HAS_CPU

from helpers import device_path
from helpers.backends import INTERPRET

pytestmark = pytest.mark.skipif(not HAS_CPU, reason="the C++ extension is not built")

B, T, V = 2, 8, 64


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher's Python mode (each a launch on a
    device), leaving out views, detach, the wrapping of a Python number as a 0-d tensor
    (scalar_tensor: no launch) and the extension's own ops."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.namespace == "ppo_kernels" or func.is_view
                or func.overloadpacket in (torch.ops.aten.detach, torch.ops.aten.lift_fresh,
                                        torch.ops.aten.scalar_tensor)):
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g).requires_grad_()
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    adv = torch.randn(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 5:] = False
    ref = -torch.rand(B, T, generator=g) * 3
    roll = old + 0.05 * torch.randn(B, T, generator=g)
    return logits, tokens, old, adv, mask, ref, roll


def _kept(tokens, k=8):
    """Sampling replay's given kept sets: k ids per position, the sampled token among them."""
    ids = (tokens.reshape(-1, 1) + torch.arange(k) * 7) % V
    return pk.SamplingMask(ids.reshape(-1), torch.arange(0, ids.numel() + 1, k))


# name: (keywords of ppo_loss, the most ops fwd + bwd may dispatch). Before the metrics,
# checks and weights moved into CPU ops: 100, 136, 100, 185 and 194. The fused single pass
# now dispatches 1 (autograd's ones_like: the backward compares grad_output with the applied
# scale on the host, csrc/eager_calls.cpp, and the metrics wait for their first read,
# loss_metrics.py), tis 5 (its four element-wise weight ops). GSPO's two-phase [B, T] middle
# is one op, ppo_kernels::seq_loss_grad (it was autograd through the eager formulas: 60):
# 4 (7 while the two-phase path also built an unused per-token loss). Sampling replay (a
# given kept set with a KL; a re-derived top-k / top-p set): its token-level middle one op
# too, ppo_kernels::token_loss_grad (was 168 and 75 with the eager middle), the token ids
# checked by the kernels, a given set's CSR by one op (ppo_kernels::check_kept_ids; was
# about 20 eager ops): 12 and 25, most of the rest of top-p the threshold's derivation (a
# kept set without a KL on the full logp, top-p here, starts its dlogits with the
# extension's zeros_grad in place of the dense kernel: both are kernel ops).
CONFIGS = {
    "default": (lambda ref, roll, tok: {}, 12),
    "kl-k3": (lambda ref, roll, tok: dict(ref_logprobs=ref, kl_coef=0.1), 12),
    "entropy": (lambda ref, roll, tok: dict(entropy_coef=0.01), 12),
    "tis": (lambda ref, roll, tok: dict(rollout_logprobs=roll, rollout_correction="tis"), 12),
    "gspo": (lambda ref, roll, tok: dict(policy_loss="gspo"), 20),
    "replay": (lambda ref, roll, tok: dict(sampling_mask=_kept(tok), ref_logprobs=ref,
                                           kl_coef=0.1), 12),
    "top-p": (lambda ref, roll, tok: dict(top_k=16, top_p=0.8), 25),
}


def count_ops(name):
    """(forward ops, backward ops, the forward's Counter) of one call of configuration
    name, after a warm-up call (caches filled, as in a training loop)."""
    logits, tokens, old, adv, mask, ref, roll = _inputs()
    kw = CONFIGS[name][0](ref, roll, tokens)
    for _ in range(2):
        logits.grad = None
        with OpCounter() as fwd:
            loss, metrics = pk.ppo_loss(logits, tokens, old, adv, mask, backend="cpu", **kw)
        with OpCounter() as bwd:
            loss.backward()
    return sum(fwd.ops.values()), sum(bwd.ops.values()), fwd.ops + bwd.ops


@pytest.mark.parametrize("name", list(CONFIGS))
def test_launch_counts(name):
    n_fwd, n_bwd, ops = count_ops(name)
    print(f"\n{name}: forward {n_fwd} + backward {n_bwd} = {n_fwd + n_bwd} aten ops: "
          f"{dict(ops)}")
    assert n_fwd + n_bwd <= CONFIGS[name][1], dict(ops)


if __name__ == "__main__":
    for name in CONFIGS:
        f, b, ops = count_ops(name)
        print(f"{name:8s} fwd {f:4d} bwd {b:3d} total {f + b:4d}  {dict(ops)}")


# ------------------------------------------------------------------ the metrics op's values

POLICY_CASES = [("vanilla", dict(dual_clip_c=3.0)), ("cispo", {}), ("sapo", {}),
                ("dppo-tv", dict(clip_eps_low=0.05, dual_clip_c=2.0)),
                ("dppo-kl", dict(clip_eps_low=0.05)), ("gspo", dict(dual_clip_c=3.0)),
                ("gspo-token", {}), ("vespo", {})]


def _eager_metrics(monkeypatch, *args, **kw):
    from ppo_kernels import loss as loss_mod
    with monkeypatch.context() as mp:
        mp.setattr(loss_mod, "_host_metrics", lambda spec, x: False)
        return pk.ppo_loss(*args, **kw)


@pytest.mark.parametrize("policy,extra", POLICY_CASES, ids=[p for p, _ in POLICY_CASES])
@pytest.mark.parametrize("inputs", ["plain", "on-policy", "tis", "mis", "nan", "empty"])
def test_metrics_op_matches_the_eager_formulas(monkeypatch, policy, extra, inputs):
    """ppo_kernels::ppo_loss_metrics (the cpu backend) gives the eager formulas' metrics
    (_torch_impl.metrics, rollout_correction.metrics): the same keys in the same order,
    0-d float32, values equal up to the summation order; the loss is the same bits. NaN on
    masked positions stays out; a NaN on a valid token reaches the means it enters; an
    all-masked batch gives 0."""
    g = torch.Generator().manual_seed(len(policy) + len(inputs))
    b, t, v = 3, 7, 20
    logits = torch.randn(b, t, v, generator=g) * 2
    tokens = torch.randint(0, v, (b, t), generator=g)
    old = -torch.rand(b, t, generator=g) * 3
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[2] = False
    ref = -torch.rand(b, t, generator=g) * 3
    roll = old + 0.2 * torch.randn(b, t, generator=g)
    kw = dict(policy_loss=policy, ref_logprobs=ref, kl_coef=0.1, entropy_coef=0.01,
              backend="cpu", **extra)
    if inputs == "on-policy":
        old = None
    if inputs in ("tis", "mis"):
        if policy == "vespo":
            pytest.skip("VESPO takes no rollout_correction")
        kw.update(rollout_logprobs=roll, rollout_correction=inputs,
                  rollout_is_threshold=1.1 if inputs == "mis" else 2.0)
    if inputs == "nan":
        old = old.masked_fill(~mask, float("nan"))
        adv = adv.masked_fill(~mask, float("nan"))
        logits[0, 1, 3] = float("nan") if mask[0, 1] else logits[0, 1, 3]
        kw["rollout_logprobs"] = roll.masked_fill(~mask, float("nan"))
    if inputs == "empty":
        mask[:] = False
    loss, got = pk.ppo_loss(logits, tokens, old, adv, mask, **kw)
    e_loss, want = _eager_metrics(monkeypatch, logits, tokens, old, adv, mask, **kw)
    assert torch.equal(loss, e_loss) or (loss.isnan() and e_loss.isnan())
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == torch.float32 and got[name].shape == (), name
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6,
                                   equal_nan=True, msg=name)


# ------------------------------------------------------------------ the device path

try:
    from triton.runtime import interpreter as _interp
except ImportError:  # (no triton: the device-path counts are skipped, said why)
    _interp = None


class DeviceCounter(TorchDispatchMode):
    """The launches of a call on the device path (the triton backend as it runs on a CUDA
    device), counted on the CPU under the Triton interpreter: each Triton kernel launch
    (an interpreter GridExecutor call, counted by device_launches) and each aten op outside
    them that launches a kernel on a device: allocations (no launch), views, detach and
    the interpreter's own copies inside a launch left out. The extension's Triton ops
    (ppo_kernels::triton_*) are opened up: the aten ops of their launchers count too."""

    NO_LAUNCH = ("empty", "empty_like", "empty_strided", "new_empty", "detach", "lift_fresh",
                 "scalar_tensor")

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "ppo_kernels":
            from ppo_kernels.triton_kernels.library import LAUNCHERS
            launcher = LAUNCHERS.get(func.overloadpacket.__name__)
            if launcher is None:
                return func(*args, **(kwargs or {}))
            with self:  # (its launcher's own ops, under this mode again)
                return launcher(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not (self.inside or func.is_view or name in self.NO_LAUNCH):
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def device_launches(monkeypatch):
    """Puts the call on the device path (_backends.device_eager, no host reads of tensor
    values) and counts each interpreter launch into the innermost DeviceCounter running;
    returns the list that holds it (push a counter, run, pop)."""
    device_path.force(monkeypatch)
    running, launch = [], _interp.GridExecutor.__call__

    def counted(executor, *args, **kwargs):
        if not running:
            return launch(executor, *args, **kwargs)
        c = running[-1]
        c.ops["triton launch"] += 1
        c.inside += 1
        try:
            return launch(executor, *args, **kwargs)
        finally:
            c.inside -= 1

    monkeypatch.setattr(_interp.GridExecutor, "__call__", counted)
    return running


# name: (keywords of ppo_loss, the most launches forward, backward). Counted: 6 forward
# (the weights, the id check and the rollout correction in two Triton launches,
# triton_kernels/weights.py, its assertion, the applied scale's full, the loss kernel and
# its dot), 3 backward (autograd's ones_like, scale_grad_'s two launches), 3 more when the
# metrics are read (triton_kernels/metrics.py); before: 15 forward (token_range's 8, the
# weights' 4) plus the metrics' 3 at every call, 29 with "tis" (its 11 eager ops). GSPO:
# 10 forward (the statistics pass, its middle in one launch, triton_kernels/seq_loss.py,
# the gradient pass, the weights' two), 13 in all (the goal: 20); before: 76 forward.
# Replay (as CONFIGS): its middle in one launch (triton_kernels/token_middle.py), its
# weights and id check in the weights' two and its metrics at the dict's first read (the
# metrics kernel's KL on the full log-probs), a given set's CSR checked by one kernel and a
# sort (triton_kernels/csr_check.py, was about 20 torch ops), a re-derived set's threshold
# by one launch (triton_kernels/threshold.py, a radix select; was torch sorts over chunks
# of rows, about 30 ops), the kept mass by one launch (triton_kernels/kept_mass.py, was 7
# ops): forward 29 and 33 (before: 204 and 221 with the metrics at the call, 184 and 119
# with the eager middle alone, 55 and 70 with the eager CSR checks and an unused per-token
# loss, 35 and 67 with the threshold's sorts, 35 and 39 with the eager kept mass); the
# metrics 20 at their first read.
DEVICE_CONFIGS = {
    "default": (lambda ref, roll, tok: {}, 8, 3),
    "kl-k3": (lambda ref, roll, tok: dict(ref_logprobs=ref, kl_coef=0.1), 8, 3),
    "entropy": (lambda ref, roll, tok: dict(entropy_coef=0.01), 8, 3),
    "tis": (lambda ref, roll, tok: dict(rollout_logprobs=roll, rollout_correction="tis"), 8, 3),
    "gspo": (lambda ref, roll, tok: dict(policy_loss="gspo"), 14, 3),
    "replay": (lambda ref, roll, tok: dict(sampling_mask=_kept(tok), ref_logprobs=ref,
                                           kl_coef=0.1), 29, 3),
    "top-p": (lambda ref, roll, tok: dict(top_k=16, top_p=0.8), 33, 3),
}


def count_device_launches(monkeypatch, name):
    """Counters of the launches of one call of configuration name on the device path,
    after a warm-up call: forward, backward, the first read of the metrics."""
    running = device_launches(monkeypatch)
    logits, tokens, old, adv, mask, ref, roll = _inputs()
    kw = DEVICE_CONFIGS[name][0](ref, roll, tokens)
    for _ in range(2):
        logits.grad = None
        fwd, bwd, met = DeviceCounter(), DeviceCounter(), DeviceCounter()
        running.append(fwd)
        with fwd:
            loss, metrics = pk.ppo_loss(logits, tokens, old, adv, mask, backend="triton", **kw)
        running[-1] = bwd
        with bwd:
            loss.backward()
        running[-1] = met
        with met:
            dict(metrics)
        running.pop()
    return fwd.ops, bwd.ops, met.ops


@pytest.mark.skipif(_interp is None or not INTERPRET, reason="counts the Triton launches "
                    "under the interpreter (TRITON_INTERPRET=1, no GPU)")
@pytest.mark.parametrize("name", list(DEVICE_CONFIGS))
def test_device_path_launch_counts(monkeypatch, name):
    fwd, bwd, met = count_device_launches(monkeypatch, name)
    n_fwd, n_bwd = sum(fwd.values()), sum(bwd.values())
    print(f"\n{name}: forward {n_fwd} launches {dict(fwd)}, backward {n_bwd} {dict(bwd)}, "
          f"metrics {sum(met.values())} {dict(met)}")
    assert fwd["triton launch"] >= 3 and bwd["triton launch"] >= 1  # (the counter sees them)
    assert n_fwd <= DEVICE_CONFIGS[name][1], dict(fwd)
    assert n_bwd <= DEVICE_CONFIGS[name][2], dict(bwd)
