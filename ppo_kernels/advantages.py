"""Rollout-side ops: gae, kl_penalized_rewards, whiten, score_rollout."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from . import _checks as ck
from . import _torch_impl
from . import packed
from . import sampling as _sampling
from . import vocab_parallel as vp
from .context_parallel import check_group
from .rank_agreement import checks_together, groups
from ._backends import device_eager, get_backend
from .rows import logits_logprobs
from .spec import KL_ESTIMATORS


def _seq_tensors(rewards_name, rewards, values_name, values, response_mask):
    ck.tensor(rewards_name, rewards, floating=True)
    if rewards.dim() != 2:
        raise ValueError(f"{rewards_name}: expected [B, T], got shape {list(rewards.shape)}")
    acc = ck.acc_dtype(rewards)
    v = ck.per_token(values_name, values, rewards, False, acc, like_name=rewards_name)
    mask = ck.response_mask(response_mask, rewards, False, like_name=rewards_name)
    return rewards.to(acc).contiguous(), v, mask, acc


LENGTH_ADAPTIVE = "length-adaptive"


def length_adaptive_lam(response_mask, lam_alpha, dtype=torch.float32):
    """VAPO's length-adaptive lambda (Yue et al. 2025, arXiv:2504.05118, Length-Adaptive
    GAE): lambda_b = 1 - 1 / (lam_alpha * l_b) with l_b the number of valid tokens of
    sequence b (response_mask.sum(-1)), clamped at 0 (a sequence shorter than 1 / lam_alpha
    gets lambda 0, the TD(0) advantage; VAPO gives no rule there); an empty sequence
    (l_b = 0) gets 0 (it has no advantage to compute). Computed in float64 on the mask's
    device (no host read), returned as ``dtype`` [B]."""
    m = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    n = m.sum(-1).to(torch.float64)  # (an exact int64 count: faster than a float64 sum)
    lam = (1.0 - 1.0 / (lam_alpha * n.clamp(min=1.0))).clamp(min=0.0)
    return torch.where(n > 0, lam, 0.0).to(dtype)


class GaeLambda(NamedTuple):
    """The checked lambda options of gae / score_rollout: lam (a number, or None for the
    length-adaptive lambda of lam_alpha) and the returns' value_lam (None: lam's)."""

    lam: float | None
    lam_alpha: float | None
    value_lam: float | None

    def options(self):
        """As keyword arguments of pk.gae."""
        return dict(lam=LENGTH_ADAPTIVE if self.lam is None else self.lam,
                    lam_alpha=self.lam_alpha, value_lam=self.value_lam)

    def kernel_args(self, mask, dtype):
        """(lam, lam_per_seq or None, value_lam or None) of the kernel ops (csrc/ops.cpp).
        A value_lam equal to a scalar lam is passed as None: the same returns, one scan."""
        if self.lam is None:
            return 0.0, length_adaptive_lam(mask, self.lam_alpha, dtype), self.value_lam
        value_lam = None if self.value_lam == self.lam else self.value_lam
        return self.lam, None, value_lam


def gae_lambda(lam, value_lam, lam_alpha):
    """Checks gae's lambda options (a ValueError / TypeError naming the argument)."""
    if isinstance(lam, str):
        if lam != LENGTH_ADAPTIVE:
            raise ValueError(f"lam: expected a number in [0, 1] or {LENGTH_ADAPTIVE!r}, got "
                             f"{lam!r}")
        if lam_alpha is None:
            raise ValueError(f"lam_alpha: lam={LENGTH_ADAPTIVE!r} needs lam_alpha (VAPO's "
                             f"alpha, a number > 0), got None")
        lam, alpha = None, ck.number("lam_alpha", lam_alpha, lo=0.0, lo_open=True)
    else:
        lam, alpha = ck.number("lam", lam, lo=0.0, hi=1.0), None
        if lam_alpha is not None:
            raise ValueError(f"lam_alpha: only meaningful with lam={LENGTH_ADAPTIVE!r}, got "
                             f"lam_alpha={lam_alpha!r} with lam={lam!r}")
    if value_lam is not None:
        value_lam = ck.number("value_lam", value_lam, lo=0.0, hi=1.0)
    return GaeLambda(lam, alpha, value_lam)


