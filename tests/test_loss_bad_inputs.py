"""Bad arguments of ppo_kernels/loss.py's ops (ppo_loss, token_logprobs, value_loss), as
DESIGN.md asks: a ValueError or TypeError whose message names the argument, raised before
any kernel runs; the loss menu's arguments too (docs/LOSSES.md), including values outside
float32's range. And the near misses that must NOT raise: out-of-range token ids on masked
positions, other token and mask dtypes, the boundary values of the ranges.
(The rollout side: test_advantages.py; packed, tensor- and context-parallel arguments:
test_packed.py, test_vocab_parallel.py, test_context_parallel.py.)"""

import math

import pytest
import torch

import ppo_kernels as pk

from helpers.backends import BACKENDS_CPU, HAS_CUDA_DEVICE
from helpers.bad_inputs import (BAD_B, BAD_T, BAD_V, META, PUBLIC_FUNCS, assert_bad_input_raises,
                                bad_row_id, base_gae, base_ppo, base_vl, oob)
from helpers.inputs import seeded_inputs

B, T, V = BAD_B, BAD_T, BAD_V
FUNCS = {k: PUBLIC_FUNCS[k] for k in ("ppo_loss", "token_logprobs", "value_loss")}

# (function, argument to replace, new value or f(base dict) -> value, exception, match)
ROWS = [
    # ---------------- ppo_loss
    ("ppo_loss", "logits", torch.randn(B, T, V, 2), ValueError, "logits"),
    ("ppo_loss", "logits", torch.randn(V), ValueError, "logits"),
    ("ppo_loss", "logits", torch.zeros(B, T, V, dtype=torch.int32), TypeError, "logits"),
    ("ppo_loss", "logits", torch.zeros(B, T, V, dtype=torch.complex64), TypeError, "logits"),
    ("ppo_loss", "logits", [[[0.0] * V] * T] * B, TypeError, "logits"),
    ("ppo_loss", "logits", torch.zeros(B, T, 0), ValueError, "logits"),
    ("ppo_loss", "tokens", torch.zeros(B, T), TypeError, "tokens"),
    ("ppo_loss", "tokens", torch.zeros(B, T, dtype=torch.bool), TypeError, "tokens"),
    ("ppo_loss", "tokens", torch.zeros(B, T + 2, dtype=torch.long), ValueError, "tokens"),
    ("ppo_loss", "tokens", torch.zeros(B + 1, T, dtype=torch.long), ValueError, "tokens"),
    ("ppo_loss", "tokens", torch.zeros(B * T, dtype=torch.long), ValueError, "tokens"),
    ("ppo_loss", "tokens", [[0] * T] * B, TypeError, "tokens"),
    ("ppo_loss", "tokens", oob(V), ValueError, "tokens"),
    ("ppo_loss", "tokens", oob(-1), ValueError, "tokens"),
    ("ppo_loss", "tokens", oob(10**6, (0, 0)), ValueError, "tokens"),
    ("ppo_loss", "old_logprobs", torch.zeros(B, T + 1), ValueError, "old_logprobs"),
    ("ppo_loss", "old_logprobs", torch.zeros(B, T, dtype=torch.long), TypeError, "old_logprobs"),
    ("ppo_loss", "old_logprobs", "x", TypeError, "old_logprobs"),
    ("ppo_loss", "old_logprobs", 0.5, TypeError, "old_logprobs"),
    ("ppo_loss", "advantages", torch.zeros(T, B), ValueError, "advantages"),
    ("ppo_loss", "advantages", torch.zeros(B, T, dtype=torch.int64), TypeError, "advantages"),
    ("ppo_loss", "response_mask", torch.ones(B, T + 1, dtype=torch.bool), ValueError,
     "response_mask"),
    ("ppo_loss", "response_mask", "all", TypeError, "response_mask"),
    ("ppo_loss", "ref_logprobs", torch.zeros(B, 1), ValueError, "ref_logprobs"),
    ("ppo_loss", "rollout_is_weights", torch.ones(B + 1), ValueError, "rollout_is_weights"),
    ("ppo_loss", "rollout_is_weights", torch.ones(B, T, dtype=torch.int32), TypeError,
     "rollout_is_weights"),
    ("ppo_loss", "loss_agg_mode", "mean", ValueError, "loss_agg_mode"),
    ("ppo_loss", "loss_agg_mode", "seq-mean", ValueError, "loss_agg_mode"),
    ("ppo_loss", "kl_estimator", "k4", ValueError, "kl_estimator"),
    ("ppo_loss", "kl_estimator", "K3", ValueError, "kl_estimator"),
    ("ppo_loss", "backend", "gpu", ValueError, "backend"),
    ("ppo_loss", "backend", "cuda", ValueError, "backend"),
    ("ppo_loss", "backend", None, ValueError, "backend"),
    ("ppo_loss", "temperature", 0.0, ValueError, "temperature"),
    ("ppo_loss", "temperature", -1.0, ValueError, "temperature"),
    ("ppo_loss", "temperature", math.nan, ValueError, "temperature"),
    ("ppo_loss", "temperature", math.inf, ValueError, "temperature"),
    ("ppo_loss", "temperature", "1.0", TypeError, "temperature"),
    # 1 / temperature overflows float32 (the accumulation type of float32 logits)
    ("ppo_loss", "temperature", 1e-39, ValueError, "temperature"),
    ("ppo_loss", "temperature", 5e-324, ValueError, "temperature"),
    # and underflows below float32's smallest normal number (-inf entries would shift to NaN)
    ("ppo_loss", "temperature", 1e38, ValueError, "temperature"),
    ("ppo_loss", "temperature", 1e46, ValueError, "temperature"),
    # an int past float64's range: no OverflowError from float()
    ("ppo_loss", "temperature", 10**400, ValueError, "temperature"),
    ("ppo_loss", "kl_coef", 10**400, ValueError, "kl_coef"),
    ("ppo_loss", "top_p", 10**400, ValueError, "top_p"),
    # a per-row temperature tensor: wrong shape, dtype, device, or a bad value on a valid
    # position (the same value on a masked position is ignored: test_loss_temperature.py)
    ("ppo_loss", "temperature", torch.ones(B + 1), ValueError, "temperature"),
    ("ppo_loss", "temperature", torch.ones(B, T + 1), ValueError, "temperature"),
    ("ppo_loss", "temperature", torch.ones(T, B), ValueError, "temperature"),
    ("ppo_loss", "temperature", torch.ones(B, T, dtype=torch.long), TypeError, "temperature"),
    ("ppo_loss", "temperature", torch.tensor([1.0, 0.0]), ValueError, "temperature"),
    ("ppo_loss", "temperature", torch.tensor([[1.0, -1.0, 1.0], [1.0] * 3]), ValueError,
     "temperature"),
    ("ppo_loss", "temperature", torch.tensor([[1.0, math.nan, 1.0], [1.0] * 3]), ValueError,
     "temperature"),
    ("ppo_loss", "temperature", torch.tensor([math.inf, 1.0]), ValueError, "temperature"),
    ("ppo_loss", "temperature", torch.tensor([1.0, 3e38]), ValueError, "temperature"),
    ("ppo_loss", "temperature", torch.tensor([1e-45, 1.0]), ValueError, "temperature"),
    # just above 2**126, whose reciprocal is float32's smallest normal number (accepted)
    ("ppo_loss", "temperature", torch.tensor([2.0**126 * (1 + 2**-23), 1.0]), ValueError,
     "temperature"),
    ("ppo_loss", "temperature", lambda d: torch.ones(B, T, device=META), ValueError,
     "temperature"),
    ("ppo_loss", "grad_scale", 0.0, ValueError, "grad_scale"),
    ("ppo_loss", "grad_scale", -1.0, ValueError, "grad_scale"),
    ("ppo_loss", "grad_scale", math.inf, ValueError, "grad_scale"),
    ("ppo_loss", "grad_scale", 1e-40, ValueError, "grad_scale"),  # float32 subnormal
    ("ppo_loss", "grad_scale", 1e39, ValueError, "grad_scale"),  # inf in float32
    ("ppo_loss", "clip_eps_low", 1.0, ValueError, "clip_eps_low"),  # [0, 1)
    ("ppo_loss", "clip_eps_high", 1.0, ValueError, "clip_eps_high"),
    ("ppo_loss", "grad_scale", torch.tensor(0.5), TypeError, "grad_scale"),
    ("ppo_loss", "clip_eps_low", -0.1, ValueError, "clip_eps_low"),
    ("ppo_loss", "clip_eps_low", 1.0, ValueError, "clip_eps_low"),
    ("ppo_loss", "clip_eps_high", 1.0, ValueError, "clip_eps_high"),
    ("ppo_loss", "clip_eps_high", -0.2, ValueError, "clip_eps_high"),
    ("ppo_loss", "dual_clip_c", 1.0, ValueError, "dual_clip_c"),
    ("ppo_loss", "dual_clip_c", 0.5, ValueError, "dual_clip_c"),
    ("ppo_loss", "dual_clip_c", -3.0, ValueError, "dual_clip_c"),
    # at or below 1 + clip_eps_high (0.2) the cap cuts into the clip band
    ("ppo_loss", "dual_clip_c", 1.2, ValueError, "dual_clip_c"),
    ("ppo_loss", "policy_loss", "ppo", ValueError, "policy_loss"),
    ("ppo_loss", "policy_loss", "GSPO", ValueError, "policy_loss"),
    ("ppo_loss", "sapo_tau_pos", 0.0, ValueError, "sapo_tau_pos"),
    ("ppo_loss", "sapo_tau_neg", -1.0, ValueError, "sapo_tau_neg"),
    ("ppo_loss", "clip_eps_high", 2.0, ValueError, "clip_eps_high"),  # fine for cispo only
    ("ppo_loss", "kl_bias_correction", "yes", TypeError, "kl_bias_correction"),
    ("ppo_loss", "kl_estimator", "k2+", ValueError, "kl_estimator"),
    ("ppo_loss", "entropy_agg_mode", "none", ValueError, "entropy_agg_mode"),
    ("ppo_loss", "entropy_agg_mode", "mean", ValueError, "entropy_agg_mode"),
    ("ppo_loss", "advantages", torch.zeros(B + 1), ValueError, "advantages"),
    ("ppo_loss", "advantages", torch.zeros(B, 2), ValueError, "advantages"),
    ("ppo_loss", "rollout_is_weights", torch.ones(B, 2), ValueError, "rollout_is_weights"),
    ("ppo_loss", "global_num_tokens", torch.tensor([3.0, 4.0]), ValueError, "global_num_tokens"),
    ("ppo_loss", "global_num_tokens", torch.tensor(0.0), ValueError, "global_num_tokens"),
    ("ppo_loss", "global_num_tokens", torch.tensor(True), TypeError, "global_num_tokens"),
    ("ppo_loss", "global_num_seqs", 0, ValueError, "global_num_seqs"),
    ("ppo_loss", "global_num_seqs", torch.tensor(-2), ValueError, "global_num_seqs"),
    ("ppo_loss", "kl_coef", -0.1, ValueError, "kl_coef"),
    ("ppo_loss", "kl_coef", math.nan, ValueError, "kl_coef"),
    ("ppo_loss", "entropy_coef", "0.1", TypeError, "entropy_coef"),
    ("ppo_loss", "entropy_coef", math.inf, ValueError, "entropy_coef"),
    ("ppo_loss", "global_num_tokens", 0, ValueError, "global_num_tokens"),
    ("ppo_loss", "global_num_tokens", -4, ValueError, "global_num_tokens"),
    ("ppo_loss", "norm_length", 0, ValueError, "norm_length"),
    ("ppo_loss", "norm_length", -1.5, ValueError, "norm_length"),
    ("ppo_loss", "inplace_backward", "yes", TypeError, "inplace_backward"),
    ("ppo_loss", "tokens", lambda d: d["tokens"].to(META), ValueError, "tokens"),
    ("ppo_loss", "old_logprobs", lambda d: d["old_logprobs"].to(META), ValueError,
     "old_logprobs"),
    ("ppo_loss", "advantages", lambda d: d["advantages"].to(META), ValueError, "advantages"),
    ("ppo_loss", "response_mask", lambda d: d["response_mask"].to(META), ValueError,
     "response_mask"),
    ("ppo_loss", "ref_logprobs", lambda d: d["ref_logprobs"].to(META), ValueError,
     "ref_logprobs"),
    # ---------------- token_logprobs
    ("token_logprobs", "logits", torch.zeros(B, T, V, dtype=torch.int64), TypeError, "logits"),
    ("token_logprobs", "logits", torch.zeros(B, T, 0), ValueError, "logits"),
    ("token_logprobs", "logits", torch.zeros(B, T + 2, V), ValueError, "tokens"),
    ("token_logprobs", "logits", None, TypeError, "logits"),
    ("token_logprobs", "tokens", torch.zeros(B, T, dtype=torch.float16), TypeError, "tokens"),
    ("token_logprobs", "tokens", oob(V), ValueError, "tokens"),
    ("token_logprobs", "tokens", oob(-2), ValueError, "tokens"),
    ("token_logprobs", "tokens", lambda d: d["tokens"].to(META), ValueError, "tokens"),
    ("token_logprobs", "response_mask", torch.ones(T, B), ValueError, "response_mask"),
    ("token_logprobs", "temperature", 0, ValueError, "temperature"),
    ("token_logprobs", "temperature", -0.5, ValueError, "temperature"),
    ("token_logprobs", "temperature", 2e-39, ValueError, "temperature"),
    ("token_logprobs", "temperature", torch.ones(B, T, 2), ValueError, "temperature"),
    ("token_logprobs", "temperature", torch.ones(B * T), ValueError, "temperature"),
    ("token_logprobs", "temperature", torch.ones(B, T, dtype=torch.bool), TypeError,
     "temperature"),
    ("token_logprobs", "temperature", torch.tensor([[1.0, 1.0, 0.0], [1.0] * 3]), ValueError,
     "temperature"),
    ("token_logprobs", "temperature", torch.tensor([-2.0, 1.0]), ValueError, "temperature"),
    ("token_logprobs", "return_entropy", "yes", TypeError, "return_entropy"),
    ("token_logprobs", "backend", "tpu", ValueError, "backend"),
    ("token_logprobs", "backend", "cuda", ValueError, "backend"),
    # ---------------- sampling replay (docs/SAMPLING.md)
    *[(f, "sampling_mask", v, e, m) for f in ("ppo_loss", "token_logprobs") for v, e, m in (
        (pk.SamplingMask(torch.tensor([V]), torch.tensor([0] + [1] * (B * T))), ValueError,
         "sampling_mask.token_ids"),
        (pk.SamplingMask(torch.tensor([-1]), torch.tensor([0] + [1] * (B * T))), ValueError,
         "sampling_mask.token_ids"),
        (pk.SamplingMask(torch.tensor([0, 1]), torch.tensor([0, 2, 1] + [2] * (B * T - 2))),
         ValueError, "sampling_mask.offsets"),
        (pk.SamplingMask(torch.tensor([0, 1]), torch.tensor([0] + [1] * (B * T))),
         ValueError, "sampling_mask.offsets"),
        (pk.SamplingMask(torch.tensor([0]), torch.tensor([0, 1, 1])), ValueError,
         "sampling_mask.offsets"),
        (pk.SamplingMask(torch.tensor([0, 0]), torch.tensor([0, 2] + [2] * (B * T - 1))),
         ValueError, "sampling_mask.token_ids"),
        (pk.SamplingMask(torch.tensor([0.0]), torch.tensor([0] + [1] * (B * T))), TypeError,
         "sampling_mask.token_ids"),
        ((torch.tensor([0]),), TypeError, "sampling_mask"))],
    *[(f, k, v, e, k) for f in ("ppo_loss", "token_logprobs") for k, v, e in (
        ("top_k", 0, ValueError), ("top_k", 2.5, ValueError), ("top_k", "5", TypeError),
        ("top_k", torch.tensor([3, 0]), ValueError), ("top_k", torch.tensor([3]), ValueError),
        ("top_k", torch.tensor([3.0, 2.0]), TypeError),
        ("top_p", 0.0, ValueError), ("top_p", 1.5, ValueError), ("top_p", math.nan, ValueError),
        ("top_p", torch.tensor([0.5, 1.2]), ValueError),
        ("min_p", 1.0, ValueError), ("min_p", -0.1, ValueError),
        ("min_p", torch.tensor([0.1, -0.2]), ValueError))],
    ("ppo_loss", "top_p", lambda d: (d.update(
        sampling_mask=pk.SamplingMask(torch.arange(V).repeat(B * T),
                                      torch.arange(B * T + 1) * V)), 0.9)[1], ValueError,
     "sampling_mask"),
    ("ppo_loss", "kl_logprobs", "partial", ValueError, "kl_logprobs"),
    ("ppo_loss", "entropy_over", "topk", ValueError, "entropy_over"),
    ("token_logprobs", "entropy_over", "all", ValueError, "entropy_over"),
    ("token_logprobs", "return_full", True, ValueError, "return_full"),
    ("token_logprobs", "return_full", 1, TypeError, "return_full"),
    # ---------------- value_loss
    ("value_loss", "values", torch.randn(B, T, 1), ValueError, "values"),
    ("value_loss", "values", torch.ones(B, T, dtype=torch.long), TypeError, "values"),
    ("value_loss", "values", None, TypeError, "values"),
    ("value_loss", "old_values", torch.randn(B, T + 1), ValueError, "old_values"),
    ("value_loss", "old_values", None, TypeError, "old_values"),
    ("value_loss", "returns", torch.randn(T, B), ValueError, "returns"),
    ("value_loss", "returns", lambda d: d["returns"].to(META), ValueError, "returns"),
    ("value_loss", "response_mask", torch.ones(B), ValueError, "response_mask"),
    ("value_loss", "clip_range", -0.1, ValueError, "clip_range"),
    ("value_loss", "clip_range", math.inf, ValueError, "clip_range"),
    ("value_loss", "loss_agg_mode", "sum", ValueError, "loss_agg_mode"),
]


