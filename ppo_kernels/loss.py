"""Public loss ops: token_logprobs, ppo_loss, value_loss (argument checks, dispatch)."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from . import _checks as ck
from . import _torch_impl, _two_phase, packed
from . import sampling as _sampling
from . import context_parallel as _cp
from . import rollout_correction as _rc
from . import vocab_parallel as _vp
from . import _backends
from ._backends import get_backend
from ._extension import eager_call
from ._two_phase import per_token_loss, replay_loss
from .loss_metrics import LossMetrics
from .rows import logits_logprobs
from .rank_agreement import agreed_sizes, checks_together, groups
from .spec import KERNEL_POLICY_LOSSES, LOSS_AGG_MODES, LossSpec


def token_logprobs(logits, tokens, response_mask=None, *, temperature=1.0,
                   return_entropy=False, tp_group=None, vocab_start=None, backend="auto",
                   sampling_mask=None, top_k=None, top_p=None, min_p=None, return_full=False,
                   entropy_over="full"):
    """Log-probabilities of the sampled tokens (and the policy entropy), from logits.

    logp_t = z[t, tokens_t] - logsumexp_v z[t, v] with z = logits / temperature;
    H_t = logsumexp_v z - sum_v p_v z_v. Differentiable with respect to ``logits``.

    Args:
        logits: [B, T, V], [B, T + 1, V] (raw model output; the last position is ignored and
            gets a zero gradient) or [N, V]; float32, bfloat16, float16 or float64. Any
            batch/time strides (no copy); a non-unit vocabulary stride is copied.
        tokens: int [B, T] (or [N]), sampled token ids.
        response_mask: [B, T] bool/int/float, nonzero = valid; None = all valid. Masked
            positions are never read and come back 0.
        temperature: > 0, the sampling temperature the logits are divided by: a number, or a
            tensor of them, 0-d, per sequence [B] (or [B, 1]) or per token [B, T] ([N] with
            flat tokens): each row is divided by its own value (prime-rl's temperature schedules,
            per-turn temperatures). The tensor gets no gradient; values on masked positions
            are not read; the logits' gradient is divided by the row's temperature.
        return_entropy: also return the entropy H [B, T] (nats).
        tp_group: a torch.distributed process group over which the vocabulary is split:
            ``logits`` is then this rank's contiguous shard [.., V_r] (token ids stay
            global); the results are those of the whole vocabulary, the same on every
            rank, and the gradient is this shard's (docs/DISTRIBUTED.md). A DTensor
            sharded on the vocabulary (Shard(-1)) takes this path without tp_group.
        vocab_start: the first vocabulary id of this rank's shard (default rank * V_r, an
            even split; pass it for uneven splits).
        backend: "auto" | "cpu" | "cuda" | "triton" | "torch" (a split vocabulary: the
            kernel backends only).
        sampling_mask: sampling replay (docs/SAMPLING.md): a pk.SamplingMask(token_ids,
            offsets), the inference engine's kept set of every position (CSR over the B * T
            positions in row-major order, global ids; vLLM's --return-sampling-mask). The
            log-probs are then renormalised over the kept set (vLLM's processed_logprobs);
            the sampled token is always kept (added where the set lacks it).
        top_k, top_p, min_p: the kept sets re-derived from the sampling parameters with
            vLLM v1's sampler rules, applied to logits / temperature (a number, or one value
            per sequence [B]; top_k >= 1, top_p in (0, 1], min_p in [0, 1)); not with
            sampling_mask.
        return_full: with a kept set, also return the full-vocabulary log-probs.
        entropy_over: "full" | "kept": the distribution whose entropy return_entropy gives.

    Returns:
        logprobs [B, T] (nats), or (logprobs, entropy); float32 (float64 for float64 logits).
        With a kept set, logprobs are logp_kept = z_y - logsumexp over the kept set, and
        return_full=True gives (logp_kept, logp_full) or (logp_kept, logp_full, entropy).

    Raises:
        TypeError / ValueError naming the argument for wrong types, shapes, devices,
        out-of-range token ids on valid positions, a non-positive or non-finite temperature
        (a number, or a tensor's value on a valid position; on a device that is an
        asynchronous device assertion, a RuntimeError naming `temperature`), a temperature
        tensor of the wrong shape, or an unknown or unavailable backend.
    """
    def checks():  # no collective: the ranks of tp_group decide validity together
        local, shard = _vp.shard_of(logits, tp_group, vocab_start, -1, "logits")
        logits3, tokens2, flat = ck.logits_and_tokens(local, tokens)
        mask = ck.response_mask(response_mask, tokens2, flat)
        t = ck.temperature(temperature, logits3, tokens2, flat, mask)
        ck.flag("return_entropy", return_entropy)
        be = get_backend(backend, logits3.device)
        _vp.require_kernels(be, shard)
        rp = _sampling.check_replay(sampling_mask, top_k, top_p, min_p, tokens2,
                                    None if shard is not None else logits3.shape[2],
                                    device=_backends.device_eager(be, tokens2))
        _sampling.check_outputs(rp, return_full, entropy_over)
        return logits3, shard, tokens2, flat, mask, t, be, rp

    logits3, shard, tokens2, flat, mask, temperature, be, rp = checks_together(
        groups(tp_group=tp_group), checks, lambda r: {"tp_group": tuple(r[2].shape)})
    if rp is not None:
        if shard is None:
            tokens2 = ck.token_range(tokens2, mask, logits3.shape[2])
        lp_k, ent_k, logp, ent, _, _, _ = logits_logprobs(be, logits3, tokens2, mask,
                                                          temperature, rp, shard)
        return _sampling.outputs(lp_k, ent_k, logp, ent, return_full, return_entropy,
                                 entropy_over, (lambda v: v[0]) if flat else None)
    if shard is not None:
        logp, ent = logits_logprobs(be, logits3, tokens2, mask, temperature, None, shard)
        ent = ent if return_entropy else None
    else:
        tokens2 = ck.token_range(tokens2, mask, logits3.shape[2])
        logp, ent = be.token_logprobs(logits3, tokens2, mask, temperature, return_entropy)
    if flat:
        logp = logp[0]
        ent = ent[0] if ent is not None else None
    return (logp, ent) if return_entropy else logp


def ppo_loss(logits, tokens, old_logprobs, advantages, response_mask=None, ref_logprobs=None,
             *, policy_loss="vanilla", clip_eps_low=0.2, clip_eps_high=None, dual_clip_c=None,
             sapo_tau_pos=1.0, sapo_tau_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
             vespo_k_neg=3.0, vespo_lambda_neg=2.0, kl_coef=0.0, kl_estimator="k3",
             kl_bias_correction=False, entropy_coef=0.0, entropy_agg_mode=None,
             temperature=1.0, loss_agg_mode="token-mean", global_num_tokens=None,
             global_num_seqs=None, norm_length=None, rollout_is_weights=None,
             rollout_logprobs=None, rollout_correction=None, rollout_is_threshold=2.0,
             off_policy_mask_threshold=None, grad_scale=1.0, inplace_backward=False,
             cu_seqlens=None, max_seqlen=None, tp_group=None, vocab_start=None,
             cp_group=None, return_per_token=False, backend="auto", sampling_mask=None,
             top_k=None, top_p=None, min_p=None, kl_logprobs="full", entropy_over="full"):
    """Fused PPO / GRPO policy loss straight from the logits, and its metrics.

    Per token (DESIGN.md): rho = exp(clamp(logp - old_logp, -20, 20)); the policy term of
    ``policy_loss`` (vanilla: pg = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A),
    Schulman et al. 2017, eq. 7, capped at -c A where A < 0 with dual clip c, Ye et al.
    2020, eq. 5; cispo, sapo, gspo, gspo-token: docs/LOSSES.md), times rollout_is_weights;
    loss = pg + kl_coef * kl(logp, ref_logp) [* rho] - entropy_coef * H with the
    k1/k2/k3/abs estimator (Schulman 2020) or verl's straight-through k1+/k3+; aggregated
    by ``loss_agg_mode`` (the entropy term by ``entropy_agg_mode``). On the kernel backends
    the gradient with respect to the logits is written in the same pass over the logits
    (the sequence-level losses read them once more); backward only scales it. No [N, V]
    intermediate is materialised.

    Args:
        logits: [B, T, V], [B, T + 1, V] or [N, V]; float32, bfloat16, float16 or float64.
        tokens: int [B, T] (or [N]), the sampled tokens.
        old_logprobs: float [B, T] from the rollout policy, or None: on-policy, rho =
            exp(logp - sg(logp)) (value 1, gradient that of logp), no extra pass.
        advantages: float [B, T], or per sequence [B] / [B, 1] (broadcast over tokens).
            These, and the other per-token inputs, are data: they receive no gradient.
        response_mask: [B, T], nonzero = valid token; None = all valid.
        ref_logprobs: float [B, T] of the frozen reference policy; needed when kl_coef > 0.
        policy_loss: "vanilla" | "cispo" | "sapo" | "dppo-tv" | "dppo-kl" | "gspo" |
            "gspo-token" | "vespo" (docs/LOSSES.md).
        clip_eps_low, clip_eps_high: in [0, 1); clip_eps_high=None means clip_eps_low. For
            cispo the band [1 - eps_low, 1 + eps_high] bounds a weight: eps_low in [0, 1],
            eps_high >= 0 (TRL's cap epsilon_high = 1 + clip_eps_high, clip_eps_low = 1).
            For dppo-tv / dppo-kl the trust-region thresholds (>= 0) of the binary total
            variation |p - p_old| / the binary KL: eps_high where A > 0 and the token's
            probability rose, eps_low where A <= 0 and it fell (verl's clip_ratio_low /
            clip_ratio_high, TRL's epsilon / epsilon_high).
        dual_clip_c: > 1 + clip_eps_high (the cap -c A on A < 0; TRL/Liger call it delta),
            or None. Only for vanilla, gspo, gspo-token and, as the cap c > 0 of the detached
            ratio min(rho, c) (verl's / TRL's clip_ratio_c), dppo-tv / dppo-kl.
        sapo_tau_pos, sapo_tau_neg: > 0, SAPO's gate temperatures for A > 0 and A <= 0.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma weight
            phi(w) = exp(lambda + k log w - lambda w) of the sequence ratio w, (k, lambda)
            for A >= 0 and A < 0 (k >= 0, lambda > 0; TRL's names and defaults).
        kl_coef: >= 0 (beta). kl_estimator: "k1" | "k2" | "k3" | "abs" | "k1+" | "k3+".
        kl_bias_correction: the KL term times the policy loss's ratio (DeepSeek-V3.2; TRL's
            use_bias_correction_kl), differentiated through the ratio as TRL does.
        entropy_coef: entropy bonus weight. entropy_agg_mode: the entropy term's
            aggregation (default: loss_agg_mode; TRL: "token-mean").
        temperature: > 0, a number or a tensor per sequence [B] / [B, 1] or per token
            [B, T] (as in token_logprobs; with cu_seqlens per packed sequence [S] / [S, 1]
            or per token in the packed layout [total] / [1, total]).
        loss_agg_mode: "token-mean" | "token-sum" | "seq-mean-token-sum" |
            "seq-mean-token-mean" | "seq-mean-token-sum-norm" | "none" (per-token loss
            [B, T], 0 where masked).
        global_num_tokens: > 0 (a number or a 0-d tensor, e.g. all-reduced), the token-mean
            denominator across data-parallel ranks / micro-batches.
        global_num_seqs: > 0 (number or 0-d tensor), the denominator of the seq-mean modes
            (default: B, or the non-empty sequences for seq-mean-token-mean; TRL's grpo
            counts empty completions: global_num_seqs = B).
        norm_length: > 0, the seq-mean-token-sum-norm length (default T; with cu_seqlens
            the longest sequence; Dr. GRPO).
        rollout_is_weights: float [B, T] or [B] / [B, 1], no gradient; multiplies pg and its
            gradient (not the KL or entropy terms).
        rollout_logprobs: float [B, T], the inference engine's log-probs of the sampled
            tokens (vLLM / SGLang), for rollout_correction and the mismatch metrics.
        rollout_correction: None | "tis" | "tis-seq" | "mis" | "mis-seq" | "geo-seq":
            importance weights / masks from pi_old / pi_rollout (ppo_kernels.
            rollout_correction; verl's rollout_corr, TRL's vLLM IS), multiplied into
            rollout_is_weights.
        rollout_is_threshold: C (an upper bound; geo-seq: the bounds (1 / C, C)) or
            (lo, hi). Default 2.0 (verl; TRL's default is 3.0).
        off_policy_mask_threshold: drop the policy term of sequences with A < 0 whose mean
            of (rollout_logp - sg(logp)) exceeds it (DeepSeek-V3.2; TRL's
            off_policy_mask_threshold; old_logprobs stand in without rollout_logprobs).
            Runs the two-phase path (it reads the current logp).
        grad_scale: > 0, the factor the loss will be multiplied by before backward (e.g.
            1 / gradient-accumulation steps, or a loss scale). A hint only: the loss and its
            gradients are the same for any value, but the kernel backends write dlogits
            pre-scaled by it, so ``(loss * grad_scale).backward()`` costs no pass over the
            logits, while any other grad_output rescales dlogits once, in place (no [N, V]
            allocation either way, unless the backward keeps the graph: then it returns a
            fresh gradient). float16 logits are pre-scaled by at most 1 (a loss
            scale would overflow their range; the backward applies the rest).
        inplace_backward: write the gradient into the logits' storage (the logits must not
            be used afterwards; their entries must not share memory); saves one [N, V]
            buffer. Kernel backends, scalar modes and the token-level policy losses
            (vanilla, cispo, sapo, dppo-tv, dppo-kl) only: "torch" and "none" allocate as
            usual; the two-phase path (gspo, gspo-token, vespo, off_policy_mask_threshold,
            a kept set, a split vocabulary; packed sequences with those) allocates as usual
            and warns (UserWarning naming inplace_backward) when the logits require grad.
        cu_seqlens: int [S + 1], packed sequences (verl's / OpenRLHF's remove-padding
            layout): logits [1, total, V] or [total, V], tokens and the per-token inputs
            [1, total] or [total] (advantages and rollout_is_weights may be per sequence,
            [S, 1], or [S] unless S == total, where a 1-D tensor is per token); the
            sequence-level losses, the seq-mean modes, the sequence rollout corrections and
            the per-sequence metrics then treat each packed sequence as a row of [B, T]
            (docs/DISTRIBUTED.md). max_seqlen: the longest sequence, if known
            (saves a host read on devices).
        tp_group, vocab_start: a vocabulary split over ranks, as in token_logprobs: every
            policy loss runs the two-phase path with the row statistics merged between the
            passes (one all-gather); the loss and metrics are the whole vocabulary's, the
            same on every rank, and the gradient is this shard's (docs/DISTRIBUTED.md).
        cp_group: context parallel: each rank of the group holds a contiguous piece of
            every sequence ([B, T_r], the same B sequences). The sequence reductions (GSPO's
            ratio, the seq-mean lengths and counts, the token-mean count, the sequence
            rollout corrections, the off-policy mask, num_seqs / seq_clip_frac) are then
            the whole sequences', and the sum of the ranks' losses is the whole batch's
            loss, with each rank's gradient that loss's gradient in its own logits. Token
            metrics stay this rank's (num_tokens weighs them; pk.distributed.reduce_metrics).
        return_per_token: also put the per-token log-probs and entropy the loss used
            (detached, [B, T] like tokens, 0 where masked) in metrics, as
            "per_token_logprobs" and "per_token_entropy" (a trainer's own per-sequence
            metrics need them; no extra pass).
        backend: "auto" | "cpu" | "cuda" | "triton" | "torch".
        sampling_mask, top_k, top_p, min_p: sampling replay, as in token_logprobs
            (docs/SAMPLING.md): the kept set of every token, given (pk.SamplingMask) or
            re-derived (vLLM v1's sampler rules). The policy ratio (every policy loss, GSPO's
            sequence ratio, the off-policy mask) then uses logp_kept, the log-prob over the
            kept set, as old_logprobs / rollout_logprobs from vLLM's processed_logprobs do;
            the loss runs the two-phase path. With cu_seqlens the CSR rows are the packed
            positions and per-sequence parameters are [S].
        kl_logprobs: "full" | "kept": the log-probs of the KL to ref_logprobs (with a kept
            set; default the full vocabulary's).
        entropy_over: "full" | "kept": the distribution of the entropy term and metric
            (with a kept set).

    Returns:
        (loss, metrics): loss a 0-d float32 tensor (float64 for float64 logits) or [B, T]
        for "none"; metrics a dict of 0-d float32 tensors without gradient: num_tokens,
        num_seqs (non-empty), clip_frac, clip_frac_high, clip_frac_low, dual_clip_frac,
        approx_kl, kl_ref, entropy, ratio_mean, ratio_max (means over valid tokens, 0 if
        none; of the token ratio under every loss), plus cispo_clip_frac (cispo),
        seq_clip_frac (gspo, gspo-token), seq_ratio_mean / seq_ratio_max (the sequence
        ratio of gspo, gspo-token, vespo; over non-empty sequences), the rollout_*
        mismatch metrics (with rollout_logprobs) and off_policy_masked_frac (the fraction
        of non-empty sequences the off-policy mask drops); with a kept set kept_mass (the
        mean of exp(lse_kept - lse_full)), kept_size_mean and mask_missing_token_frac (the
        tokens whose given set lacked them).

    Raises:
        TypeError / ValueError naming the argument (see DESIGN.md, "Bad input");
        NotImplementedError for a kernel backend under a torch.func transform; at the
        backward, RuntimeError for create_graph=True on a kernel backend and for logits
        changed in place before the backward of inplace_backward=True (DESIGN.md,
        "Autograd contract").
    """
    # every argument by name, for LossSpec and check_loss (written out: dynamo in torch
    # 2.11 cannot trace locals(); tests/test_tracing.py keeps it complete)
    options = dict(logits=logits, tokens=tokens, old_logprobs=old_logprobs,
                   advantages=advantages, response_mask=response_mask,
                   ref_logprobs=ref_logprobs, policy_loss=policy_loss,
                   clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high,
                   dual_clip_c=dual_clip_c, sapo_tau_pos=sapo_tau_pos,
                   sapo_tau_neg=sapo_tau_neg, vespo_k_pos=vespo_k_pos,
                   vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                   vespo_lambda_neg=vespo_lambda_neg, kl_coef=kl_coef,
                   kl_estimator=kl_estimator,
                   kl_bias_correction=kl_bias_correction,
                   entropy_coef=entropy_coef, entropy_agg_mode=entropy_agg_mode,
                   temperature=temperature, loss_agg_mode=loss_agg_mode,
                   global_num_tokens=global_num_tokens,
                   global_num_seqs=global_num_seqs, norm_length=norm_length,
                   rollout_is_weights=rollout_is_weights,
                   rollout_logprobs=rollout_logprobs,
                   rollout_correction=rollout_correction,
                   rollout_is_threshold=rollout_is_threshold,
                   off_policy_mask_threshold=off_policy_mask_threshold,
                   grad_scale=grad_scale, inplace_backward=inplace_backward,
                   cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, tp_group=tp_group,
                   vocab_start=vocab_start, cp_group=cp_group,
                   return_per_token=return_per_token, backend=backend,
                   sampling_mask=sampling_mask, top_k=top_k, top_p=top_p,
                   min_p=min_p, kl_logprobs=kl_logprobs, entropy_over=entropy_over)

    def checks(options):  # no collective: the ranks of tp_group / cp_group decide together
        local, shard = _vp.shard_of(logits, tp_group, vocab_start, -1, "logits")
        logits3, tokens2, flat = ck.logits_and_tokens(local, tokens)
        spec, x, pending = check_loss(logits3, None if shard else logits3.shape[2], tokens2,
                                      flat, options, single_pass=shard is None)
        if inplace_backward and not ck.rows_disjoint(logits3):
            raise ValueError("logits: inplace_backward=True writes the gradient into the "
                             "logits, which needs entries that do not share memory; got "
                             f"shape {list(local.shape)} with strides {list(local.stride())} "
                             f"(an expanded or overlapping view)")
        _vp.require_kernels(x.be, shard)
        return logits3, shard, spec, x, pending

    logits3, shard, spec, x, pending = checks_together(
        groups(tp_group=tp_group, cp_group=cp_group), checks, lambda r: agreed_sizes(r[3]),
        options)
    x = weigh_loss(spec, x, pending)
    if spec.inplace_backward:
        _warn_inplace_ignored(spec, x, shard, logits3)
    if x.replay is not None:
        loss, logp, ent, aux = _replay_loss_of_logits(spec, x, logits3, shard)
        return loss, loss_metrics(spec, x, logp, ent, aux)
    loss, logp, ent = _loss_of_logits(spec, x, logits3, shard)
    return loss, loss_metrics(spec, x, logp, ent)


def _warn_inplace_ignored(spec, x, shard, logits3):
    """inplace_backward=True on a kernel backend where the loss takes the two-phase path
    (its gradient sweep writes a fresh [N, V] buffer): said once per call site, never
    silently ignored. The fused single pass (the token-level policy losses) honours it."""
    if not (x.be.is_kernel and x.weights is not None and two_phase(spec, x, shard)):
        return
    if not (logits3.requires_grad and torch.is_grad_enabled()):
        return
    if spec.sequence_loss:
        why = f"policy_loss={spec.policy_loss!r} (a sequence-level loss)"
    elif x.behaviour is not None:
        why = "off_policy_mask_threshold"
    elif x.replay is not None:
        why = "a kept set (sampling_mask / top_k / top_p / min_p)"
    else:
        why = "a vocabulary split over tp_group"
    warnings.warn(f"inplace_backward=True is ignored with {why}: that loss runs the two-phase "
                  f"path, whose gradient pass writes a fresh [N, V] buffer. The gradient is "
                  f"written over the logits only by the fused single pass: policy_loss in "
                  f"{KERNEL_POLICY_LOSSES} on a kernel backend, with a loss_agg_mode other "
                  f"than 'none' (pass inplace_backward=False to silence this)",
                  UserWarning, stacklevel=3)


def _replay_loss_of_logits(spec, x, logits3, shard):
    """(loss, logp_kept, H, aux) with a kept set (x.replay): the kernel backends' two-phase
    path (the fused single pass has no kept set), or autograd through the kept-set
    log-probs (the eager composite, and loss_agg_mode="none"). H is the entropy
    spec.entropy_over names; aux: (full logp, kept mass, kept size, missing), [B, T]."""
    if x.weights is not None and x.be.is_kernel:
        loss, logp, ent, *aux = _two_phase.ppo_loss(x.be, logits3, spec, x, shard)
        return loss, logp, ent, tuple(aux)
    kin = x.kin
    out = logits_logprobs(x.be, logits3, kin.tokens, kin.mask, kin.temperature(spec),
                          x.replay, shard)
    lp_k, ent_k, logp, ent, mass, size, missing = (x.padded(v) for v in out)
    loss, ent_sel = replay_loss(spec, x, lp_k, ent_k, logp, ent)
    return loss, lp_k.detach(), ent_sel.detach(), (logp.detach(), mass, size, missing)


def two_phase(spec, x, shard):
    """Whether the loss takes the two-phase path (statistics pass, [B, T] middle, gradient
    pass; _two_phase.py) rather than the fused single pass: the per-token terms need every
    logp of their sequence first (GSPO's ratio, the off-policy mask's mean), or the row
    statistics must be merged over a split vocabulary first, or a kept set needs its own
    statistics (sampling replay). The one place this is decided, for the logits and the
    hidden-state paths alike."""
    return (spec.sequence_loss or x.behaviour is not None or shard is not None
            or x.replay is not None)


def _loss_of_logits(spec, x, logits3, shard):
    """(loss, logp, H) on the path the options need; logp and H in the LossInputs' layout."""
    kin = x.kin
    if x.weights is None:
        # per-token loss: no scalar to pre-scale by, so go through token_logprobs' autograd
        if shard is not None:
            logp, ent = logits_logprobs(x.be, logits3, kin.tokens, kin.mask,
                                        kin.temperature(spec), None, shard)
        else:
            logp, ent = x.be.token_logprobs(logits3, kin.tokens, kin.mask,
                                            kin.temperature(spec), True)
        logp, ent = x.padded(logp), x.padded(ent)
        return per_token_loss(spec, x, logp, ent), logp, ent
    if not x.be.is_kernel:
        if two_phase(spec, x, shard):
            return composite_padded(spec, x, logits3)
    elif two_phase(spec, x, shard):
        loss, logp, ent = _two_phase.ppo_loss(x.be, logits3, spec, x, shard)
        return loss, logp, ent
    loss, _, logp, ent = x.be.ppo_loss(logits3, kin, spec)
    return loss, x.padded(logp), x.padded(ent)


def composite_padded(spec, x, logits3):
    """The eager composite of the two-phase losses: log-probs on the kernels' rows (packed
    with cu_seqlens), the loss on the LossInputs' [B, T] layout (padded; autograd through
    both)."""
    kin = x.kin
    logp, ent = _torch_impl.token_logprobs(logits3, kin.tokens, kin.mask,
                                           kin.temperature(spec), True)
    logp, ent = x.padded(logp), x.padded(ent)
    pol, _ = _torch_impl.token_losses(logp, ent, x, spec, x.behaviour)
    loss = _torch_impl.aggregate(pol, ent, x.mask, x.weights, x.w_ent, spec)
    return loss, logp.detach(), ent.detach()


def _replaced(x, **changes):
    """x._replace(**changes) for a LossInputs; traced, built field by field: torch 2.6's
    dynamo does not trace a NamedTuple's _replace (torch.compile(fullgraph=True) stops with
    "inline in skipfiles: LossInputs._replace": collections/__init__.py is in its
    SKIP_DIRS); later releases inline it."""
    if not torch.compiler.is_compiling():
        return x._replace(**changes)
    return LossInputs(*[changes[f] if f in changes else getattr(x, f)
                        for f in LossInputs._fields])


class KernelInputs(NamedTuple):
    """The per-token tensors of a loss call in the layout the kernels read ([B, T], packed
    again with cu_seqlens), made once per call (weigh_loss: LossInputs.kin) and handed to
    the backends and row sources as one record: the ppo_loss_fwd ops' tensor arguments
    (op_tensors before the options, row_tensors after them), the per-row temperature among
    them (None: spec.temperature)."""

    tokens: Any
    mask: Any
    old: Any
    adv: Any
    weights: Any
    ref: Any
    isw: Any
    w_ent: Any
    temperatures: Any = None

    def op_tensors(self):
        """The eight tensors the ppo_loss_fwd ops take after the logits, in their order (a
        method, not a slice: torch 2.6's dynamo fails on slicing a NamedTuple)."""
        return (self.tokens, self.mask, self.old, self.adv, self.weights, self.ref, self.isw,
                self.w_ent)

    def row_tensors(self):
        """The per-row tensors the ppo_loss_fwd ops take last (after compute_grad; after
        codes in the in-place op), in their order, None where absent: the per-row
        temperature. A new per-row tensor option goes at the end of both, with a None
        default in the schemas (csrc/ops.cpp), so that a call without it is unchanged."""
        return (self.temperatures,)

    def temperature(self, spec):
        """The temperature as the backends take it: the per-row tensor, or
        spec.temperature."""
        return spec.temperature if self.temperatures is None else self.temperatures


class LossInputs(NamedTuple):
    """The checked tensors of a loss call, [B, T] (padded [S, max_seqlen] with cu_seqlens),
    and the backend: prepare_loss's second result beside the LossSpec (a NamedTuple:
    torch.compile traces it)."""

    tokens: Any
    mask: Any
    acc: Any  # the accumulation dtype
    old: Any
    adv: Any
    ref: Any
    isw: Any  # rollout-corrected
    rollout: Any
    rc_w: Any
    behaviour: Any  # the off-policy mask's log-probs (None: no mask)
    weights: Any  # None for loss_agg_mode="none"
    w_ent: Any
    be: Any  # the backend
    flat: bool
    packing: Any  # packed.Packing (cu_seqlens: the tensors above are padded) or None
    # the per-row temperature [B, T] (1 on masked positions), or None: spec.temperature
    temperature: Any = None
    replay: Any = None  # sampling.Replay (the kept sets, in the kernels' layout) or None
    kin: Any = None  # KernelInputs: the tensors above as the kernels read them (weigh_loss)

    def kernel(self, x):
        """x [B, T] in the layout the kernels read (packed again with cu_seqlens)."""
        if x is None or self.packing is None:
            return x
        return self.packing.unpad(x).contiguous()

    def padded(self, x):
        """A kernel output [B, T] in the layout of the fields above."""
        return x if x is None or self.packing is None else self.packing.pad(x)


_TENSOR_OPTIONS = ("old_logprobs", "advantages", "response_mask", "ref_logprobs",
                   "global_num_tokens", "global_num_seqs", "rollout_is_weights",
                   "rollout_logprobs", "cu_seqlens", "max_seqlen", "backend",
                   "sampling_mask", "top_k", "top_p", "min_p")
# (temperature is a LossSpec number, or a tensor that check_loss takes apart like the
# per-token inputs)
# the arguments ppo_loss reads itself (the logits' path, the split vocabulary)
_CALL_ARGUMENTS = ("logits", "tokens", "tp_group", "vocab_start")
_NOT_SPEC_OPTIONS = frozenset(_TENSOR_OPTIONS + _CALL_ARGUMENTS)
_NOT_SPEC_OPTIONS_PER_ROW_T = _NOT_SPEC_OPTIONS | {"temperature"}  # (a tensor temperature)


def check_loss(like, vocab, tokens2, flat, options, single_pass=False):
    """Every check of a loss call's arguments but the logits themselves, shared by ppo_loss
    and ppo_loss_from_hidden, with no collective (so that the ranks of a group can decide
    validity together first, rank_agreement.py): (LossSpec, LossInputs without their
    weights, what weigh_loss needs). options: the call's keywords by name
    (ppo_loss's; an unknown one is a TypeError); like: the logits [B, Tl, V] or the hidden
    states, whose dtype and device the per-token inputs take; vocab: V for the token-range
    check, None where the vocabulary is split over ranks and the merge checks the ids.

    With cu_seqlens the per-token inputs are those of the packed layout (advantages and
    rollout_is_weights may be per sequence, [S]); the LossInputs hold their padded
    [S, max_seqlen] copies (packed.py) and LossInputs.kernel() packs them again.

    single_pass: the caller runs the fused single pass whenever the options allow it
    (ppo_loss on whole-vocabulary logits): then, where they do, the per-token inputs are
    kept as given on masked positions (no kernel and no metric reads them there), and on
    the cpu backend the kernel itself checks the token ids (the same ValueError)."""
    given = options.get  # (the tensor options by name; None where not given)
    acc = ck.acc_dtype(like)
    temperature = options.get("temperature")
    if isinstance(temperature, torch.Tensor):  # per row: LossSpec keeps the default 1
        spec = LossSpec.from_options(acc, options, _NOT_SPEC_OPTIONS_PER_ROW_T)
        if temperature.dim() == 0:  # one value, left on its device
            temperature = temperature.reshape(1, 1).expand(tokens2.shape)
    else:
        temperature = None
        spec = LossSpec.from_options(acc, options, _NOT_SPEC_OPTIONS)
    _cp.check_group(spec.cp_group)
    response_mask, old_logprobs, advantages = (given("response_mask"), given("old_logprobs"),
                                               given("advantages"))
    ref_logprobs, rollout_is_weights = given("ref_logprobs"), given("rollout_is_weights")
    rollout_logprobs = given("rollout_logprobs")
    packing = None
    norm_length = spec.norm_length
    tokens_k = tokens2  # the kernels' layout (packed with cu_seqlens)
    if given("cu_seqlens") is not None:
        if tokens2.shape[0] != 1:
            raise ValueError(f"tokens: with cu_seqlens expected the packed layout [1, total] "
                             f"or [total], got {list(tokens2.shape)}")
        packing = packed.packing(given("cu_seqlens"), tokens2.shape[1], tokens2,
                                 given("max_seqlen"))
        # per sequence: [S, 1], or [S] where S != total (with S == total a 1-D tensor is
        # per token)
        s_ = packing.num_seqs
        advantages, rollout_is_weights, temperature = (
            packing.per_seq(v) if isinstance(v, torch.Tensor) and (
                tuple(v.shape) == (s_, 1) or (tuple(v.shape) == (s_,) and s_ != packing.total))
            else v for v in (advantages, rollout_is_weights, temperature))
        response_mask, padded = packed.padded_inputs(
            packing, response_mask, "tokens", tokens2, old_logprobs=old_logprobs,
            advantages=advantages, ref_logprobs=ref_logprobs,
            rollout_is_weights=rollout_is_weights, rollout_logprobs=rollout_logprobs,
            temperature=temperature)
        temperature = padded["temperature"]
        old_logprobs, advantages, ref_logprobs = (padded["old_logprobs"], padded["advantages"],
                                                  padded["ref_logprobs"])
        rollout_is_weights = padded["rollout_is_weights"]
        rollout_logprobs = padded["rollout_logprobs"]
        tokens2, out_flat, flat = packing.pad(tokens2), flat, False
    else:
        packed.check_max_seqlen(given("max_seqlen"))
    mask = ck.response_mask(response_mask, tokens2, flat)
    old = ck.per_token("old_logprobs", old_logprobs, tokens2, flat, acc, optional=True)
    adv = ck.per_token("advantages", advantages, tokens2, flat, acc, per_seq_ok=True)
    ref = ck.per_token("ref_logprobs", ref_logprobs, tokens2, flat, acc, optional=True)
    isw = ck.per_token("rollout_is_weights", rollout_is_weights, tokens2, flat, acc,
                       optional=True, per_seq_ok=True)
    rollout = ck.per_token("rollout_logprobs", rollout_logprobs, tokens2, flat, acc,
                           optional=True)
    if temperature is not None:
        temperature = ck.temperature(temperature, like, tokens2, flat, mask)
    be = get_backend(given("backend", "auto"), like.device)
    replay = _sampling.check_replay(given("sampling_mask"), given("top_k"), given("top_p"),
                                    given("min_p"), tokens_k, vocab, packing,
                                    device=_backends.device_eager(be, tokens_k))
    # the fused single pass: the kernels and the metrics read valid positions alone
    fused = (single_pass and be.is_kernel and replay is None and not spec.sequence_loss
             and spec.off_policy_mask_threshold is None and spec.loss_agg_mode != "none")
    if not fused:
        # masked positions hold anything (NaN included); the [B, T] formulas that reduce
        # over a sequence (GSPO's ratio, the off-policy mask) would carry 0 * NaN into the
        # valid tokens' gradient, so they are set apart here, before any of them
        old, adv, ref, isw, rollout = (None if v is None else torch.where(mask, v, 0.0)
                                       for v in (old, adv, ref, isw, rollout))
    bounds = None
    if spec.rollout_correction is not None:
        if rollout is None or old is None:
            raise ValueError(f"rollout_correction: {spec.rollout_correction!r} weighs pi_old / "
                             f"pi_rollout and needs both old_logprobs and rollout_logprobs")
        if spec.policy_loss == "vespo":
            raise ValueError("rollout_correction: VESPO folds the train / inference ratio into "
                             "its sequence weight (TRL); not supported here, got "
                             f"{spec.rollout_correction!r} (pass rollout_is_weights to weigh "
                             "the tokens instead)")
        bounds = _rc.bounds(spec.rollout_correction, spec.rollout_is_threshold)
    behaviour = None
    if spec.off_policy_mask_threshold is not None:
        # on-policy (neither old nor rollout log-probs): the KL is 0, nothing is masked
        behaviour = rollout if rollout is not None else old
    if spec.kl_coef > 0 and ref is None:
        raise ValueError(f"ref_logprobs: kl_coef = {spec.kl_coef} > 0 needs ref_logprobs, got "
                         f"None")
    global_num_tokens, global_num_seqs = given("global_num_tokens"), given("global_num_seqs")
    if global_num_tokens is not None:
        global_num_tokens = ck.count("global_num_tokens", global_num_tokens, like, acc)
    if global_num_seqs is not None:
        global_num_seqs = ck.count("global_num_seqs", global_num_seqs, like, acc)
    # the cpu kernels that read the logits first (ppo_loss_fwd, token_logprobs_fwd: with a
    # kept set too, the kept-set op reads the ids after it) check the ids of valid rows
    # themselves, before they compute anything (csrc/cpu/common.h Rows::check_tokens: the
    # ValueError token_range raises); outside a context-parallel group, whose ranks must
    # agree on validity before any collective
    kernel_checks = (single_pass and be.name == "cpu" and packing is None
                     and spec.cp_group is None and ck.host_readable(tokens2))
    # on a CUDA device the weights of a call on the logits come from two Triton launches
    # that check the ids too, an asynchronous assertion ahead of every kernel that reads
    # them (token_range's on a device is one as well; the row kernels never read an id
    # outside [0, V): it gives NaN)
    device_weights = (single_pass and be.is_kernel
                      and spec.loss_agg_mode != "none"
                      and _device_weights(spec, be, tokens2, packing, global_num_tokens,
                                          norm_length, global_num_seqs))
    if vocab is not None and not kernel_checks and not device_weights:
        tokens2 = ck.token_range(tokens2, mask, vocab)
    x = LossInputs(tokens=tokens2, mask=mask, acc=acc, old=old, adv=adv, ref=ref, isw=isw,
                   rollout=rollout, rc_w=None, behaviour=behaviour, weights=None, w_ent=None,
                   be=be, flat=out_flat if packing is not None else flat, packing=packing,
                   temperature=temperature, replay=replay)
    return spec, x, dict(bounds=bounds, global_num_tokens=global_num_tokens,
                         global_num_seqs=global_num_seqs, norm_length=norm_length, fused=fused,
                         device_weights=device_weights,
                         check_vocab=vocab if device_weights else None)


def weigh_loss(spec, x, pending):
    """The second half of prepare_loss, where a context-parallel group's collectives run:
    the rollout-correction weights, the packed default sum-norm length and the aggregation
    weights. pending: check_loss's third result."""
    group = spec.cp_group
    isw, rc_w, weights = x.isw, None, None
    device = pending.get("device_weights", False)
    if device:  # the weights, the id check and the rollout correction in two launches
        weights, rc_w = _device_loss_weights(spec, x, pending)
    elif pending["bounds"] is not None:
        lo, hi = pending["bounds"]
        rc_w = _rc.weights(x.old, x.rollout, x.mask, spec.rollout_correction, lo, hi, group,
                           valid_only=pending.get("fused", False) and _host_metrics(spec, x))
    if rc_w is not None:
        isw = rc_w if isw is None else isw * rc_w
    norm_length = pending["norm_length"]
    if x.packing is not None and norm_length is None and "seq-mean-token-sum-norm" in (
            spec.loss_agg_mode, spec.entropy_agg_mode):
        # seq-mean-token-sum-norm's default length: the longest whole sequence (there is no
        # padding to take the width of; across a context-parallel group the pieces add up,
        # an all-reduce, so only for the mode that reads it)
        lens = _cp.group_sum(x.packing.lens.to(x.acc), group)
        norm_length = lens.max().clamp(min=1.0) if x.packing.num_seqs else 1.0
    w_ent = None
    if spec.loss_agg_mode != "none":
        def weights_of(mode):
            w = _host_weights(x, mode, pending["global_num_tokens"], norm_length,
                              pending["global_num_seqs"], group)
            if w is not None:
                return w
            if device:
                return _device_weights_of(x, mode, pending)[0]
            return _torch_impl.agg_weights(x.mask, mode, pending["global_num_tokens"],
                                           norm_length, dtype=x.acc,
                                           global_num_seqs=pending["global_num_seqs"],
                                           group=group)
        if weights is None:
            weights = weights_of(spec.loss_agg_mode)
        w_ent = None if spec.entropy_agg_mode in (None, spec.loss_agg_mode) else weights_of(
            spec.entropy_agg_mode)
    k = x.kernel
    kin = KernelInputs(k(x.tokens), k(x.mask), k(x.old), k(x.adv), k(weights), k(x.ref),
                       k(isw), k(w_ent), k(x.temperature))
    return _replaced(x, isw=isw, rc_w=rc_w, weights=weights, w_ent=w_ent, kin=kin)


def _host_weights(x, mode, global_num_tokens, norm_length, global_num_seqs, group):
    """_torch_impl.agg_weights's w [B, T] from the one CPU op ppo_kernels::agg_weights (the
    same bits: the counts are exact and each weight is one division in the accumulation
    dtype), on the cpu backend when every denominator is a number (none is a tensor and
    no context-parallel group sums them); else None."""
    if x.be.name != "cpu" or group is not None or not hasattr(torch.ops.ppo_kernels,
                                                                 "agg_weights"):
        return None
    code = _weights_code(x.mask.shape, mode, global_num_tokens, norm_length, global_num_seqs)
    if code is None:
        return None
    return torch.ops.ppo_kernels.agg_weights(x.mask, *code, x.acc == torch.float64)


def _device_loss_weights(spec, x, pending):
    """(weights of loss_agg_mode, rollout-correction weights or None) from the two launches
    of triton_kernels/weights.py (_device_weights), the token ids of valid positions
    checked in the same launches: an asynchronous device assertion naming `tokens`
    (token_range's, without its 8 ops)."""
    vocab = pending["check_vocab"]
    rc = None
    if pending["bounds"] is not None:
        rc = dict(old=x.old, rollout=x.rollout, rc_mode=spec.rollout_correction,
                  lo=pending["bounds"][0], hi=pending["bounds"][1])
    w, ok, rc_w = _device_weights_of(x, spec.loss_agg_mode, pending, vocab, rc)
    if ok is not None:
        torch._assert_async(ok, f"tokens: ids must lie in [0, {vocab}) on valid positions")
    return w, rc_w


def _device_weights_of(x, mode, pending, vocab=None, rc=None):
    """triton_kernels/weights.py loss_weights for loss_agg_mode mode: (w, ok, rc_w)."""
    from .triton_kernels import weights as device_weights
    code = _weights_code(x.mask.shape, mode, pending["global_num_tokens"],
                         pending["norm_length"], pending["global_num_seqs"])
    return device_weights.loss_weights(x.mask, *code, x.acc == torch.float64,
                                       x.tokens if vocab is not None else None, vocab or 0,
                                       **(rc or {}))


def _weights_code(shape, mode, global_num_tokens, norm_length, global_num_seqs):
    """(mode code, denominator) of the agg_weights ops (csrc/ops_host.cpp) for
    loss_agg_mode mode on a [B, T] mask, or None where a denominator is a tensor (the
    eager formulas then divide by it on its device)."""
    if isinstance(global_num_tokens, torch.Tensor) or isinstance(norm_length, torch.Tensor) \
            or isinstance(global_num_seqs, torch.Tensor):
        return None
    b, t = shape
    if mode == "token-mean":
        return 0, 0.0 if global_num_tokens is None else float(global_num_tokens)
    if mode == "token-sum":
        return 1, 0.0
    if mode == "seq-mean-token-sum":
        return 2, float(b if global_num_seqs is None else global_num_seqs)
    if mode == "seq-mean-token-mean":
        return 3, 0.0 if global_num_seqs is None else float(global_num_seqs)
    # seq-mean-token-sum-norm: (n * length) in Python arithmetic, as agg_weights
    n = b if global_num_seqs is None else global_num_seqs
    return 2, float(n * (t if norm_length is None else norm_length))


def _device_weights(spec, be, tokens, packing, global_num_tokens, norm_length,
                    global_num_seqs):
    """Whether the weights and the token-id check come from the two Triton launches of
    triton_kernels/weights.py (the CPU op agg_weights's twin) rather than about 12 small
    eager ops: a kernel backend's pass over whole-vocabulary logits (the fused one or the
    two-phase path's, with or without a kept set) with CUDA tensors, eager mode, no
    context-parallel group or packing, every denominator a number. Unrun on a GPU since it was added
    (tests/test_triton_weights.py runs the kernels under the Triton interpreter)."""
    if not (_backends.device_eager(be, tokens) and spec.cp_group is None and packing is None):
        return False
    return all(_weights_code(tokens.shape, mode, global_num_tokens, norm_length,
                             global_num_seqs) is not None
               for mode in (spec.loss_agg_mode, spec.entropy_agg_mode) if mode is not None)


def prepare_loss(like, vocab, tokens2, flat, options):
    """check_loss and weigh_loss in one: (LossSpec, LossInputs), for a caller on one rank."""
    spec, x, pending = check_loss(like, vocab, tokens2, flat, options)
    return spec, weigh_loss(spec, x, pending)


# The slots of the CPU op ppo_kernels::ppo_loss_metrics's [K] vector (csrc/ops_host.cpp,
# csrc/cpu/metrics.cpp enum Metric: the same order)
METRIC_SLOTS = ("num_tokens", "num_seqs", "clip_frac", "clip_frac_high", "clip_frac_low",
                "dual_clip_frac", "approx_kl", "kl_ref", "entropy", "ratio_mean", "ratio_max",
                "cispo_clip_frac", "seq_clip_frac", "seq_ratio_mean", "seq_ratio_max",
                "rollout_ratio_mean", "rollout_ratio_max", "rollout_ratio_min",
                "rollout_ratio_outside_frac", "rollout_kl_k3", "rollout_chi2",
                "rollout_is_mean", "rollout_is_max", "rollout_masked_frac")
_METRIC_INDEX = {name: i for i, name in enumerate(METRIC_SLOTS)}


def _metric_names(spec, rollout):
    """(names, slots): the metrics a call reports, in the order of _torch_impl.metrics and
    rollout_correction.metrics, and their METRIC_SLOTS indices (cached by the few option
    values they depend on)."""
    key = (spec.policy_loss, rollout)
    got = _METRIC_NAMES.get(key)
    if got is None:
        names = list(METRIC_SLOTS[:11])
        if spec.policy_loss == "cispo":
            names.append("cispo_clip_frac")
        if spec.policy_loss in ("gspo", "gspo-token"):
            names.append("seq_clip_frac")
        if spec.sequence_loss:
            names += ["seq_ratio_mean", "seq_ratio_max"]
        if rollout:
            names += list(METRIC_SLOTS[15:])
        got = _METRIC_NAMES[key] = (tuple(names), [_METRIC_INDEX[n] for n in names])
    return got[0], list(got[1])


_METRIC_NAMES = {}


def _host_metrics(spec, x):
    """Whether the metrics come from the one CPU op (ppo_kernels::ppo_loss_metrics) rather
    than the eager formulas: the cpu backend, outside a context-parallel group (whose
    sequence reductions are collectives)."""
    return (x.be.name == "cpu" and spec.cp_group is None
            and hasattr(torch.ops.ppo_kernels, "ppo_loss_metrics"))


def _device_metrics(spec, x, logp):
    """Whether the metrics come from the two Triton launches of
    triton_kernels/metrics.py (the CPU op's twin) rather than the ~85 small
    ops of the eager formulas: the triton or cuda backend on a CUDA device, eager mode (a
    compiled graph fuses the formulas itself), outside a context-parallel group.
    Unrun on a GPU since it was added (tests/test_triton_metrics.py runs the kernels under
    the Triton interpreter)."""
    return (_backends.device_eager(x.be, logp) and spec.cp_group is None
            and logp.dtype in (torch.float32, torch.float64))


def _metrics_op(spec, x, logp):
    """The one op that computes every metric of the call (the CPU op, or its Triton twin
    on a CUDA device; the same arguments), or None: the eager formulas."""
    if _host_metrics(spec, x):
        return torch.ops.ppo_kernels.ppo_loss_metrics
    if _device_metrics(spec, x, logp):
        from .triton_kernels import metrics as device_metrics
        return device_metrics.ppo_loss_metrics
    return None


# the CPU metrics op and the unbind of its vector in one C++ call (csrc/eager_calls.cpp), or
# None (a build from before it)
_CPP_METRICS_DICT = eager_call("metrics_dict")


def loss_metrics(spec, x, logp, ent, aux=None):
    """ppo_loss's metrics dict from the per-token logp and entropy (DESIGN.md, Metrics).
    aux: with a kept set (sampling replay), (full logp, kept mass, kept size, missing)
    [B, T]; logp is then logp_kept. Where one op computes them all in eager mode (the CPU
    op, or its Triton twin on a CUDA device outside a CUDA graph's capture; outside a
    context-parallel group) a LossMetrics filled at its first read (loss_metrics.py: the
    caller's tensors it reads are watched for in-place changes until then), else
    metrics_now's dict."""
    if (_host_metrics(spec, x) or (_device_metrics(spec, x, logp)
                                   and not _capturing(logp))) and not (
            torch.compiler.is_compiling() or torch.jit.is_tracing()):
        return LossMetrics.deferred(lambda: metrics_now(spec, x, logp, ent, aux), (
            ("response_mask", x.mask), ("old_logprobs", x.old), ("advantages", x.adv),
            ("ref_logprobs", x.ref), ("rollout_logprobs", x.rollout)))
    return metrics_now(spec, x, logp, ent, aux)


def _capturing(t):
    """Whether a CUDA graph is being captured on t's device's current stream (its replays
    must then update the metrics' tensors: they are computed at the call)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def metrics_now(spec, x, logp, ent, aux=None):
    """loss_metrics's dict, computed now. On the cpu backend one op computes them all (the
    values of the eager formulas up to the summation order; the dict's tensors are views
    of its one [K] result, K the number of metrics reported), on a CUDA device its Triton
    twin (two launches)."""
    logp_kl = None
    if aux is not None and spec.kl_logprobs != "kept":
        logp_kl = aux[0]
    rollout = x.rollout is not None and x.old is not None
    op = _metrics_op(spec, x, logp)
    if op is not None:
        scalars, codes = spec.kernel_args(torch.float32)
        names, slots = _metric_names(spec, rollout)
        args = (ck.detached(logp), ck.detached(ent), x.mask, x.old, x.adv, x.ref, x.rollout,
                x.rc_w, scalars, codes, slots,
                None if logp_kl is None else ck.detached(logp_kl))
        if op is torch.ops.ppo_kernels.ppo_loss_metrics and _CPP_METRICS_DICT is not None \
                and not (torch.compiler.is_compiling() or torch.jit.is_tracing()):
            # the op and its unbind in one C++ call, in eager mode (traced, the op and its
            # unbind stay Python calls, the graph they recorded before this call existed)
            metrics = _CPP_METRICS_DICT(names, *args)
        else:
            metrics = dict(zip(names, op(*args).unbind()))
        rollout = False  # (in the vector already)
    else:
        metrics = _torch_impl.metrics(logp, ent, x.old, x.adv, x.ref, x.mask, spec, logp_kl)
    if aux is not None:
        metrics.update(_sampling.replay_metrics(aux[1], aux[2], aux[3], x.mask))
    if rollout:
        metrics.update(_rc.metrics(x.old, x.rollout, x.mask, torch.ones_like(x.old)
                                   if x.rc_w is None else x.rc_w))
    if spec.return_per_token:
        per_tok = [("per_token_logprobs", logp), ("per_token_entropy", ent)]
        if aux is not None:
            per_tok.append(("per_token_logprobs_full", aux[0]))
        for name, v in per_tok:
            v = x.kernel(torch.where(x.mask, v.detach(), 0.0))
            metrics[name] = v[0] if x.flat else v
    if x.behaviour is not None:
        with torch.no_grad():
            keep = _torch_impl.off_policy_keep(logp, x.behaviour, x.adv, x.mask,
                                               spec.off_policy_mask_threshold, spec.cp_group)
            # the mask is one decision per sequence (every token of a dropped sequence is
            # 0), so its first column is the sequence's
            nonempty = _cp.seq_any(x.mask, spec.cp_group)
            dropped = (keep[:, 0] == 0) if keep.shape[1] else torch.zeros_like(nonempty)
            metrics["off_policy_masked_frac"] = (
                (dropped & nonempty).sum() / nonempty.sum().clamp(min=1)).float()
    return metrics


def value_loss(values, old_values, returns, response_mask=None, *, clip_range=None,
               loss_agg_mode="token-mean", global_num_tokens=None, global_num_seqs=None):
    """Clipped value loss 0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)).

    The PPO2 value clipping of OpenAI baselines (also verl's compute_value_loss).

    Args:
        values: float [B, T], the critic's predictions (differentiable).
        old_values: float [B, T], the rollout's predictions. returns: float [B, T]
            (both receive no gradient).
        response_mask: [B, T], nonzero = valid; None = all valid.
        clip_range: c >= 0, or None for no clipping.
        loss_agg_mode: as in ppo_loss ("none" gives the per-token loss).
        global_num_tokens, global_num_seqs: as in ppo_loss (data-parallel denominators).

    Returns:
        (loss, metrics): metrics = {"vf_clip_frac": fraction of valid tokens where the
        clipped error is strictly the larger}.

    Raises:
        TypeError / ValueError naming the argument.
    """
    ck.tensor("values", values, floating=True)
    if values.dim() not in (1, 2):
        raise ValueError(f"values: expected [B, T] (or [N]), got shape {list(values.shape)}")
    v = values if values.dim() == 2 else values.unsqueeze(0)
    acc = ck.acc_dtype(v)
    flat = values.dim() == 1
    vo = ck.per_token("old_values", old_values, v, flat, acc, like_name="values")
    ret = ck.per_token("returns", returns, v, flat, acc, like_name="values")
    mask = ck.response_mask(response_mask, v, flat, like_name="values")
    if clip_range is not None:
        clip_range = ck.number("clip_range", clip_range, lo=0.0)
    ck.choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    # masked positions are set apart before any arithmetic, so a NaN there reaches
    # neither the loss nor the gradient
    v = torch.where(mask, v.to(acc), 0.0)
    vo, ret = torch.where(mask, vo, 0.0), torch.where(mask, ret, 0.0)
    err = (v - ret) ** 2
    clipped_larger = torch.zeros_like(mask)
    if clip_range is not None:
        vc = torch.clamp(v, vo - clip_range, vo + clip_range)
        err_c = (vc - ret) ** 2
        clipped_larger = err_c > err
        err = torch.where(clipped_larger, err_c, err)
    loss_tok = torch.where(mask, 0.5 * err, 0.0)
    if loss_agg_mode == "none":
        loss = loss_tok[0] if flat else loss_tok
    else:
        if global_num_tokens is not None:
            global_num_tokens = ck.count("global_num_tokens", global_num_tokens, v, acc)
        if global_num_seqs is not None:
            global_num_seqs = ck.count("global_num_seqs", global_num_seqs, v, acc)
        loss = (_torch_impl.agg_weights(mask, loss_agg_mode, global_num_tokens, dtype=acc,
                                        global_num_seqs=global_num_seqs) * loss_tok).sum()
    n = mask.sum().clamp(min=1)
    return loss, {"vf_clip_frac": (clipped_larger & mask).sum().float() / n}