def gae(rewards, values, response_mask=None, *, gamma=1.0, lam=0.95, bootstrap_values=None,
        value_lam=None, lam_alpha=None, cu_seqlens=None, max_seqlen=None, backend="auto"):
    """Generalised advantage estimation, a reverse scan over T (Schulman et al. 2016, eq. 16).

    delta_t = r_t + gamma V_next - V_t;  A_t = delta_t + gamma lam A_next. Masked positions
    are transparent: V_next and A_next carry across them unchanged, without decay. After the
    last valid token V_next = 0 (terminated) unless ``bootstrap_values`` (truncated).

    VAPO's variants (Yue et al. 2025, arXiv:2504.05118): decoupled GAE (``value_lam``: the
    critic's targets use their own lambda, VAPO / VC-PPO take 1.0, arXiv:2503.01491) and
    length-adaptive GAE (``lam="length-adaptive"``: lambda_b = max(0, 1 - 1 / (lam_alpha *
    l_b)) per sequence, l_b its number of valid tokens; an empty sequence gets 0; VAPO's
    alpha is 0.05; see length_adaptive_lam).

    Args:
        rewards, values: float [B, T]. response_mask: [B, T], nonzero = valid; None = all.
        gamma: in [0, 1]. lam: in [0, 1], or "length-adaptive" (needs lam_alpha > 0; a
            lam_alpha with a numeric lam is a ValueError).
        value_lam: in [0, 1], the lambda of the returns; None = lam's (the length-adaptive
            one too), which gives today's returns bit for bit.
        bootstrap_values: float [B] (per sequence) or None.
        cu_seqlens: int [S + 1] for packed sequences (ppo_kernels.packed): rewards, values
            and the mask are then [1, total] or [total] and the scan restarts at every
            boundary; max_seqlen: the longest sequence, if known (saves a host read on
            devices).
        backend: "auto" | "cpu" | "cuda" | "triton" | "torch".

    Returns:
        (advantages, returns), float32 [B, T] (float64 for float64 rewards; the packed
        layout with cu_seqlens), 0 where the mask is 0. No gradient. returns = the GAE
        advantages computed with value_lam + values, i.e. the lambda-return of value_lam
        (Sutton & Barto 2018, sec. 12.1: G^lambda_t - V_t = sum_l (gamma lam)^l delta_{t+l}),
        which verl's compute_gae_advantage_return also takes as the critic's targets (with
        the advantages' lambda: value_lam=None); value_lam = 1 gives the discounted
        reward-to-go plus gamma^n times the bootstrap value.

    Raises:
        TypeError / ValueError naming the argument.
    """
    if cu_seqlens is not None:
        packing = packed.packing(cu_seqlens, packed.total_of(rewards, "rewards"), rewards,
                            max_seqlen)
        mask, t = packed.padded_inputs(packing, response_mask, "rewards", rewards, rewards=rewards,
                                       values=values)
        adv, ret = gae(t["rewards"], t["values"], mask, gamma=gamma, lam=lam,
                       bootstrap_values=bootstrap_values, value_lam=value_lam,
                       lam_alpha=lam_alpha, backend=backend)
        return packed.unpadded(packing, adv, rewards), packed.unpadded(packing, ret, rewards)
    packed.check_max_seqlen(max_seqlen)
    r, v, mask, acc = _seq_tensors("rewards", rewards, "values", values, response_mask)
    gamma = ck.number("gamma", gamma, lo=0.0, hi=1.0)
    lams = gae_lambda(lam, value_lam, lam_alpha)
    boot = None
    if bootstrap_values is not None:
        ck.tensor("bootstrap_values", bootstrap_values, floating=True)
        ck.same_device("bootstrap_values", bootstrap_values, "rewards", r)
        if tuple(bootstrap_values.shape) != (r.shape[0],):
            raise ValueError(f"bootstrap_values: expected shape [{r.shape[0]}], got "
                             f"{list(bootstrap_values.shape)}")
        boot = bootstrap_values.detach().to(acc).contiguous()
    be = get_backend(backend, r.device)
    with torch.no_grad():
        return be.gae(r.detach(), v.detach(), mask, boot, gamma, *lams.kernel_args(mask, acc))