@pytest.mark.parametrize("row", ROWS, ids=[bad_row_id(r) for r in ROWS])
def test_bad_input_raises_naming_the_argument(row):
    """Each row: the base call of its function with one argument replaced raises the
    row's exception, whose message names the argument and says what was expected."""
    assert_bad_input_raises(row, FUNCS)


def test_every_public_function_has_rows():
    """Every function of the module has rows in the table."""
    assert {r[0] for r in ROWS} == set(FUNCS)


def test_base_calls_are_valid():
    """The table's base inputs are valid: each row fails because of its one change."""
    for name, (fn, base) in FUNCS.items():
        fn(**base())


@pytest.mark.parametrize("policy_loss", ["cispo", "sapo", "vespo"])
def test_dual_clip_only_with_a_clipped_surrogate(policy_loss):
    """dual_clip_c with cispo or sapo (no clipped surrogate to cap) is a ValueError naming
    dual_clip_c."""
    with pytest.raises(ValueError, match="dual_clip_c"):
        pk.ppo_loss(**base_ppo(), policy_loss=policy_loss, dual_clip_c=3.0)


def test_kl_coef_without_ref_logprobs():
    """kl_coef > 0 without ref_logprobs is a ValueError naming ref_logprobs; kl_coef = 0
    needs none."""
    d = base_ppo()
    d["ref_logprobs"] = None
    d["kl_coef"] = 0.1
    with pytest.raises(ValueError, match="ref_logprobs"):
        pk.ppo_loss(**d)
    d["kl_coef"] = 0.0
    pk.ppo_loss(**d)  # fine without a penalty


