"""ppo_kernels/spec.py: the option record (LossSpec) and the name <-> id and slot tables
that the C++ (csrc/ppo_math.h) and Triton (triton_kernels/_math.py) kernels mirror."""

import dataclasses
import inspect
import pathlib
import re

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import spec
from ppo_kernels.triton_kernels import _math as tmath

ROOT = pathlib.Path(__file__).resolve().parents[1]
MATH_H = (ROOT / "csrc" / "ppo_math.h").read_text()


def _cpp_enum(name):
    """The enumerator names of `enum <name> : int { ... }` in ppo_math.h, in order."""
    body = re.search(r"enum\s+" + name + r"\s*:\s*int\s*\{([^}]*)\}", MATH_H).group(1)
    names = [re.sub(r"//.*", "", e).split("=")[0].strip() for e in body.split(",")]
    return [n for n in names if n]


def test_cpp_slots_mirror_spec():
    assert _cpp_enum("Float") == list(spec.FLOAT_SLOTS) + ["kNumFloat"]
    assert _cpp_enum("Int") == list(spec.INT_SLOTS) + ["kNumInt"]


def _cpp_enum_values(name):
    """{enumerator: value} of `enum <name> : int { ... }` where the values are written."""
    body = re.search(r"enum\s+" + name + r"\s*:\s*int\s*\{([^}]*)\}", MATH_H).group(1)
    pairs = re.findall(r"(\w+)\s*=\s*(\d+)", re.sub(r"//[^\n]*", "", body))
    return {k: int(v) for k, v in pairs}


def test_cpp_enums_mirror_spec():
    # KlEstimator by order (and by value where written): kK1 <-> "k1", kAbs <-> "abs",
    # kK1Plus <-> "k1+"; the kernels take spec.KL_ESTIMATORS.index(name) as the code
    assert spec.KL_ESTIMATORS == ("k1", "k2", "k3", "abs", "k1+", "k3+")
    kl = ["k" + n[0].upper() + n[1:].replace("+", "Plus") for n in spec.KL_ESTIMATORS]
    assert kl == ["kK1", "kK2", "kK3", "kAbs", "kK1Plus", "kK3Plus"]
    assert _cpp_enum("KlEstimator") == kl
    values = _cpp_enum_values("KlEstimator")
    assert all(values.get(n, i) == i for i, n in enumerate(kl)), values
    assert _cpp_enum("PolicyLoss") == ["kVanilla", "kCispo", "kSapo", "kDppoTv", "kDppoKl",
                                       "kGspo", "kGspoToken", "kVespo"]
    assert spec.POLICY_LOSSES == ("vanilla", "cispo", "sapo", "dppo-tv", "dppo-kl", "gspo",
                                  "gspo-token", "vespo")
    assert spec.KERNEL_POLICY_LOSSES == ("vanilla", "cispo", "sapo", "dppo-tv", "dppo-kl")


def test_triton_constants_mirror_spec():
    for i, name in enumerate(spec.FLOAT_SLOTS):
        assert getattr(tmath, "F_" + name.upper()).value == i, name
    for i, name in enumerate(spec.INT_SLOTS):
        assert getattr(tmath, "I_" + name.upper()).value == i, name
    kl = ["KL_K1", "KL_K2", "KL_K3", "KL_ABS", "KL_K1_PLUS", "KL_K3_PLUS"]
    assert [getattr(tmath, n).value for n in kl] == list(range(len(spec.KL_ESTIMATORS)))
    pg = ["PG_VANILLA", "PG_CISPO", "PG_SAPO", "PG_DPPO_TV", "PG_DPPO_KL"]
    assert [getattr(tmath, n).value for n in pg] == [
        spec.POLICY_LOSSES.index(x) for x in spec.KERNEL_POLICY_LOSSES]


def test_ppo_loss_defaults_are_the_records():
    """The public keywords and LossSpec's fields carry the same defaults (the record is
    built from the keywords; ppo_loss_from_hidden passes its **options straight to it)."""
    params = inspect.signature(pk.ppo_loss).parameters
    for f in dataclasses.fields(pk.LossSpec):
        assert f.name in params, f.name
        assert params[f.name].default == f.default, f.name


def test_build_checks_and_fills():
    s = pk.LossSpec.build(clip_eps_low=0.1)
    assert s.clip_eps_high == 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.kl_coef = 1.0
    with pytest.raises(TypeError, match="clip_eps"):
        pk.LossSpec.build(clip_eps=0.2)
    with pytest.raises(ValueError, match="kl_estimator"):
        pk.LossSpec.build(kl_estimator="k4")
    with pytest.raises(ValueError, match="dual_clip_c"):
        pk.LossSpec.build(dual_clip_c=1.1, clip_eps_high=0.28)


def test_from_options_reuses_records_and_leaves_out_ignored_keys():
    """A repeated call's options give the same record (one look-up); another value, or the
    same value of another type (1 vs 1.0 vs True), a record of its own; the keys named in
    ignore (a call's tensors) are left out, whatever they hold; an unknown key is still the
    TypeError."""
    t = torch.zeros(2)
    opts = dict(logits=t, kl_coef=0.1, tokens=t, loss_agg_mode="token-sum")
    ignore = frozenset({"logits", "tokens"})
    a = pk.LossSpec.from_options(torch.float32, opts, ignore)
    assert a is pk.LossSpec.from_options(torch.float32, dict(opts, logits=t + 1), ignore)
    assert (a.kl_coef, a.loss_agg_mode) == (0.1, "token-sum")
    assert a == pk.LossSpec.build(kl_coef=0.1, loss_agg_mode="token-sum")
    b = pk.LossSpec.from_options(torch.float32, dict(opts, kl_coef=0.2), ignore)
    assert b.kl_coef == 0.2 and b is not a
    one = pk.LossSpec.from_options(torch.float32, {"entropy_coef": 1})
    assert one is not pk.LossSpec.from_options(torch.float32, {"entropy_coef": 1.0})
    assert pk.LossSpec.from_options(torch.float32, {}) == pk.LossSpec.build()
    with pytest.raises(TypeError, match="logits"):
        pk.LossSpec.from_options(torch.float32, opts)


def test_kernel_args_by_slot():
    s = pk.LossSpec.build(policy_loss="sapo", kl_coef=0.3, kl_estimator="k3+",
                          kl_bias_correction=True, temperature=0.7, grad_scale=4.0)
    f, i = s.kernel_args(torch.float32)
    assert f[spec.F["kl_coef"]] == 0.3 and f[spec.F["temperature"]] == 0.7
    assert f[spec.F["grad_scale"]] == 4.0 and f[spec.F["dual_clip_c"]] == 0.0
    assert i == (2, 5, 1)  # (tuples: the cached record's, which nothing can change)
    # float16 gradients are pre-scaled by at most 1 (the backward applies the rest)
    assert s.kernel_args(torch.float16)[0][spec.F["grad_scale"]] == 1.0