def kl_penalized_rewards(scores, logprobs, ref_logprobs, response_mask, *, kl_coef,
                         kl_estimator="k1", cu_seqlens=None, max_seqlen=None):
    """Per-token rewards r_t = -kl_coef * kl_t, plus scores[b] on the LAST valid token of
    sequence b (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022).

    Args:
        scores: float [B], the reward model's sequence scores.
        logprobs, ref_logprobs: float [B, T]. response_mask: [B, T].
        kl_coef: >= 0. kl_estimator: "k1" | "k2" | "k3" | "abs" | "k1+" | "k3+" (the "+"
            estimators give the values of k1 / k3 here: no gradient flows).
        cu_seqlens, max_seqlen: packed sequences, as in pk.gae (scores [S]; the score goes
            on the last valid token of each packed sequence).

    Returns:
        rewards float32 [B, T] (the packed layout with cu_seqlens), 0 where masked.

    Raises:
        TypeError / ValueError naming the argument.
    """
    if cu_seqlens is not None:
        packing = packed.packing(cu_seqlens, packed.total_of(logprobs, "logprobs"), logprobs,
                            max_seqlen)
        mask, t = packed.padded_inputs(packing, response_mask, "logprobs", logprobs,
                                       logprobs=logprobs, ref_logprobs=ref_logprobs)
        r = kl_penalized_rewards(scores, t["logprobs"], t["ref_logprobs"], mask,
                                 kl_coef=kl_coef, kl_estimator=kl_estimator)
        return packed.unpadded(packing, r, logprobs)
    packed.check_max_seqlen(max_seqlen)
    lp, ref, mask, _ = _seq_tensors("logprobs", logprobs, "ref_logprobs", ref_logprobs,
                                    response_mask)
    _scores(scores, lp)
    kl_coef = ck.number("kl_coef", kl_coef, lo=0.0)
    ck.choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    with torch.no_grad():
        return _torch_impl.kl_penalized_rewards(scores, lp, ref, mask, kl_coef, kl_estimator)[0]


def _scores(scores, like):
    ck.tensor("scores", scores, floating=True)
    ck.same_device("scores", scores, "logprobs", like)
    if tuple(scores.shape) != (like.shape[0],):
        raise ValueError(f"scores: expected shape [{like.shape[0]}], got {list(scores.shape)}")