@pytest.mark.parametrize("name", ["kl_bias_correction", "inplace_backward"])
def test_flags_are_bools(name):
    """kl_bias_correction and inplace_backward take bools only (1 is a TypeError naming
    them)."""
    with pytest.raises(TypeError, match=name):
        pk.ppo_loss(**base_ppo(), **{name: 1})


def test_tokens_one_position_too_long_get_a_hint():
    """tokens of the logits' length T + 1 (not shifted): the ValueError says
    tokens[:, 1:]."""
    d = base_ppo()
    d["logits"] = torch.randn(B, T + 1, V)
    d["tokens"] = torch.randint(0, V, (B, T + 1))
    with pytest.raises(ValueError, match=r"tokens\[:, 1:\]"):
        pk.ppo_loss(**d)


# the other device of a mismatch: "meta" runs everywhere (the device checks raise before
# any data is read), "cuda" where a GPU is present
OTHER_DEVICES = [pytest.param("meta", id="meta"),
                 pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
                     not HAS_CUDA_DEVICE, reason="needs a CUDA device"))]


@pytest.mark.parametrize("device", OTHER_DEVICES)
@pytest.mark.parametrize("name", ["tokens", "old_logprobs", "advantages", "response_mask",
                                  "ref_logprobs"])
def test_device_mismatch(device, name):
    """One tensor argument left on the CPU while the logits and every other tensor are on
    another device (backend auto): a ValueError naming that argument, whichever order the
    checks run in."""
    d = base_ppo()
    for k, v in list(d.items()):
        if isinstance(v, torch.Tensor) and k != name:
            d[k] = v.to(device)
    d["backend"] = "auto"
    assert d[name].device.type == "cpu" and d["logits"].device.type == device
    with pytest.raises(ValueError, match=rf"^{name}: expected a tensor on"):
        pk.ppo_loss(**d)


