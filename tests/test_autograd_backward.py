"""The backward of the fused loss (ppo_kernels/_autograd.py: the autograd formulas,
scale_grad, FusedLoss and its C++ twin csrc/eager_calls.cpp): grad_output != 1 (gradient accumulation, loss scaling, every
backward under torch.compile) must cost no [N, V] allocation and scale in float32, and a
grad_scale known before the forward must cost no pass at all; no host read of a tensor
value anywhere in forward or backward (CUDA-graph capture, no stalls).

inplace_backward (the gradient written over the logits): its result, its refusal of a
second backward through a retained graph and of logits sharing memory, the version
counter it bumps, no_grad / inference_mode leaving the logits alone; retained graphs
replayed with other grad_outputs; the per-token inputs receive no gradient."""

import warnings

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_kernels as pk
from ppo_kernels import _checks
from ppo_kernels import reference as ref

from helpers.asserts import assert_grad_close, to_np
from helpers.backends import BACKENDS, BACKENDS_CPU, KERNELS_CPU, POLICY_LOSSES, TOKEN_LOSSES, TORCH
from helpers.bad_inputs import base_ppo
from helpers.inputs import make_inputs, seeded_inputs, small_inputs

CASES = [(1.0, 1.0), (1.0, 1 / 3), (1 / 3, 1 / 3), (1 / 3, 1.0), (0.5, 2.0)]


class _GradBuffer(TorchDispatchMode):
    """Records where the forward's dlogits buffer is: the last output of the ppo_loss_fwd
    op (the C++ autograd Function of the cpu / cuda backends and the Python one of Triton
    both call the op itself, which a dispatch mode sees)."""

    def __init__(self):
        super().__init__()
        self.ptr = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.name() in ("ppo_kernels::ppo_loss_fwd", "ppo_kernels::triton_ppo_loss_fwd"):
            self.ptr = out[-1].data_ptr()
        return out


def _run(be, inp, dtype, grad_scale, mult, inplace):
    leaf = be.t(inp["full"][:, :-1]).to(dtype).detach().clone().requires_grad_(True)
    x = leaf * 1.0  # a non-leaf in front of the loss, as a model's output is
    seen = {}
    x.register_hook(lambda g: seen.setdefault("ptr", g.data_ptr()) and None)
    with _GradBuffer() as buf:
        loss, _ = pk.ppo_loss(x, be.t(inp["tokens"]), be.t(inp["old"]), be.t(inp["adv"]),
                              be.t(inp["mask"]), be.t(inp["ref"]), kl_coef=0.1,
                              entropy_coef=0.01, grad_scale=grad_scale,
                              inplace_backward=inplace, backend=be.name)
    (loss * mult).backward()
    return leaf.grad, loss.detach(), seen["ptr"], buf.ptr, x.data_ptr()


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

    # On a GPU the Triton launcher runs through the triton_kernel_wrapper_mutation
    # higher-order operator; a mode without this flag makes the HOP refuse to dispatch.
    # The HOP reaches __torch_dispatch__ like an op (it is not a host read itself).
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "_schema", None) is not None and func._schema.name in self.HOST_READS:
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


# ------------------------------------------------------------------ in-place and retained graphs