def whiten(x, response_mask, *, shift_mean=True, eps=1e-8, cu_seqlens=None, max_seqlen=None,
           group=None):
    """Normalise ``x`` over the valid tokens: (x - mean) / sqrt(var + eps), with the unbiased
    (n - 1) variance; ``shift_mean=False`` adds the mean back. Masked positions give 0; one
    valid token is only centred (gives 0), never NaN; no valid token gives all 0.

    Args:
        x: float [B, T]. response_mask: [B, T]. eps: >= 0.
        cu_seqlens, max_seqlen: packed sequences, as in pk.gae (the statistics are over
            every valid token of the batch either way, so only the layout is checked).
        group: a torch.distributed process group (data parallel): the mean and variance
            are those of the valid tokens of every rank's x (one all-reduce of 3 numbers).

    Returns:
        float [B, T] of x's dtype (differentiable); statistics in float64.

    Raises:
        TypeError / ValueError naming the argument.
    """
    ck.tensor("x", x, floating=True)
    if cu_seqlens is not None:
        packed.packing(cu_seqlens, packed.total_of(x, "x"), x, max_seqlen)
        flat = x.dim() == 1
        out = whiten(x.reshape(1, -1), None if response_mask is None else
                     packed.packed_like(response_mask, "response_mask", x.shape[-1]),
                     shift_mean=shift_mean, eps=eps, group=group)
        return out[0] if flat else out
    packed.check_max_seqlen(max_seqlen)
    mask = ck.response_mask(response_mask, x, False, like_name="x")
    eps = ck.number("eps", eps, lo=0.0)
    ck.flag("shift_mean", shift_mean)
    # statistics in float64: a float32 sum of squares overflows from |x| ~ 1.8e19 (and
    # silently whitens to 0), a float16 one from 256; [B, T] is small. Masked entries are
    # set apart with where, so a NaN or inf there changes nothing
    acc = torch.float64
    xv = torch.where(mask, x.to(acc), 0.0)
    m = mask.to(acc)
    if group is None:
        n = m.sum()
        mean = xv.sum() / n.clamp(min=1)
        centred = (xv - mean) * m
        var = (centred * centred).sum() / (n - 1).clamp(min=1)
    else:  # the batch of every rank: sum, sum of squares and count in one all-reduce
        check_group(group, "group")
        stats = torch.stack([m.sum(), xv.sum(), (xv * xv).sum()]).to(torch.float64)
        dist.all_reduce(stats, group=group)
        n, total, sq = stats.to(acc).unbind()
        mean = total / n.clamp(min=1)
        centred = (xv - mean) * m
        # (float64 sums: the one-pass variance keeps its digits at these batch sizes)
        var = ((stats[2] - stats[1] * stats[1] / stats[0].clamp(min=1)).clamp(min=0)
               / (stats[0] - 1).clamp(min=1)).to(acc)
    # (var + eps == 0: a constant input with eps = 0, whose centred values are all 0 and
    # stay so, rather than 0 * inf = NaN)
    scale = torch.where((n > 1) & (var + eps > 0), torch.rsqrt(var + eps), torch.ones_like(var))
    out = centred * scale
    if not shift_mean:
        out = out + mean * m
    return out.to(x.dtype)


_whiten = whiten  # score_rollout's `whiten` flag shadows the function's name


class Rollout(NamedTuple):
    """score_rollout's outputs, float32 [B, T] each, 0 where masked."""

    logprobs: torch.Tensor  # the old_logprobs of the PPO update
    kl: torch.Tensor  # per-token KL estimate against the reference
    rewards: torch.Tensor  # KL-penalised, with the score on the last valid token
    advantages: torch.Tensor  # GAE, whitened over valid tokens when whiten=True
    returns: torch.Tensor  # advantages + values, computed before whitening


# a saved Rollout loads with torch.load's default weights_only=True
torch.serialization.add_safe_globals([Rollout])


def rollout_inputs(tokens2, response_mask, ref_logprobs, values, scores, kl_coef,
                   kl_estimator, gamma, lam, whiten, value_lam=None, lam_alpha=None):
    """score_rollout's checks of everything but the logits (shared with
    score_rollout_from_hidden): (mask, ref, values, kl_coef, gamma, lams), lams the
    GaeLambda of lam, value_lam and lam_alpha."""
    mask = ck.response_mask(response_mask, tokens2, False)
    ref = ck.per_token("ref_logprobs", ref_logprobs, tokens2, False, torch.float32)
    vals = ck.per_token("values", values, tokens2, False, torch.float32)
    _scores(scores, ref)
    kl_coef = ck.number("kl_coef", kl_coef, lo=0.0)
    ck.choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    gamma = ck.number("gamma", gamma, lo=0.0, hi=1.0)
    lams = gae_lambda(lam, value_lam, lam_alpha)
    ck.flag("whiten", whiten)
    return mask, ref, vals, kl_coef, gamma, lams