@pytest.mark.parametrize("device", OTHER_DEVICES)
def test_device_mismatch_gae(device):
    """gae with values on the CPU, rewards and mask on another device: a ValueError naming
    values."""
    g = base_gae()
    with pytest.raises(ValueError, match="^values: expected a tensor on"):
        pk.gae(g["rewards"].to(device), g["values"], g["response_mask"].to(device))


@pytest.mark.parametrize("bad", [-1, V, V + 7, -10**9, 2**40])
def test_out_of_range_tokens_on_masked_positions_are_fine(bad):
    """Out-of-range token ids on masked positions are fine (ppo_loss, token_logprobs,
    score_rollout: a finite result); the same id on a valid position is a ValueError naming
    tokens."""
    for name in ("ppo_loss", "token_logprobs", "score_rollout"):
        fn, base = PUBLIC_FUNCS[name]
        d = base()
        d["tokens"] = d["tokens"].clone()
        d["tokens"][1, 2] = bad
        d["response_mask"] = d["response_mask"].clone()
        d["response_mask"][1, 2] = False
        out = fn(**d)
        first = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(first).all(), name
        d["response_mask"][1, 2] = True
        with pytest.raises(ValueError, match="tokens"):
            fn(**d)


@pytest.mark.parametrize("replay", [dict(top_k=3, top_p=0.9), "given"])
@pytest.mark.parametrize("bad", [-1, V, 2**40])
def test_out_of_range_tokens_with_a_kept_set(bad, replay):
    """With sampling replay on the cpu backend (the kernels check the ids, token_logprobs_fwd
    before the kept-set op reads them): an out-of-range id on a valid position is the
    ValueError naming tokens, on a masked one fine."""
    d = base_ppo()
    d["backend"] = "cpu"
    d["tokens"] = d["tokens"].clone()
    d["tokens"][1, 2] = bad
    if replay == "given":
        ids = (torch.arange(B * T)[:, None] + torch.arange(3)) % V
        replay = dict(sampling_mask=pk.SamplingMask(ids.reshape(-1),
                                                    torch.arange(0, B * T * 3 + 1, 3)))
    d["response_mask"] = d["response_mask"].clone()
    d["response_mask"][1, 2] = False
    loss, _ = pk.ppo_loss(**d, **replay)
    assert torch.isfinite(loss)
    d["response_mask"][1, 2] = True
    with pytest.raises(ValueError, match="^tokens: ids must lie in"):
        pk.ppo_loss(**d, **replay)


