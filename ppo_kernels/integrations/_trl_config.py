"""TRL 1.16 GRPOConfig -> the keyword arguments of ppo_kernels.ppo_loss(_from_hidden).

No import of trl here: ``args`` is anything with GRPOConfig's attribute names (docs/TRL.md
has the mapping table; TRL's GRPOTrainer._compute_loss the semantics it reproduces).
"""

from __future__ import annotations

import torch

CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
SUPPORTED_LOSS_TYPES = CLIP_LOSSES + ("cispo", "sapo", "vespo")

# loss_type -> the op's loss_agg_mode (the per-micro-batch normaliser of TRL's loss)
AGG_MODE = {"grpo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean",
            "bnpo": "token-mean", "dapo": "token-mean", "cispo": "token-mean",
            "vespo": "token-mean",
            "dr_grpo": "seq-mean-token-sum-norm", "luspo": "seq-mean-token-sum"}
# the loss types whose TRL loss is divided by the gradient-accumulation steps (the others,
# dapo, cispo and vespo, divide by the generation batch's token count instead)
DIVIDED_BY_GA = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")


def _unsupported(option, value, why):
    return ValueError(f"ppo_kernels TRL integration: {option}={value!r} is not supported: "
                      f"{why} (use trl.GRPOTrainer itself for it)")


def check_trl_config(args):
    """Raise ValueError naming the GRPOConfig option for anything the op cannot express
    exactly (docs/TRL.md, "Unsupported options"). Returns None."""
    lt = args.loss_type
    if lt not in SUPPORTED_LOSS_TYPES:
        raise _unsupported("loss_type", lt, f"supported loss types are "
                                            f"{', '.join(SUPPORTED_LOSS_TYPES)}")
    level = args.importance_sampling_level
    if level not in ("token", "sequence"):
        raise _unsupported("importance_sampling_level", level, "TRL knows 'token' and "
                           "'sequence' only")
    if lt == "vespo" and getattr(args, "use_vllm", False) and getattr(
            args, "vllm_importance_sampling_correction", False):
        raise _unsupported("vllm_importance_sampling_correction", True, "TRL's VESPO folds "
                           "the vLLM importance ratios into its sequence weight; the op's "
                           "vespo does not (it would multiply them into the tokens' terms)")
    if level == "sequence" and lt in ("cispo", "sapo", "vespo"):
        raise _unsupported("importance_sampling_level", level, f"loss_type={lt!r} at the "
                           f"sequence level has no op formula (the op's sequence-level "
                           f"loss, gspo, is the clipped surrogate of grpo/bnpo/dr_grpo/"
                           f"dapo/luspo)")
    eps_low = args.epsilon
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    if lt in CLIP_LOSSES:
        for name, v in (("epsilon", eps_low), ("epsilon_high", eps_high)):
            if not 0.0 <= v < 1.0:
                raise _unsupported(name, v, "the op's clip band needs 0 <= eps < 1")
        if args.delta is not None and not args.delta > 1.0 + eps_high:
            raise _unsupported("delta", args.delta, f"the op's dual clip cap must exceed "
                               f"1 + epsilon_high = {1.0 + eps_high} (at or below it, "
                               f"TRL's delta cuts into the clip band itself)")
    if lt == "cispo" and not eps_high >= 1.0:
        raise _unsupported("epsilon_high", args.epsilon_high, f"CISPO's weight cap "
                           f"min(ratio, epsilon_high) is {eps_high} (epsilon_high=None "
                           f"falls back to epsilon); the op caps at 1 + clip_eps_high >= 1. "
                           f"Set epsilon_high >= 1 (ScaleRL recommends 5.0)")
    if lt == "sapo":
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(args, name) > 0:
                raise _unsupported(name, getattr(args, name), "must be > 0")
    if args.beta < 0:
        raise _unsupported("beta", args.beta, "the op's kl_coef must be >= 0")
    if not args.temperature > 0:
        raise _unsupported("temperature", args.temperature, "must be > 0")
    bonus = args.entropy_coef != 0.0 or args.use_adaptive_entropy
    if args.top_entropy_quantile < 1.0 and bonus:
        raise _unsupported("top_entropy_quantile", args.top_entropy_quantile,
                           "with an entropy bonus (entropy_coef / use_adaptive_entropy) TRL "
                           "averages the bonus over the high-entropy tokens only; the op's "
                           "entropy term uses the response mask (without a bonus the "
                           "quantile mask is supported)")


# generation_kwargs keys (vLLM SamplingParams / transformers GenerationConfig) that change the
# distribution a token is drawn from: with sampling_replay the kept sets would not be the ones
# the engine sampled from (docs/TRL.md, "Sampling replay")
DISTRIBUTION_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "logit_bias", "bad_words",
                     "bad_words_ids", "allowed_token_ids", "logits_processors",
                     "suppress_tokens", "begin_suppress_tokens", "no_repeat_ngram_size",
                     "encoder_no_repeat_ngram_size", "typical_p", "epsilon_cutoff",
                     "eta_cutoff", "top_h", "min_tokens", "min_new_tokens", "min_length",
                     "sequence_bias", "guided_decoding", "structured_outputs", "num_beams",
                     "do_sample", "use_beam_search", "forced_bos_token_id",
                     "forced_eos_token_id", "renormalize_logits", "watermarking_config",
                     "exponential_decay_length_penalty", "diversity_penalty")


