"""verl (0.9.x) integration: ppo_kernels' losses in verl's policy-loss registry, the fused
LM-head log-prob / entropy kernel behind verl's ``use_fused_kernels`` path, and the mapping
of verl's config keys to ``pk.ppo_loss`` / ``pk.ppo_loss_from_hidden`` keyword arguments
(docs/VERL.md).

Switching it on (every verl process, workers included, must import this module):

    actor_rollout_ref.model.external_lib=ppo_kernels.integrations.verl
    actor_rollout_ref.actor.policy_loss.loss_mode=ppo_kernels        # or ppo_kernels_gspo, ...
    actor_rollout_ref.model.use_fused_kernels=True                   # the fused hook
    actor_rollout_ref.model.fused_kernel_options.impl_backend=torch  # (or triton)

Importing the module

* registers the policy losses ``"ppo_kernels"`` (= ``"ppo_kernels_vanilla"``),
  ``"ppo_kernels_vanilla"``, ``"ppo_kernels_gspo"``, ``"ppo_kernels_cispo"`` and
  ``"ppo_kernels_sapo"`` with ``verl.trainer.ppo.core_algos.register_policy_loss``; each
  computes the verl loss mode of the same name (vanilla PPO with verl's dual clip, verl's
  GSPO-token form, CISPO with verl's two-sided clip, SAPO) with ppo_kernels' formulas
  (``ppo_kernels._torch_impl``, the library's eager composite) and returns verl's metrics;
* installs the fused hook (unless ``PPO_KERNELS_VERL_FUSED_HOOK=0``): verl's
  ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (the ``impl_backend=torch``
  path of ``use_fused_kernels``) and ``verl.utils.kernel.linear_cross_entropy.
  linear_cross_entropy`` (the ``triton`` path) are replaced by ``FusedLinearForPPO`` /
  ``linear_cross_entropy`` below, which run ``pk.token_logprobs_from_hidden``: the chunked
  kernel that never stores the [N, V] logits. verl's model forwards
  (``verl/models/transformers/dense_common.py`` and the VL variants) look both names up at
  call time, so they pick the hook up.

verl computes the KL loss (``use_kl_loss``) and the entropy bonus (``entropy_coeff``) itself,
around the registered policy loss (``verl/workers/utils/losses.py::ppo_loss``), so those keys
need no support on the registry path; ``from_verl_config`` maps them for users who call
``pk.ppo_loss`` / ``pk.ppo_loss_from_hidden`` in their own loop, and raises a ValueError
naming the key for every option the op cannot express.

Sampling replay (docs/VERL.md, "Sampling replay"): with
``+actor_rollout_ref.model.fused_kernel_options.sampling_replay=True`` and the rollout's
sampling parameters passed alongside (``...fused_kernel_options.top_k=${actor_rollout_ref.
rollout.top_k}``, ``top_p=...``), or ``configure_sampling_replay(rollout_config)``, the fused
hook scores every log-prob it computes (the actor's old and current ones, the reference's)
over the kept set of top-k / top-p (/ min-p) after verl's temperature, as vLLM's
processed_logprobs are. The registered losses receive log-probs already computed, so
replay reaches them through the hook only.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch

from .. import _checks as ck
from .. import _torch_impl
from ..from_hidden import token_logprobs_from_hidden
from ..loss import prepare_loss
from ..spec import LOSS_AGG_MODES, LossSpec
from ._verl_config import (SEQ_MODES, GSPO_LOG_RATIO_MAX, REGISTERED_LOSS_MODES,
                           VERL_LOSS_MODES, cfg_get, policy_kwargs, from_verl_config,
                           replay_kwargs_from_verl, verl_batch_kwargs)

try:
    from verl.trainer.ppo import core_algos as _core_algos
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError(
        "ppo_kernels.integrations.verl needs verl 0.9.x and the modules its policy-loss "
        "registry imports; `bash scripts/install_verl.sh` installs them without verl's "
        f"heavy dependencies (import failed: {exc})") from exc

__all__ = ["REGISTERED_LOSS_MODES", "VERL_LOSS_MODES", "compute_policy_loss",
           "from_verl_config", "FusedLinearForPPO", "fused_logprobs_and_entropy",
           "linear_cross_entropy", "register_policy_losses", "install_fused_hook",
           "uninstall_fused_hook", "fused_hook_installed", "configure_fused_hook",
           "fused_hook_chunk_size", "configure_sampling_replay", "sampling_replay_kwargs",
           "replay_kwargs_from_verl", "verl_batch_kwargs"]

def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask,
                        loss_agg_mode="token-mean", config=None, rollout_is_weights=None, *,
                        loss_mode=None):
    """verl's policy loss (a ``core_algos.PolicyLossFn``) computed by ppo_kernels.

    The formulas are ppo_kernels' (``_torch_impl.pg_terms`` / ``token_losses`` /
    ``agg_weights``, docs/LOSSES.md) for the verl loss mode ``loss_mode`` (default: the one
    ``config.policy_loss.loss_mode`` names, ``"ppo_kernels*"`` or a verl mode):

    * vanilla: ``-min(r A, clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high) A)`` capped at
      ``-clip_ratio_c A`` where ``A < 0``, ``r = exp(clamp(lp - old, +-20))``
      (Schulman et al. 2017 eq. 7; Ye et al. 2020 eq. 5; verl ``compute_policy_loss_vanilla``);
    * gspo: the same clip (no dual clip) of ``s_it = sg(s_i) exp(lp_t - sg(lp_t))``,
      ``s_i = exp(mean_t (lp - old))`` (GSPO-token, Zheng et al. 2025; verl
      ``compute_policy_loss_gspo``);
    * cispo: ``-sg(clip(r, 1 - low, 1 + high)) A lp`` (MiniMax-M1; verl two-sided clip);
    * sapo: ``-(4 / tau) sigmoid(tau (r - 1)) A``, ``tau = tau_pos`` if ``A > 0`` else
      ``tau_neg``, always aggregated "seq-mean-token-mean" as verl does;
    * dppo_tv / dppo_kl: ``-M sg(min(r, clip_ratio_c)) A lp`` with DPPO's binary-TV /
      binary-KL trust mask M, thresholds clip_ratio_low / clip_ratio_high (Qi et al. 2026;
      verl ``compute_policy_loss_dppo_tv`` / ``_kl``).

    Each token's term is multiplied by ``rollout_is_weights`` and aggregated by verl's
    ``agg_loss`` rule with ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``,
    ``global_batch_size``, ``loss_scale_factor``).

    Args:
        old_log_prob, log_prob: float [B, T] log-probs (nats) of the sampled tokens under the
            old and the current policy; only log_prob gets a gradient.
        advantages: float [B, T] (or per sequence [B] / [B, 1]).
        response_mask: [B, T] bool / 0-1, the tokens that count.
        loss_agg_mode: "token-mean", "token-sum", "seq-mean-token-sum",
            "seq-mean-token-mean" or "seq-mean-token-sum-norm" (ignored for sapo).
        config: verl's ActorConfig (or a DictConfig / dict with its keys); required.
        rollout_is_weights: optional float [B, T] constant IS weights.
        loss_mode: override config.policy_loss.loss_mode.

    Returns:
        (pg_loss, metrics): a 0-d tensor (float32; float64 for float64 log-probs)
        differentiable in log_prob, and verl's metrics as Python floats:
        ``actor/pg_clipfrac`` (fraction of valid tokens whose clipped branch is strictly
        active; cispo: whose ratio is clipped; sapo: 0), ``actor/ppo_kl`` (mean of
        old - lp, clamped to +-20 except for gspo, as verl), ``actor/pg_clipfrac_lower``
        (vanilla: fraction of A < 0 tokens capped by the dual clip; else 0).

    Raises:
        ValueError: an option the op cannot express (naming the verl key), an unknown loss
        mode or agg mode, dp_size > 1 without batch_num_tokens / global_batch_size (as
        verl), or a bad input shape / dtype (the library's own checks).

    Differences from verl's own functions (docs/VERL.md): gspo clamps the log of the
    sequence ratio to [-20, 20] where verl clamps it to at most 10 (a warning is issued when
    a sequence's mean log-ratio exceeds 10); denominators: token-mean without
    batch_num_tokens and the seq modes use a count clamped at 1 (verl: 0 / 0 = NaN for an
    all-empty batch) and the per-sequence token mean divides by max(L_i, 1) (verl by
    L_i + 1e-8).
    """
    if config is None:
        raise ValueError("config: verl's ActorConfig (or a mapping with its keys) is required")
    verl_mode, kw = policy_kwargs(config, loss_mode)
    agg = "seq-mean-token-mean" if verl_mode == "sapo" else loss_agg_mode
    if agg not in LOSS_AGG_MODES[:-1]:
        raise ValueError(f"loss_agg_mode: expected one of {list(LOSS_AGG_MODES[:-1])}, got "
                         f"{agg!r}")
    info = cfg_get(config, "global_batch_info", None) or {}
    dp_size = info.get("dp_size", 1) or 1
    if isinstance(dp_size, torch.Tensor):
        dp_size = int(dp_size)
    n_tok, n_seq = info.get("batch_num_tokens"), info.get("global_batch_size")
    lsf = info.get("loss_scale_factor")  # verl's ppo_loss copies config.loss_scale_factor
    extra = {}
    if agg == "token-mean":
        if n_tok is None and dp_size > 1:
            raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
        extra["global_num_tokens"] = n_tok
    elif agg in SEQ_MODES:
        if n_seq is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
        extra["global_num_seqs"] = n_seq
        if agg == "seq-mean-token-sum-norm" and lsf is not None:
            extra["norm_length"] = lsf
    # verl's count of the non-empty sequences where none is given (the op's default would
    # be B; seq-mean-token-mean's own count is verl's already)
    count_seqs = agg in ("seq-mean-token-sum", "seq-mean-token-sum-norm") and n_seq is None
    fast = _plain_inputs(old_log_prob, log_prob, advantages, response_mask,
                         rollout_is_weights)
    if fast is not None:
        if count_seqs:
            extra["global_num_seqs"] = (fast[5].sum(-1) > 0).sum().clamp(min=1)
        out = _fast_policy_loss(fast, verl_mode, kw, agg, extra, dp_size)
        if out is not None:
            return out
    if count_seqs:
        ck.tensor("response_mask", response_mask)
        extra["global_num_seqs"] = (response_mask != 0).any(-1).sum().clamp(min=1) \
            if response_mask.dim() == 2 else None
    return _checked_policy_loss(old_log_prob, log_prob, advantages, response_mask,
                                rollout_is_weights, verl_mode, kw, agg, extra, dp_size)


def _plain_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights):
    """The registry's common case, decided from shapes, dtypes and devices alone (O(1), no
    kernel): four (five with rollout_is_weights) floating [B, T] tensors on one device and
    a [B, T] mask. Returns (lp, old, adv, isw, bool mask, float mask, acc dtype), converted
    as the library's checks convert them (ck.per_token, ck.response_mask), or None: every
    other call (per-sequence advantages, a bad argument) takes prepare_loss's checks."""
    if not isinstance(log_prob, torch.Tensor) or log_prob.dim() != 2 or \
            not log_prob.dtype.is_floating_point:
        return None
    shape, dev = log_prob.shape, log_prob.device
    for x, optional in ((old_log_prob, False), (advantages, False),
                        (rollout_is_weights, True)):
        if x is None and optional:
            continue
        if not isinstance(x, torch.Tensor) or x.shape != shape or x.device != dev or \
                not x.dtype.is_floating_point:
            return None
    m = response_mask
    if not isinstance(m, torch.Tensor) or m.shape != shape or m.device != dev or \
            m.dtype.is_complex:
        return None
    acc = ck.acc_dtype(log_prob)
    mb = m if m.dtype == torch.bool else m != 0
    # bool -> float is one cheap pass; the float mask carries every [B, T] reduction
    # below (bool-tensor kernels cost 5-25x a float one on CPU)
    mf = mb.to(acc)
    conv = [None if x is None else x.detach().to(acc)
            for x in (old_log_prob, advantages, rollout_is_weights)]
    return (log_prob.to(acc), conv[0], conv[1], conv[2], mb, mf, acc)


def _fast_policy_loss(inputs, verl_mode, kw, agg, extra, dp_size):
    """compute_policy_loss without the masked-input zeroing: the masked positions of
    old / advantages / rollout_is_weights are left as they are and the loss is
    sum(weights * pg) with weights 0 there. That is the checked path's value and gradient
    exactly (weights * where(mask, pg, 0) has the same products, and d loss / d pg is the
    same 0 off the mask) whenever the masked terms are finite; where one is not (NaN or
    inf on a masked position, or a NaN on a valid one), the loss or the metric sum turns
    NaN, read with the metrics, and the call returns None for the checked path to redo
    (NaN-safe, with token_losses' guard). Returns (pg_loss, metrics) or None."""
    lp, old, adv, isw, mb, mf, acc = inputs
    opts = dict(kw, loss_agg_mode=agg)
    if "norm_length" in extra:
        opts["norm_length"] = extra["norm_length"]
    spec = _spec_of(acc, opts)
    counts = {}
    for key in ("global_num_tokens", "global_num_seqs"):
        v = extra.get(key)
        counts[key] = None if v is None else ck.count(key, v, lp, acc)
    weights = _torch_impl.agg_weights(mf, agg, counts["global_num_tokens"], spec.norm_length,
                                      dtype=acc, global_num_seqs=counts["global_num_seqs"])
    if dp_size != 1:
        weights = weights * dp_size
    pt = _torch_impl.pg_terms(lp, old, adv, mb, spec)
    pol = pt["pg"] if isw is None else pt["pg"] * isw
    pg_loss = (weights * pol).sum()
    metrics, nan = _pg_metrics(lp.detach(), spec, old, adv, mb, verl_mode, pt, pg_loss, mf)
    return None if nan else (pg_loss, metrics)


@functools.lru_cache(maxsize=64)
def _cached_spec(acc, items):
    return LossSpec.build(acc, **dict(items))


def _spec_of(acc, opts):
    """LossSpec.build(acc, **opts), built once per distinct set of options (a frozen
    record; a failed build raises every time: lru_cache keeps no exception)."""
    items = tuple(sorted(opts.items()))
    if any(isinstance(v, torch.Tensor) for _, v in items):  # (e.g. a tensor norm_length)
        return LossSpec.build(acc, **opts)
    try:
        hash(items)
    except TypeError:
        return LossSpec.build(acc, **opts)
    return _cached_spec(acc, items)


def _checked_policy_loss(old_log_prob, log_prob, advantages, response_mask,
                         rollout_is_weights, verl_mode, kw, agg, extra, dp_size):
    """compute_policy_loss through the library's checks (prepare_loss: the masked positions
    of every input zeroed, NaN-safe aggregation)."""
    tokens = torch.zeros(log_prob.shape, dtype=torch.long, device=log_prob.device)
    # (vocab None: the token ids are placeholders, there is no range to check)
    spec, s = prepare_loss(log_prob, None, tokens, False, dict(
        response_mask=response_mask, old_logprobs=old_log_prob, advantages=advantages,
        loss_agg_mode=agg, rollout_is_weights=rollout_is_weights, backend="torch", **kw,
        **extra), )
    lp = log_prob.to(s.acc)
    pt = _torch_impl.pg_terms(lp, s.old, s.adv, s.mask, spec)  # once: loss and metrics
    weights = s.weights if dp_size == 1 else s.weights * dp_size
    # token_losses without a KL or an off-policy mask is is_w * pg plus its NaN guard (a
    # NaN loss on a valid token must reach the gradient), which adds exactly 0 where no
    # valid token's loss is NaN: aggregate first, and take token_losses' own path only
    # when the aggregated loss is NaN (read with the metrics: no extra host read)
    pol = pt["pg"] if s.isw is None else pt["pg"] * s.isw
    pg_loss = _torch_impl.aggregate(pol, None, s.mask, weights, None, spec)
    metrics, nan = _pg_metrics(lp.detach(), spec, s.old, s.adv, s.mask, verl_mode, pt,
                               pg_loss)
    if nan:
        pol, _ = _torch_impl.token_losses(lp, None, s, spec, terms=pt)
        pg_loss = _torch_impl.aggregate(pol, None, s.mask, weights, None, spec)
    return pg_loss, metrics


@torch.no_grad()
def _pg_metrics(lp, spec, old_in, adv, m, verl_mode, pt, loss, mf=None):
    """(verl's three policy-loss metrics (core_algos.py, compute_policy_loss_<mode>) from
    ppo_kernels' per-token terms pt (pg_terms of the loss), whether loss or the log-ratio
    sum is NaN), read to the host at once. m: the bool mask; mf: its float copy, given
    where the masked positions were not zeroed (the fast path: a masked NaN then shows as
    a NaN sum, and the caller redoes the call NaN-safely), None: the sum is masked by a
    where."""
    if verl_mode == "gspo":
        old = lp if old_in is None else old_in
        neg_kl = old - lp  # verl's GSPO metric does not clamp
        # the sequence ratio exp(clamp(mean log-ratio, +-20)): above e^10 where verl clamps
        big = (pt["seq_ratio"] > math.exp(GSPO_LOG_RATIO_MAX)).any()
    else:
        neg_kl, big = -pt["log_ratio"], None
    if mf is None:
        parts = [m.sum(), torch.where(m, neg_kl, 0.0).sum()]
    else:
        parts = [mf.sum(), (neg_kl * mf).sum()]
    parts.append(torch.isnan(loss.detach()) | torch.isnan(parts[1]))
    dppo = verl_mode in ("dppo_tv", "dppo_kl")
    if verl_mode in ("vanilla", "gspo"):
        parts.append(((pt["clip_high"] | pt["clip_low"]) & m).sum())
    elif verl_mode == "cispo":
        parts.append((pt["cispo_clip"] & m).sum())
    elif dppo:
        # verl: the masked fraction (every advantage, zeros included) and the fraction of
        # kept tokens whose ratio the cap truncated
        parts.append((pt["dppo_masked"] & m).sum())  # (pg_terms' mask)
    if verl_mode == "vanilla" or dppo:
        parts.append((pt["dual"] & m).sum())
    if big is not None:
        parts.append(big)
    vals = torch.stack([p.to(lp.dtype) for p in parts]).tolist()  # one host read
    n = max(vals[0], 1.0)
    if verl_mode == "gspo" and vals[-1]:
        warnings.warn(f"ppo_kernels gspo: a sequence's mean log-ratio exceeds "
                      f"{GSPO_LOG_RATIO_MAX:g}; verl clamps it there (value e^10, no "
                      f"gradient), ppo_kernels only at 20", RuntimeWarning, stacklevel=3)
    clipfrac = vals[3] / n if verl_mode in ("vanilla", "gspo", "cispo") or dppo else 0.0
    lower = vals[4] / n if verl_mode == "vanilla" or dppo else 0.0
    return {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": vals[1] / n,
            "actor/pg_clipfrac_lower": lower}, bool(vals[2])


def _registered(name, verl_mode):
    def policy_loss(old_log_prob, log_prob, advantages, response_mask,
                    loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
        return compute_policy_loss(old_log_prob, log_prob, advantages, response_mask,
                                   loss_agg_mode, config, rollout_is_weights,
                                   loss_mode=verl_mode)
    policy_loss.__name__ = policy_loss.__qualname__ = f"policy_loss_{name}"
    policy_loss.__doc__ = (f"verl policy loss {name!r}: verl's {verl_mode!r} loss mode "
                           f"computed by ppo_kernels (see compute_policy_loss).")
    return policy_loss


def register_policy_losses():
    """Registers REGISTERED_LOSS_MODES in verl's POLICY_LOSS_REGISTRY (idempotent; done on
    import). Returns the names."""
    for name, verl_mode in REGISTERED_LOSS_MODES.items():
        _core_algos.register_policy_loss(name)(_registered(name, verl_mode))
    return tuple(REGISTERED_LOSS_MODES)


# ------------------------------------------------------------------ the fused hook

def fused_logprobs_and_entropy(hidden_states, vocab_weights, input_ids, temperature=1.0, *,
                               chunk_size=None, backend="auto", replay=None):
    """verl's fused log-prob / entropy contract (``FusedLinearForPPO.forward``) computed by
    ``pk.token_logprobs_from_hidden``: ``z = hidden_states @ vocab_weights^T / temperature``,
    ``log_probs = log_softmax(z)[input_ids]``, ``entropy = logsumexp(z) - sum softmax(z) z``,
    in chunks of ``chunk_size`` rows (None: about 256 MiB of logits, more for a large
    head: docs/FROM_HIDDEN.md), never storing the
    [N, V] logits; differentiable in hidden_states and vocab_weights.

    Args:
        hidden_states: [B, T, H] or [N, H], float32 / bfloat16 / float16 / float64.
        vocab_weights: the LM head weight [V, H], hidden's dtype and device.
        input_ids: [B, T] or [N] integer token ids in [0, V) (verl's rolled labels).
        temperature: float > 0.
        replay: the kept-set keywords (top_k / top_p / min_p), None: the hook's
            configuration (sampling_replay_kwargs(); {} = off). With a kept set the
            log-probs are ``z_y - logsumexp_{j in K} z_j`` over the kept set K of vLLM v1's
            sampler after the temperature (docs/SAMPLING.md); the entropy stays over the
            full vocabulary.

    Returns:
        (log_probs, entropy) of input_ids' shape: log_probs float32 and entropy in hidden's
        dtype, as verl's FusedLinearForPPO returns them (nats).

    Raises:
        TypeError / ValueError from the library's checks (dtype or device mismatch, shapes,
        out-of-range ids, temperature <= 0).
    """
    replay = sampling_replay_kwargs() if replay is None else replay
    logp, ent = token_logprobs_from_hidden(hidden_states, vocab_weights, input_ids.long(),
                                           temperature=float(temperature),
                                           return_entropy=True, chunk_size=chunk_size,
                                           backend=backend, **replay)
    return logp.to(torch.float32), ent.to(hidden_states.dtype)



class FusedLinearForPPO(torch.nn.Module):
    """Drop-in for verl's ``verl.utils.experimental.torch_functional.FusedLinearForPPO``
    (same constructor and forward), running ``fused_logprobs_and_entropy``.

    Args:
        chunk_size: rows per chunk (None: about 256 MiB of logits per chunk, more for a
            large head; verl's own default is 512 rows).
        impl_backend: verl's option, "torch" or "liger" (both run ppo_kernels here).
        backend: ppo_kernels' backend ("auto" picks the compiled kernel of the device).
    """

    def __init__(self, chunk_size=None, impl_backend="torch", backend="auto"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose "
                             f"'torch' or 'liger'.")
        if chunk_size is None:  # verl constructs it without one: the configured value
            chunk_size = fused_hook_chunk_size()
        self.chunk_size, self.impl_backend, self.backend = chunk_size, impl_backend, backend

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        return fused_logprobs_and_entropy(hidden_states, vocab_weights, input_ids, temperature,
                                          chunk_size=self.chunk_size, backend=self.backend)


_ORIGINALS = {}
_TP_WARNED = []
_HOOK_OPTIONS = {}  # chunk_size: set by configure_fused_hook or verl's model config
CHUNK_SIZE_ENV = "PPO_KERNELS_VERL_CHUNK_SIZE"


def _chunk(value, key):
    if value is None:
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a positive int (rows per chunk) or null, got "
                         f"{value!r}") from None
    if isinstance(value, bool) or n < 1 or n != float(value):
        raise ValueError(f"{key}: expected a positive int (rows per chunk) or null, got "
                         f"{value!r}")
    return n


def configure_fused_hook(chunk_size=None):
    """Rows per chunk of the fused hook (FusedLinearForPPO and linear_cross_entropy, which
    verl constructs / calls without one): an int >= 1, or None for the default (about
    256 MiB of logits per chunk, more for a large head). verl's config sets it with
    ``actor_rollout_ref.model.fused_kernel_options.chunk_size=N`` (read when verl builds
    its model config, in every process), the environment with
    ``PPO_KERNELS_VERL_CHUNK_SIZE=N``; a call here overrides both. ValueError naming the
    key for anything else."""
    _HOOK_OPTIONS["chunk_size"] = _chunk(chunk_size, "chunk_size")


def fused_hook_chunk_size():
    """The chunk_size the fused hook uses now (None: the op's default)."""
    if "chunk_size" in _HOOK_OPTIONS:
        return _HOOK_OPTIONS["chunk_size"]
    return _chunk(os.environ.get(CHUNK_SIZE_ENV) or None, CHUNK_SIZE_ENV)


def configure_sampling_replay(rollout=None, *, top_k=None, top_p=None, min_p=None):
    """Switch sampling replay of the fused hook on or off (this process).

    Args:
        rollout: verl's ``actor_rollout_ref.rollout`` section (RolloutConfig / DictConfig /
            dict): its top_k / top_p (/ min_p) in verl's convention (top_k -1 or 0 off,
            top_p 1 off). Or None with the numbers as keywords (the same convention);
            everything None / off: replay off (the hook's plain log-probs, bit for bit).

    Returns the kept-set keywords now in force (sampling_replay_kwargs()). Raises
    ValueError naming the key for a bad value (replay_kwargs_from_verl), leaving the
    previous setting."""
    if rollout is not None and (top_k, top_p, min_p) != (None, None, None):
        raise ValueError("configure_sampling_replay: pass the rollout config or top_k / "
                         "top_p / min_p, not both")
    if rollout is None:
        rollout = {"top_k": top_k, "top_p": top_p, "min_p": min_p}
        kw = replay_kwargs_from_verl(rollout, key="configure_sampling_replay")
    else:
        kw = replay_kwargs_from_verl(rollout)
    _HOOK_OPTIONS["replay"] = kw
    return dict(kw)


def sampling_replay_kwargs():
    """The kept-set keywords (top_k / top_p / min_p) the fused hook passes to
    pk.token_logprobs_from_hidden now: {} when replay is off (the default)."""
    return dict(_HOOK_OPTIONS.get("replay", {}))


_REPLAY_KEYS = ("top_k", "top_p", "min_p")
_FKO = "actor_rollout_ref.model.fused_kernel_options"


def _read_model_config(cfg):
    """fused_kernel_options.chunk_size and .sampling_replay (with .top_k / .top_p /
    .min_p) of a verl HFModelConfig, when it has them."""
    opts = getattr(cfg, "fused_kernel_options", None)
    if opts is not None and cfg_get(opts, "chunk_size", None) is not None:
        configure_fused_hook(_chunk(cfg_get(opts, "chunk_size"), f"{_FKO}.chunk_size"))
    replay = None if opts is None else cfg_get(opts, "sampling_replay", None)
    if replay is None:
        return
    if not isinstance(replay, bool):
        raise ValueError(f"{_FKO}.sampling_replay: expected true or false, got {replay!r}")
    if not replay:
        _HOOK_OPTIONS["replay"] = {}
        return
    given = {k: cfg_get(opts, k, None) for k in _REPLAY_KEYS}
    if all(v is None for v in given.values()):
        raise ValueError(
            f"{_FKO}.sampling_replay=true needs the rollout's sampling parameters next to it "
            f"(the model config does not see the rollout's): "
            f"+{_FKO}.top_k=${{actor_rollout_ref.rollout.top_k}} and "
            f"+{_FKO}.top_p=${{actor_rollout_ref.rollout.top_p}}")
    _HOOK_OPTIONS["replay"] = replay_kwargs_from_verl(given, key=_FKO)


def _follow_model_configs():
    """verl imports this module (model.external_lib) from HFModelConfig.__post_init__: read
    the chunk size of that config (the caller's frame) and of every later one."""
    try:
        from verl.workers.config import model as _model_cfg
    except ImportError:  # pragma: no cover - verl without its worker configs
        return
    cls = _model_cfg.HFModelConfig
    if not getattr(cls.__post_init__, "_ppo_kernels", False):
        original = cls.__post_init__

        def __post_init__(self):
            original(self)
            _read_model_config(self)
        __post_init__._ppo_kernels = True
        cls.__post_init__ = __post_init__
    import sys
    frame = sys._getframe()
    while frame is not None:  # the config whose __post_init__ is importing us
        me = frame.f_locals.get("self")
        if frame.f_code.co_name == "__post_init__" and isinstance(me, cls):
            _read_model_config(me)
            break
        frame = frame.f_back


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none",
                         dist_process_group=None):
    """Drop-in for verl's ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``
    (the ``impl_backend=triton`` path): flat float32 (log_probs [N], entropy [N]) of
    hidden [..., H] @ weight [V, H]^T / temperature for labels [...], by
    ``pk.token_logprobs_from_hidden``. Only reduction="none" (the one verl's model forwards
    use; others raise ValueError). A vocabulary split over a process group of more than one
    rank (Megatron's tensor parallelism) is handed to verl's own kernel, with a warning."""
    if dist_process_group is not None and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size(dist_process_group) > 1:
        if not _TP_WARNED:
            _TP_WARNED.append(True)
            warnings.warn("ppo_kernels' verl hook: a vocabulary-parallel linear_cross_entropy "
                          "runs verl's own kernel", RuntimeWarning, stacklevel=2)
        original = _ORIGINALS.get("linear_cross_entropy")
        if original is None:
            raise NotImplementedError("linear_cross_entropy over a vocabulary split across "
                                      "ranks (dist_process_group) is not supported")
        return original(hidden, weight, labels, temperature, reduction, dist_process_group)
    if not isinstance(reduction, str) or reduction.lower() != "none":
        raise ValueError(f"reduction: ppo_kernels' linear_cross_entropy supports 'none' only, "
                         f"got {reduction!r}")
    replay = sampling_replay_kwargs()
    logp, ent = token_logprobs_from_hidden(hidden.reshape(-1, hidden.shape[-1]), weight,
                                           labels.reshape(-1).long(),
                                           temperature=float(temperature),
                                           return_entropy=True,
                                           chunk_size=fused_hook_chunk_size(), **replay)
    return logp.to(torch.float32), ent.to(torch.float32)