@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("inplace", [False, True])
def test_grad_output_zero_gives_zero_gradient(be, inplace):
    """loss.backward(0) gives a zero gradient, with and without inplace_backward."""
    d = small_inputs()
    leaf = d["logits"].clone().requires_grad_()
    loss, _ = pk.ppo_loss(leaf * 1, d["tokens"], d["old"], d["adv"], inplace_backward=inplace,
                          backend=be.name)
    loss.backward(torch.tensor(0.0))
    assert (leaf.grad == 0).all()


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_retain_graph_twice_accumulates(be):
    """Two backwards through a retained graph accumulate twice the gradient."""
    d = small_inputs()
    leaf = d["logits"].clone().requires_grad_()
    loss, _ = pk.ppo_loss(leaf, d["tokens"], d["old"], d["adv"], backend=be.name)
    loss.backward(retain_graph=True)
    g1 = leaf.grad.clone()
    loss.backward()
    torch.testing.assert_close(leaf.grad, 2 * g1)


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_no_grad_and_inference_mode_leave_inplace_logits_alone(be):
    """inplace_backward=True under no_grad / inference_mode: the logits are not
    overwritten, and the loss is the same and needs no gradient."""
    d = small_inputs()
    logits = d["logits"].clone().requires_grad_()
    with torch.no_grad():
        a, _ = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], inplace_backward=True,
                           backend=be.name)
    with torch.inference_mode():
        b, _ = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], inplace_backward=True,
                           backend=be.name)
    assert torch.equal(logits.detach(), d["logits"])
    assert a.item() == b.item() and not a.requires_grad


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_inplace_backward_leaf_and_bf16_view_match(be):
    """inplace_backward on a float32 leaf and on a bf16 view logits[:, :-1] of a
    non-leaf: the reference's gradient, 0 on the dropped last position."""
    d = small_inputs()
    leaf = d["logits"].clone().requires_grad_()
    loss, _ = pk.ppo_loss(leaf, d["tokens"], d["old"], d["adv"], inplace_backward=True,
                          backend=be.name)
    loss.backward()
    _, _, e_grad = ref.ppo_loss(d["logits"].double(), d["tokens"], d["old"], d["adv"])
    torch.testing.assert_close(leaf.grad, torch.from_numpy(e_grad).float(), rtol=1e-5,
                               atol=1e-7)
    full = torch.cat([d["logits"], d["logits"][:, :1]], 1).bfloat16().requires_grad_()
    loss, _ = pk.ppo_loss((full * 1)[:, :-1], d["tokens"], d["old"], d["adv"],
                          inplace_backward=True, backend=be.name)
    loss.backward()
    # the reference on the bf16-rounded logits; the gradient comes back in bf16 (8 bits)
    _, _, e_grad = ref.ppo_loss(full.detach()[:, :-1].double(), d["tokens"], d["old"],
                                d["adv"])
    torch.testing.assert_close(full.grad[:, :-1].float(), torch.from_numpy(e_grad).float(),
                               rtol=1e-2, atol=1e-2)
    assert (full.grad[:, -1] == 0).all()


@pytest.mark.parametrize("be", KERNELS_CPU)
def test_inplace_backward_retain_graph_twice(be):
    """With inplace_backward the gradient lives in the logits' storage: a backward that
    keeps the graph returns a fresh copy of it, so a second backward through the retained
    graph gives the same gradient again (the sum is exactly twice one backward's), never a
    corrupted one (tests/test_autograd_contract.py has the whole contract)."""
    d = small_inputs()
    leaf = d["logits"].clone().requires_grad_()
    pk.ppo_loss(leaf * 1, d["tokens"], d["old"], d["adv"], inplace_backward=True,
                backend=be.name)[0].backward()
    once = leaf.grad.clone()
    leaf.grad = None
    loss, _ = pk.ppo_loss(leaf * 1, d["tokens"], d["old"], d["adv"], inplace_backward=True,
                          backend=be.name)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(leaf.grad, 2 * once, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("be", BACKENDS_CPU)
def test_inplace_backward_on_expanded_logits(be):
    """inplace_backward on expanded logits (entries sharing memory) is a ValueError
    naming the logits."""
    d = small_inputs()
    base = d["logits"][:1].clone().requires_grad_()
    with pytest.raises(ValueError, match="logits.*share memory"):
        pk.ppo_loss(base.expand(2, 3, 5), d["tokens"], d["old"], d["adv"],
                    inplace_backward=True, backend=be.name)


@pytest.mark.parametrize("be", KERNELS_CPU)
def test_inplace_backward_bumps_version_counter(be):
    """The in-place backward bumps the logits' version counter: another op that saved
    the logits for its backward raises autograd's 'modified by an inplace operation'."""
    d = small_inputs()
    leaf = d["logits"].clone().requires_grad_()
    logits = leaf * 1
    sq = (logits ** 2).sum()  # saves `logits` for its backward
    loss, _ = pk.ppo_loss(logits, d["tokens"], d["old"], d["adv"], inplace_backward=True,
                          backend=be.name)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + sq).backward()


