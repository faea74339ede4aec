"""TRL (1.16) drop-in: GRPOTrainer's loss computed by ppo_kernels.ppo_loss_from_hidden from the
model's last hidden states and LM head weight, never materialising the [B, T, V] logits
(docs/TRL.md).

    from ppo_kernels.integrations.trl import FusedGRPOTrainer
    trainer = FusedGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)

or, on a GRPOTrainer (or subclass) already built: ``fuse_grpo_loss(trainer)``; or
``class MyTrainer(FusedGRPOLossMixin, GRPOTrainer)``. For a loop of one's own:
``from_trl_config(args)`` gives the op's keyword arguments.

The loss, its gradients and the logged metrics (TRL's own names: kl, entropy,
clip_ratio/*, cispo_clip_ratio, policy_loss, entropy_coef) are those of TRL's
GRPOTrainer._compute_loss (trl/trainer/grpo_trainer.py) for every option the op can
express; the others raise ValueError when the trainer is built (check_trl_config).
Numerical differences by design: the op clamps log-ratios to +-20 (TRL does not), so
they differ only where |logp - old_logp| > 20.

``sampling_replay=True`` (FusedGRPOTrainer, fuse_grpo_loss, from_trl_config; default False:
the results above, bit for bit) scores every log-prob the trainer computes (old, reference
and current) over the kept set of GRPOConfig's top_k / top_p / min_p after its temperature,
as vLLM's processed_logprobs are (docs/TRL.md, "Sampling replay").
"""

from __future__ import annotations

import functools
import types

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer

from ..from_hidden import ppo_loss_from_hidden, token_logprobs_from_hidden
from ..lm_head import forward_redirect
from ..loss import ppo_loss
from ._trl_config import (check_sampling_replay, check_trl_config, from_trl_config,
                          head_transform, replay_kwargs, trl_batch_kwargs)
from ._trl_metrics import log_loss_metrics

__all__ = ["FusedGRPOTrainer", "FusedGRPOLossMixin", "fuse_grpo_loss", "from_trl_config",
           "check_trl_config", "check_sampling_replay", "replay_kwargs", "trl_batch_kwargs"]

_HIDDEN_FLAG = "ppo_kernels_last_hidden_state"
# the model inputs TRL's _get_per_token_logps_and_entropies forwards (one chunk: all rows)
_MODEL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes",
                 "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _policy(trainer):
    """The causal LM whose forward TRL patched (the PEFT base model when wrapped)."""
    model = trainer.model
    return model.get_base_model() if is_peft_model(model) else model


HEAD_DTYPES = ("float32", "autocast")


def _add_hidden_forward(model):
    """Let ``model(..., ppo_kernels_last_hidden_state=True)`` return the backbone's last hidden
    state [B, L, H] (no LM head), and ``model(..., ppo_kernels_last_hidden_state=fn)`` return
    fn(last hidden state): the fused loss then runs inside the model's forward, where DDP
    sees every parameter it uses (find_unused_parameters=True included) and FSDP2 holds the
    root unit's parameters whole. Any other call goes to the forward it had (TRL's fused
    one). Going through model(...) keeps DDP / FSDP / DeepSpeed wrappers in the loop."""
    if getattr(model, "_ppo_kernels_hidden_forward", False):
        return
    previous = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, ppo_kernels_last_hidden_state=False, **kwargs):
        if not ppo_kernels_last_hidden_state:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        last = self.base_model(*args, **kwargs).last_hidden_state
        return ppo_kernels_last_hidden_state(last) if callable(
            ppo_kernels_last_hidden_state) else last

    model.forward = types.MethodType(forward, model)
    model._ppo_kernels_hidden_forward = True