def _hook_modules():
    import verl.utils.experimental.torch_functional as tf
    import verl.utils.kernel.linear_cross_entropy as lce
    return tf, lce


def install_fused_hook():
    """Replaces verl's FusedLinearForPPO (use_fused_kernels, impl_backend=torch / liger) and
    linear_cross_entropy (impl_backend=triton) by this module's (idempotent; done on import
    unless PPO_KERNELS_VERL_FUSED_HOOK=0). Models whose forward verl already patched pick it
    up at their next call: verl imports both names inside the forward."""
    tf, lce = _hook_modules()
    if not fused_hook_installed():
        _ORIGINALS["FusedLinearForPPO"] = tf.FusedLinearForPPO
        _ORIGINALS["linear_cross_entropy"] = lce.linear_cross_entropy
    tf.FusedLinearForPPO = FusedLinearForPPO
    lce.linear_cross_entropy = linear_cross_entropy


def uninstall_fused_hook():
    """Puts verl's own FusedLinearForPPO and linear_cross_entropy back."""
    tf, lce = _hook_modules()
    if fused_hook_installed():
        tf.FusedLinearForPPO = _ORIGINALS["FusedLinearForPPO"]
        lce.linear_cross_entropy = _ORIGINALS["linear_cross_entropy"]


def fused_hook_installed():
    """Whether verl's fused-kernel names currently point at this module's."""
    tf, lce = _hook_modules()
    return tf.FusedLinearForPPO is FusedLinearForPPO and \
        lce.linear_cross_entropy is linear_cross_entropy