def test_int32_tokens_and_mask_dtypes_accepted():
    """int32 tokens and int / float / no masks give the loss of int64 tokens and a bool
    mask."""
    d = base_ppo()
    loss_ref, _ = pk.ppo_loss(**d)
    d["tokens"] = d["tokens"].int()
    for m in (d["response_mask"].int(), d["response_mask"].float(), None):
        d["response_mask"] = m
        loss, _ = pk.ppo_loss(**d)
        assert float(loss) == pytest.approx(float(loss_ref), rel=1e-6)


@pytest.mark.parametrize("kw", [dict(clip_eps_low=0.0), dict(clip_eps_low=0.999),
                                dict(clip_eps_high=0.0), dict(dual_clip_c=1.2001),
                                dict(policy_loss="cispo", clip_eps_low=1.0, clip_eps_high=4.0),
                                dict(global_num_tokens=torch.tensor(7)),
                                dict(global_num_seqs=torch.tensor(5.0)), dict(global_num_seqs=1),
                                dict(temperature=1e-3), dict(temperature=3e-38),
                                dict(temperature=2.0**126),
                                dict(temperature=torch.tensor([2.0**126, 1.0])),
                                dict(grad_scale=1e-30), dict(kl_coef=0.0),
                                dict(grad_scale=float(torch.finfo(torch.float32).tiny)),
                                dict(grad_scale=float(torch.finfo(torch.float32).max)),
                                dict(global_num_tokens=1), dict(norm_length=0.5),
                                # any top_k >= V is V (off), past int64 and float64 too
                                dict(top_k=2**63), dict(top_k=10**400)])
