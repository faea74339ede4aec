"""The device weights and token-id check (triton_kernels/weights.py) against the CPU op
ppo_kernels::agg_weights and the eager formulas, on a CUDA device where one is present,
else under the Triton interpreter (CPU tensors): every mode and denominator, empty
sequences, an all-masked batch, shapes that span several of the interpreter's 8-wide
blocks, both dtypes; and ppo_loss on the path that uses them (_backends.device_eager
forced), whose loss and gradient keep their bits."""

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import _torch_impl
from ppo_kernels.triton_kernels import weights as tw

from helpers import device_path
from helpers.backends import TRITON_DEVICE as DEV, triton_ops

# (on CUDA where a device is present, else CPU tensors under the interpreter)
pytestmark = triton_ops

MODES = [(0, 0.0), (0, 37.0), (1, 0.0), (2, 3.0), (2, 1e-3), (3, 0.0), (3, 4.0)]
EAGER = {0: "token-mean", 1: "token-sum", 2: "seq-mean-token-sum", 3: "seq-mean-token-mean"}


def _mask(b, t, seed, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) > 0.35
    if empty_row and b > 1:
        mask[1] = False
    return mask.to(DEV)


@pytest.mark.parametrize("shape", [(5, 19), (1, 1), (3, 8), (20, 3), (0, 4), (4, 0)])
@pytest.mark.parametrize("mode,denom", MODES)
@pytest.mark.parametrize("float64", [False, True])
def test_weights_are_the_cpu_ops_bits(shape, mode, denom, float64):
    mask = _mask(*shape, seed=len(shape) + mode)
    w, ok, _ = tw.loss_weights(mask, mode, denom, float64)
    assert ok is None
    want = torch.ops.ppo_kernels.agg_weights(mask.cpu(), mode, denom, float64).to(DEV)
    assert w.dtype == want.dtype and torch.equal(w, want)
    if mode != 2 and denom == 0.0 and mask.numel():  # the eager formulas' bits too
        eager = _torch_impl.agg_weights(mask, EAGER[mode], dtype=want.dtype)
        assert torch.equal(w, eager)


def test_all_masked_batch_gives_zero_weights():
    mask = torch.zeros(3, 10, dtype=torch.bool, device=DEV)
    for mode, denom in MODES:
        w, _, _ = tw.loss_weights(mask, mode, denom, False)
        assert torch.equal(w, torch.zeros(3, 10, device=DEV))


def test_token_check_flags_only_valid_positions():
    g = torch.Generator().manual_seed(3)
    mask = _mask(4, 21, seed=4)
    V = 50
    tokens = torch.randint(0, V, (4, 21), generator=g).to(DEV)
    tokens[~mask] = V + 7  # masked positions hold anything
    _, ok, _ = tw.loss_weights(mask, 0, 0.0, False, tokens, V)
    assert ok.dtype == torch.bool and ok.shape == () and bool(ok)
    for bad in (V, -1, 2**40):
        t2 = tokens.clone()
        r, c = mask.nonzero()[-1].tolist()  # the last valid position: the last block
        t2[r, c] = bad
        w, ok, _ = tw.loss_weights(mask, 3, 0.0, False, t2, V)
        assert not bool(ok), bad
        want = torch.ops.ppo_kernels.agg_weights(mask.cpu(), 3, 0.0, False)
        assert torch.equal(w, want.to(DEV))


@pytest.mark.parametrize("rc_mode", ["tis", "mis", "tis-seq", "mis-seq", "geo-seq"])
@pytest.mark.parametrize("float64", [False, True])
def test_rollout_correction_weights_match_the_eager_formulas(rc_mode, float64):
    """rc_w against rollout_correction.weights: within 2e-7 relative (exp_acc, and the
    sequence sums in another order), 0 where masked, NaN where a valid log-prob is NaN
    (its token's, or its whole sequence's), a ratio past the clamp, an empty sequence."""
    from ppo_kernels import rollout_correction as rc
    dt = torch.float64 if float64 else torch.float32
    g = torch.Generator().manual_seed(len(rc_mode) + float64)
    B, T = 6, 19
    mask = _mask(B, T, seed=9).cpu()
    old = -torch.rand(B, T, generator=g, dtype=dt) * 3
    roll = old + 0.15 * torch.randn(B, T, generator=g, dtype=dt)
    roll[0, 0] = old[0, 0] - 30.0  # past the clamp
    mask[0, 0] = True
    old[3, 4] = float("nan")  # a NaN on a valid token
    mask[3, 4] = True
    roll[4, 2] = float("nan")  # a NaN on a masked one: never read
    mask[4, 2] = False
    old = old.masked_fill(~mask, 1e30)  # masked positions hold anything
    mask, old, roll = mask.to(DEV), old.to(DEV), roll.to(DEV)
    lo, hi = rc.bounds(rc_mode, 1.2 if rc_mode != "geo-seq" else 1.05)
    _, _, got = tw.loss_weights(mask, 0, 0.0, float64, old=old, rollout=roll, rc_mode=rc_mode,
                                lo=lo, hi=hi)
    want = rc.weights(torch.where(mask, old, 0.0), torch.where(mask, roll, 0.0), mask,
                      rc_mode, lo, hi)
    assert got.dtype == dt
    assert torch.equal(got.isnan(), want.isnan()) and got[3, 4].isnan()
    assert (got[~mask] == 0).all()
    torch.testing.assert_close(got, want, rtol=2e-7, atol=0.0, equal_nan=True)
    assert (got[mask & ~got.isnan()] != 1.0).any() or rc_mode == "geo-seq"