def rollout_from_logprobs(logp, ref, vals, scores, mask, kl_coef, kl_estimator, gamma, lams,
                          whiten, backend):
    """The [B, T] steps of score_rollout after the log-probs (no gradient): KL-penalised
    rewards, GAE (lams: the GaeLambda of rollout_inputs), whitening. For the paths that get
    the log-probs elsewhere (from hidden states, a split vocabulary, packed sequences)."""
    with torch.no_grad():
        logp = logp.float().contiguous()  # rollout outputs are float32 by contract
        # (what pk.kl_penalized_rewards computes, with the per-token KL it drops)
        rewards, kl = _torch_impl.kl_penalized_rewards(
            scores.detach().float().contiguous(), logp, ref, mask, kl_coef, kl_estimator)
        adv, ret = gae(rewards, vals, mask, gamma=gamma, backend=backend, **lams.options())
        if whiten:
            adv = _whiten(adv, mask)
    return Rollout(logp, kl, rewards, adv, ret)


def score_rollout(logits, tokens, ref_logprobs, values, scores, response_mask, *, kl_coef,
                  kl_estimator="k1", gamma=1.0, lam=0.95, value_lam=None, lam_alpha=None,
                  temperature=1.0, whiten=True, cu_seqlens=None, max_seqlen=None,
                  tp_group=None, vocab_start=None, backend="auto", sampling_mask=None,
                  top_k=None, top_p=None, min_p=None, kl_logprobs="full"):
    """The rollout side in one pass over the logits: logprobs of the sampled tokens, per-token
    KL to the reference, KL-penalised rewards (score on the last valid token), GAE
    advantages and returns, then (optionally) whitened advantages.

    Args:
        logits: [B, T, V] or [B, T + 1, V] of the policy that sampled ``tokens`` (no grad).
        tokens: int [B, T]. ref_logprobs, values: float [B, T]. scores: float [B].
        response_mask: [B, T]. kl_coef: >= 0. kl_estimator: "k1" | "k2" | "k3" | "abs" |
            "k1+" | "k3+" (the "+" estimators give the values of k1 / k3 here: no gradient
            flows).
        gamma, lam, value_lam, lam_alpha: the GAE options of pk.gae (lam may be
            "length-adaptive" with lam_alpha; value_lam the returns' lambda, VAPO's
            decoupled GAE). whiten: whiten the advantages.
        temperature: > 0, a number or a tensor per sequence [B] / [B, 1] or per token
            [B, T] (with cu_seqlens: per packed sequence [S] / [S, 1] or per token
            [total] / [1, total]); as in pk.token_logprobs.
        tp_group, vocab_start: a vocabulary split over ranks, as in pk.token_logprobs (a
            DTensor sharded with Shard(-1) needs neither): the log-probs are merged over the
            group, then the [B, T] steps run on every rank alike.
        cu_seqlens, max_seqlen: packed sequences (as in pk.gae): logits [1, total, V] or
            [total, V], the per-token inputs [1, total] or [total], scores [S]; the outputs
            come back in the packed layout.
        backend: "auto" | "cpu" | "cuda" | "triton" | "torch".
        sampling_mask, top_k, top_p, min_p: sampling replay (pk.token_logprobs,
            docs/SAMPLING.md): out.logprobs are then logp_kept, the old_logprobs that the
            update's replayed ratio compares with; the KL to ref_logprobs uses the full
            log-probs unless kl_logprobs="kept".

    Returns:
        Rollout(logprobs, kl, rewards, advantages, returns), float32 [B, T] each.

    Raises:
        TypeError / ValueError naming the argument.
    """
    def checks():  # no collective: the ranks of tp_group decide validity together
        local, shard = vp.shard_of(logits, tp_group, vocab_start, -1, "logits")
        logits3, tokens2, flat = ck.logits_and_tokens(local, tokens)
        if cu_seqlens is not None:  # the packing's checks are part of the agreed validity
            checked = packed_rollout_inputs(tokens2, tokens, ref_logprobs, values, scores,
                                            response_mask, cu_seqlens, max_seqlen, opts)
            be = get_backend(backend, logits3.device)
            vp.require_kernels(be, shard)
            packing, mask = checked[0], checked[1]
            temp = ck.temperature(packed.packed_temperature(packing, temperature), logits3,
                                  tokens2, False, packing.unpad(mask))
            return logits3, tokens2, shard, (checked, temp, be)
        packed.check_max_seqlen(max_seqlen)
        if flat:
            raise ValueError(f"logits: score_rollout needs [B, T, V] or [B, T + 1, V] (or "
                             f"cu_seqlens for the packed [total, V]), got "
                             f"{list(local.shape)}")
        checked = rollout_inputs(tokens2, response_mask, ref_logprobs, values, scores,
                                 kl_coef, kl_estimator, gamma, lam, whiten, value_lam,
                                 lam_alpha)
        be = get_backend(backend, logits3.device)
        vp.require_kernels(be, shard)
        temp = ck.temperature(temperature, logits3, tokens2, False, checked[0])
        return logits3, tokens2, shard, (*checked, temp, be)

    opts = dict(kl_coef=kl_coef, kl_estimator=kl_estimator, gamma=gamma, lam=lam,
                whiten=whiten, value_lam=value_lam, lam_alpha=lam_alpha)
    logits3, tokens2, shard, checked = checks_together(
        groups(tp_group=tp_group), checks, lambda r: {"tp_group": rollout_sizes(
            r[1], r[3][0][0] if cu_seqlens is not None else None)})
    replay = dict(sampling_mask=sampling_mask, top_k=top_k, top_p=top_p, min_p=min_p,
                  kl_logprobs=ck.choice("kl_logprobs", kl_logprobs, _sampling.KL_LOGPROBS))
    if cu_seqlens is not None:
        return _score_packed(logits3, tokens2, tokens, scores, shard, opts, *checked, backend,
                             replay)
    mask, ref, vals, kl_coef, gamma, lams, temperature, be = checked
    rp = _sampling.check_replay(sampling_mask, top_k, top_p, min_p, tokens2,
                                None if shard is not None else logits3.shape[2],
                                device=device_eager(be, tokens2))
    if rp is not None:
        with torch.no_grad():
            if shard is None:
                tokens2 = ck.token_range(tokens2, mask, logits3.shape[2])
            out = logits_logprobs(be, logits3.detach(), tokens2, mask, temperature, rp, shard)
        lp_k, lp = out[0], out[2]
        r = rollout_from_logprobs(lp_k if kl_logprobs == "kept" else lp, ref, vals, scores,
                                  mask, kl_coef, kl_estimator, gamma, lams, whiten, backend)
        return r._replace(logprobs=lp_k.float())
    if shard is not None:
        with torch.no_grad():
            logp, _ = logits_logprobs(be, logits3.detach(), tokens2, mask, temperature, None,
                                      shard)
        return rollout_from_logprobs(logp, ref, vals, scores, mask, kl_coef, kl_estimator,
                                     gamma, lams, whiten, backend)
    tokens2 = ck.token_range(tokens2, mask, logits3.shape[2])
    if logits3.dtype == torch.float64:
        logits3 = logits3.float()  # rollout outputs are float32 by contract
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.float()
    lam, lam_per_seq, value_lam = lams.kernel_args(mask, torch.float32)
    with torch.no_grad():
        logp, kl, rewards, adv, ret = be.score_rollout(
            logits3.detach(), tokens2, mask, ref.detach(), vals.detach(),
            scores.detach().float().contiguous(), kl_coef, KL_ESTIMATORS.index(kl_estimator),
            gamma, lam, temperature, lam_per_seq, value_lam)
        if whiten:
            adv = _whiten(adv, mask)
    return Rollout(logp, kl, rewards, adv, ret)


