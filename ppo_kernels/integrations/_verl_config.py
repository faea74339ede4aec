"""verl's config keys mapped to ``pk.ppo_loss`` / ``pk.ppo_loss_from_hidden`` keyword
arguments (``from_verl_config``), with a ValueError naming the key for every option the op
cannot express; the policy losses registered by ppo_kernels.integrations.verl read their
options through the same code (docs/VERL.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..spec import LOSS_AGG_MODES, LossSpec

# verl loss_mode -> ppo_kernels policy_loss (verl's "gspo" is the paper's GSPO-token form)
VERL_LOSS_MODES = {"vanilla": "vanilla", "gspo": "gspo-token", "cispo": "cispo",
                   "sapo": "sapo", "dppo_tv": "dppo-tv", "dppo_kl": "dppo-kl"}
# the names registered in verl's POLICY_LOSS_REGISTRY -> the verl loss mode each computes
REGISTERED_LOSS_MODES = {"ppo_kernels": "vanilla", "ppo_kernels_vanilla": "vanilla",
                         "ppo_kernels_gspo": "gspo", "ppo_kernels_cispo": "cispo",
                         "ppo_kernels_sapo": "sapo", "ppo_kernels_dppo_tv": "dppo_tv",
                         "ppo_kernels_dppo_kl": "dppo_kl"}
# verl loss modes (and options) with no exact counterpart in the op, and why
_UNSUPPORTED_LOSS_MODES = {
    "clip_cov": "a randomised subset of tokens loses its gradient (randperm)",
    "kl_cov": "a top-k-by-covariance subset of tokens gets an extra |lp - old| penalty",
    "geo_mean": "GMPO's sequence-level geometric mean of sign-clipped ratios",
    "gpg": "-A * lp with no ratio",
    "dro": "a quadratic (lp - old)^2 penalty",
    "bypass_mode": "verl's bypass mode (old = rollout log-probs, in-loss IS / RS)",
}
# verl kl_loss_type -> kl_estimator (verl/trainer/ppo/core_algos.py::kl_penalty)
_KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "k2+": "k2", "mse+": "k2",
             "abs": "abs", "k1+": "k1+", "kl+": "k1+"}
_KL_UNSUPPORTED = {
    "low_var_kl": "verl clamps the k3 value to [-10, 10] (and ref - lp to [-20, 20]); "
                  "ppo_kernels' k3 has no value clamp",
    "k3": "verl's k3 is low_var_kl: its value is clamped to [-10, 10]; ppo_kernels' k3 "
          "has no value clamp",
    "low_var_kl+": "the value is verl's clamped k3 (at most 10), ppo_kernels' k3+ value "
                   "is not clamped (the gradient, lp - ref, is the same)",
    "k3+": "the value is verl's clamped k3 (at most 10), ppo_kernels' k3+ value is not "
           "clamped (the gradient, lp - ref, is the same)",
    "abs+": "ppo_kernels has no straight-through abs estimator",
    "full": "verl does not implement it either",
}
# ppo_kernels argument -> the verl key it comes from (for error messages)
_VERL_KEY = {"clip_eps_low": "actor.clip_ratio_low (or actor.clip_ratio)",
             "clip_eps_high": "actor.clip_ratio_high (or actor.clip_ratio)",
             "dual_clip_c": "actor.clip_ratio_c", "sapo_tau_pos": "actor.tau_pos",
             "sapo_tau_neg": "actor.tau_neg", "policy_loss": "actor.policy_loss.loss_mode"}
SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
GSPO_LOG_RATIO_MAX = 10.0  # verl clamps GSPO's log ratio here from above; ppo_kernels at 20


def cfg_get(cfg, key, default=None):
    """cfg[key] for a verl dataclass config (BaseConfig), an omegaconf DictConfig, a dict or
    any object with attributes; default when absent or None-valued configs."""
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    getter = getattr(cfg, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except (KeyError, AttributeError, TypeError):
            pass
    return getattr(cfg, key, default)


def _float(key, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: expected a number, got {value!r}") from None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    return value


def _verl_error(exc, kw):
    """A ppo_kernels argument error re-raised naming the verl key the argument came from."""
    msg = str(exc)
    name = msg.split(":", 1)[0]
    key = _VERL_KEY.get(name, name)
    value = kw.get(name)
    return ValueError(f"{key} = {value!r} cannot be expressed by ppo_kernels: {msg}")


def _loss_mode(actor, loss_mode=None):
    """The verl loss mode ("vanilla", "gspo", "cispo", "sapo", "dppo_tv", "dppo_kl") that actor's
    policy_loss.loss_mode (or loss_mode) asks for; ValueError for any other."""
    mode = loss_mode if loss_mode is not None else cfg_get(cfg_get(actor, "policy_loss"),
                                                        "loss_mode", "vanilla")
    verl_mode = REGISTERED_LOSS_MODES.get(mode, mode)
    if verl_mode in VERL_LOSS_MODES:
        return verl_mode
    why = _UNSUPPORTED_LOSS_MODES.get(verl_mode)
    supported = sorted(VERL_LOSS_MODES) + sorted(REGISTERED_LOSS_MODES)
    if why is not None:
        raise ValueError(f"actor.policy_loss.loss_mode = {mode!r} is not supported by "
                         f"ppo_kernels ({why}); supported: {supported}")
    raise ValueError(f"actor.policy_loss.loss_mode = {mode!r} is not a loss mode ppo_kernels "
                     f"knows; supported: {supported}")


def policy_kwargs(actor, loss_mode=None):
    """(verl mode, the op's policy keyword arguments) of a verl actor config, validated by
    the library's own checks; a ValueError names the verl key."""
    verl_mode = _loss_mode(actor, loss_mode)
    clip = cfg_get(actor, "clip_ratio", 0.2)
    low, high = cfg_get(actor, "clip_ratio_low", None), cfg_get(actor, "clip_ratio_high", None)
    low = clip if low is None else low
    high = clip if high is None else high
    kw = {"policy_loss": VERL_LOSS_MODES[verl_mode],
          "clip_eps_low": _float(_VERL_KEY["clip_eps_low"], low),
          "clip_eps_high": _float(_VERL_KEY["clip_eps_high"], high)}
    if verl_mode == "vanilla":  # verl's dual clip is always on for vanilla (A < 0 only)
        c = _float(_VERL_KEY["dual_clip_c"], cfg_get(actor, "clip_ratio_c", 3.0))
        if not c > 1.0:  # verl asserts it too
            raise ValueError(f"actor.clip_ratio_c = {c!r}: verl requires clip_ratio_c > 1")
        kw["dual_clip_c"] = c
    if verl_mode in ("dppo_tv", "dppo_kl"):
        # verl's DPPO: clip_ratio_low / clip_ratio_high are the divergence thresholds and
        # clip_ratio_c caps the detached ratio (compute_policy_loss_dppo_tv / _kl)
        kw["dual_clip_c"] = _float(_VERL_KEY["dual_clip_c"], cfg_get(actor, "clip_ratio_c", 20.0))
    if verl_mode == "sapo":
        kw["sapo_tau_pos"] = _float(_VERL_KEY["sapo_tau_pos"], cfg_get(actor, "tau_pos", 1.0))
        kw["sapo_tau_neg"] = _float(_VERL_KEY["sapo_tau_neg"], cfg_get(actor, "tau_neg", 1.05))
    try:
        LossSpec.build(**kw)
    except (ValueError, TypeError) as exc:
        raise _verl_error(exc, kw) from exc
    return verl_mode, kw


def _rollout_correction_kwargs(rc):
    """rollout_correction / rollout_is_threshold of verl's algorithm.rollout_correction
    (decoupled mode: the IS weights of pi_old / pi_rollout)."""
    if rc is None:
        return {}
    if cfg_get(rc, "bypass_mode", False):
        raise ValueError("algorithm.rollout_correction.bypass_mode = True is not supported by "
                         "ppo_kernels (old = rollout log-probs with IS / rejection inside the "
                         "loss, verl's compute_policy_loss_bypass_mode)")
    if cfg_get(rc, "rollout_is_batch_normalize", False):
        raise ValueError("algorithm.rollout_correction.rollout_is_batch_normalize = True is not "
                         "supported by ppo_kernels (the IS weights are not renormalised to "
                         "mean 1)")
    rs = cfg_get(rc, "rollout_rs", None)
    if rs not in (None, "", "null"):
        raise ValueError(f"algorithm.rollout_correction.rollout_rs = {rs!r} is not supported by "
                         f"ppo_kernels: verl's rejection sampling removes the rejected tokens "
                         f"from response_mask (and the token-mean denominator) before the "
                         f"loss; ppo_kernels' masks keep them in the denominators. Inside "
                         f"verl the actor already receives the rejected mask: pass that "
                         f"response_mask and leave rollout_rs out of the mapping")
    level = cfg_get(rc, "rollout_is", None)
    if level in (None, "", "null"):
        return {}
    if level not in ("token", "sequence"):
        raise ValueError(f"algorithm.rollout_correction.rollout_is = {level!r}: expected "
                         f"'token', 'sequence' or None")
    spec = cfg_get(rc, "rollout_is_threshold", 2.0)
    key = "algorithm.rollout_correction.rollout_is_threshold"
    lo = None
    if isinstance(spec, str) and "_" in spec.strip():
        lo_s, hi_s = spec.strip().split("_", 1)
        lo, hi = _float(key, lo_s), _float(key, hi_s)
        if not (0 < lo <= hi):
            raise ValueError(f"{key} = {spec!r}: expected 0 < lower <= upper")
        if lo == hi:
            raise ValueError(f"{key} = {spec!r}: ppo_kernels needs lower < upper for IcePop "
                             f"bounds")
    else:
        hi = _float(key, spec)
        if not hi > 0:
            raise ValueError(f"{key} = {spec!r}: expected an upper bound > 0")
    seq = "-seq" if level == "sequence" else ""
    if lo is None:  # TIS: w = min(w, upper), no lower bound
        return {"rollout_correction": "tis" + seq, "rollout_is_threshold": hi}
    return {"rollout_correction": "mis" + seq, "rollout_is_threshold": (lo, hi)}


def _split_config(config):
    """(actor config, rollout_correction config or None, temperature or None) of either a
    full verl trainer config (with actor_rollout_ref and algorithm) or an actor config."""
    arr = cfg_get(config, "actor_rollout_ref", None)
    if arr is None:
        return config, None, None
    actor = cfg_get(arr, "actor", None)
    if actor is None:
        raise ValueError("config.actor_rollout_ref.actor: missing (expected verl's trainer "
                         "config or its actor_rollout_ref.actor section)")
    rc = cfg_get(cfg_get(config, "algorithm", None), "rollout_correction", None)
    temperature = cfg_get(cfg_get(arr, "rollout", None), "temperature", None)
    return actor, rc, temperature


REPLAY_LOGPROBS_MODES = ("processed_logprobs",)


def replay_kwargs_from_verl(rollout, *, key="actor_rollout_ref.rollout"):
    """The kept-set keywords of sampling replay (``top_k`` / ``top_p`` / ``min_p`` of
    pk.token_logprobs / pk.ppo_loss, docs/SAMPLING.md) for verl's rollout sampling
    parameters: ``rollout`` is ``actor_rollout_ref.rollout`` (a RolloutConfig, a
    DictConfig or a dict with its keys ``top_k``, ``top_p`` and, where a config has one,
    ``min_p``). verl's top_k = -1 (its default) or 0, top_p = 1 and min_p = 0 are off and
    leave the key out (all off: an empty dict, the plain op).

    Raises ValueError naming the key: top_k not an integer (-1, 0 or >= 1), top_p outside
    (0, 1], min_p outside [0, 1), or ``calculate_log_probs=True`` with a ``logprobs_mode``
    other than processed_logprobs or with ``name="sglang"`` (the rollout log-probs of
    rollout correction would be scored over another distribution than the replayed
    ones)."""
    top_k = cfg_get(rollout, "top_k", None)
    top_p = cfg_get(rollout, "top_p", None)
    min_p = cfg_get(rollout, "min_p", None)
    top_k = -1 if top_k is None else top_k
    top_p = 1.0 if top_p is None else top_p
    min_p = 0.0 if min_p is None else min_p
    kw = {}
    if isinstance(top_k, bool) or not isinstance(top_k, (int, float)) or \
            top_k != int(top_k) or top_k < -1:
        raise ValueError(f"{key}.top_k = {top_k!r}: expected an integer, -1 / 0 (off) or "
                         f">= 1")
    if top_k >= 1:
        kw["top_k"] = int(top_k)
    top_p = _float(f"{key}.top_p", top_p)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{key}.top_p = {top_p!r}: expected a value in (0, 1]")
    if top_p < 1.0:
        kw["top_p"] = top_p
    min_p = _float(f"{key}.min_p", min_p)
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"{key}.min_p = {min_p!r}: expected a value in [0, 1)")
    if min_p > 0.0:
        kw["min_p"] = min_p
    mode = cfg_get(rollout, "logprobs_mode", None)
    uses = bool(cfg_get(rollout, "calculate_log_probs", False))
    if uses and cfg_get(rollout, "name", None) == "sglang":
        raise ValueError(f"{key}.name = 'sglang' with calculate_log_probs = True and sampling "
                         f"replay: SGLang returns log-probs over the full vocabulary (of the "
                         f"temperature-scaled logits, before top-k / top-p), not over the "
                         f"kept sets; train without replay there")
    if uses and mode is not None and mode not in REPLAY_LOGPROBS_MODES:
        raise ValueError(f"{key}.logprobs_mode = {mode!r} with calculate_log_probs = True "
                         f"and sampling replay: the rollout log-probs are not over the kept "
                         f"sets (set logprobs_mode=processed_logprobs, vLLM's log-probs "
                         f"after the temperature, top-k and top-p)")
    return kw