def _dry_run(kw):
    """Run the op once on a 1 x 2 batch with the config's options, so that anything it
    rejects is reported when the trainer is built."""
    opts = {k: v for k, v in kw.items() if k != "logit_softcap"}
    z = torch.zeros(1, 2, 3)
    tok = torch.zeros(1, 2, dtype=torch.long)
    ref = torch.zeros(1, 2) if opts.get("kl_coef", 0.0) > 0 else None
    try:
        ppo_loss(z, tok, torch.zeros(1, 2), torch.zeros(1), None, ref, backend="torch",
                 **opts)
    except (TypeError, ValueError) as e:
        raise ValueError(f"ppo_kernels TRL integration: this GRPOConfig maps to op options "
                         f"the op rejects ({opts}): {e}") from e


def _check_overrides(trainer, patched):
    """A subclass's own _compute_loss (a regulariser, an extra metric) that the fused one
    would shadow, or its own _get_per_token_logps_and_entropies, which TRL keeps using for
    the old and reference log-probs while the fused loss computes the current ones without
    it, is refused: either would change the training run silently. patched: the fused
    methods go on the instance (fuse_grpo_loss), shadowing every class's."""
    mro = type(trainer).__mro__
    ours = (FusedGRPOLossMixin, FusedGRPOTrainer, GRPOTrainer)

    def users(classes, name):  # the classes (not TRL's, not ours) that define ``name``
        return [c for c in classes if c not in ours and not c.__module__.startswith("trl.")
                and name in c.__dict__]

    behind = mro if patched else mro[mro.index(FusedGRPOLossMixin) + 1:]
    for cls in users(behind, "_compute_loss"):
        raise ValueError(
            f"trainer: {cls.__name__} overrides GRPOTrainer._compute_loss, which the fused "
            f"loss would replace, dropping the override; compute the extra term in your "
            f"own _compute_loss on top of ppo_kernels' (class MyTrainer("
            f"FusedGRPOLossMixin, GRPOTrainer) and call super()._compute_loss), or train "
            f"without the fused loss")
    for cls in users(mro, "_get_per_token_logps_and_entropies"):
        raise ValueError(
            f"trainer: {cls.__name__} overrides _get_per_token_logps_and_entropies; TRL "
            f"would use it for the old and reference log-probs while the fused loss "
            f"computes the current ones from the hidden states without it: the ratio "
            f"would compare two different functions. Not supported with the fused loss")


def check_trainer(trainer, patched=False, sampling_replay=False):
    """check_trl_config(trainer.args) plus what depends on the model and on the trainer's
    class (_check_overrides); ValueError naming the option. Returns the config's static op
    keywords (with sampling_replay, GRPOConfig's top_k / top_p / min_p among them)."""
    _check_overrides(trainer, patched)
    kw = from_trl_config(trainer.args, getattr(trainer.model, "config", None),
                         sampling_replay=sampling_replay)
    if trainer.aux_loss_enabled:
        raise ValueError("ppo_kernels TRL integration: router_aux_loss_coef="
                         f"{trainer.router_aux_loss_coef!r} (a Mixture-of-Experts model's "
                         "load-balancing loss) is not supported; set router_aux_loss_coef=0")
    if _policy(trainer).get_output_embeddings() is None:
        raise ValueError("ppo_kernels TRL integration: the model has no output embeddings "
                         "(get_output_embeddings() is None): no LM head to fuse")
    _dry_run(kw)
    return kw