def packed_rollout_inputs(tokens2, tokens, ref_logprobs, values, scores, response_mask,
                          cu_seqlens, max_seqlen, opts):
    """score_rollout's checks for packed sequences (shared with score_rollout_from_hidden):
    (packing, the padded mask, ref and values, kl_coef, gamma, lams); opts: kl_coef,
    kl_estimator, gamma, lam, whiten and (optional) value_lam, lam_alpha."""
    if tokens2.shape[0] != 1:
        raise ValueError(f"tokens: with cu_seqlens expected the packed layout [1, total] or "
                         f"[total], got {list(tokens.shape)}")
    packing = packed.packing(cu_seqlens, tokens2.shape[1], tokens2, max_seqlen)
    mask, t = packed.padded_inputs(packing, response_mask, "tokens", tokens2,
                                   ref_logprobs=ref_logprobs, values=values)
    if t["ref_logprobs"] is None or t["values"] is None:
        raise TypeError("ref_logprobs, values: expected tensors, got None")
    mask, ref, vals, kl_coef, gamma, lams = rollout_inputs(
        packing.pad(tokens2), mask, t["ref_logprobs"], t["values"], scores, opts["kl_coef"],
        opts["kl_estimator"], opts["gamma"], opts["lam"], opts["whiten"],
        opts.get("value_lam"), opts.get("lam_alpha"))
    return packing, mask, ref, vals, kl_coef, gamma, lams