def test_range_boundaries_are_accepted(kw):
    """The boundary values of the ranges (clip_eps 0 and just below 1, dual_clip_c just
    above 1 + clip_eps_high, cispo's wide band, tensor and int global counts, temperatures
    1e-3, 3e-38 and 2**126 (whose reciprocal is float32's smallest normal number), as a
    number and per row, grad_scale 1e-30 and float32's smallest normal and largest
    values, kl_coef 0, norm_length 0.5, a top_k past int64) are accepted."""
    loss, _ = pk.ppo_loss(**base_ppo(), **kw)
    assert torch.isfinite(loss)


def test_value_loss_zero_clip_range_accepted():
    """value_loss with clip_range = 0 is accepted."""
    loss, _ = pk.value_loss(**base_vl(), clip_range=0)
    assert torch.isfinite(loss)


# ------------------------------------------------------------------ the loss menu's arguments

ROLL = -torch.rand(B, T, generator=torch.Generator().manual_seed(0)) - 0.4

BAD_ARGS = [
    ("policy_loss", dict(policy_loss="GSPO")),
    ("policy_loss", dict(policy_loss=None)),
    ("sapo_tau_pos", dict(policy_loss="sapo", sapo_tau_pos=0.0)),
    ("sapo_tau_neg", dict(policy_loss="sapo", sapo_tau_neg=True)),
    ("sapo_tau_pos", dict(policy_loss="sapo", sapo_tau_pos=torch.tensor(1.0))),
    ("kl_estimator", dict(kl_estimator="k2+")),
    ("kl_bias_correction", dict(kl_bias_correction="yes")),
    ("entropy_agg_mode", dict(entropy_agg_mode="none")),
    ("global_num_tokens", dict(global_num_tokens=0)),
    ("global_num_tokens", dict(global_num_tokens=float("nan"))),
    ("global_num_tokens", dict(global_num_tokens=torch.tensor(0.0))),
    ("global_num_tokens", dict(global_num_tokens=torch.tensor(float("inf")))),
    ("global_num_tokens", dict(global_num_tokens=torch.tensor(True))),
    ("global_num_tokens", dict(global_num_tokens=torch.tensor([2.0, 3.0]))),
    ("global_num_tokens", dict(global_num_tokens=torch.tensor(1e-50, dtype=torch.float64))),
    ("global_num_tokens", dict(global_num_tokens=True)),
    ("global_num_seqs", dict(loss_agg_mode="seq-mean-token-mean",
                             global_num_seqs=torch.tensor(-1))),
    ("global_num_seqs", dict(global_num_seqs=torch.tensor(2 + 0j))),
    ("grad_scale", dict(grad_scale=0.0)),
    ("grad_scale", dict(grad_scale=True)),
    ("rollout_is_threshold", dict(rollout_correction="tis", rollout_is_threshold=(1.0,))),
    ("rollout_is_threshold", dict(rollout_correction="tis", rollout_is_threshold="2")),
    ("rollout_is_threshold", dict(rollout_correction="tis", rollout_is_threshold=(-0.5, 2.0))),
    ("rollout_is_threshold", dict(rollout_correction="tis",
                                  rollout_is_threshold=torch.tensor(2.0))),
    ("rollout_is_threshold", dict(rollout_correction="geo-seq", rollout_is_threshold=1.0)),
    ("rollout_correction", dict(rollout_correction="TIS")),
    ("rollout_logprobs", dict(rollout_correction="tis", rollout_logprobs=ROLL[:, :2])),
    ("rollout_logprobs", dict(rollout_correction="tis", rollout_logprobs=ROLL.long())),
    ("off_policy_mask_threshold", dict(off_policy_mask_threshold="0.1")),
    ("off_policy_mask_threshold", dict(off_policy_mask_threshold=float("inf"))),
    ("inplace_backward", dict(inplace_backward="no")),
    ("advantages", dict(adv=torch.randn(B, 2))),
    ("advantages", dict(adv=torch.randn(1, T))),
    ("advantages", dict(adv=torch.randn(B, 1, 1))),
    ("advantages", dict(adv=torch.randn(B).long())),
    ("rollout_is_weights", dict(rollout_is_weights=torch.rand(1, T))),
    ("rollout_is_weights", dict(rollout_is_weights=torch.rand(B, T, 1))),
    ("clip_eps_high", dict(policy_loss="cispo", clip_eps_high=-0.1)),
    ("clip_eps_low", dict(policy_loss="cispo", clip_eps_low=1.5)),
    ("clip_eps_high", dict(policy_loss="gspo", clip_eps_high=1.0)),
    ("dual_clip_c", dict(policy_loss="sapo", dual_clip_c=3.0)),
    ("dual_clip_c", dict(policy_loss="gspo", dual_clip_c=1.1)),
    # DPPO: divergence thresholds >= 0, the ratio cap > 0
    ("clip_eps_low", dict(policy_loss="dppo-tv", clip_eps_low=-0.1)),
    ("clip_eps_high", dict(policy_loss="dppo-kl", clip_eps_high=float("nan"))),
    ("clip_eps_high", dict(policy_loss="dppo-tv", clip_eps_high="0.2")),
    ("dual_clip_c", dict(policy_loss="dppo-tv", dual_clip_c=0.0)),
    ("dual_clip_c", dict(policy_loss="dppo-kl", dual_clip_c=float("inf"))),
    # VESPO: k >= 0, lambda > 0, no dual clip, no rollout correction (TRL folds it)
    ("vespo_k_pos", dict(policy_loss="vespo", vespo_k_pos=-1.0)),
    ("vespo_k_neg", dict(policy_loss="vespo", vespo_k_neg="3")),
    ("vespo_lambda_pos", dict(policy_loss="vespo", vespo_lambda_pos=0.0)),
    ("vespo_lambda_neg", dict(policy_loss="vespo", vespo_lambda_neg=float("nan"))),
    ("vespo_lambda_neg", dict(policy_loss="vespo", vespo_lambda_neg=True)),
    ("dual_clip_c", dict(policy_loss="vespo", dual_clip_c=3.0)),
    ("rollout_correction", dict(policy_loss="vespo", rollout_correction="tis",
                                rollout_logprobs=ROLL)),
]


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("name,kw", BAD_ARGS, ids=[f"{n}-{i}" for i, (n, _) in
                                                   enumerate(BAD_ARGS)])