def test_per_token_inputs_get_no_gradient():
    """old_logprobs / advantages / ref_logprobs / rollout_is_weights are rollout data: on
    every backend and mode they receive no gradient, and the logits' gradient is the same."""
    d = small_inputs()
    is_w = torch.rand(d["adv"].shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for be, mode in (("cpu", "token-mean"), ("torch", "token-mean"), ("cpu", "none"),
                     ("torch", "none")):
        lg = d["logits"].clone().requires_grad_()
        o, a, r, w = (x.clone().requires_grad_() for x in (d["old"], d["adv"], d["ref"], is_w))
        loss, _ = pk.ppo_loss(lg, d["tokens"], o, a, ref_logprobs=r, kl_coef=0.1,
                              rollout_is_weights=w, loss_agg_mode=mode, backend=be)
        (loss if loss.dim() == 0 else loss.sum() / loss.numel()).backward()
        assert all(x.grad is None for x in (o, a, r, w)), (be, mode)
        grads.append(lg.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy_loss", ["gspo", "gspo-token"])
def test_inplace_backward_allocates_as_usual_for_sequence_losses(policy_loss):
    """As documented: the two-phase path's gradient sweep writes a fresh buffer."""
    d = base_ppo()
    grads = []
    for inplace in (False, True):
        x = d["logits"].clone().requires_grad_(True)
        pk.ppo_loss(**dict(d, logits=x), policy_loss=policy_loss,
                    inplace_backward=inplace)[0].backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1])


# ------------------------------------------------------------------ the loss menu's backward
# (CPU tensors: cpu, torch and the Triton interpreter)

@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", TOKEN_LOSSES)
def test_inplace_backward_token_level_losses(be, policy_loss):
    """inplace_backward with the token-level losses (vanilla, cispo, sapo), on-policy
    with k3+, the bias correction and an entropy aggregation of its own: the reference's
    loss, and 3x its gradient for (3 * loss).backward()."""
    inp = seeded_inputs(2, 4, 13, 21)
    kw = dict(policy_loss=policy_loss, kl_coef=0.1, kl_estimator="k3+", kl_bias_correction=True,
              entropy_coef=0.02, entropy_agg_mode="token-mean", old=None)
    e_loss, _, e_grad = ref.ppo_loss(inp["base"], inp["tokens"], None, inp["adv"], inp["mask"],
                                   inp["ref"], **{k: v for k, v in kw.items() if k != "old"})
    leaf = inp["full"][:, :4].clone().requires_grad_(True)
    loss, _ = pk.ppo_loss(leaf * 1, inp["tokens"], None, inp["adv"], inp["mask"], inp["ref"],
                          inplace_backward=True, backend=be.name,
                          **{k: v for k, v in kw.items() if k != "old"})
    (loss * 3).backward()
    assert float(loss.detach()) == pytest.approx(e_loss, rel=2e-6, abs=2e-6)
    assert np.abs(to_np(leaf.grad) - 3 * e_grad).max() <= 3e-6 * 3 * np.abs(e_grad).max()


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", ["gspo", "gspo-token"])
def test_retain_graph_twice_sequence_losses_any_grad_outputs(be, policy_loss):
    """gspo / gspo-token with grad_scale 0.5 and three backwards through a retained
    graph (x2, x1, x0.25): 3.25x the gradient."""
    inp = seeded_inputs(2, 4, 11, 22)
    args = (inp["tokens"], inp["old"], inp["adv"], inp["mask"])
    x0 = inp["full"][:, :4].clone().requires_grad_(True)
    pk.ppo_loss(x0, *args, policy_loss=policy_loss, backend=be.name)[0].backward()
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, _ = pk.ppo_loss(x, *args, policy_loss=policy_loss, grad_scale=0.5, backend=be.name)
    (loss * 2).backward(retain_graph=True)
    loss.backward(retain_graph=True)
    (loss * 0.25).backward()
    torch.testing.assert_close(x.grad, 3.25 * x0.grad, rtol=1e-5, atol=1e-7)


