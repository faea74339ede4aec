"""Tests of triton_kernels/ (the Triton backend): the raw ppo_kernels::triton_*
ops against the numpy float64 oracle (reference.py). Registration and schemas
(library.py); token_logprobs forward and backward (logprobs.py); the fused ppo_loss, in
place, with the loss menu, grad_scale and scale_grad_ (ppo_loss.py); gae and score_rollout
(gae.py); the _math helpers probed by a kernel of their own; the ops' own argument checks;
more than 65,535 rows and 64-bit offsets (on a GPU).

Runs on CUDA when a device is present, else on CPU tensors under TRITON_INTERPRET=1 (set
by tests/helpers/backends.py before triton is imported), where shapes are kept small: the
interpreter runs the programs one by one. The interpreter runs the kernels with a 32-wide vocabulary
block and an 8-long GAE chunk (triton_kernels/_config.py), so V = 100, 257 and
T = 20 cross several blocks/chunks with a partial last one. The raw ops' precision, batch
invariance and opcheck tests sit beside their siblings (test_loss_precision.py,
test_batch_invariance.py, test_autograd_opcheck.py); the kernels' lowering for sm_90:
test_triton_kernels_lowering.py.
"""

import pathlib
import re

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import ppo_kernels.triton_kernels as tk
from ppo_kernels.triton_kernels import library
from ppo_kernels import reference as ref
from ppo_kernels.triton_kernels._math import (exp_acc, expm1, expm1_minus_x, kl_term,
                                              log1p)
from ppo_kernels.spec import KERNEL_POLICY_LOSSES
from ppo_kernels.testing import make_mask

from helpers.asserts import TOK_TOL, assert_close_np, expm1_minus_x64, grad_tol, rel_err
from helpers.backends import GENUINE_INF, KL_CODES, TRITON_DEVICE, triton_ops
from helpers.inputs import acc_of, k3_deltas, make_case, per_token, ppo_inputs, rand_tok
from helpers.raw_ops import check_ppo, ref_ppo, run_ppo, slot_args

# (on CPU: skipped, with the reason, where triton's interpreter cannot run the kernels)
pytestmark = triton_ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = torch.ops.ppo_kernels
DEV = TRITON_DEVICE


# ------------------------------------------------------------------ registration / schema

def _norm_schema(s):
    """A schema string reduced to its meaning: whitespace-normalised; output names dropped
    (some torch versions ignore the schema given to triton_op and infer it from the
    annotations, which name no outputs); SymInt read as int (torch 2.11's triton_op reports
    the `int[] codes` of csrc/ops.cpp as `SymInt[] codes`, torch 2.14 keeps `int[]`: in an
    operator schema SymInt is an int that may be symbolic under tracing, the same argument
    for an eager caller). Argument names, order, types, optionality and aliasing all stay."""
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"\bSymInt\b", "int", s)
    args, rets = s.split(" -> ")
    return args + " -> " + re.sub(r"(Tensor(?:\([a-z]!?\))?) \w+", r"\1", rets)


def test_norm_schema_reads_symint_as_int():
    """The torch 2.11 form of a schema equals the csrc/ops.cpp form; a real difference
    (type, optionality, name) does not."""
    cpp = "ns::f(Tensor x, float[] scalars, int[] codes, int n) -> (Tensor loss)"
    assert _norm_schema("ns::f(Tensor x, float[] scalars, SymInt[] codes, SymInt n) -> (Tensor)"
                        ) == _norm_schema(cpp)
    for other in ("ns::f(Tensor x, float[] scalars, int[]? codes, int n) -> (Tensor)",
                  "ns::f(Tensor x, float[] scalars, float[] codes, int n) -> (Tensor)",
                  "ns::f(Tensor x, float[] scalars, int[] kinds, int n) -> (Tensor)",
                  "ns::f(Tensor(a!) x, float[] scalars, int[] codes, int n) -> (Tensor)"):
        assert _norm_schema(other) != _norm_schema(cpp), other


def test_schemas_match_ops_cpp():
    """Every triton_* op has the schema of its C++ twin in csrc/ops.cpp (_norm_schema)."""
    text = (ROOT / "csrc" / "ops.cpp").read_text()
    defs = re.findall(r'm\.def\(\s*((?:"[^"]*"\s*)+)\)', text)
    cpp = {}
    for d in defs:
        s = "".join(re.findall(r'"([^"]*)"', d))
        name, rest = s.split("(", 1)
        cpp[name.strip()] = "(" + rest
    assert set(cpp) == {"token_logprobs_fwd", "token_logprobs_bwd", "ppo_loss_fwd",
                        "ppo_loss_fwd_inplace", "scale_grad_", "gae", "score_rollout",
                        "distill_fwd",
                        # sampling replay (docs/SAMPLING.md)
                        "sampling_threshold", "kept_logprobs_fwd", "kept_logprobs_bwd_",
                        "kept_logprobs_bwd", "threshold_kept_fwd"}
    for name, schema in cpp.items():
        got = str(getattr(OPS, "triton_" + name).default._schema)
        assert _norm_schema(got) == _norm_schema(f"ppo_kernels::triton_{name}{schema}"), name
    assert library.register() == library.register()  # idempotent


# ------------------------------------------------------------------ token_logprobs_fwd

@pytest.mark.parametrize("V", [1, 7, 100, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_token_logprobs_fwd(V, dtype):
    logits, tokens, mask = make_case(B=2, T=4, V=V, dtype=dtype, seed=V)
    logp, ent, row_max, log_sum = OPS.triton_token_logprobs_fwd(logits, tokens, mask, 0.7,
                                                                 True)
    acc = acc_of(dtype)
    assert logp.dtype == ent.dtype == row_max.dtype == log_sum.dtype == acc
    rl, re_ = ref.token_logprobs(logits, tokens, mask, 0.7)
    rtol, atol = TOK_TOL[dtype]
    assert_close_np(logp, rl, rtol, atol, "logprobs")
    assert_close_np(ent, re_, rtol, atol, "entropy")
    # row_max: the raw max logit; log_sum: log sum exp((x - row_max) / T); 0 on masked rows
    m = mask.cpu().numpy()
    x = ref.as_f64(logits)
    xmax = x.max(-1)
    rls = np.log(np.exp((x - xmax[..., None]) / 0.7).sum(-1))
    assert_close_np(row_max, np.where(m, xmax, 0.0), 0, 0, "row_max")
    assert_close_np(log_sum, np.where(m, rls, 0.0), rtol, atol, "log_sum")
    logp2, ent2, row_max2, log_sum2 = OPS.triton_token_logprobs_fwd(logits, tokens, mask, 0.7,
                                                                     False)
    assert ent2.numel() == 0
    assert torch.equal(logp2, logp) and torch.equal(row_max2, row_max)
    assert torch.equal(log_sum2, log_sum)


@pytest.mark.parametrize("layout,padding", [("view", "left"), ("raw", "right"),
                                            ("bstride", "interior"), ("raw", "empty_row"),
                                            ("view", "all")])
def test_token_logprobs_layouts_and_padding(layout, padding):
    logits, tokens, mask = make_case(B=3, T=6, V=100, layout=layout, padding=padding,
                                     neginf=True, seed=1)
    logp, ent, _, _ = OPS.triton_token_logprobs_fwd(logits, tokens, mask, 1.0, True)
    rl, re_ = ref.token_logprobs(logits, tokens, mask)
    assert_close_np(logp, rl, 1e-5, 1e-6, "logprobs")
    assert_close_np(ent, re_, 1e-5, 1e-6, "entropy")
    assert (logp[~mask] == 0).all() and (ent[~mask] == 0).all()


# ------------------------------------------------------------------ token_logprobs_bwd

@pytest.mark.parametrize("V", [1, 7, 257])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_bwd(V, with_entropy, dtype):
    logits, tokens, mask = make_case(B=2, T=4, V=V, dtype=dtype, layout="raw",
                                     padding="interior", neginf=V > 1, seed=2)
    acc = acc_of(dtype)
    _, ent, row_max, log_sum = OPS.triton_token_logprobs_fwd(logits, tokens, mask, 1.3,
                                                              with_entropy)
    g = rand_tok(2, 4, acc, 3)
    gh = rand_tok(2, 4, acc, 4) if with_entropy else None
    d = OPS.triton_token_logprobs_bwd(g, gh, logits, tokens, mask, row_max, log_sum, ent, 1.3)
    assert d.shape == logits.shape and d.dtype == logits.dtype and d.is_contiguous()
    rd = ref.token_logprobs_grad(logits, tokens, mask, 1.3, g, gh)
    assert_close_np(d, rd, *grad_tol(dtype, rd), "dlogits")
    assert (d[:, 4:] == 0).all(), "positions t >= T get a zero gradient"
    assert (d[:, :4][~mask] == 0).all(), "masked rows get a zero gradient"
    if V > 1:
        assert (d[torch.isinf(logits)] == 0).all(), "-inf logits get exactly 0"


class _LogProbsFn(torch.autograd.Function):
    """fwd/bwd ops glued for gradcheck (the package's own autograd is ppo_kernels/_autograd.py;
    this checks that the two kernels agree with each other in float64)."""

    @staticmethod
    def forward(ctx, logits, tokens, mask, temperature):
        logp, ent, row_max, log_sum = OPS.triton_token_logprobs_fwd(logits, tokens, mask,
                                                                     temperature, True)
        ctx.save_for_backward(logits, tokens, mask, row_max, log_sum, ent)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, glogp, gent):
        logits, tokens, mask, row_max, log_sum, ent = ctx.saved_tensors
        d = OPS.triton_token_logprobs_bwd(glogp.contiguous(), gent.contiguous(), logits,
                                          tokens, mask, row_max, log_sum, ent, ctx.temperature)
        return d, None, None, None


def test_token_logprobs_gradcheck_float64():
    logits, tokens, mask = make_case(B=2, T=3, V=5, dtype=torch.float64, layout="raw",
                                     padding="left", seed=5)
    logits = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: _LogProbsFn.apply(x, tokens, mask, 0.9), (logits,), eps=1e-6, atol=1e-7)


