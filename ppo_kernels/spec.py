"""The one record of a loss call's non-tensor options (LossSpec) and the name <-> id tables
that every language mirrors.

``LossSpec.build(**keywords)`` checks every option of ``pk.ppo_loss`` once (each bad value a
ValueError / TypeError naming the keyword) and returns a frozen record; everything below the
public call reads the record's fields, and the kernels get its numbers as two tuples,
``LossSpec.kernel_args(dtype) -> (floats, ints)``, in the slot order of FLOAT_SLOTS and
INT_SLOTS. The C++ kernels (csrc/ppo_math.h, namespace ppo::slot) and the Triton kernels
(triton_kernels/_math.py, F_* / I_*) index those lists with named constants that
mirror the tables here; tests/test_spec.py compares them, and the enums (policy losses, KL
estimators), with the C++ and Triton sources.

How to add an option: docs/DESIGN.md, "Adding a policy loss, a KL estimator or a kernel
option".
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch

from . import _checks as ck

# id = index: ppo::PolicyLoss (csrc/ppo_math.h), PG_* (triton_kernels/_math.py). The fused
# kernels run the token-level losses; the sequence-level ones need every token's logp of a
# sequence before any gradient (the two-phase path, ppo_kernels/_two_phase.py).
POLICY_LOSSES = ("vanilla", "cispo", "sapo", "dppo-tv", "dppo-kl", "gspo", "gspo-token",
                 "vespo")
SEQUENCE_POLICY_LOSSES = ("gspo", "gspo-token", "vespo")
# DPPO's divergence trust region (docs/LOSSES.md): clip_eps_low / clip_eps_high are the
# thresholds of the binary TV / binary KL, dual_clip_c the cap of the detached ratio
DPPO_POLICY_LOSSES = ("dppo-tv", "dppo-kl")
KERNEL_POLICY_LOSSES = tuple(x for x in POLICY_LOSSES if x not in SEQUENCE_POLICY_LOSSES)
# id = index: ppo::KlEstimator, KL_* (triton_kernels/_math.py). "k1+" / "k3+": verl's
# straight-through estimators (the value of k1 / k3, the gradient of k2).
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm", "none")
SEQ_MEAN_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ROLLOUT_CORRECTIONS = ("tis", "tis-seq", "mis", "mis-seq", "geo-seq")

# The kernel ops' `float[] scalars` and `int[] codes`, slot = index (ppo::slot::Float /
# ppo::slot::Int in csrc/ppo_math.h, F_* / I_* in triton_kernels/_math.py). dual_clip_c's
# slot holds 0 for "no dual clip"; kl_bias_correction's 0 or 1.
FLOAT_SLOTS = ("clip_eps_low", "clip_eps_high", "dual_clip_c", "kl_coef", "entropy_coef",
               "temperature", "grad_scale", "sapo_tau_pos", "sapo_tau_neg")
INT_SLOTS = ("policy_loss", "kl_estimator", "kl_bias_correction")
F = {name: i for i, name in enumerate(FLOAT_SLOTS)}
I = {name: i for i, name in enumerate(INT_SLOTS)}  # noqa: E741


def _plain(v):
    """Whether an option value may key LossSpec.build's cache: None, a bool, a number, a
    string, or a tuple of those."""
    if isinstance(v, tuple):
        return all(_plain(u) for u in v)
    return v is None or isinstance(v, (bool, int, float, str))


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Every non-tensor option of a ppo_loss call, checked (pk.ppo_loss documents each).

    Built by LossSpec.build; the defaults are ppo_loss's. clip_eps_high is never None in a
    built record (None means clip_eps_low); cp_group is a torch.distributed group or None.
    """

    policy_loss: str = "vanilla"
    clip_eps_low: float = 0.2
    clip_eps_high: Optional[float] = None
    dual_clip_c: Optional[float] = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_bias_correction: bool = False
    entropy_coef: float = 0.0
    entropy_agg_mode: Optional[str] = None
    temperature: float = 1.0
    loss_agg_mode: str = "token-mean"
    norm_length: Optional[float] = None
    rollout_correction: Optional[str] = None
    rollout_is_threshold: Any = 2.0
    off_policy_mask_threshold: Optional[float] = None
    grad_scale: float = 1.0
    inplace_backward: bool = False
    return_per_token: bool = False
    cp_group: Any = None
    # sampling replay (docs/SAMPLING.md): the log-probs of the KL to the reference and the
    # distribution of the entropy, "full" (the whole vocabulary) or "kept" (the kept set);
    # read only when a kept set is given (sampling_mask, top_k / top_p / min_p)
    kl_logprobs: str = "full"
    entropy_over: str = "full"

    @classmethod
    def build(cls, dtype=torch.float32, **options):
        """The checked record of ppo_loss's keywords (unknown ones a TypeError). dtype: the
        accumulation dtype, in which grad_scale and the SAPO temperatures must stay
        positive normal numbers. A record is immutable, so one built from the same keyword
        values (each of the same type) is reused: a training loop checks its options once."""
        return cls.from_options(dtype, options)

    @classmethod
    def from_options(cls, dtype, options, ignore=frozenset()):
        """build(dtype, **options) from the dict itself (no keyword repacking: a repeated
        call costs one key and one look-up). ignore: keys of options that are not the
        record's (a call's tensors), left out without copying the dict."""
        if torch.compiler.is_compiling():  # (traced: no cache to consult or fill)
            return cls._build(dtype, **{k: v for k, v in options.items() if k not in ignore})
        names, pick = _picker(tuple(options), ignore)
        values = pick(options)
        try:  # (looked up first: the check of every value below costs more than a hit)
            key = (dtype, names, values, tuple(map(type, values)))
            spec = _BUILT.get(key)
        except (TypeError, RuntimeError):  # unhashable (a list), or a tensor compared
            return cls._build(dtype, **dict(zip(names, values)))
        if spec is not None:
            return spec
        spec = cls._build(dtype, **dict(zip(names, values)))
        # only plain values are keys: a process group or a tensor (cp_group, a tensor
        # global_num_tokens) kept alive by the cache would outlive its group (a gloo group
        # destroyed at interpreter exit aborts the process) or pin a step's tensor
        if all(_plain(v) for v in values):
            if len(_BUILT) >= _BUILT_MAX:
                _BUILT.clear()
            _BUILT[key] = spec
        return spec

    @classmethod
    def _build(cls, dtype=torch.float32, **options):
        unknown = sorted(set(options) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"{unknown[0]}: not an option of ppo_loss (the options: "
                            f"{sorted(DEFAULTS)})")
        o = {**DEFAULTS, **options}
        ck.choice("policy_loss", o["policy_loss"], POLICY_LOSSES)
        if o["policy_loss"] == "cispo":  # a band for a weight, not a trust region: wider ranges
            eps_low = ck.number("clip_eps_low", o["clip_eps_low"], lo=0.0, hi=1.0)
            eps_high = eps_low if o["clip_eps_high"] is None else ck.number(
                "clip_eps_high", o["clip_eps_high"], lo=0.0)
        elif o["policy_loss"] in DPPO_POLICY_LOSSES:
            # thresholds of a divergence (a probability difference, a Bernoulli KL), >= 0
            eps_low = ck.number("clip_eps_low", o["clip_eps_low"], lo=0.0)
            eps_high = eps_low if o["clip_eps_high"] is None else ck.number(
                "clip_eps_high", o["clip_eps_high"], lo=0.0)
        else:
            eps_low = ck.number("clip_eps_low", o["clip_eps_low"], lo=0.0, hi=1.0, hi_open=True)
            eps_high = eps_low if o["clip_eps_high"] is None else ck.number(
                "clip_eps_high", o["clip_eps_high"], lo=0.0, hi=1.0, hi_open=True)
        dual = o["dual_clip_c"]
        if dual is not None:
            if o["policy_loss"] in ("cispo", "sapo", "vespo"):
                raise ValueError(f"dual_clip_c: the dual clip caps PPO's clipped surrogate; "
                                 f"policy_loss={o['policy_loss']!r} has none (got {dual!r})")
            if o["policy_loss"] in DPPO_POLICY_LOSSES:
                # DPPO: the cap of the detached ratio (verl's / TRL's clip_ratio_c)
                dual = ck.number("dual_clip_c", dual, lo=0.0, lo_open=True)
            else:
                # a cap at or below 1 + eps_high would cut into the clip band itself: the
                # loss silently became something else (TRL / Liger's delta is this cap)
                dual = ck.number("dual_clip_c", dual, lo=1.0 + eps_high, lo_open=True)
        checked = dict(
            clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip_c=dual,
            sapo_tau_pos=ck.positive_in("sapo_tau_pos", o["sapo_tau_pos"], dtype),
            sapo_tau_neg=ck.positive_in("sapo_tau_neg", o["sapo_tau_neg"], dtype),
            # VESPO's gamma weight w^k e^(lambda (1 - w)) (TRL's vespo_k_* / vespo_lambda_*)
            vespo_k_pos=ck.number("vespo_k_pos", o["vespo_k_pos"], lo=0.0),
            vespo_k_neg=ck.number("vespo_k_neg", o["vespo_k_neg"], lo=0.0),
            vespo_lambda_pos=ck.number("vespo_lambda_pos", o["vespo_lambda_pos"], lo=0.0,
                                       lo_open=True),
            vespo_lambda_neg=ck.number("vespo_lambda_neg", o["vespo_lambda_neg"], lo=0.0,
                                       lo_open=True))
        if o["rollout_correction"] is not None:
            ck.choice("rollout_correction", o["rollout_correction"], ROLLOUT_CORRECTIONS)
        if o["off_policy_mask_threshold"] is not None:
            checked["off_policy_mask_threshold"] = ck.number("off_policy_mask_threshold",
                                                             o["off_policy_mask_threshold"])
        checked["kl_coef"] = ck.number("kl_coef", o["kl_coef"], lo=0.0)
        ck.choice("kl_estimator", o["kl_estimator"], KL_ESTIMATORS)
        ck.flag("kl_bias_correction", o["kl_bias_correction"])
        checked["entropy_coef"] = ck.number("entropy_coef", o["entropy_coef"])
        checked["temperature"] = ck.temperature_in(o["temperature"], dtype)
        checked["grad_scale"] = ck.positive_in("grad_scale", o["grad_scale"], dtype)
        ck.choice("loss_agg_mode", o["loss_agg_mode"], LOSS_AGG_MODES)
        if o["entropy_agg_mode"] is not None:
            ck.choice("entropy_agg_mode", o["entropy_agg_mode"], LOSS_AGG_MODES[:-1])
        if o["norm_length"] is not None:
            checked["norm_length"] = ck.number("norm_length", o["norm_length"], lo=0.0,
                                               lo_open=True)
        ck.flag("inplace_backward", o["inplace_backward"])
        ck.flag("return_per_token", o["return_per_token"])
        ck.choice("kl_logprobs", o["kl_logprobs"], ("full", "kept"))
        ck.choice("entropy_over", o["entropy_over"], ("full", "kept"))
        # (one constructor call from a plain dict: torch.compile traces it)
        return cls(**{**o, **checked})

    # ---------------------------------------------------------------- derived

    @property
    def policy_loss_id(self):
        return POLICY_LOSSES.index(self.policy_loss)

    @property
    def kl_estimator_id(self):
        return KL_ESTIMATORS.index(self.kl_estimator)

    @property
    def sequence_loss(self):
        """Whether the policy loss itself reduces over a sequence (GSPO's ratio)."""
        return self.policy_loss in SEQUENCE_POLICY_LOSSES

    def effective_grad_scale(self, dtype):
        """The scale the forward writes the gradient with: float16 cannot hold every
        pre-scaled gradient (a loss scale of 2^16), so there the backward scales up
        instead, where an overflow is the loss scaler's to see."""
        return min(self.grad_scale, 1.0) if dtype == torch.float16 else self.grad_scale

    def kernel_args(self, dtype):
        """(scalars, codes): the float[] and int[] the ppo_loss kernel ops take, in the slot
        order of FLOAT_SLOTS / INT_SLOTS; dtype: the logits' (or hidden states') dtype.
        (Made once per record and dtype, handed out as tuples: nothing can change them.)"""
        if torch.compiler.is_compiling():
            return self._kernel_args(dtype)
        cache = self.__dict__.get("_kernel_args_cache")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_kernel_args_cache", cache)  # (a frozen record)
        got = cache.get(dtype)
        if got is None:
            got = cache[dtype] = self._kernel_args(dtype)
        return got

    def _kernel_args(self, dtype):
        values = dict(
            clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
            dual_clip_c=self.dual_clip_c or 0.0, kl_coef=self.kl_coef,
            entropy_coef=self.entropy_coef, temperature=self.temperature,
            grad_scale=self.effective_grad_scale(dtype), sapo_tau_pos=self.sapo_tau_pos,
            sapo_tau_neg=self.sapo_tau_neg)
        codes = dict(policy_loss=self.policy_loss_id, kl_estimator=self.kl_estimator_id,
                     kl_bias_correction=int(self.kl_bias_correction))
        return (tuple(float(values[n]) for n in FLOAT_SLOTS),
                tuple(int(codes[n]) for n in INT_SLOTS))


# LossSpec.build's records by their keyword values (cleared when full)
_BUILT = {}
_BUILT_MAX = 256
_PICKERS = {}


def _picker(keys, ignore):
    """(names, pick) for a dict with these keys: the keys not in ignore, in order, and a
    function of the dict returning their values as a tuple (operator.itemgetter: one C
    call, where a comprehension over every keyword of a call costs microseconds)."""
    got = _PICKERS.get((keys, ignore))
    if got is None:
        names = tuple(k for k in keys if k not in ignore)
        get = operator.itemgetter(*names) if names else (lambda d: ())
        pick = get if len(names) != 1 else (lambda d: (get(d),))
        if len(_PICKERS) >= _BUILT_MAX:
            _PICKERS.clear()
        got = _PICKERS[(keys, ignore)] = (names, pick)
    return got


# ppo_loss's defaults, by option (read by LossSpec.build, where torch.compile cannot trace
# dataclasses.fields)
DEFAULTS = {f.name: f.default for f in dataclasses.fields(LossSpec)}