def _retain_twice(be, policy_loss):
    inp = seeded_inputs(2, 4, 11, 30)
    args = (inp["tokens"], inp["old"], inp["adv"], inp["mask"])
    x0 = inp["full"][:, :4].clone().requires_grad_(True)
    pk.ppo_loss(x0, *args, policy_loss=policy_loss, backend=be.name)[0].backward()
    x = inp["full"][:, :4].clone().requires_grad_(True)
    loss, _ = pk.ppo_loss(x, *args, policy_loss=policy_loss, backend=be.name)
    (loss * 2).backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(x.grad, 3 * x0.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy_loss", TOKEN_LOSSES)
def test_retain_graph_different_grad_outputs_torch(policy_loss):
    """The eager composite: (2 * loss).backward(retain_graph=True), then
    loss.backward(), accumulates 3x the gradient."""
    _retain_twice(TORCH, policy_loss)


@pytest.mark.parametrize("be", KERNELS_CPU)
@pytest.mark.parametrize("policy_loss", TOKEN_LOSSES)
def test_retain_graph_different_grad_outputs_kernels(be, policy_loss):
    """The kernels' fused path: (2 * loss).backward(retain_graph=True), then
    loss.backward(), accumulates 3x the gradient (the saved dlogits handed out as .grad must
    not be rescaled in place by the second backward: that gave 2x)."""
    _retain_twice(be, policy_loss)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_no_grad_call_matches_grad_call(be, policy_loss):
    """A no_grad call gives the loss and metrics of a grad-enabled call, bit for bit,
    and no graph."""
    inp = seeded_inputs(2, 4, 11, 23)
    args = (inp["tokens"], inp["old"], inp["adv"][:, :1], inp["mask"], inp["ref"])
    kw = dict(policy_loss=policy_loss, kl_coef=0.1, kl_bias_correction=True,
              off_policy_mask_threshold=0.05, backend=be.name)
    x = inp["full"][:, :4].clone().requires_grad_(True)
    with torch.no_grad():
        l0, m0 = pk.ppo_loss(x, *args, **kw)
    l1, m1 = pk.ppo_loss(x, *args, **kw)
    assert not l0.requires_grad and l1.requires_grad
    assert float(l0) == float(l1.detach())
    assert all(float(m0[k]) == float(m1[k]) for k in m1)


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("be", KERNELS_CPU)
@pytest.mark.parametrize("kw", [dict(policy_loss="gspo"), dict(policy_loss="gspo-token"),
                                dict(off_policy_mask_threshold=0.05)],
                         ids=["gspo", "gspo-token", "off-policy-mask"])
def test_no_grad_sequence_loss_skips_the_gradient_pass(be, kw):
    """Under no_grad the two-phase path (gspo, gspo-token, the off-policy mask) runs no
    token_logprobs_bwd: no second pass over the logits, no [N, V] gradient."""
    inp = seeded_inputs(2, 4, 11, 31)
    x = inp["full"][:, :4].clone().requires_grad_(True)
    with torch.no_grad(), _RecordOps() as rec:
        pk.ppo_loss(x, inp["tokens"], inp["old"], inp["adv"], inp["mask"], backend=be.name,
                    **kw)
    assert not [op for op in rec.ops if "token_logprobs_bwd" in op]


@pytest.mark.parametrize("be", KERNELS_CPU)
@pytest.mark.parametrize("policy_loss", ["gspo", "gspo-token"])
def test_inplace_backward_sequence_losses_match_reference(be, policy_loss):
    """inplace_backward=True with gspo / gspo-token: accepted (DESIGN.md: the two-phase
    path allocates as usual, a kernel backend with a UserWarning naming inplace_backward:
    tests/test_loss_inplace_warning.py), with the reference's gradient, on the kernel
    backends and the eager composite alike."""
    inp = seeded_inputs(2, 4, 11, 32)
    args = (inp["tokens"], inp["old"], inp["adv"], inp["mask"])
    _, _, e_grad = ref.ppo_loss(inp["base"], *args, policy_loss=policy_loss)
    for backend in (be.name, "torch"):
        leaf = inp["full"][:, :4].clone().requires_grad_(True)
        # a refusal (ValueError) fails the test: accepting it is the contract
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "inplace_backward", UserWarning)
            loss, _ = pk.ppo_loss(leaf * 1, *args, policy_loss=policy_loss,
                                  inplace_backward=True, backend=backend)
        loss.backward()
        assert_grad_close(leaf.grad, e_grad, 3e-6)