def test_bad_menu_arguments_name_themselves(be, name, kw):
    """Bad values of the loss menu's arguments (and of the global counts, grad_scale,
    the rollout correction's, the per-sequence shapes): a ValueError or TypeError whose
    message names the argument."""
    g = torch.Generator().manual_seed(27)
    kw = dict(kw)
    adv = kw.pop("adv", torch.randn(B, T, generator=g))
    if "rollout_correction" in kw:
        kw.setdefault("rollout_logprobs", ROLL)
    with pytest.raises((ValueError, TypeError), match=name):
        pk.ppo_loss(torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T)),
                    ROLL + 0.05, adv, backend=be.name, **kw)


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("tau", [1e-40, 1e39])
def test_sapo_tau_outside_float32(be, tau):
    """sapo_tau_pos / sapo_tau_neg outside float32's range (1e-40, 1e39): a ValueError
    naming sapo_tau_pos and the range (never a -inf loss, a NaN gradient or a RuntimeError
    from the float conversion). Refusing is the contract: the kernels take the scalars as
    float32 (DESIGN.md, "Bad input": a ValueError naming the argument, what was expected
    and what was given), where 1e-40 is subnormal and 1e39 overflows to inf, so no loss
    computed with them would be SAPO's."""
    inp = seeded_inputs(2, 3, 5, 34)
    x = inp["full"][:, :3].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"sapo_tau_pos: .*float32") as info:
        pk.ppo_loss(x, inp["tokens"], None, inp["adv"], inp["mask"], policy_loss="sapo",
                    sapo_tau_pos=tau, sapo_tau_neg=tau, backend=be.name)
    assert repr(tau) in str(info.value)
    assert x.grad is None