# ------------------------------------------------------------------ ppo_loss_fwd


@pytest.mark.parametrize("kl_est", [0, 1, 2, 3])
@pytest.mark.parametrize("dual", [0.0, 3.0])
def test_ppo_loss_estimators_and_dual_clip(kl_est, dual):
    logits, tokens, mask = make_case(B=2, T=5, V=100, seed=10 + kl_est)
    inp = ppo_inputs(logits, tokens, mask, seed=kl_est)
    out = run_ppo(logits, tokens, mask, inp, kl_est=kl_est, dual=dual, temp=0.8)
    rout = ref_ppo(logits, tokens, mask, inp, kl_est=kl_est, dual=dual, temp=0.8)
    check_ppo(out, rout, logits, tokens, mask, torch.float32, temp=0.8)


@pytest.mark.parametrize("V", [1, 7, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64])
def test_ppo_loss_dtypes(V, dtype):
    logits, tokens, mask = make_case(B=2, T=4, V=V, dtype=dtype, padding="right",
                                     seed=20 + V)
    inp = ppo_inputs(logits, tokens, mask, seed=V, mode="seq-mean-token-mean")
    out = run_ppo(logits, tokens, mask, inp, dual=2.0, ent_coef=0.05)
    rout = ref_ppo(logits, tokens, mask, inp, dual=2.0, ent_coef=0.05,
                    mode="seq-mean-token-mean")
    check_ppo(out, rout, logits, tokens, mask, dtype)


@pytest.mark.parametrize("layout,padding", [("view", "left"), ("raw", "interior"),
                                            ("bstride", "empty_row")])
def test_ppo_loss_layouts_neginf_is_weights(layout, padding):
    logits, tokens, mask = make_case(B=3, T=5, V=100, layout=layout, padding=padding,
                                     neginf=True, seed=30)
    inp = ppo_inputs(logits, tokens, mask, seed=3, with_isw=True)
    out = run_ppo(logits, tokens, mask, inp, kl_est=0, ent_coef=0.1, temp=1.5)
    rout = ref_ppo(logits, tokens, mask, inp, kl_est=0, ent_coef=0.1, temp=1.5)
    check_ppo(out, rout, logits, tokens, mask, torch.float32, temp=1.5)
    dl = out[4]
    assert (dl[torch.isinf(logits)] == 0).all()
    if layout == "raw":
        assert (dl[:, tokens.shape[1]:] == 0).all()


def test_ppo_loss_no_ref_no_grad():
    logits, tokens, mask = make_case(B=2, T=5, V=7, padding="left", seed=40)
    inp = ppo_inputs(logits, tokens, mask, seed=4, with_ref=False)
    out = run_ppo(logits, tokens, mask, inp, kl_coef=0.0, compute_grad=False)
    assert out[4].numel() == 0
    rloss, rloss_tok, _ = ref_ppo(logits, tokens, mask, inp, kl_coef=0.0)
    assert_close_np(out[0], rloss, 1e-5, 1e-6, "loss")
    assert_close_np(out[1], rloss_tok, 1e-5, 1e-6, "loss_tok")
    # the kl_coef is ignored without ref_logprobs (nothing to compare against)
    out2 = run_ppo(logits, tokens, mask, inp, kl_coef=0.5, compute_grad=False)
    assert torch.equal(out2[1], out[1])


def test_ppo_loss_all_masked():
    logits, tokens, mask = make_case(B=2, T=4, V=7, layout="raw", padding="all", seed=41)
    inp = ppo_inputs(logits, tokens, mask, seed=5)
    loss, loss_tok, logp, ent, dl = run_ppo(logits, tokens, mask, inp)
    assert loss.item() == 0.0
    assert (loss_tok == 0).all() and (logp == 0).all() and (ent == 0).all()
    assert (dl == 0).all()


@pytest.mark.parametrize("layout,dtype", [("raw", torch.float32), ("view", torch.bfloat16),
                                          ("aligned", torch.float64)])
def test_ppo_loss_inplace(layout, dtype):
    logits, tokens, mask = make_case(B=2, T=4, V=100, dtype=dtype, layout=layout,
                                     padding="interior", neginf=True, seed=50)
    inp = ppo_inputs(logits, tokens, mask, seed=6, with_isw=True)
    out = run_ppo(logits, tokens, mask, inp, dual=3.0, kl_est=1)
    base = logits._base if logits._base is not None else logits
    before = base.clone()
    acc = inp["acc"]
    res = OPS.triton_ppo_loss_fwd_inplace(
        logits, tokens, mask, per_token(inp["old"], acc), per_token(inp["adv"], acc),
        per_token(inp["w"], acc), per_token(inp["ref"], acc), per_token(inp["isw"], acc),
        None, *slot_args(0.2, 0.28, 3.0, 0.1, 1, 0.01, 1.0, 1.0, 0, 1.0, 1.05, False))
    assert len(res) == 4
    # the same numbers as the out-of-place kernel (bit for bit under the interpreter; on a
    # GPU the in-place launch uses a fixed config, the other an autotuned block size, so
    # reductions may round differently)
    rtol, atol = TOK_TOL[dtype]
    for a, b, what in zip(res, out[:4], ("loss", "loss_tok", "logprobs", "entropy")):
        assert_close_np(a, b.cpu().double().numpy(), rtol, atol, what)
    dl = out[4].cpu().double().numpy()
    assert_close_np(logits, dl, *grad_tol(dtype, dl), "the logits now hold dlogits")
    assert (logits[torch.isinf(before[:, :tokens.shape[1]] if layout != "raw" else before)]
            == 0).all(), "-inf logits became exact zeros"
    if layout == "raw":
        assert (logits[:, tokens.shape[1]:] == 0).all()
    if layout == "view":  # storage outside the view is left alone
        T = tokens.shape[1]
        assert torch.equal(base[:, T:], before[:, T:])