class FusedGRPOLossMixin:
    """Replaces GRPOTrainer._compute_loss by ppo_loss_from_hidden (module docstring). Put it
    before GRPOTrainer (or your subclass of it) in the bases and call
    ``self._ppo_kernels_setup()`` after GRPOTrainer.__init__ (FusedGRPOTrainer does;
    ``_ppo_kernels_setup(head_dtype=..., sampling_replay=True)`` takes FusedGRPOTrainer's
    options)."""

    def _ppo_kernels_setup(self, patched=False, head_dtype="float32", sampling_replay=False):
        check_sampling_replay(self.args, sampling_replay)
        if head_dtype not in HEAD_DTYPES:
            raise ValueError(f"head_dtype: expected one of {HEAD_DTYPES}, got {head_dtype!r}")
        if head_dtype == "autocast" and self.args.cast_lm_head_to_fp32:
            raise ValueError("head_dtype: 'autocast' contradicts GRPOConfig's "
                             "cast_lm_head_to_fp32=True (the head in float32); drop one")
        self._pk_kwargs = check_trainer(self, patched, sampling_replay)
        # the kept-set keywords of token_logprobs_from_hidden (old, reference, no-grad pass)
        self._pk_replay = {k: v for k, v in (replay_kwargs(self.args) if sampling_replay
                                             else {}).items() if k != "kl_logprobs"}
        self._pk_scale = head_transform(getattr(self.model, "config", None))[1]
        self._pk_head_dtype = head_dtype
        _add_hidden_forward(_policy(self))

    def _pk_head_dtype_for(self, hidden, w):
        """The dtype the fused head runs in (docs/TRL.md, "Precision of the head"):
        head_dtype="float32" (the default, as cast_lm_head_to_fp32=True): float32;
        "autocast": torch.autocast's dtype for a linear where autocast is on (bfloat16
        under GRPOConfig's bf16=True, stock TRL's own head precision), else that of the
        weight and hidden states (the wider of the two)."""
        if self._pk_head_dtype == "float32" or self.args.cast_lm_head_to_fp32:
            return torch.float32
        dev = w.device.type
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
        return torch.promote_types(hidden.dtype, w.dtype)

    def _pk_head(self, hidden, fn, lm=None):
        """fn(hidden, W, b) run as the LM head's forward (ppo_kernels.forward_redirect):
        inside the head's hooks, FSDP2 / ZeRO-3 hold its weight whole and reduce its
        gradient. hidden, W and b are in one dtype (_pk_head_dtype_for) on W's device; a
        logit scale multiplies hidden (and b) instead of the logits. lm: the causal LM
        whose head it is (default: the policy)."""
        head = (_policy(self) if lm is None else lm).get_output_embeddings()

        def run(h):
            w, b = head.weight, head.bias
            h = h.to(w.device)
            dt = self._pk_head_dtype_for(h, w)
            h, w = h.to(dt), w.to(dt)
            b = None if b is None else b.to(dt)
            if self._pk_scale != 1.0:
                h = h * self._pk_scale
                b = None if b is None else b * self._pk_scale
            with torch.autocast(w.device.type, enabled=False):
                return fn(h, w, b)
        return forward_redirect(head, run, hidden)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False,
                                           **kwargs):
        """TRL's old and reference log-probs from the kernel the fused loss computes the
        current ones with (the same hidden-state forward, head and chunks), so that the
        ratio and the KL compare like with like: on-policy, logp - old and logp - ref are
        exactly 0, as in stock TRL. With sampling_replay the log-probs are over each model's
        own kept sets (top_k / top_p / min_p re-derived from its logits), the entropies over
        the full vocabulary. The MoE aux loss and image inputs go to TRL's own."""
        replay = getattr(self, "_pk_replay", {})
        if replay and (compute_aux_loss or kwargs.get("pixel_values") is not None):
            raise NotImplementedError(
                "sampling_replay: the MoE aux loss and image inputs go through TRL's own "
                "log-prob function, which scores over the full vocabulary; not supported "
                "together with sampling_replay=True")
        if compute_aux_loss or kwargs.get("pixel_values") is not None:
            return GRPOTrainer._get_per_token_logps_and_entropies(
                self, model, input_ids, attention_mask, logits_to_keep, batch_size,
                compute_entropy, compute_aux_loss, **kwargs)
        lm = self.accelerator.unwrap_model(model)
        lm = lm.get_base_model() if is_peft_model(lm) else lm
        _add_hidden_forward(lm)
        extra = {k: v for k, v in kwargs.items() if k in _MODEL_INPUTS and v is not None}
        cap = self._pk_kwargs.get("logit_softcap")
        chunk = self._pk_kwargs.get("chunk_size")
        step = batch_size or input_ids.size(0)
        logps, ents = [], []
        for r0 in range(0, input_ids.size(0), step):
            rows = slice(r0, r0 + step)

            def head_fn(h, w, b, rows=rows):
                return token_logprobs_from_hidden(
                    h, w, input_ids[rows, -logits_to_keep:], lm_head_bias=b,
                    logit_softcap=cap, temperature=self.temperature, return_entropy=True,
                    chunk_size=chunk, **replay)

            def from_last(last, head_fn=head_fn):  # inside the model's forward
                return self._pk_head(last[:, -logits_to_keep - 1:-1], head_fn, lm)
            with self.accelerator.autocast():
                lp, ent = model(input_ids=input_ids[rows],
                                attention_mask=attention_mask[rows], **{_HIDDEN_FLAG: from_last},
                                **{k: v[rows] for k, v in extra.items()})
            logps.append(lp)
            ents.append(ent)
        return torch.cat(logps), torch.cat(ents) if compute_entropy else None, None

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        training = mode == "train"
        ga = self.current_gradient_accumulation_steps if training else 1
        c_ids, c_mask = inputs["completion_ids"], inputs["completion_mask"]
        t = c_ids.size(1)
        mask = c_mask if "tool_mask" not in inputs else c_mask * inputs["tool_mask"]
        extra = {k: inputs[k] for k in _MODEL_INPUTS if inputs.get(k) is not None}
        kw = dict(self._pk_kwargs)
        cap = kw.pop("logit_softcap", None)
        adv = inputs["advantages"]
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        old = inputs.get("old_per_token_logps")
        samp = inputs.get("sampling_per_token_logps", old)
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        bonus = self._entropy_bonus_enabled
        coef = self.entropy_coef
        if bonus and self.use_adaptive_entropy:
            coef = coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        kw["entropy_coef"] = float(coef) if bonus else 0.0
        bkw, divisor = trl_batch_kwargs(
            self.args, mask, num_items_in_batch=inputs.get("num_items_in_batch"),
            grad_accum_steps=ga, num_processes=self.accelerator.num_processes,
            training=training, entropy_coef=kw["entropy_coef"])
        kw.update(bkw)

        def head_fn(hidden, w, b):  # the LM head's forward, inside the model's
            lp = ent = None
            if self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None:
                # options that read the current per-token values before the loss: one more
                # pass without a gradient (otherwise the loss hands them back, no extra pass)
                with torch.no_grad():
                    lp, ent = token_logprobs_from_hidden(
                        hidden.detach(), w.detach(), c_ids, mask,
                        lm_head_bias=None if b is None else b.detach(), logit_softcap=cap,
                        temperature=self.temperature, return_entropy=True,
                        **getattr(self, "_pk_replay", {}))
            isw = None
            if self.top_entropy_quantile < 1.0:
                isw = self.get_high_entropy_mask(ent, mask, 1 - self.top_entropy_quantile).to(
                    lp.dtype)
            if self.use_vllm and self.vllm_importance_sampling_correction:
                r = inputs["importance_sampling_ratio"]
                isw = r if isw is None else isw * r
            rollout = None
            if self.off_policy_mask_threshold is not None:
                rollout = lp if samp is None else samp
                rollout = torch.where(torch.isnan(rollout), lp, rollout)  # TRL: NaN: KL 0
            loss, metrics = ppo_loss_from_hidden(hidden, w, c_ids, old, adv, mask, ref,
                                                 lm_head_bias=b, logit_softcap=cap,
                                                 rollout_is_weights=isw,
                                                 rollout_logprobs=rollout,
                                                 return_per_token=True, **kw)
            if lp is None:  # TRL's metrics need the per-token values the loss used
                lp, ent = metrics["per_token_logprobs"], metrics["per_token_entropy"]
            return loss, lp, ent

        def from_last(last):  # inside the model's forward: DDP sees the head used
            return self._pk_head(last[:, -t - 1:-1], head_fn)
        with self.accelerator.autocast():
            loss, lp, ent = model(input_ids=torch.cat([inputs["prompt_ids"], c_ids], 1),
                                  attention_mask=torch.cat([inputs["prompt_mask"], c_mask], 1),
                                  **{_HIDDEN_FLAG: from_last}, **extra)
        if bonus:
            self._pk_entropy_bookkeeping(mode, loss, divisor, ga, coef, ent, mask)
        log_loss_metrics(self, mode, lp, ent, None if old is None else
                         torch.where(mask.bool(), old, lp), adv, mask,
                         None if ref is None else torch.where(mask.bool(), ref, lp))
        return loss / divisor

    def _pk_entropy_bookkeeping(self, mode, loss, divisor, ga, coef, ent, mask):
        """TRL's policy_loss / entropy_coef metrics and its adaptive entropy controller."""
        m = mask.to(ent.dtype)
        ent_sum, n = (ent * m).sum(), m.sum()
        # the op's loss is policy - coef * (token-mean entropy) * divisor / ga
        policy = loss.detach() + coef * (ent_sum / n.clamp(min=1.0)) * (divisor / ga)
        self._metrics[mode]["policy_loss"].append(
            self.accelerator.gather(policy).nanmean().item())
        sync = self.accelerator.sync_gradients
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([ent_sum, n])
            self._entropy_window_stats = stats if self._entropy_window_stats is None \
                else self._entropy_window_stats + stats
            if sync:
                tot = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = (tot[0] / tot[1].clamp(min=1.0)).item()
                a = self.args
                if world <= a.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta,
                                            a.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta,
                                            a.entropy_coef_min)
                self._last_world_entropy = world
                self._entropy_window_stats = None
        if mode == "train" and sync:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)