def verl_batch_kwargs(response_mask, loss_agg_mode, global_batch_info=None):
    """The per-step counts of verl's ``agg_loss`` (verl/trainer/ppo/core_algos.py) as the
    op's keywords, so that the op's loss is verl's for the same micro-batch.

    Args:
        response_mask: [B, T] bool / 0-1, the micro-batch's loss mask.
        loss_agg_mode: the op's loss_agg_mode (from_verl_config's).
        global_batch_info: verl's ``config.global_batch_info`` (``dp_size``,
            ``batch_num_tokens``, ``global_batch_size``) or None (one process).

    Returns:
        dict: token-mean: ``global_num_tokens = batch_num_tokens / dp_size`` (default: the
        micro-batch's valid tokens); seq-mean modes: ``global_num_seqs =
        global_batch_size / dp_size`` (default: the micro-batch's **non-empty** sequences,
        as verl counts them: the op's own default for seq-mean-token-sum(-norm) is B);
        token-sum: nothing. Tensors stay tensors (no host read).

    Raises:
        ValueError as verl: dp_size > 1 without batch_num_tokens (token-mean) or
        global_batch_size (seq-mean modes); token-sum with dp_size > 1 (verl multiplies the
        sum by dp_size, a factor the op does not apply).
    """
    info = global_batch_info or {}
    dp = cfg_get(info, "dp_size", 1) or 1
    dp = int(dp) if not isinstance(dp, (int, float)) else dp
    if loss_agg_mode == "token-mean":
        n = cfg_get(info, "batch_num_tokens", None)
        if n is None:
            if dp > 1:
                raise ValueError("global_batch_info.batch_num_tokens: required when dp_size > 1 "
                                 "(as in verl)")
            n = response_mask.sum()
        return {"global_num_tokens": n / dp if dp != 1 else n}
    if loss_agg_mode in SEQ_MODES:
        n = cfg_get(info, "global_batch_size", None)
        if n is None:
            if dp > 1:
                raise ValueError("global_batch_info.global_batch_size: required when dp_size "
                                 "> 1 (as in verl)")
            n = response_mask.bool().any(-1).sum()  # verl: the non-empty sequences
        return {"global_num_seqs": n / dp if dp != 1 else n}
    if loss_agg_mode == "token-sum" and dp > 1:
        raise ValueError(f"global_batch_info.dp_size = {dp}: verl's token-sum multiplies the "
                         f"sum by dp_size, which the op does not express")
    return {}