def _guard_monkey_patch():
    """verl 0.9.1's ``apply_monkey_patch`` (the path that installs the fused forward, and
    with it the fused hook) patches ``state_dict`` of TRL's value-head model whenever TRL
    is installed, importing ``trl.experimental.ppo`` or ``trl`` 's
    AutoModelForCausalLMWithValueHead; TRL 1.16 has neither, so the call raises
    ImportError. Where the class does not exist there is nothing to patch: verl is told
    TRL is absent for that step only (its is_trl_available name in the monkey_patch
    module), the rest of apply_monkey_patch runs as written."""
    try:
        import verl.models.transformers.monkey_patch as mp
    except Exception:  # pragma: no cover - verl without its transformers patches
        return
    if getattr(mp.is_trl_available, "_ppo_kernels", False):
        return
    import importlib.util
    with warnings.catch_warnings():  # (trl.experimental warns on import)
        warnings.simplefilter("ignore")
        try:
            if importlib.util.find_spec("trl") is None:
                return  # verl's is_trl_available is False already
            from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401
            return
        except ImportError:
            pass
        try:
            from trl import AutoModelForCausalLMWithValueHead  # noqa: F401,F811
            return
        except ImportError:
            pass

    def is_trl_available():
        return False
    is_trl_available._ppo_kernels = True
    mp.is_trl_available = is_trl_available


register_policy_losses()
if os.environ.get("PPO_KERNELS_VERL_FUSED_HOOK", "1") != "0":
    install_fused_hook()
_follow_model_configs()
_guard_monkey_patch()