_FUSED_METHODS = ("_ppo_kernels_setup", "_pk_head", "_pk_head_dtype_for",
                  "_pk_entropy_bookkeeping",
                  "_get_per_token_logps_and_entropies", "_compute_loss")


class FusedGRPOTrainer(FusedGRPOLossMixin, GRPOTrainer):
    """trl.GRPOTrainer with the loss computed by ppo_kernels.ppo_loss_from_hidden: the same
    constructor, the same training run (docs/TRL.md), plus ``head_dtype``: "float32"
    (the default: the fused head runs in float32, as with cast_lm_head_to_fp32=True, also
    under bf16 autocast) or "autocast" (the head in autocast's dtype, bfloat16 under
    bf16=True, as stock TRL's lm_head), plus ``sampling_replay``: False (the default, the
    log-probs over the full vocabulary) or True (old, reference and current log-probs over
    the kept sets of GRPOConfig's top_k / top_p / min_p after its temperature, as vLLM's
    processed_logprobs; docs/TRL.md "Sampling replay"). Raises ValueError, before the model
    is set up, for a GRPOConfig option the op cannot express or with which replay would not
    be exact (TypeError for a non-bool sampling_replay)."""

    def __init__(self, model, reward_funcs, args=None, *rest, head_dtype="float32",
                 sampling_replay=False, **kwargs):
        if args is not None:
            check_trl_config(args)  # fail before TRL loads anything
            check_sampling_replay(args, sampling_replay)
        elif not isinstance(sampling_replay, bool):
            check_sampling_replay(None, sampling_replay)
        if head_dtype not in HEAD_DTYPES:
            raise ValueError(f"head_dtype: expected one of {HEAD_DTYPES}, got {head_dtype!r}")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._ppo_kernels_setup(head_dtype=head_dtype, sampling_replay=sampling_replay)


def fuse_grpo_loss(trainer, head_dtype="float32", sampling_replay=False):
    """The one-line hook: make a built GRPOTrainer (or subclass) compute its loss with
    ppo_loss_from_hidden. head_dtype, sampling_replay: as FusedGRPOTrainer's. Returns the
    trainer. Raises ValueError for an unsupported option (check_trl_config,
    check_sampling_replay), leaving the trainer as it was."""
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"trainer: expected a trl.GRPOTrainer, got {type(trainer).__name__}")
    for name in _FUSED_METHODS:
        setattr(trainer, name, types.MethodType(getattr(FusedGRPOLossMixin, name), trainer))
    try:
        trainer._ppo_kernels_setup(patched=True, head_dtype=head_dtype,
                                   sampling_replay=sampling_replay)
    except Exception:
        for name in _FUSED_METHODS:
            delattr(trainer, name)
        raise
    return trainer