def _grad_scale_run(be, grad_scale, dtype=torch.float32, logits=None, adv=None):
    """(dlogits of loss.backward() with the grad_scale hint, the reference's), or "raised"
    for a ValueError naming grad_scale at the call."""
    inp = seeded_inputs(2, 4, 11, 33)
    x = (inp["full"][:, :4] if logits is None else logits).to(dtype)
    adv = inp["adv"] if adv is None else adv
    tok = inp["tokens"] if logits is None else torch.zeros(x.shape[:2], dtype=torch.long)
    mask = inp["mask"] if logits is None else None
    leaf = x.clone().requires_grad_(True)
    try:
        loss, _ = pk.ppo_loss(leaf, tok, None, adv, mask, loss_agg_mode="token-sum",
                              grad_scale=grad_scale, backend=be.name)
    except ValueError as e:
        assert "grad_scale" in str(e)
        return "raised", None
    loss.backward()
    _, _, e_grad = ref.ppo_loss(x.double(), tok, None, adv, mask, loss_agg_mode="token-sum")
    return leaf.grad, e_grad


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("grad_scale", [1e-30, 0.125, 1e30])
def test_grad_scale_is_only_a_hint(be, grad_scale):
    """grad_scale of 1e-30, 0.125 or 1e30, then loss.backward(): the reference's
    gradient whatever the hint."""
    got, want = _grad_scale_run(be, grad_scale)
    assert np.abs(to_np(got) - want).max() <= 3e-6 * np.abs(want).max()


@pytest.mark.parametrize("grad_scale", [1e-50, 1e50])
def test_grad_scale_outside_float32_torch(grad_scale):
    """grad_scale outside float32's range (1e-50, 1e50) on the eager composite: a
    ValueError naming grad_scale at the call, or the reference's gradient."""
    got, want = _grad_scale_run(TORCH,
                                grad_scale)
    assert isinstance(got, str) or np.abs(to_np(got) - want).max() <= 3e-6 * np.abs(want).max()


@pytest.mark.parametrize("be", KERNELS_CPU)
@pytest.mark.parametrize("grad_scale", [1e-50, 1e50])
def test_grad_scale_outside_float32_kernels(be, grad_scale):
    """grad_scale outside float32's range (1e-50, 1e50) on the kernels: a ValueError
    naming grad_scale at the call, or the reference's gradient (never NaN or an error at
    backward)."""
    got, want = _grad_scale_run(be, grad_scale)
    assert isinstance(got, str) or np.abs(to_np(got) - want).max() <= 3e-6 * np.abs(want).max()


def _fp16_big_grad_inputs():
    x = torch.zeros(1, 1, 2)
    x[0, 0, 1] = 3.0
    return x, torch.tensor([[3.0]])  # d loss / d logits ~ 2.86: times 2^16 overflows fp16


def test_fp16_grad_scale_torch():
    """float16 logits, grad_scale = 2^16 (a GradScaler's scale), then loss.backward() on
    the eager composite: the reference's gradient."""
    x, adv = _fp16_big_grad_inputs()
    got, want = _grad_scale_run(TORCH,
                                2.0 ** 16, torch.float16, x, adv)
    assert np.abs(to_np(got) - want).max() <= 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("be", KERNELS_CPU)
def test_fp16_grad_scale_kernels(be):
    """float16 logits, grad_scale = 2^16 (a GradScaler's scale), then loss.backward() on
    the kernels: finite dlogits, the reference's (the pre-scaled gradient must not overflow
    float16 and stay inf after the rescale)."""
    x, adv = _fp16_big_grad_inputs()
    got, want = _grad_scale_run(be, 2.0 ** 16, torch.float16, x, adv)
    assert torch.isfinite(got).all()
    assert np.abs(to_np(got) - want).max() <= 1e-2 * np.abs(want).max()