def test_bad_arguments_raise():
    mask = torch.ones(2, 3, dtype=torch.bool, device=DEV)
    with pytest.raises(ValueError, match="mode"):
        tw.loss_weights(mask, 4, 0.0, False)
    with pytest.raises(ValueError, match="mask"):
        tw.loss_weights(mask.float(), 0, 0.0, False)
    with pytest.raises(ValueError, match="rc_mode"):
        tw.loss_weights(mask, 0, 0.0, False, rc_mode="tis")
    with pytest.raises(ValueError, match="rc_mode"):
        tw.loss_weights(mask, 0, 0.0, False, old=mask.float(), rollout=mask.float(),
                        rc_mode="icepop")


def _loss_inputs(seed, B=3, T=7, V=11):
    """logits [B, T, V], tokens, old_logprobs, advantages, response_mask (an empty
    sequence) on DEV."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    adv = torch.randn(B, T, generator=g)
    return (*(v.to(DEV) for v in (logits, tokens, old, adv)), _mask(B, T, seed=seed + 1))


@pytest.mark.parametrize("opts", [dict(), dict(loss_agg_mode="seq-mean-token-mean"),
                                  dict(loss_agg_mode="seq-mean-token-sum-norm",
                                       entropy_coef=0.01, entropy_agg_mode="token-sum"),
                                  dict(global_num_tokens=40, kl_coef=0.1)],
                         ids=["token-mean", "seq-mean-token-mean", "norm-entropy", "global"])
def test_ppo_loss_on_the_device_path_keeps_its_bits(monkeypatch, opts):
    """The triton backend's loss and gradient with the weights and the id check from the
    two launches equal those with the eager weights and token_range, bit for bit."""
    logits, tokens, old, adv, mask = _loss_inputs(21)
    kw = dict(opts, backend="triton")
    if "kl_coef" in opts:
        kw["ref_logprobs"] = old + 0.1
    want, got, calls = device_path.eager_and_device(monkeypatch, tw, "loss_weights", logits,
                                                    tokens, old, adv, mask, **kw)
    assert calls, "the device weights did not run"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert set(got[2]) >= {"clip_frac", "entropy"}


@pytest.mark.parametrize("rc_mode", ["tis", "mis-seq"])
def test_ppo_loss_rollout_correction_on_the_device_path(monkeypatch, rc_mode):
    """With a rollout correction the device path's loss, gradient and metrics are the
    eager weights' within float32 rounding (the weights' exps differ by an ulp or so)."""
    logits, tokens, old, adv, mask = _loss_inputs(31)
    roll = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(33))
    kw = dict(backend="triton", rollout_correction=rc_mode, rollout_is_threshold=1.3,
              rollout_logprobs=roll.to(DEV))
    want, got, calls = device_path.eager_and_device(monkeypatch, tw, "loss_weights", logits,
                                                    tokens, old, adv, mask, **kw)
    assert calls
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)
    for name in ("rollout_is_mean", "rollout_is_max", "rollout_masked_frac"):
        torch.testing.assert_close(got[2][name], want[2][name].float(), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(DEV == "cuda", reason="a failing device assertion ends the CUDA "
                    "context; checked under the interpreter, where it raises at once")
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_ppo_loss_on_the_device_path_rejects_bad_ids(monkeypatch, policy_loss):
    """An id outside [0, V) on a valid position fails the call (the asynchronous device
    assertion, raised at once on the CPU) with a message naming `tokens`; one on a masked
    position is never read. The fused pass and the two-phase path (gspo) alike."""
    calls = device_path.spy(monkeypatch, tw, "loss_weights")
    device_path.force(monkeypatch)
    g = torch.Generator().manual_seed(5)
    B, T, V = 2, 5, 9
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    old, adv = -torch.rand(B, T, generator=g), torch.randn(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    tokens[1, 4] = V + 3
    logits = logits.detach().to(DEV).requires_grad_()
    tokens, old, adv, mask = (v.to(DEV) for v in (tokens, old, adv, mask))
    kw = dict(backend="triton", policy_loss=policy_loss)
    loss, _ = pk.ppo_loss(logits, tokens, old, adv, mask, **kw)
    assert torch.isfinite(loss) and calls
    tokens[0, 2] = V
    with pytest.raises(RuntimeError, match="tokens"):
        pk.ppo_loss(logits, tokens, old, adv, mask, **kw)