@pytest.mark.parametrize("be", BACKENDS_CPU)
@pytest.mark.parametrize("name,agg", [("global_num_tokens", "token-mean"),
                                      ("global_num_seqs", "seq-mean-token-sum")])
def test_global_count_number_underflowing_float32(be, name, agg):
    """global_num_tokens / global_num_seqs as a Python number below float32's range
    (1e-50): a ValueError naming it and the range, as for the same value as a tensor
    (never a NaN or inf loss). Refusing is the contract: the count rounds to 0 in float32,
    a non-positive count (DESIGN.md, "Bad input")."""
    inp = seeded_inputs(2, 3, 5, 35)
    with pytest.raises(ValueError, match=name + r": .*float32") as info:
        pk.ppo_loss(inp["full"][:, :3], inp["tokens"], inp["old"], inp["adv"], inp["mask"],
                    loss_agg_mode=agg, backend=be.name, **{name: 1e-50})
    assert "1e-50" in str(info.value)


def test_shape_messages_show_the_given_shape():
    """A per-token input of the wrong shape is named with the shape the caller passed (flat
    [N] layout too: a [N, 1] temperature is not reported as [1]), and the hint about tokens
    of one position more only where tokens are [B, T]."""
    g = torch.Generator().manual_seed(3)
    logits, tokens = torch.randn(5, 7, generator=g), torch.randint(0, 7, (5,), generator=g)
    with pytest.raises(ValueError, match=r"temperature: expected shape \[5\], got \[5, 1\]$"):
        pk.token_logprobs(logits, tokens, temperature=torch.ones(5, 1))
    with pytest.raises(ValueError, match=r"old_logprobs: expected shape \[5\], got \[4\]$"):
        pk.ppo_loss(logits, tokens, torch.zeros(4), torch.zeros(5))