def check_sampling_replay(args, sampling_replay):
    """Raise for a sampling_replay value, or a GRPOConfig, with which the re-derived kept sets
    would not be the ones the rollout engine sampled from: TypeError for a non-bool,
    ValueError naming the GRPOConfig option otherwise. Returns None (nothing to check for
    sampling_replay=False)."""
    if not isinstance(sampling_replay, bool):
        raise TypeError(f"sampling_replay: expected True or False, got "
                        f"{type(sampling_replay).__name__}")
    if not sampling_replay:
        return

    def bad(option, value, why):
        return ValueError(f"sampling_replay=True with {option}={value!r}: {why}; the kept "
                          f"sets re-derived from top_k / top_p / min_p would not be the ones "
                          f"the tokens were sampled from (set sampling_replay=False)")
    if getattr(args, "repetition_penalty", 1.0) != 1.0:
        raise bad("repetition_penalty", args.repetition_penalty, "the penalty is a logits "
                  "processor that depends on the tokens generated so far")
    regex = getattr(args, "vllm_structured_outputs_regex", None)
    if regex is not None:
        raise bad("vllm_structured_outputs_regex", regex, "structured outputs mask the "
                  "logits by a grammar")
    gk = getattr(args, "generation_kwargs", None) or {}
    if isinstance(gk, dict):
        for key in gk:
            if key in DISTRIBUTION_KEYS:
                raise bad(f"generation_kwargs[{key!r}]", gk[key], "it changes the sampled "
                          "distribution (and overrides GRPOConfig's own field)")
    top_k, top_p, min_p = sampling_params(args)
    if not getattr(args, "use_vllm", False) and min_p is not None and top_p is not None:
        raise bad("min_p", args.min_p, "transformers' generate applies min-p after top-p "
                  "(vLLM, which the kept sets follow, before it): with both min_p and "
                  "top_p < 1 the orders give different sets")
    if top_k is not None and not isinstance(top_k, int):
        raise bad("top_k", top_k, "expected an integer")


def sampling_params(args):
    """(top_k, top_p, min_p) of a GRPOConfig in the op's convention, None = off: TRL's
    top_k <= 0 (vLLM: 0 or -1), top_p = 1 and min_p None / 0 are off."""
    top_k = getattr(args, "top_k", 0)
    top_p = getattr(args, "top_p", 1.0)
    min_p = getattr(args, "min_p", None)
    top_k = None if top_k is None or (not isinstance(top_k, bool) and isinstance(
        top_k, (int, float)) and top_k <= 0) else top_k
    top_p = None if top_p is None or top_p == 1.0 else float(top_p)
    min_p = None if min_p is None or min_p == 0.0 else float(min_p)
    return top_k, top_p, min_p


def replay_kwargs(args):
    """The op keywords of sampling replay for a GRPOConfig: top_k / top_p / min_p where
    set (an empty dict when all are off: the plain op, bit for bit) and, with a KL term,
    kl_logprobs="kept" (the reference's log-probs are over its own kept sets too)."""
    top_k, top_p, min_p = sampling_params(args)
    kw = {k: v for k, v in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p))
          if v is not None}
    if kw and args.beta != 0.0:
        kw["kl_logprobs"] = "kept"
    return kw


def head_transform(model_config):
    """(logit_softcap or None, logit_scale) of a model config, read as TRL's fused LM head
    reads them: final_logit_softcapping; logit_scale / output_multiplier /
    lm_head_multiplier, or 1 / logits_scaling (times, for hyperclovax)."""
    if model_config is None:
        return None, 1.0
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") \
        else model_config
    cap = getattr(cfg, "final_logit_softcapping", None)
    scale = None
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(cfg, name, None)
    divisor = getattr(cfg, "logits_scaling", None)
    if scale is None and divisor is not None:
        scale = divisor if getattr(cfg, "model_type", None) == "hyperclovax" else 1.0 / divisor
    return cap, 1.0 if scale is None else float(scale)