def rollout_sizes(tokens2, packing=None):
    """What the ranks of tp_group agree on in score_rollout(_from_hidden): [B, T] of the
    tokens, and with cu_seqlens the number of packed sequences as well."""
    return tuple(tokens2.shape) + (() if packing is None else (packing.num_seqs,))


def _score_packed(logits3, tokens2, tokens, scores, shard, opts, checked, temperature, be,
                  backend, replay=None):
    """score_rollout of packed sequences (checked: packed_rollout_inputs' result, agreed
    over tp_group): the log-probs on the packed rows, the [B, T] steps on the padded copy,
    the outputs packed again (replay: the sampling replay options, or None)."""
    packing, mask, ref, vals, kl_coef, gamma, lams = checked
    mask_k = packing.unpad(mask)
    replay = replay or {}
    rp = _sampling.check_replay(replay.get("sampling_mask"), replay.get("top_k"),
                                replay.get("top_p"), replay.get("min_p"), tokens2,
                                None if shard is not None else logits3.shape[2], packing)
    if rp is not None:
        with torch.no_grad():
            tok = tokens2 if shard is not None else ck.token_range(tokens2, mask_k,
                                                                    logits3.shape[2])
            out = logits_logprobs(be, logits3.detach(), tok, mask_k, temperature, rp, shard)
        lp_k, lp = packing.pad(out[0]), packing.pad(out[2])
        r = rollout_from_logprobs(lp_k if replay["kl_logprobs"] == "kept" else lp, ref, vals,
                                  scores, mask, kl_coef, opts["kl_estimator"], gamma, lams,
                                  opts["whiten"], backend)
        r = r._replace(logprobs=lp_k.float())
        return Rollout(*(packed.unpadded(packing, x, tokens) for x in r))
    with torch.no_grad():
        if shard is not None:
            logp, _ = logits_logprobs(be, logits3.detach(), tokens2, mask_k, temperature,
                                      None, shard)
        else:
            tok = ck.token_range(tokens2, mask_k, logits3.shape[2])
            logp, _ = be.token_logprobs(logits3.detach(), tok, mask_k, temperature, False)
    r = rollout_from_logprobs(packing.pad(logp), ref, vals, scores, mask, kl_coef,
                              opts["kl_estimator"], gamma, lams, opts["whiten"], backend)
    return Rollout(*(packed.unpadded(packing, x, tokens) for x in r))