def from_verl_config(config, *, rollout_correction=None, response_mask=None,
                     global_batch_info=None, sampling_replay=False):
    """The keyword arguments of ``pk.ppo_loss`` / ``pk.ppo_loss_from_hidden`` that compute
    verl 0.9's actor loss (``verl/workers/utils/losses.py::ppo_loss``: the policy loss of
    ``policy_loss.loss_mode``, minus ``entropy_coeff`` times the aggregated entropy, plus
    ``kl_loss_coef`` times the aggregated ``kl_loss_type`` KL when ``use_kl_loss``).

    Args:
        config: verl's actor config (``actor_rollout_ref.actor``: an ``ActorConfig``
            dataclass, an omegaconf ``DictConfig`` or a plain dict with its keys), or the
            whole trainer config (then ``algorithm.rollout_correction`` and
            ``actor_rollout_ref.rollout.temperature`` are read too).
        rollout_correction: verl's ``algorithm.rollout_correction`` section, when config is
            only the actor's (decoupled mode; its IS weights of pi_old / pi_rollout are then
            computed by the op from ``rollout_logprobs``).
        response_mask, global_batch_info: the micro-batch's mask (and verl's
            ``global_batch_info``): adds verl_batch_kwargs' counts (global_num_tokens /
            global_num_seqs as verl's agg_loss computes them; without them the op's
            seq-mean-token-sum divides by B, verl by the non-empty sequences).
        sampling_replay: True adds the rollout's ``top_k`` / ``top_p`` (/ ``min_p``) as
            the op's kept-set keywords (replay_kwargs_from_verl; and, with use_kl_loss,
            ``kl_logprobs="kept"``: the reference's log-probs over its own kept sets, as the
            fused hook computes them); needs the whole trainer config. False (the default)
            leaves the keywords as they were.

    Returns:
        dict with ``policy_loss``, ``clip_eps_low``, ``clip_eps_high``, ``dual_clip_c``
        (vanilla), ``sapo_tau_pos`` / ``sapo_tau_neg`` (sapo), ``loss_agg_mode`` (and
        ``entropy_agg_mode`` for SAPO, whose policy term verl always aggregates
        "seq-mean-token-mean"), ``norm_length`` (``loss_scale_factor``), ``entropy_coef``,
        ``kl_coef`` / ``kl_estimator`` (``use_kl_loss``), ``rollout_correction`` /
        ``rollout_is_threshold`` and ``temperature`` (whole config). The per-step counts
        of verl's ``global_batch_info`` are data, not config: pass ``global_num_tokens =
        batch_num_tokens / dp_size`` (token-mean) or ``global_num_seqs = global_batch_size
        / dp_size`` (seq-mean modes; verl's default is the number of non-empty sequences)
        yourself.

    Raises:
        ValueError naming the verl key, for everything the op cannot express exactly:
        loss modes clip_cov, kl_cov, geo_mean, gpg, dro, dppo_tv, dppo_kl, bypass_mode;
        kl_loss_type low_var_kl / k3 (value clamp at 10), low_var_kl+ / k3+, abs+, full;
        clip_ratio_c <= 1 + clip_ratio_high (vanilla) and clip ratios outside the op's
        ranges; SAPO with use_kl_loss and loss_agg_mode != "seq-mean-token-mean";
        rollout_correction.bypass_mode, rollout_rs and rollout_is_batch_normalize.
    """
    if not isinstance(sampling_replay, bool):
        raise TypeError(f"sampling_replay: expected True or False, got "
                        f"{type(sampling_replay).__name__}")
    actor, rc, temperature = _split_config(config)
    replay = {}
    if sampling_replay:
        arr = cfg_get(config, "actor_rollout_ref", None)
        if arr is None:
            raise ValueError("sampling_replay: needs the whole trainer config (its "
                             "actor_rollout_ref.rollout top_k / top_p), got an actor section")
        replay = replay_kwargs_from_verl(cfg_get(arr, "rollout", None))
    if rollout_correction is not None:
        rc = rollout_correction
    verl_mode, kw = policy_kwargs(actor)
    agg = cfg_get(actor, "loss_agg_mode", "token-mean")
    if agg not in LOSS_AGG_MODES[:-1]:  # "none" is ppo_kernels', not verl's
        raise ValueError(f"actor.loss_agg_mode = {agg!r}: expected one of "
                         f"{list(LOSS_AGG_MODES[:-1])}")
    entropy_coef = _float("actor.entropy_coeff", cfg_get(actor, "entropy_coeff", 0.0))
    use_kl = bool(cfg_get(actor, "use_kl_loss", False))
    if verl_mode == "sapo" and agg != "seq-mean-token-mean":
        # verl forces the SAPO policy term to seq-mean-token-mean; entropy and KL keep agg
        if use_kl:
            raise ValueError(f"actor.loss_agg_mode = {agg!r} with policy_loss.loss_mode = "
                             f"'sapo' and actor.use_kl_loss = True cannot be expressed by "
                             f"ppo_kernels: verl aggregates the SAPO term seq-mean-token-mean "
                             f"but the KL term with {agg!r}, and the op aggregates both with "
                             f"loss_agg_mode (set loss_agg_mode=seq-mean-token-mean)")
        kw["loss_agg_mode"] = "seq-mean-token-mean"
        if entropy_coef != 0.0:
            kw["entropy_agg_mode"] = agg
    else:
        kw["loss_agg_mode"] = agg
    lsf = cfg_get(actor, "loss_scale_factor", None)
    if lsf is not None and kw["loss_agg_mode"] == "seq-mean-token-sum-norm":
        kw["norm_length"] = _float("actor.loss_scale_factor", lsf)
    kw["entropy_coef"] = entropy_coef
    if use_kl:
        kl_type = cfg_get(actor, "kl_loss_type", "low_var_kl")
        if kl_type in _KL_UNSUPPORTED:
            raise ValueError(f"actor.kl_loss_type = {kl_type!r} is not supported by "
                             f"ppo_kernels: {_KL_UNSUPPORTED[kl_type]}; supported: "
                             f"{sorted(_KL_TYPES)}")
        if kl_type not in _KL_TYPES:
            raise ValueError(f"actor.kl_loss_type = {kl_type!r} is not a KL type verl 0.9 "
                             f"knows; supported by ppo_kernels: {sorted(_KL_TYPES)}")
        coef = _float("actor.kl_loss_coef", cfg_get(actor, "kl_loss_coef", 0.001))
        if coef < 0:
            raise ValueError(f"actor.kl_loss_coef = {coef!r}: ppo_kernels needs kl_coef >= 0")
        kw["kl_coef"], kw["kl_estimator"] = coef, _KL_TYPES[kl_type]
    kw.update(_rollout_correction_kwargs(rc))
    if replay:
        kw.update(replay)
        if use_kl:
            kw["kl_logprobs"] = "kept"
    if temperature is not None:
        kw["temperature"] = _float("actor_rollout_ref.rollout.temperature", temperature)
    if response_mask is not None:
        kw.update(verl_batch_kwargs(response_mask, kw["loss_agg_mode"], global_batch_info))
        if kw.get("entropy_agg_mode") in SEQ_MODES and "global_num_seqs" not in kw:
            kw.update(verl_batch_kwargs(response_mask, kw["entropy_agg_mode"],
                                        global_batch_info))
    elif global_batch_info is not None:
        raise ValueError("global_batch_info: pass response_mask with it (the counts are "
                         "per micro-batch)")
    return kw


# ------------------------------------------------------------------ the registered loss
