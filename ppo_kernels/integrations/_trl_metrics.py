"""TRL 1.16 GRPOTrainer's loss metrics (names and definitions of its _compute_loss), from the
per-token log-probs and entropies of the current policy (no gradient)."""

from __future__ import annotations

import torch
from trl.trainer.utils import nanmax, nanmin

from ._trl_config import CLIP_LOSSES


def importance_weights(lp, old, mask, level):
    """TRL's coef_1: exp(lp - old) per token [B, T], or per sequence exp(masked mean) [B, 1]
    (no clamp of the log-ratio, unlike the op's +-20)."""
    log_ratio = lp - old
    if level == "sequence":
        m = mask.to(lp.dtype)
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return torch.exp(log_ratio)


def log_loss_metrics(trainer, mode, lp, ent, old, adv, mask, ref):
    """Append kl, entropy and clip_ratio/*, cispo_clip_ratio or vespo/phi_seq_mean to
    trainer._metrics[mode], as
    TRL's _compute_loss does (global over processes through trainer.accelerator).

    lp, ent: [B, T] current log-probs / entropies (detached); old: [B, T] or None
    (on-policy); adv: [B, 1] or [B, T]; mask [B, T]; ref: [B, T] or None."""
    acc = trainer.accelerator
    m = mask.to(lp.dtype)
    coef_1 = importance_weights(lp, lp if old is None else old, mask,
                                trainer.importance_sampling_level)

    def global_mean(x):  # per-sequence values [B, 1] count once each
        if x.shape[1] == 1:
            s, n = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            s, n = (x * m).sum(), m.sum()
        tot = acc.reduce(torch.stack([s, n.to(s.dtype)]), reduction="sum")
        return (tot[0] / tot[1].clamp(min=1.0)).item()

    def seq_means(x):  # NaN for an empty sequence (no clamp), as TRL
        return x.squeeze(1) if x.shape[1] == 1 else (x * m).sum(-1) / m.sum(-1)

    log = trainer._metrics[mode]
    if trainer.beta != 0.0:
        kl = torch.exp(ref - lp) - (ref - lp) - 1.0
        if trainer.args.use_bias_correction_kl:
            kl = kl * coef_1
        log["kl"].append(global_mean(kl))
    log["entropy"].append(global_mean(ent))
    lt = trainer.loss_type
    if lt in CLIP_LOSSES:
        if trainer.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=trainer.args.delta)
        low = ((coef_1 < 1 - trainer.epsilon_low) & (adv < 0)).to(lp.dtype)
        high = ((coef_1 > 1 + trainer.epsilon_high) & (adv > 0)).to(lp.dtype)
        log["clip_ratio/low_mean"].append(global_mean(low))
        log["clip_ratio/high_mean"].append(global_mean(high))
        log["clip_ratio/region_mean"].append(global_mean(torch.maximum(low, high)))
        log["clip_ratio/low_min"].append(nanmin(acc.gather(seq_means(low))).item())
        log["clip_ratio/high_max"].append(nanmax(acc.gather(seq_means(high))).item())
    elif lt == "cispo":
        clipped = ((coef_1 > trainer.epsilon_high) & (adv > 0)).to(lp.dtype)
        log["cispo_clip_ratio"].append(global_mean(clipped))
    elif lt == "vespo":  # TRL's own gamma weights (its vLLM IS folding is refused)
        a = trainer.args
        phi = trainer.get_gamma_weights(
            advantages=adv, log_ratio_per_token=lp - (lp if old is None else old), mask=m,
            importance_sampling_ratio=None, k_pos=a.vespo_k_pos, lambda_pos=a.vespo_lambda_pos,
            k_neg=a.vespo_k_neg, lambda_neg=a.vespo_lambda_neg)
        log["vespo/phi_seq_mean"].append(global_mean(phi))