def from_trl_config(args, model_config=None, sampling_replay=False):
    """The keyword arguments of pk.ppo_loss / pk.ppo_loss_from_hidden that reproduce TRL
    1.16's GRPO loss for a GRPOConfig ``args`` (docs/TRL.md).

    Args:
        args: a trl.GRPOConfig (or anything with its attribute names).
        model_config: the policy's transformers config, or None: adds
            ``logit_softcap`` (final_logit_softcapping) when it has one. A model whose
            logits are scaled (logit_scale, ...) needs the hidden states multiplied by the
            scale first (FusedGRPOTrainer does it).
        sampling_replay: True adds GRPOConfig's top_k / top_p / min_p (replay_kwargs): the
            ratio's log-probs over the kept sets vLLM v1's sampler keeps after the
            temperature (docs/SAMPLING.md, docs/TRL.md "Sampling replay"); False (the
            default) leaves the keywords as they were.

    Returns:
        dict of the op's keywords that depend on the config only. The per-batch ones are
        the caller's (trl_batch_kwargs gives them): the denominators global_num_seqs /
        global_num_tokens, grad_scale, and the data (old_logprobs=None when on-policy,
        rollout_is_weights = TRL's importance_sampling_ratio, ...).

    Raises:
        ValueError naming the option for anything the op cannot express (check_trl_config),
        or with which sampling replay would not be exact (check_sampling_replay);
        TypeError for a non-bool sampling_replay.
    """
    check_trl_config(args)
    check_sampling_replay(args, sampling_replay)
    lt = args.loss_type
    eps_low = args.epsilon
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    kw = dict(loss_agg_mode=AGG_MODE[lt], temperature=float(args.temperature),
              kl_coef=float(args.beta), kl_estimator="k3",
              kl_bias_correction=bool(args.beta != 0.0 and args.use_bias_correction_kl),
              entropy_coef=float(args.entropy_coef), entropy_agg_mode="token-mean")
    if lt in CLIP_LOSSES:
        kw.update(policy_loss="gspo" if args.importance_sampling_level == "sequence"
                  else "vanilla", clip_eps_low=float(eps_low), clip_eps_high=float(eps_high),
                  dual_clip_c=None if args.delta is None else float(args.delta))
    elif lt == "cispo":  # TRL's weight min(r, C) = clip(r, 1 - 1, 1 + (C - 1))
        kw.update(policy_loss="cispo", clip_eps_low=1.0, clip_eps_high=float(eps_high) - 1.0)
    elif lt == "vespo":  # TRL clamps the lambdas at 1e-4 from below; the op needs > 0
        kw.update(policy_loss="vespo", vespo_k_pos=float(args.vespo_k_pos),
                  vespo_lambda_pos=max(float(args.vespo_lambda_pos), 1e-4),
                  vespo_k_neg=float(args.vespo_k_neg),
                  vespo_lambda_neg=max(float(args.vespo_lambda_neg), 1e-4))
    else:
        kw.update(policy_loss="sapo", sapo_tau_pos=float(args.sapo_temperature_pos),
                  sapo_tau_neg=float(args.sapo_temperature_neg))
    if lt == "dr_grpo":
        kw["norm_length"] = float(args.max_completion_length)
    if args.off_policy_mask_threshold is not None:
        kw["off_policy_mask_threshold"] = float(args.off_policy_mask_threshold)
    cap, _ = head_transform(model_config)
    if cap is not None:
        kw["logit_softcap"] = float(cap)
    if sampling_replay:
        kw.update(replay_kwargs(args))
    return kw


def trl_batch_kwargs(args, mask, *, num_items_in_batch=None, grad_accum_steps=1,
                     num_processes=1, training=True, entropy_coef=None):
    """(kwargs, divisor): the per-micro-batch keywords (denominators and grad_scale) and the
    number D to divide the op's loss by, so that loss / D is TRL's micro-batch loss.

    Args:
        args: the GRPOConfig. mask: [B, T] the loss mask (completion_mask * tool_mask).
        num_items_in_batch: 0-d tensor or number, TRL's inputs["num_items_in_batch"]
            (valid tokens of the whole generation batch, all processes); dapo / cispo /
            vespo only.
        grad_accum_steps: TRL's current_gradient_accumulation_steps (1 in eval).
        num_processes: accelerator.num_processes. training: False in evaluation.
        entropy_coef: the coefficient applied this step (adaptive entropy), default
            args.entropy_coef.
    """
    lt = args.loss_type
    ga = grad_accum_steps if training else 1
    coef = args.entropy_coef if entropy_coef is None else entropy_coef
    kw = {}
    if lt in DIVIDED_BY_GA:
        divisor = ga
        if lt != "bnpo":  # TRL's .mean() over the rows counts empty completions
            kw["global_num_seqs"] = mask.shape[0]
    else:  # dapo, cispo, vespo: sum over the micro-batch / (the generation batch's tokens, rescaled)
        if num_items_in_batch is None:
            raise ValueError(f"num_items_in_batch: loss_type={lt!r} needs TRL's "
                             f"num_items_in_batch (the generation batch's token count)")
        n = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=mask.device)
        n = n.clamp(min=1.0) / num_processes
        if training:
            n = n * ga / args.steps_per_generation
        kw["global_num_tokens"] = n
        divisor = 1
        if coef != 0.0:  # TRL's bonus is the micro-batch's token mean / GA
            kw["entropy_agg_mode"] = "seq-mean-token-sum"
            kw["global_num_seqs"] = mask.sum().to(torch.float32).clamp(min=1.0) * ga
    kw["grad_scale"] = 1.0 / divisor
    return kw, divisor