def _fused_and_inplace(logits, tokens, mask, inp, kw):
    """The fused loss's outputs out of place (run_ppo with kw) and those of the in-place
    variant with the same options, and the logits it overwrote with the gradient."""
    acc = inp["acc"]
    out = run_ppo(logits, tokens, mask, inp, **kw)
    lg = logits.clone()
    res = OPS.triton_ppo_loss_fwd_inplace(
        lg, tokens, mask, per_token(inp["old"], acc), per_token(inp["adv"], acc),
        per_token(inp["w"], acc), per_token(inp["ref"], acc), per_token(inp["isw"], acc),
        None, *slot_args(0.2, 0.28, 3.0, 0.1, 2, 0.05, 0.7, 1.0, 0, 1.0, 1.05, False))
    return (*out, *res, lg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_one_tile_is_the_two_sweeps_bit_for_bit(monkeypatch, dtype):
    """ONE_TILE (the row read once, held whole between the statistics and the gradient)
    gives the bits of the two sweeps with the same block: out of place and in place, with
    -inf entries, masked rows, weight-0 rows (the zero-gradient shortcut), a temperature,
    the entropy term. Under the interpreter the configs are 32 wide and V = 7 takes the
    tile, V = 100 the loop (_config.inplace_tile_row_config, which the launcher uses for
    both variants there); here both run V = 100 in one 128-wide block."""
    from ppo_kernels.triton_kernels import _config, ppo_loss as pl
    logits, tokens, mask = make_case(B=3, T=5, V=100, dtype=dtype, layout="raw",
                                     padding="interior", neginf=True, seed=170)
    inp = ppo_inputs(logits, tokens, mask, seed=171, with_isw=True)
    inp["w"] = np.where(np.arange(5) == 2, 0.0, inp["w"])  # weight 0: the zero rows
    kw = dict(dual=3.0, kl_est=2, ent_coef=0.05, temp=0.7)
    outs = []
    for one in (False, True):
        if not _config.INTERPRET:  # (on a GPU the out-of-place launch is autotuned)
            cfg = triton.Config({"BLOCK_V": 128, "ONE_TILE": one}, num_warps=1)
            monkeypatch.setattr(pl._ppo_loss_kernel, "configs", [cfg])
            monkeypatch.setattr(pl._ppo_loss_kernel, "cache", {})
        monkeypatch.setattr(_config, "inplace_tile_row_config",
                            lambda V, one=one: {"BLOCK_V": 128, "num_warps": 1, "ONE_TILE": one})
        outs.append(_fused_and_inplace(logits, tokens, mask, inp, kw))
    assert (outs[0][4][:, 2] == 0).all() and (outs[0][4] != 0).sum() > 100
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("persist", [1, 3])
def test_persistent_grid_is_a_program_per_row_bit_for_bit(monkeypatch, persist):
    """A persistent grid (PERSIST = k: k programs a multiprocessor, each looping over rows;
    here one multiprocessor, so k programs in all) gives the bits of a program per
    row: outputs, gradient, in place, with masked rows, rows t >= T and a row count that
    is not a multiple of the programs."""
    from ppo_kernels.triton_kernels import _config, ppo_loss as pl
    logits, tokens, mask = make_case(B=3, T=5, V=100, dtype=torch.float32, layout="raw",
                                     padding="interior", neginf=True, seed=172)
    inp = ppo_inputs(logits, tokens, mask, seed=173, with_isw=True)
    kw = dict(dual=3.0, kl_est=2, ent_coef=0.05, temp=0.7)
    base = _config.inplace_tile_row_config(100)
    monkeypatch.setattr(_config, "sm_count", lambda device: 1)  # (a GPU's grid loops too)
    outs = []
    for k in (0, persist):
        if not _config.INTERPRET:  # (on a GPU the out-of-place launch is autotuned)
            cfg = triton.Config({"BLOCK_V": 128, "ONE_TILE": False, "PERSIST": k}, num_warps=4)
            monkeypatch.setattr(pl._ppo_loss_kernel, "configs", [cfg])
            monkeypatch.setattr(pl._ppo_loss_kernel, "cache", {})
        monkeypatch.setattr(_config, "inplace_tile_row_config",
                            lambda V, k=k: {**base, "PERSIST": k})
        outs.append(_fused_and_inplace(logits, tokens, mask, inp, kw))
    assert (outs[0][4] != 0).sum() > 100
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ loss menu

POLICY = ("vanilla", "cispo", "sapo")


def _menu_np(logits, tokens, mask, inp, *, eps_low, eps_high, dual, kl_coef, kl_est,
             ent_coef, temp, policy_loss, tau_pos, tau_neg, kl_bias):
    """float64 numpy of csrc/ppo_math.h token_loss for every token, written from the
    formulas (not from reference.py): (loss_tok, dlogits of sum(w * loss_tok) with the
    entropy term weighted by w_ent)."""
    m = mask.cpu().numpy()
    logp, ent = ref.token_logprobs(logits, tokens, mask, temp)
    old = logp if inp.get("old") is None else np.asarray(inp["old"], np.float64)
    a = np.asarray(inp["adv"], np.float64)
    w = np.asarray(inp["w"], np.float64)
    went = w if inp.get("went") is None else np.asarray(inp["went"], np.float64)
    isw = np.ones_like(logp) if inp.get("isw") is None else np.asarray(inp["isw"], np.float64)
    d_raw = logp - old
    clamped = np.abs(d_raw) > 20.0
    rho = np.exp(np.clip(d_raw, -20.0, 20.0))
    drho = np.where(clamped, 0.0, rho)
    if policy_loss == 0:
        un, cl = -rho * a, -np.clip(rho, 1 - eps_low, 1 + eps_high) * a
        pg = np.maximum(un, cl)
        g = np.where(un >= cl, -rho * a, 0.0)
        if dual > 0:
            cap = (a < 0) & (pg > -dual * a)
            pg, g = np.where(cap, -dual * a, pg), np.where(cap, 0.0, g)
        g = np.where(clamped, 0.0, g)
    elif policy_loss == 1:
        wc = np.clip(rho, 1 - eps_low, 1 + eps_high)
        pg, g = -wc * a * logp, -wc * a
    else:
        tau = np.where(a > 0, tau_pos, tau_neg)
        sg = 1.0 / (1.0 + np.exp(-tau * (rho - 1.0)))
        pg, g = -(4.0 / tau) * sg * a, -4.0 * sg * (1.0 - sg) * drho * a
    loss_tok = isw * pg - ent_coef * ent
    dlogp = isw * g
    if inp.get("ref") is not None:
        delta = logp - np.asarray(inp["ref"], np.float64)
        c = np.clip(delta, -20.0, 20.0)
        k3 = ref.expm1_minus_x(-c)
        kl, dkl = {"k1": (delta, np.ones_like(delta)), "k2": (0.5 * delta**2, delta),
                   "k3": (k3, np.where(np.abs(delta) > 20, 0.0, -np.expm1(-c))),
                   "abs": (np.abs(delta), np.sign(delta)), "k1+": (delta, delta),
                   "k3+": (k3, delta)}[KL_CODES[kl_est]]
        if kl_bias:
            loss_tok = loss_tok + kl_coef * kl * rho
            dlogp = dlogp + kl_coef * (rho * dkl + kl * drho)
        else:
            loss_tok = loss_tok + kl_coef * kl
            dlogp = dlogp + kl_coef * dkl
    loss_tok = np.where(m, loss_tok, 0.0)
    dl = ref.token_logprobs_grad(logits, tokens, mask, temp, w * dlogp, -went * ent_coef)
    return loss_tok, dl


def _menu_expect(logits, tokens, mask, inp, *, eps_low=0.2, eps_high=0.28, dual=0.0,
                 kl_coef=0.1, kl_est=2, ent_coef=0.01, temp=1.0, policy_loss=0, tau_pos=1.0,
                 tau_neg=1.05, kl_bias=False, mode="token-mean", ent_mode=None):
    """(loss, loss_tok, dlogits) the fused op must give: the loss is the op's contract
    sum(weights * loss_tok) (csrc/cpu/ppo_loss.cpp weighted_sum, whatever the entropy
    weights), loss_tok and dlogits from reference.ppo_loss (its entropy term weighted by
    ent_mode's weights, inp["went"])."""
    common = dict(
        clip_eps_low=eps_low, clip_eps_high=eps_high,
        dual_clip_c=dual if dual > 0 else None,
        kl_coef=kl_coef if inp["ref"] is not None else 0.0, kl_estimator=KL_CODES[kl_est],
        entropy_coef=ent_coef, temperature=temp, rollout_is_weights=inp["isw"],
        policy_loss=POLICY[policy_loss], sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg,
        kl_bias_correction=kl_bias)
    _, _, dl = ref.ppo_loss(logits, tokens, inp["old"], inp["adv"], mask, inp["ref"],
                            loss_agg_mode=mode, entropy_agg_mode=ent_mode, **common)
    # per-token loss: "none" (its entropy weights are the mask's, irrelevant here)
    loss_tok, _, _ = ref.ppo_loss(logits, tokens, inp["old"], inp["adv"], mask,
                                  inp["ref"], loss_agg_mode="none", **common)
    loss_tok = np.asarray(loss_tok, np.float64)
    return float((np.asarray(inp["w"]) * loss_tok).sum()), loss_tok, dl


# The menu's terms amplify the float32 rounding of logp (~|logp| 6e-8 absolute, inherent:
# the oracle's logp is float64): the straight-through derivative is delta = logp - ref
# itself, k3 ~ delta^2 / 2, and the bias correction multiplies by rho up to e^20. A small
# delta (0.01) then carries ~5e-5 relative error; a wrong formula is off by O(1).
MENU_RTOL32 = 2e-4


def menu_tol(dtype):
    rtol, atol = TOK_TOL[dtype]
    return (rtol, atol) if dtype == torch.float64 else (MENU_RTOL32, atol)


def close_rows(actual, expected, dtype, what):
    """dlogits row by row, each with the tolerance of its own scale (one token with
    rho = e^20 must not loosen the check of the others)."""
    a = actual.detach().cpu().double().numpy().reshape(-1, actual.shape[-1])
    e = np.asarray(expected, np.float64).reshape(a.shape)
    assert not np.isnan(a).any(), f"{what}: NaN in kernel output"
    for i in range(a.shape[0]):
        rtol, atol = grad_tol(dtype, e[i])
        if dtype != torch.float64:
            rtol, atol = max(rtol, MENU_RTOL32), max(atol, MENU_RTOL32 * atol / rtol)
        np.testing.assert_allclose(a[i], e[i], rtol, atol, err_msg=f"{what}, row {i}")


def _check_menu(out, rout, logits, tokens, mask, dtype, temp=1.0):
    loss, loss_tok, logp, ent, dl = out
    rloss, rloss_tok, rdl = rout
    assert loss.dim() == 0 and loss.dtype == loss_tok.dtype == acc_of(dtype)
    assert_close_np(loss_tok, rloss_tok, *menu_tol(dtype), "loss_tok")
    assert_close_np(loss, rloss, *menu_tol(dtype), "loss")
    rtol, atol = TOK_TOL[dtype]
    rl, re_ = ref.token_logprobs(logits, tokens, mask, temp)
    assert_close_np(logp, rl, rtol, atol, "logprobs")
    assert_close_np(ent, re_, rtol, atol, "entropy")
    assert dl.shape == logits.shape and dl.dtype == logits.dtype
    close_rows(dl, rdl, dtype, "dlogits")


def test_menu_np_matches_the_vanilla_reference():
    """reference.ppo_loss, the oracle of the tests below (_menu_expect), equals _menu_np, a
    float64 transcription of the kernels' per-token formula (csrc/ppo_math.h token_loss)
    written independently of reference.py, on the vanilla options: loss_tok and dlogits
    to 1e-12 (k1; k3 with the dual clip; abs)."""
    logits, tokens, mask = make_case(B=2, T=5, V=7, seed=100)
    for est, dual in ((0, 0.0), (2, 3.0), (3, 0.0)):
        inp = ppo_inputs(logits, tokens, mask, seed=100 + est, with_isw=True)
        # the reference's own float64 weights (ppo_inputs rounds them to float32, as the
        # kernels read them): the two formulas, not the weights' rounding, are compared
        inp["w"] = ref.agg_weights(mask.cpu().numpy(), "token-mean")
        lt, dl = _menu_np(logits, tokens, mask, inp, eps_low=0.2, eps_high=0.28, dual=dual,
                          kl_coef=0.1, kl_est=est, ent_coef=0.03, temp=0.9, policy_loss=0,
                          tau_pos=1.0, tau_neg=1.05, kl_bias=False)
        _, rlt, rdl = ref_ppo(logits, tokens, mask, inp, kl_est=est, dual=dual,
                               ent_coef=0.03, temp=0.9)
        np.testing.assert_allclose(lt, rlt, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(dl, rdl, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("policy_loss,taus", [(1, (1.0, 1.05)), (2, (1.0, 1.05)),
                                              (2, (0.5, 3.0)), (2, (4.0, 0.25))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_policy_losses(policy_loss, taus, dtype):
    """CISPO and SAPO (several gate temperatures, A of both signs, one clamped log-ratio,
    one rho = e^1.5 with A < 0) against the float64 oracle: loss, loss_tok, dlogits."""
    logits, tokens, mask = make_case(B=2, T=5, V=100, dtype=dtype, seed=110 + policy_loss)
    inp = ppo_inputs(logits, tokens, mask, seed=111, with_isw=True)
    a = np.asarray(inp["adv"])
    assert (a[mask.cpu().numpy()] > 0).any() and (a[mask.cpu().numpy()] < 0).any()
    kw = dict(policy_loss=policy_loss, tau_pos=taus[0], tau_neg=taus[1], kl_est=1,
              ent_coef=0.02, temp=0.9, dual=3.0)
    out = run_ppo(logits, tokens, mask, inp, **kw)
    _check_menu(out, _menu_expect(logits, tokens, mask, inp, **kw), logits, tokens, mask,
                dtype, temp=0.9)


def test_sapo_gate_temperatures_are_used():
    """tau_pos acts on A > 0 tokens only, tau_neg on A <= 0 ones: changing one leaves the
    other tokens' loss_tok bitwise unchanged."""
    logits, tokens, mask = make_case(B=2, T=5, V=7, padding="none", seed=115)
    inp = ppo_inputs(logits, tokens, mask, seed=116, with_ref=False)
    a = torch.as_tensor(inp["adv"]).to(DEV)
    base = run_ppo(logits, tokens, mask, inp, policy_loss=2, kl_coef=0.0, tau_pos=1.0,
                    tau_neg=1.05)[1]
    pos = run_ppo(logits, tokens, mask, inp, policy_loss=2, kl_coef=0.0, tau_pos=2.0,
                   tau_neg=1.05)[1]
    neg = run_ppo(logits, tokens, mask, inp, policy_loss=2, kl_coef=0.0, tau_pos=1.0,
                   tau_neg=2.0)[1]
    assert torch.equal(pos[a <= 0], base[a <= 0]) and not torch.equal(pos[a > 0], base[a > 0])
    assert torch.equal(neg[a > 0], base[a > 0]) and not torch.equal(neg[a <= 0], base[a <= 0])


@pytest.mark.parametrize("kl_est", [4, 5])
@pytest.mark.parametrize("kl_bias", [False, True])
@pytest.mark.parametrize("policy_loss", [0, 2])
def test_straight_through_kl_and_bias_correction(kl_est, kl_bias, policy_loss):
    """k1+ / k3+ (value of k1 / k3, derivative delta) with and without the KL bias
    correction (kl * rho, d / d logp = rho dkl + kl d rho: 0 d rho on the clamped token)."""
    logits, tokens, mask = make_case(B=2, T=5, V=100, seed=120 + kl_est)
    inp = ppo_inputs(logits, tokens, mask, seed=121)
    kw = dict(kl_est=kl_est, kl_bias=kl_bias, policy_loss=policy_loss, kl_coef=0.3,
              temp=1.1)
    out = run_ppo(logits, tokens, mask, inp, **kw)
    _check_menu(out, _menu_expect(logits, tokens, mask, inp, **kw), logits, tokens, mask,
                torch.float32, temp=1.1)
    # the value is that of k1 / k3, the gradient that of k2 (no bias correction, no pg, no
    # entropy: the KL term alone)
    if not kl_bias:
        zero = dict(inp, adv=np.zeros_like(inp["adv"]))
        kw0 = dict(kl_coef=0.3, temp=1.1, ent_coef=0.0)
        st = run_ppo(logits, tokens, mask, zero, kl_est=kl_est, **kw0)
        val = run_ppo(logits, tokens, mask, zero, kl_est=0 if kl_est == 4 else 2, **kw0)
        grd = run_ppo(logits, tokens, mask, zero, kl_est=1, **kw0)
        assert torch.equal(st[1], val[1]) and torch.equal(st[4], grd[4])


@pytest.mark.parametrize("kl_est", [0, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_kl_bias_correction(kl_est, dtype):
    """kl_bias_correction on: the oracle's kl * rho; off: the plain KL term (the default
    tests); with rho = 1 (old = logp) both are the same numbers (the values; d rho / d logp
    = 1 adds kl to dlogp).

    What "the same" means: logprobs and entropy come from code the option does not touch,
    bitwise equal everywhere. loss_tok is bitwise equal in the interpreter; on a GPU the
    two specialisations compile `loss += kl_coef * kl * rho` and `loss += kl_coef * kl`,
    and triton contracts the latter into one fused multiply-add (enable_fp_fusion), so
    the product's rounding is skipped in one and not in the other: loss_tok within
    ulp(kl_coef * kl) + ulp(loss_tok), and the loss (sum of w * loss_tok) within the sum of
    those times |w| plus the two dots' own roundings."""
    logits, tokens, mask = make_case(B=2, T=4, V=257, dtype=dtype, padding="right",
                                     neginf=True, seed=130 + kl_est)
    inp = ppo_inputs(logits, tokens, mask, seed=131, with_isw=True,
                      mode="seq-mean-token-mean")
    kw = dict(kl_est=kl_est, kl_bias=True, kl_coef=0.2, dual=2.0, ent_coef=0.05)
    out = run_ppo(logits, tokens, mask, inp, **kw)
    _check_menu(out, _menu_expect(logits, tokens, mask, inp, mode="seq-mean-token-mean",
                                  **kw), logits, tokens, mask, dtype)
    onp = dict(inp, old=None)
    on = run_ppo(logits, tokens, mask, onp, **kw)
    off = run_ppo(logits, tokens, mask, onp, **dict(kw, kl_bias=False))
    assert torch.equal(on[2], off[2]) and torch.equal(on[3], off[3]), "logprobs, entropy"
    if DEV != "cuda":  # the interpreter runs each operation as written
        assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1]), "loss, loss_tok"
        return
    eps = float(torch.finfo(inp["acc"]).eps)
    lt_on, lt_off = (x.cpu().double().numpy() for x in (on[1], off[1]))
    delta = on[2].cpu().double().numpy() - np.asarray(inp["ref"], np.float64)
    kl = delta if kl_est == 0 else expm1_minus_x64(-np.clip(delta, -20.0, 20.0))
    bound = eps * (np.abs(0.2 * kl) + np.abs(lt_off))
    assert (np.abs(lt_on - lt_off) <= bound).all(), "loss_tok"
    w = np.abs(np.asarray(inp["w"], np.float64))
    n = w.size
    loss_bound = (w * bound).sum() + 2 * n * eps * (w * np.abs(lt_off)).sum()
    assert abs(float(on[0]) - float(off[0])) <= loss_bound, "loss"


@pytest.mark.parametrize("policy_loss", [0, 1, 2])
@pytest.mark.parametrize("kl_bias", [False, True])
def test_on_policy_old_logprobs_none(policy_loss, kl_bias):
    """old_logprobs=None (old = logp inside the kernel: rho = 1, d rho / d logp = 1) gives
    the loss and the gradient of passing the true logp as data, and matches the oracle
    with old = logp (detached)."""
    logits, tokens, mask = make_case(B=2, T=5, V=100, padding="interior", neginf=True,
                                     seed=140 + policy_loss)
    inp = ppo_inputs(logits, tokens, mask, seed=141, with_isw=True)
    inp["old"] = None
    kw = dict(policy_loss=policy_loss, kl_bias=kl_bias, kl_est=2, ent_coef=0.05,
              tau_pos=0.8, tau_neg=1.3)
    out = run_ppo(logits, tokens, mask, inp, **kw)
    logp = OPS.triton_token_logprobs_fwd(logits, tokens, mask, 1.0, False)[0]
    data = run_ppo(logits, tokens, mask, dict(inp, old=logp.cpu().numpy()), **kw)
    for a, b, what in zip(out, data, ("loss", "loss_tok", "logprobs", "entropy", "dlogits")):
        if DEV == "cpu":
            assert torch.equal(a, b), what
        else:
            assert_close_np(a, b.cpu().double().numpy(), 1e-6, 1e-7, what)
    _check_menu(out, _menu_expect(logits, tokens, mask, inp, **kw), logits, tokens, mask,
                torch.float32)


@pytest.mark.parametrize("policy_loss,dtype", [(0, torch.float32), (2, torch.bfloat16),
                                               (1, torch.float64)])
def test_entropy_weights(policy_loss, dtype):
    """entropy_weights != weights: dent = -w_ent * entropy_coef (the entropy part of the
    gradient follows entropy_agg_mode), the pg/KL part keeps weights; loss_tok is unchanged
    and loss stays sum(weights * loss_tok). entropy_weights = weights is None bitwise."""
    logits, tokens, mask = make_case(B=3, T=5, V=100, dtype=dtype, layout="raw",
                                     padding="left", seed=150)
    inp = ppo_inputs(logits, tokens, mask, seed=151, mode="token-mean")
    inp["went"] = ref.agg_weights(mask.cpu().numpy(), "seq-mean-token-sum")
    kw = dict(policy_loss=policy_loss, ent_coef=0.2, dual=3.0, temp=0.7)
    out = run_ppo(logits, tokens, mask, inp, **kw)
    _check_menu(out, _menu_expect(logits, tokens, mask, inp, ent_mode="seq-mean-token-sum",
                                  **kw), logits, tokens, mask, dtype, temp=0.7)
    plain = run_ppo(logits, tokens, mask, dict(inp, went=None), **kw)
    for a, b in zip(out[:4], plain[:4]):
        assert torch.equal(a, b)
    assert not torch.equal(out[4], plain[4])
    same = run_ppo(logits, tokens, mask, dict(inp, went=inp["w"]), **kw)
    assert torch.equal(same[4], plain[4])


@pytest.mark.parametrize("layout,dtype", [("raw", torch.float32), ("view", torch.bfloat16)])
def test_menu_inplace_and_grad_scale(layout, dtype):
    """The in-place variant with every menu option (on-policy, entropy weights, sapo, k3+,
    bias correction) writes grad_scale times the out-of-place op's dlogits over the logits;
    scale_grad_ then rescales it to grad_output."""
    logits, tokens, mask = make_case(B=2, T=4, V=100, dtype=dtype, layout=layout,
                                     padding="interior", neginf=True, seed=160)
    inp = ppo_inputs(logits, tokens, mask, seed=161, with_isw=True)
    inp["old"] = None
    inp["went"] = 0.5 * np.asarray(inp["w"])
    kw = dict(policy_loss=2, kl_est=5, kl_bias=True, tau_pos=1.5, tau_neg=0.7, ent_coef=0.05)
    out = run_ppo(logits, tokens, mask, inp, **kw)
    acc = inp["acc"]
    res = OPS.triton_ppo_loss_fwd_inplace(
        logits, tokens, mask, None, per_token(inp["adv"], acc), per_token(inp["w"], acc),
        per_token(inp["ref"], acc), per_token(inp["isw"], acc), per_token(inp["went"], acc),
        *slot_args(0.2, 0.28, 0.0, 0.1, 5, 0.05, 1.0, 3.0, 2, 1.5, 0.7, True))
    rtol, atol = TOK_TOL[dtype]
    for a, b, what in zip(res, out[:4], ("loss", "loss_tok", "logprobs", "entropy")):
        assert_close_np(a, b.cpu().double().numpy(), rtol, atol, what)
    dl = out[4].cpu().double().numpy()
    assert_close_np(logits, 3.0 * dl, *grad_tol(dtype, 3.0 * dl), "the logits now hold 3 * dlogits")
    OPS.triton_scale_grad_(logits, torch.tensor(1.0, device=DEV),
                           torch.tensor(3.0, device=DEV))
    assert_close_np(logits, dl, *grad_tol(dtype, dl), "rescaled to grad_output = 1")


@pytest.mark.skipif(DEV != "cuda", reason="needs a GPU: the grid-size and 32-bit offset "
                    "limits this checks do not exist in the interpreter")
def test_many_rows_and_64bit_offsets_cuda():
    """70,000 rows (more than the 65,535 of a grid's y/z axis) of V = 32,768 bf16 logits:
    2.3e9 elements, past 2^31, so row offsets must be 64-bit."""
    B, T, V = 1, 70_000, 32_768
    gen = torch.Generator(device="cuda").manual_seed(7)
    logits = torch.randn(B, T, V, device="cuda", dtype=torch.bfloat16, generator=gen)
    tokens = torch.randint(0, V, (B, T), device="cuda", generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool, device="cuda")
    logp, _, _, _ = OPS.triton_token_logprobs_fwd(logits, tokens, mask, 1.0, False)
    rows = torch.cat([torch.arange(4), torch.arange(T - 4, T)]).cuda()
    lsm = torch.log_softmax(logits[0, rows].float(), -1)
    want = lsm.gather(1, tokens[0, rows, None])[:, 0]
    torch.testing.assert_close(logp[0, rows], want, rtol=1e-5, atol=1e-5)
    # rho = 1 (old = logp): dlogp = -w A on every row, dlogits = dlogp (onehot - p)
    adv = torch.randn(B, T, device="cuda", generator=gen)
    w = torch.full((B, T), 1.0 / T, device="cuda")
    out = OPS.triton_ppo_loss_fwd(logits, tokens, mask, logp, adv, w, None, None, None,
                                  *slot_args(0.2, 0.2, 0.0, 0.0, 2, 0.0, 1.0, 1.0, 0, 1.0, 1.05,
                                         False), True)
    dl = out[4]
    onehot = torch.nn.functional.one_hot(tokens[0, rows], V).float()
    want_g = (-w[0, rows] * adv[0, rows])[:, None] * (onehot - lsm.exp())
    torch.testing.assert_close(dl[0, rows].float(), want_g, rtol=2e-2, atol=1e-9)
    del dl, out


# ------------------------------------------------------------------ the _math helpers
# (probed by a kernel of their own)

@triton.jit
def _probe_kernel(x_ptr, a_ptr, b_ptr, N, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    """Elementwise _math helpers on a vector: 0 = kl_term k3 (kl, dkl),
    1 = (expm1_minus_x, expm1), 2 = (log1p, log1p), 3 = (exp_acc, exp_acc)."""
    offs = tl.arange(0, BLOCK)
    inb = offs < N
    x = tl.load(x_ptr + offs, mask=inb, other=0.0)
    if WHICH == 0:
        a, b = kl_term(x, 2)
    elif WHICH == 1:
        a = expm1_minus_x(x)
        b = expm1(x)
    elif WHICH == 2:
        a = log1p(x)
        b = a
    else:
        a = exp_acc(x)
        b = a
    tl.store(a_ptr + offs, a, mask=inb)
    tl.store(b_ptr + offs, b, mask=inb)


def _probe(which, x):
    x = torch.as_tensor(x, dtype=torch.float32).to(DEV)
    a, b = torch.empty_like(x), torch.empty_like(x)
    _probe_kernel[(1,)](x, a, b, x.numel(), WHICH=which,
                        BLOCK=triton.next_power_of_2(x.numel()))
    return a.cpu().double().numpy(), b.cpu().double().numpy()


def test_k3_and_its_derivative_to_float32_rounding():
    """k3 = e^-c - 1 + c and d k3 / d delta = 1 - e^-c for float32
    deltas log-uniform in [1e-6, 20], both signs, within ~4 float32 ulp (5e-7) of float64
    on the same float32 delta (exp(-c) - 1 + c was 5% off at 1e-3 and 0 below 1e-4).
    Clamped beyond |delta| = 20: the value at the clamp, derivative 0."""
    d = k3_deltas(400, seed=16)
    kl, dkl = _probe(0, d)
    c = d.astype(np.float64)
    assert rel_err(kl, expm1_minus_x64(-c)) < 5e-7, "k3"
    assert rel_err(dkl, -np.expm1(-c)) < 5e-7, "d k3 / d delta"
    kl, dkl = _probe(0, [25.0, -25.0])
    assert (dkl == 0).all()
    assert rel_err(kl, expm1_minus_x64(np.array([-20.0, 20.0]))) < 5e-7


@GENUINE_INF
def test_expm1_helpers_and_log1p():
    """The tl twins of expm1, expm1_minus_x and log1p, on both sides of their series
    thresholds (|u| = 1) and over the ranges the kernels feed them."""
    u = k3_deltas(300, seed=17)
    a, b = _probe(1, u)
    u64 = u.astype(np.float64)
    assert rel_err(a, expm1_minus_x64(u64)) < 5e-7, "expm1_minus_x"
    assert rel_err(b, np.expm1(u64)) < 5e-7, "expm1"
    # log1p of a row's non-top mass: from 1e-30 (a very confident row) to V - 1
    gen = np.random.default_rng(18)
    r = np.concatenate([np.exp(gen.uniform(np.log(1e-30), np.log(2e5), 300)),
                        [0.0, 2**-24, 2**-23, 1.0, 3.0]]).astype(np.float32)
    a, _ = _probe(2, r)
    assert rel_err(a[r > 0], np.log1p(r[r > 0].astype(np.float64))) < 5e-7, "log1p"
    assert a[r == 0][0] == 0.0
    a, _ = _probe(2, [-1.0])
    assert a[0] == float("-inf")


@GENUINE_INF
def test_exp_acc_and_expm1_helpers_over_the_float32_range():
    """exp_acc, the exp of the per-token terms (the ratio, SAPO's gate, DPPO's
    probabilities, the token's own p), and the expm1 helpers beyond their series, over
    |x| <= 80 in float32: exp_acc within 1.5e-7 relative (measured 8.3e-8 here; fp32
    tl.exp lowers to ex2.approx of the rounded x log2(e), 9e-7 off at |x| = 20 and 4e-6 at
    80 on a GPU), expm1 and expm1_minus_x within 2.5e-7 (measured 1.2e-7 and 1.6e-7; the
    contract is 5e-7). The same float32 operations run on a GPU, there with fused
    multiply-adds (test_triton_kernels_lowering.py: no ex2.approx in them)."""
    gen = np.random.default_rng(19)
    x = np.concatenate([gen.uniform(-80.0, 80.0, 3000), gen.uniform(-3.0, 3.0, 1000),
                        [-80.0, -1.0, -0.5, 0.0, 0.5, 1.0, 80.0]]).astype(np.float32)
    x64 = x.astype(np.float64)
    e, _ = _probe(3, x)
    assert rel_err(e, np.exp(x64)) < 1.5e-7, "exp_acc"
    big = np.abs(x64) >= 1.0
    a, b = _probe(1, x[big])
    assert rel_err(a, expm1_minus_x64(x64[big])) < 2.5e-7, "expm1_minus_x"
    assert rel_err(b, np.expm1(x64[big])) < 2.5e-7, "expm1"
    # the edges: 0, over- and underflow, the largest finite results, NaN
    edges = np.array([0.0, float("nan"), float("inf"), -float("inf"), 88.5, 89.0, -100.0,
                      -104.0, -110.0], dtype=np.float32)
    e, _ = _probe(3, edges)
    assert e[0] == 1.0 and np.isnan(e[1]) and e[2] == np.inf and e[3] == 0.0
    assert rel_err(e[4:5], np.exp(88.5)) < 1.5e-7 and e[5] == np.inf  # e^89 > finfo.max
    assert abs(e[6] - np.exp(-100.0)) <= 2.0 ** -149 and e[7] <= 2.0 ** -149 and e[8] == 0.0


# ------------------------------------------------------------------ grad_scale, scale_grad_

@pytest.mark.parametrize("dtype,gs", [(torch.float32, 0.37), (torch.bfloat16, 3.0),
                                      (torch.float64, 1.0 / 3.0)])
def test_grad_scale(dtype, gs):
    """ppo_loss_fwd(grad_scale=s) writes s * dlogits; loss, loss_tok, logprobs and entropy
    are bitwise those of grad_scale = 1. Same for the in-place variant."""
    logits, tokens, mask = make_case(B=2, T=4, V=100, dtype=dtype, layout="raw",
                                     padding="interior", neginf=True, seed=21)
    inp = ppo_inputs(logits, tokens, mask, seed=22, with_isw=True)
    base = run_ppo(logits, tokens, mask, inp, dual=3.0, ent_coef=0.05)
    out = run_ppo(logits, tokens, mask, inp, dual=3.0, ent_coef=0.05, grad_scale=gs)
    for a, b in zip(out[:4], base[:4]):
        assert torch.equal(a, b)
    _, _, rdl = ref_ppo(logits, tokens, mask, inp, dual=3.0, ent_coef=0.05)
    assert_close_np(out[4], gs * rdl, *grad_tol(dtype, gs * rdl), "dlogits")
    acc = inp["acc"]
    x = logits.clone()
    res = OPS.triton_ppo_loss_fwd_inplace(
        x, tokens, mask, per_token(inp["old"], acc), per_token(inp["adv"], acc),
        per_token(inp["w"], acc), per_token(inp["ref"], acc), per_token(inp["isw"], acc),
        None, *slot_args(0.2, 0.28, 3.0, 0.1, 2, 0.05, 1.0, gs, 0, 1.0, 1.05, False))
    for a, b in zip(res, base[:4]):
        assert_close_np(a, b.cpu().double().numpy(), *TOK_TOL[dtype])
    assert_close_np(x, gs * rdl, *grad_tol(dtype, gs * rdl), "in-place dlogits")


def _scaled(grad, go, ap):
    """What scale_grad_ must write: grad * (go / ap) in the accumulation dtype, rounded
    once to grad's dtype (torch's CPU division is correctly rounded, like the kernel's)."""
    acc = acc_of(grad.dtype)
    f = (go.cpu().to(acc) / ap.cpu().to(acc))
    return (grad.cpu().to(acc) * f).to(grad.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64])
def test_scale_grad_(dtype):
    """f = grad_output / applied: f == 1 leaves grad bitwise untouched (and applied);
    f != 1 scales grad in place (bitwise: one rounding from the accumulation dtype) and
    sets applied := grad_output, so a second call with the same grad_output is a no-op."""
    acc = acc_of(dtype)
    gen = torch.Generator().manual_seed(23)
    grad = torch.randn(2, 5, 100, generator=gen).to(dtype).to(DEV)
    grad[0, 1, 3] = float("inf")
    before = grad.clone()
    go = torch.tensor(0.75, dtype=acc, device=DEV)
    ap = torch.tensor(0.75, dtype=acc, device=DEV)
    OPS.triton_scale_grad_(grad, go, ap)
    assert torch.equal(grad, before) and ap.item() == 0.75
    ap.fill_(0.3)  # f = 2.5 (a power of 2 would round nothing)
    want = _scaled(before, go, torch.tensor(0.3, dtype=acc))
    OPS.triton_scale_grad_(grad, go, ap)
    assert torch.equal(grad.cpu(), want), "grad *= grad_output / applied, rounded once"
    assert ap.item() == 0.75 and go.item() == 0.75
    OPS.triton_scale_grad_(grad, go, ap)  # applied == grad_output now: nothing to do
    assert torch.equal(grad.cpu(), want)


@pytest.mark.parametrize("layout", ["view", "bstride"])
def test_scale_grad_strided_storage(layout):
    """The in-place path: grad is the logits' own strided storage ([B, Tl, V] view with
    batch/time strides); only the view's entries change."""
    full = torch.randn(3, 6, 40, generator=torch.Generator().manual_seed(24)).to(DEV)
    full2 = full.clone()
    grad = full[:, :5] if layout == "view" else full.view(3, 2, 3, 40)[:, 0]
    assert not grad.is_contiguous()
    before = grad.clone()
    go = torch.tensor(2.0, device=DEV)
    ap = torch.tensor(0.3, device=DEV)
    OPS.triton_scale_grad_(grad, go, ap)
    assert torch.equal(grad.cpu(), _scaled(before, go, torch.tensor(0.3)))
    untouched = torch.ones_like(full, dtype=torch.bool)
    if layout == "view":
        untouched[:, :5] = False
    else:
        untouched.view(3, 2, 3, 40)[:, 0] = False
    assert torch.equal(full[untouched], full2[untouched])
    assert ap.item() == 2.0
    # an empty gradient still commits applied
    ap2 = torch.tensor(1.0, device=DEV)
    OPS.triton_scale_grad_(torch.empty(0, 3, 40, device=DEV), go, ap2)
    assert ap2.item() == 2.0


class _CompiledLike(triton.runtime.jit.JITFunction):
    """What triton.jit returns on a GPU machine (a JITFunction, which wrap_triton wraps in
    its HOP), run by the interpreted kernel here: the launch path of a GPU without one."""

    def __init__(self, kernel):
        super().__init__(kernel.fn)
        self._kernel = kernel

    @property
    def cache_key(self):  # (the source hash would walk into interpreted helpers)
        return f"compiled-like {id(self)}"

    def run(self, *args, grid, warmup, **kwargs):
        return self._kernel[grid](*args, **kwargs)


@pytest.mark.skipif(DEV == "cuda", reason="replaces the kernels by interpreted stand-ins")
def test_scale_grad_eager_launch_leaves_the_kernel_side_table(monkeypatch):
    """The eager backward calls the scale_grad_ launcher directly (ppo_kernels/_autograd.py),
    outside its triton_op: a launch through wrap_triton there went through torch's
    triton_kernel_wrapper_mutation HOP and appended one entry to its kernel_side_table per
    call, never freed. An eager launch is the kernel itself: the table does not grow, and
    the gradient is still scaled."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from ppo_kernels.triton_kernels import ppo_loss as pl

    for name in ("_scale_grad_kernel", "_scale_grad_commit_kernel"):
        monkeypatch.setattr(pl, name, _CompiledLike(getattr(pl, name)))
    grad = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(25))
    want = grad.clone()
    size = (len(kernel_side_table.constant_args), len(kernel_side_table.id_to_kernel))
    for i in range(4):
        go = torch.tensor(0.5 * (i + 1))
        ap = torch.tensor(0.25 * (i + 1))
        tk.scale_grad_(grad, go, ap)
        want = _scaled(want, go, torch.tensor(0.25 * (i + 1)))
        assert ap.item() == go.item()
    assert torch.equal(grad, want)
    assert (len(kernel_side_table.constant_args), len(kernel_side_table.id_to_kernel)) == size


# ------------------------------------------------------------------ gae

@pytest.mark.parametrize("padding", ["random", "left", "right", "interior", "empty_row",
                                     "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae(padding, dtype):
    B, T = 3, 20
    gen = torch.Generator().manual_seed(60)
    mask = make_mask(B, T, gen, padding).to(DEV)
    r = torch.randn(B, T, generator=gen, dtype=dtype).to(DEV)
    v = torch.randn(B, T, generator=gen, dtype=dtype).to(DEV)
    boot = torch.randn(B, generator=gen, dtype=dtype).to(DEV)
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-12, 1e-12)
    for bv in (None, boot):
        a, ret = OPS.triton_gae(r, v, mask, bv, 0.99, 0.95)
        assert a.dtype == ret.dtype == dtype
        ra, rr = ref.gae(r, v, mask, gamma=0.99, lam=0.95, bootstrap_values=bv)
        assert_close_np(a, ra, rtol, atol, "advantages")
        assert_close_np(ret, rr, rtol, atol, "returns")


@pytest.mark.parametrize("block_t", [1, 2, 32])
def test_gae_chunk_sizes(block_t):
    """The carry between chunks: the same result with any chunk (one position per chunk,
    many chunks, a single chunk)."""
    B, T = 2, 13
    gen = torch.Generator().manual_seed(61)
    mask = make_mask(B, T, gen, "interior").to(DEV)
    r = torch.randn(B, T, generator=gen).to(DEV)
    v = torch.randn(B, T, generator=gen).to(DEV)
    a, ret = tk.gae(r, v, mask, None, 1.0, 0.9, block_t=block_t)
    ra, rr = ref.gae(r, v, mask, gamma=1.0, lam=0.9)
    assert_close_np(a, ra, 1e-5, 1e-5, "advantages")
    assert_close_np(ret, rr, 1e-5, 1e-5, "returns")


@pytest.mark.parametrize("block_t", [1, 2, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae_vapo_lambdas_chunk_sizes(block_t, dtype):
    """A lambda per sequence and the decoupled returns' own scan carry across chunks
    like the advantages' (score_rollout's GAE pass too)."""
    B, T = 3, 13
    gen = torch.Generator().manual_seed(62)
    mask = make_mask(B, T, gen, "interior").to(DEV)
    r = torch.randn(B, T, generator=gen, dtype=dtype).to(DEV)
    v = torch.randn(B, T, generator=gen, dtype=dtype).to(DEV)
    boot = torch.randn(B, generator=gen, dtype=dtype).to(DEV)
    lams = torch.tensor([0.0, 0.5, 0.97], dtype=dtype, device=DEV)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for lps, vl in ((lams, None), (None, 1.0), (lams, 0.3)):
        a, ret = tk.gae(r, v, mask, boot, 0.99, 0.9, lps, vl, block_t=block_t)
        ra = rr = None
        for b in range(B):  # the reference, one sequence at a time with its own lambda
            lam_b = 0.9 if lps is None else float(lams[b])
            ea, er = ref.gae(r[b:b + 1], v[b:b + 1], mask[b:b + 1], gamma=0.99, lam=lam_b,
                             value_lam=vl, bootstrap_values=boot[b:b + 1])
            ra = ea if ra is None else np.concatenate([ra, ea])
            rr = er if rr is None else np.concatenate([rr, er])
        assert_close_np(a, ra, tol, tol, "advantages")
        assert_close_np(ret, rr, tol, tol, "returns")
    with pytest.raises(ValueError, match="value_lam"):
        tk.gae(r, v, mask, None, 0.99, 0.9, None, 1.5)
    with pytest.raises((ValueError, TypeError), match="lam_per_seq"):
        tk.gae(r, v, mask, None, 0.99, 0.9, lams[:2], None)


def test_gae_exercise_numbers():
    """A hand-checkable case: gamma = lam = 1, a reward of 1 at the end, V = 0: every valid
    position's advantage is 1; a masked gap changes nothing (transparent)."""
    mask = torch.tensor([[True, False, True, True, False]], device=DEV)
    r = torch.tensor([[0.0, 5.0, 0.0, 1.0, 7.0]], device=DEV)
    v = torch.zeros(1, 5, device=DEV)
    a, ret = OPS.triton_gae(r, v, mask, None, 1.0, 1.0)
    assert a.tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0]]
    assert ret.tolist() == a.tolist()


# ------------------------------------------------------------------ score_rollout

@pytest.mark.parametrize("kl_est,padding", [(0, "left"), (1, "right"), (2, "interior"),
                                            (3, "empty_row")])
def test_score_rollout(kl_est, padding):
    logits, tokens, mask = make_case(B=3, T=6, V=100, layout="raw", padding=padding,
                                     seed=70 + kl_est)
    B, T = tokens.shape
    rl, _ = ref.token_logprobs(logits, tokens, mask, 0.9)
    gen = np.random.default_rng(kl_est)
    refl = per_token((rl + gen.normal(0, 0.5, rl.shape)) * mask.cpu().numpy(), torch.float32)
    values = rand_tok(B, T, torch.float32, 71)
    scores = per_token(gen.normal(0, 1, B), torch.float32)
    out = OPS.triton_score_rollout(logits, tokens, mask, refl, values, scores, 0.05, kl_est,
                                   0.99, 0.95, 0.9)
    r = ref.score_rollout(logits, tokens, refl, values, scores, mask, kl_coef=0.05,
                          kl_estimator=KL_CODES[kl_est], gamma=0.99, lam=0.95, temperature=0.9,
                          whiten_advantages=False)
    for name, got in zip(("logprobs", "kl", "rewards", "advantages", "returns"), out):
        assert got.dtype == torch.float32
        assert_close_np(got, r[name], 1e-5, 1e-5, name)


def test_score_rollout_float64_and_score_placement():
    """scores[b] lands on the LAST valid token (interior gaps, left padding), nothing on
    padding; float64 logits give float64 outputs at float64 precision."""
    logits, tokens, mask = make_case(B=2, T=5, V=7, dtype=torch.float64, padding="left",
                                     seed=80)
    mask[1] = torch.tensor([True, False, True, False, False])
    refl = torch.zeros(2, 5, dtype=torch.float64, device=DEV)
    values = torch.zeros(2, 5, dtype=torch.float64, device=DEV)
    scores = torch.tensor([3.0, -2.0], dtype=torch.float64, device=DEV)
    tokens = torch.where(mask, tokens.clamp(0, 6), tokens)
    out = OPS.triton_score_rollout(logits, tokens, mask, refl, values, scores, 0.0, 0,
                                   1.0, 1.0, 1.0)
    rew = out[2].cpu()
    assert rew[0, 4].item() == 3.0 and rew[1, 2].item() == -2.0
    assert (rew[0, :4] == 0).all() and rew[1, [0, 1, 3, 4]].eq(0).all()
    r = ref.score_rollout(logits, tokens, refl, values, scores, mask, kl_coef=0.0,
                          whiten_advantages=False, gamma=1.0, lam=1.0)
    for name, got in zip(("logprobs", "kl", "rewards", "advantages", "returns"), out):
        assert got.dtype == torch.float64
        assert_close_np(got, r[name], 1e-12, 1e-12, name)


# ------------------------------------------------------------------ bad input

def test_bad_input_raises():
    logits, tokens, mask = make_case(B=2, T=3, V=7, seed=90)
    with pytest.raises((ValueError, TypeError), match="tokens"):
        OPS.triton_token_logprobs_fwd(logits, tokens.int(), mask, 1.0, False)
    with pytest.raises((ValueError, TypeError), match="mask"):
        OPS.triton_token_logprobs_fwd(logits, tokens, mask.float(), 1.0, False)
    with pytest.raises((ValueError, TypeError), match="logits"):
        OPS.triton_token_logprobs_fwd(logits[:, :2], tokens, mask, 1.0, False)
    with pytest.raises((ValueError, TypeError), match="logits"):
        OPS.triton_token_logprobs_fwd(logits.transpose(1, 2), tokens, mask, 1.0, False)
    with pytest.raises((ValueError, TypeError), match="vocabulary"):
        OPS.triton_token_logprobs_fwd(logits[..., :0], tokens, mask, 1.0, False)
    z = torch.zeros(2, 3, device=DEV)
    with pytest.raises((ValueError, TypeError), match="advantages"):
        OPS.triton_ppo_loss_fwd(logits, tokens, mask, z, z.double(), z, None, None, None,
                                *slot_args(0.2, 0.2, 0.0, 0.0, 2, 0.0, 1.0, 1.0, 0, 1.0, 1.05,
                                       False), False)
    for bad in (6, -1):
        with pytest.raises(ValueError, match="kl_estimator"):
            OPS.triton_ppo_loss_fwd(logits, tokens, mask, z, z, z, z, None, None,
                                    *slot_args(0.2, 0.2, 0.0, 0.1, bad, 0.0, 1.0, 1.0, 0, 1.0,
                                           1.05, False), False)
        with pytest.raises(ValueError, match="kl_estimator"):
            OPS.triton_score_rollout(logits, tokens, mask, z, z, torch.zeros(2, device=DEV),
                                     0.1, bad, 1.0, 1.0, 1.0)
    for bad in (len(KERNEL_POLICY_LOSSES), -1):  # the first sequence loss: no kernel runs it
        with pytest.raises(ValueError, match="policy_loss"):
            OPS.triton_ppo_loss_fwd(logits, tokens, mask, z, z, z, None, None, None,
                                    *slot_args(0.2, 0.2, 0.0, 0.0, 2, 0.0, 1.0, 1.0, bad, 1.0,
                                           1.05, False), False)
        with pytest.raises(ValueError, match="policy_loss"):
            OPS.triton_ppo_loss_fwd_inplace(logits.clone(), tokens, mask, None, z, z, None,
                                            None, None,
                                            *slot_args(0.2, 0.2, 0.0, 0.0, 2, 0.0, 1.0, 1.0, bad,
                                                   1.0, 1.05, False))
    with pytest.raises((ValueError, TypeError), match="entropy_weights"):
        OPS.triton_ppo_loss_fwd(logits, tokens, mask, None, z, z, None, None, z[:, :2],
                                *slot_args(0.2, 0.2, 0.0, 0.0, 2, 0.0, 1.0, 1.0, 0, 1.0, 1.05,
                                       False), False)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="grad_scale"):
            OPS.triton_ppo_loss_fwd(logits, tokens, mask, z, z, z, None, None, None,
                                    *slot_args(0.2, 0.2, 0.0, 0.0, 2, 0.0, 1.0, bad, 0, 1.0, 1.05,
                                           False), False)
    # a temperature whose reciprocal overflows float32, or not positive
    for bad in (1e-40, 0.0, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            OPS.triton_token_logprobs_fwd(logits, tokens, mask, bad, False)
    one = torch.ones((), device=DEV)
    with pytest.raises((ValueError, TypeError), match="grad_output"):
        OPS.triton_scale_grad_(logits.clone(), one.double(), one.clone())
    with pytest.raises((ValueError, TypeError), match="applied"):
        OPS.triton_scale_grad_(logits.clone(), one, torch.ones(1, device=DEV))
    with pytest.raises((ValueError, TypeError), match="grad"):
        OPS.triton_scale_grad_(logits[0].clone(), one, one.clone())
    with pytest.raises((ValueError, TypeError), match="bootstrap_values"):
        OPS.triton_gae(z, z, mask, torch.zeros(3, device=DEV), 1.0, 0.9)


@pytest.mark.parametrize("V", [7, 1000, 32000, 32768, 50257, 151936])
def test_tile_configs_hold_the_row_exactly_where_flagged(monkeypatch, V):
    """The GPU's candidate configs of the fused loss (_config.tile_row_configs after
    prune_tile_row_configs): ONE_TILE exactly where the block holds the row, the 32 Ki
    whole-row blocks only where V fits them, and the loops of row_configs otherwise."""
    from ppo_kernels.triton_kernels import _config
    monkeypatch.setattr(_config, "INTERPRET", False)
    got = _config.prune_tile_row_configs(_config.tile_row_configs(), {"V": V})
    assert got
    for c in got:
        assert c.kwargs["ONE_TILE"] == (c.kwargs["BLOCK_V"] >= V), c
        assert c.kwargs["BLOCK_V"] <= 16384 or c.kwargs["ONE_TILE"], c
    assert any(c.kwargs["ONE_TILE"] for c in got) == (V <= 32768)
    assert any(not c.kwargs["ONE_TILE"] for c in got) == (V > 16384)
    # persistent grids: looping blocks of rows above PERSIST_MIN_ROW_BYTES (2-byte logits
    # where named_args holds no tensor), each beside its grid of a program per row
    persist = [c for c in got if c.kwargs["PERSIST"]]
    assert bool(persist) == (2 * V > _config.PERSIST_MIN_ROW_BYTES)
    plain = {(c.kwargs["BLOCK_V"], c.num_warps) for c in got if not c.kwargs["PERSIST"]}
    for c in persist:
        assert not c.kwargs["ONE_TILE"] and (c.kwargs["BLOCK_V"], c.num_warps) in plain, c
    assert len({(c.kwargs["BLOCK_V"], c.num_warps, c.kwargs["PERSIST"]) for c in got}) == len(got)
    inplace = _config.inplace_tile_row_config(V)
    assert inplace["ONE_TILE"] == (inplace["BLOCK_V"] >= V) and inplace["PERSIST"] == 0


def test_row_grid():
    """The fused loss's grid: a program per row, or k programs a multiprocessor (one on a
    CPU device) and never more than the rows; a function of META for the autotuner."""
    from ppo_kernels.triton_kernels import _config
    cpu = torch.device("cpu")
    assert _config.row_grid(10, cpu, {"PERSIST": 0}) == (10,)
    assert _config.row_grid(10, cpu, {"PERSIST": 2}) == (2,)
    assert _config.row_grid(1, cpu, {"PERSIST": 2}) == (1,)
    g = _config.row_grid(10, cpu, {})
    assert callable(g) and g({"PERSIST": 0, "BLOCK_V": 64}) == (10,) and g({"PERSIST": 1}) == (1,)
