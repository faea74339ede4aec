"""Helpers for data-parallel training on torch.distributed (docs/DISTRIBUTED.md).

The loss needs none: with ``global_num_tokens`` / ``global_num_seqs`` (all-reduced counts)
each rank's loss is its exact share of the whole batch's, so the sum of the ranks'
gradients is the whole batch's gradient. (DDP and FSDP average the gradients instead: scale
the loss by the world size, as verl does with dp_size, or pass counts divided by it.)
What does need a collective is the metrics dict, whose means are over the rank's own tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .context_parallel import check_group

_SUMMED = ("num_tokens", "num_seqs")
_MAXED = ("ratio_max", "rollout_is_max", "rollout_ratio_max", "seq_ratio_max")
_MINNED = ("rollout_ratio_min",)
_PER_SEQ = ("seq_clip_frac", "off_policy_masked_frac", "seq_ratio_mean")


def reduce_metrics(metrics, group=None, cp_group=None):
    """The metrics of the whole batch from every rank's ``ppo_loss`` metrics: the counts
    summed, the maxima maxed, the minima minned, the means over tokens weighted by num_tokens and those over
    sequences by num_seqs. Two all-reduces (a sum and a max) of a few floats.

    Args:
        metrics: the dict of 0-d float32 tensors pk.ppo_loss returned on this rank.
        group: the process group to reduce over (None: the default group): the data-
            parallel ranks, and with context parallelism the ranks of DP x CP.
        cp_group: the context-parallel group, if any: its ranks share their sequences, so
            num_seqs and the per-sequence fractions (already the CP group's) are counted
            once per sequence.

    Returns:
        a dict with the same keys, the same on every rank (per_token_logprobs /
        per_token_entropy, of return_per_token, stay the rank's own).

    Raises:
        ValueError: metrics without num_tokens / num_seqs, or torch.distributed not
        initialised.
    """
    if not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised")
    check_group(group, "group")
    check_group(cp_group, "cp_group")
    if not isinstance(metrics, dict) or any(k not in metrics for k in _SUMMED) or \
            not all(isinstance(v, torch.Tensor) for v in metrics.values()):
        raise ValueError("metrics: expected the dict of tensors of pk.ppo_loss (with "
                         "num_tokens and num_seqs)")
    per_token = {k: v for k, v in metrics.items() if v.dim() != 0}  # return_per_token's
    metrics = {k: v for k, v in metrics.items() if v.dim() == 0}
    cp = 1 if cp_group is None else dist.get_world_size(cp_group)
    n_tok = metrics["num_tokens"].float()
    n_seq = metrics["num_seqs"].float() / cp
    keys = [k for k in metrics if k not in _MAXED + _MINNED]
    vals = []
    for k in keys:
        v = metrics[k].float()
        if k == "num_tokens":
            vals.append(n_tok)
        elif k == "num_seqs":
            vals.append(n_seq)
        else:
            vals.append(v * (n_seq if k in _PER_SEQ else n_tok))
    summed = torch.stack(vals)
    dist.all_reduce(summed, group=group)
    total = dict(zip(keys, summed.unbind()))
    out = {}
    for k in keys:
        if k in _SUMMED:
            out[k] = total[k]
        else:
            w = total["num_seqs" if k in _PER_SEQ else "num_tokens"]
            out[k] = total[k] / w.clamp(min=1.0)
    maxed = [k for k in metrics if k in _MAXED]
    minned = [k for k in metrics if k in _MINNED]
    if maxed or minned:
        # one MAX all-reduce: the minima as maxima of their negatives, a rank without
        # valid tokens (whose minimum reads 0) as -inf so that it never wins
        empty = n_tok <= 0
        m = torch.stack([metrics[k].float() for k in maxed] + [
            torch.where(empty, float("-inf"), -metrics[k].float()) for k in minned])
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        vals = m.unbind()
        out.update(zip(maxed, vals[:len(maxed)]))
        out.update((k, (-v).nan_to_num(posinf=0.0)) for k, v in zip(minned, vals[len(maxed):]))
    return {**{k: out[k] for k in metrics}, **per_token}
