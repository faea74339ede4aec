"""The PPO loss (and the token log-probs) with the LM head fused in: from the last hidden
states and the LM head weight, never materialising the [N, V] logits (docs/FROM_HIDDEN.md).

The rows of [B, T] (flattened, valid and masked alike) are processed in chunks of
``chunk_size`` rows. Per chunk: logits_c = h_c @ W^T (+ b) in hidden's dtype through torch
(oneDNN / cuBLAS), the optional soft cap z = cap * tanh(x / cap), the existing fused kernel
on the [1, C, V] view of the chunk, writing d loss / d z over the chunk's logits
(ppo_loss_fwd_inplace), times the soft cap's derivative 1 - tanh^2, then
d hidden_c = dz_c @ W, dW += dz_c^T h_c (float32 accumulator for bf16 / fp16 over several
chunks), db += sum dz_c.
All of it in the forward; the backward only rescales the saved (d hidden, dW, db) by
grad_output, in place (ppo_kernels._autograd.hand_out). The aggregation weights of the
whole batch are known before any logit, so each chunk's loss is exactly its share of the total.

The sequence-level losses (gspo, gspo-token, off_policy_mask_threshold) need every logp
before any gradient: a first chunked pass (token_logprobs_fwd) collects logp, H and the row
statistics, the [B, T] middle is that of ppo_kernels/_two_phase.py, and a second chunked
pass recomputes the logits (one more matmul) and writes dz with token_logprobs_bwd.
"""

from __future__ import annotations

import torch

from . import _checks as ck
from . import packed, sampling
from ._autograd import LossWithGrad, wants_grad
from ._backends import device_eager, get_backend
from ._checks import acc_dtype
from ._two_phase import passes, per_token_loss, replay_loss
from .advantages import (packed_rollout_inputs, rollout_from_logprobs, rollout_inputs,
                         rollout_sizes)
from .head_chunks import (Grads, HeadRows, head_options, head_shard, hidden_and_tokens,
                          materialised_logits, softcap_factor_)
from .lm_head import accepts_head_module
from .loss import check_loss, composite_padded, loss_metrics, two_phase, weigh_loss
from .rank_agreement import agreed_sizes, checks_together, groups
from .rows import logits_logprobs, row_logprobs
from .vocab_parallel import require_kernels


class HeadLoss:
    """ppo_loss_from_hidden on a kernel backend, as LossWithGrad runs it: the two-phase
    path on the head's chunks (_two_phase.passes; loss.two_phase says when), else the
    fused single pass over them (fused)."""

    name = "ppo_loss_from_hidden"

    def __init__(self, src, spec, x):
        self.src, self.spec, self.x = src, spec, x
        self.prefix = src.be.prefix

    def loss(self, inputs, need):
        """((loss, logp, H), (d hidden, dW, db), the scale they carry); logp and H in
        the LossInputs' layout."""
        if two_phase(self.spec, self.x, self.src.shard):
            loss, logp, ent, grads, gs, _ = passes(self.src, inputs, self.spec, self.x, need)
            return (loss, logp, ent), grads, gs
        return self.fused(inputs, need)

    def fused(self, inputs, need):
        """Token-level losses: one pass; per chunk the kernel writes d loss / d z over the
        chunk's logits (ppo_loss_fwd_inplace), times the soft cap's derivative (computed
        before the kernel overwrites z), into the accumulators."""
        src, spec, x = self.src, self.spec, self.x
        hidden3 = inputs[0]
        kin = x.kin
        per_tok, per_row = kin.op_tensors(), kin.row_tensors()
        g = Grads(src.n, src.head, *inputs, need)
        loss = torch.zeros((), dtype=src.acc, device=hidden3.device)
        logp, ent = [], []
        scalars, codes = spec.kernel_args(hidden3.dtype)

        def block(blk, hc, z3):
            rows = tuple(blk.rows(v) for v in per_tok)
            trail = tuple(blk.rows(v) for v in per_row)
            if g.any:
                z = z3.view(blk.r1 - blk.r0, -1)
                factor = None if src.cap is None else softcap_factor_(z.clone(), src.cap)
                lc, _, lp, en = src.be.op("ppo_loss_fwd_inplace")(z3, *rows, scalars, codes,
                                                                   *trail)
                if factor is not None:
                    z.mul_(factor)
                    del factor
                g.add(blk, z, hc)
            else:
                lc, _, lp, en, _ = src.be.op("ppo_loss_fwd")(z3, *rows, scalars, codes, False,
                                                             *trail)
            loss.add_(lc)
            logp.append(lp)
            ent.append(en)

        src.each_block(inputs, block)
        logp, ent = src.cat(logp), src.cat(ent)
        out = loss
        if kin.w_ent is not None and spec.entropy_coef != 0.0:
            # as KernelBackend.ppo_loss: the kernel's value sums w * (... - entropy_coef H);
            # the entropy term's own weights are w_ent (its gradient already carries them)
            out = loss + spec.entropy_coef * ((kin.weights - kin.w_ent) * ent).sum()
        grads = g.finish(src.t, *inputs)
        return (out, x.padded(logp), x.padded(ent)), grads, spec.effective_grad_scale(
            hidden3.dtype)


def replay_from_hidden(be, hidden3, weight, bias, tokens, mask, temperature, rp, head,
                       shard=None):
    """(logp_kept, H_kept, logp, H, kept_mass, kept_size, missing) [B, T] of the logits
    hidden @ weight^T (+ bias) as head (a HeadOptions) says; the first four
    differentiable. Kernel backends: chunks of rows, never the [N, V] logits (over a
    split vocabulary the kept partials ride on the statistics' one all-gather); "torch":
    the materialised logits."""
    if not be.is_kernel:
        logits = materialised_logits(hidden3, weight, bias, head.cap, mask, head.logits_dtype)
        return logits_logprobs(be, logits, tokens, mask, temperature, rp)
    src = HeadRows(be, head, tokens, mask, temperature, acc_dtype(hidden3), shard)
    return row_logprobs(src, (hidden3, weight, bias), rp)


def _squeeze(x, flat):
    return x[0] if flat and x is not None and x.dim() == 2 else x


# ------------------------------------------------------------------ public ops

@accepts_head_module  # a head module: the op runs as its forward (lm_head.py)
def token_logprobs_from_hidden(hidden, lm_head_weight, tokens, response_mask=None, *,
                               lm_head_bias=None, logit_softcap=None, temperature=1.0,
                               return_entropy=False, chunk_size=None, tp_group=None,
                               vocab_start=None, backend="auto", logits_dtype=None,
                               sampling_mask=None, top_k=None, top_p=None, min_p=None,
                               return_full=False, entropy_over="full", accum_dtype=None):
    """pk.token_logprobs of the logits hidden @ lm_head_weight^T (+ lm_head_bias), soft-capped
    to cap * tanh(x / cap) with logit_softcap, without storing them: chunks of chunk_size
    rows (None: about 256 MiB of logits per chunk, or a quarter of dW's accumulator where
    that is more: docs/FROM_HIDDEN.md); the backward recomputes each chunk's
    logits (one more matmul). Differentiable in hidden, lm_head_weight and lm_head_bias.

    hidden: [B, T, H], [B, T + 1, H] (the last position is ignored, zero gradient) or
    [N, H]; lm_head_weight [V, H] and lm_head_bias [V] of hidden's dtype and device.
    lm_head_weight may also be the head module (a torch.nn.Linear, FSDP2- or ZeRO-3-wrapped
    alike; lm_head_bias None: its own bias is used): the op then runs as the module's
    forward, inside the framework's hooks (ppo_kernels/lm_head.py, docs/DISTRIBUTED.md).
    Returns logprobs [B, T] (or [N]), or (logprobs, entropy); backend "torch" materialises
    the logits (the reference composite). tp_group / vocab_start: the head's rows split over
    ranks ([V_r, H] here; docs/DISTRIBUTED.md): the whole vocabulary's results on every
    rank, d hidden summed over the group, this shard's dW / db. temperature: a number or a
    tensor per sequence [B] / per token [B, T] ([N] flat), as in pk.token_logprobs.
    logits_dtype: None (the logits in hidden's dtype, as the model's own LM head makes them)
    or torch.float32: with bfloat16 / float16 hidden states and head, each chunk's logits
    are computed and kept in float32 (vLLM's head_dtype=float32, SGLang's
    enable_fp32_lm_head), the gradients into hidden / lm_head_weight / lm_head_bias stay in
    their dtype (docs/FROM_HIDDEN.md, "float32 logits"); float64 hidden states take None.
    accum_dtype: the dtype dW is summed in over the chunks of the backward: None (float32
    for bfloat16 / float16 weights, else the weight's dtype), torch.float32, or the
    weight's dtype (in place: one rounding per chunk, no [V, H] float32 buffer; the
    default of Liger-Kernel's accum_dtype; docs/FROM_HIDDEN.md, "dW's accumulator").
    Errors: a TypeError / ValueError naming the argument (temperature as in
    pk.token_logprobs; logits_dtype other than None / torch.float32; accum_dtype other
    than those three).
    sampling_mask, top_k, top_p, min_p, return_full, entropy_over: sampling replay, as in
    pk.token_logprobs (docs/SAMPLING.md); with tp_group a given sampling_mask only
    (top_k / top_p / min_p with tp_group: NotImplementedError).
    """
    def checks():  # no collective: the ranks of tp_group decide validity together
        h, w, bias, shard = head_shard(hidden, lm_head_weight, lm_head_bias, tp_group,
                                       vocab_start)
        hidden3, tokens2, flat = hidden_and_tokens(h, w, bias, tokens)
        mask = ck.response_mask(response_mask, tokens2, flat)
        t = ck.temperature(temperature, hidden3, tokens2, flat, mask)
        ck.flag("return_entropy", return_entropy)
        head = head_options(hidden3, w, logit_softcap, chunk_size, logits_dtype, accum_dtype)
        be = get_backend(backend, hidden3.device)
        require_kernels(be, shard)
        if shard is None:
            tokens2 = ck.token_range(tokens2, mask, w.shape[0])
        rp = sampling.check_replay(sampling_mask, top_k, top_p, min_p, tokens2,
                                   None if shard is not None else w.shape[0],
                                   device=device_eager(be, tokens2))
        sampling.check_outputs(rp, return_full, entropy_over)
        _vp_given_only(rp, shard)
        return w, bias, shard, hidden3, tokens2, flat, mask, t, head, be, rp

    (lm_head_weight, lm_head_bias, shard, hidden3, tokens2, flat, mask, temperature, head, be,
     rp) = checks_together(groups(tp_group=tp_group), checks,
                           lambda r: {"tp_group": tuple(r[4].shape)})
    if rp is not None:
        lp_k, ent_k, logp, ent, _, _, _ = replay_from_hidden(
            be, hidden3, lm_head_weight, lm_head_bias, tokens2, mask, temperature, rp, head,
            shard)
        return sampling.outputs(lp_k, ent_k, logp, ent, return_full, return_entropy,
                                entropy_over, lambda v: _squeeze(v, flat))
    if not be.is_kernel:
        logits = materialised_logits(hidden3, lm_head_weight, lm_head_bias, head.cap, mask,
                                     head.logits_dtype)
        logp, ent = be.token_logprobs(logits, tokens2, mask, temperature, return_entropy)
    else:
        src = HeadRows(be, head, tokens2, mask, temperature, acc_dtype(hidden3), shard)
        logp, ent = row_logprobs(src, (hidden3, lm_head_weight, lm_head_bias), None,
                                 return_entropy)
        if not return_entropy:
            ent = None
    logp, ent = _squeeze(logp, flat), _squeeze(ent, flat)
    return (logp, ent) if return_entropy else logp


@accepts_head_module  # a head module: the op runs as its forward (lm_head.py)
def ppo_loss_from_hidden(hidden, lm_head_weight, tokens, old_logprobs, advantages,
                         response_mask=None, ref_logprobs=None, *, lm_head_bias=None,
                         logit_softcap=None, chunk_size=None, tp_group=None, vocab_start=None,
                         cp_group=None, logits_dtype=None, accum_dtype=None, **loss_options):
    """pk.ppo_loss(hidden @ lm_head_weight^T (+ lm_head_bias), ...) without the [N, V]
    logits ever being stored (docs/FROM_HIDDEN.md).

    Args:
        hidden: [B, T, H], [B, T + 1, H] (last position ignored, zero gradient) or [N, H];
            float32, bfloat16, float16 or float64.
        lm_head_weight: [V, H], hidden's dtype and device (a frozen head, a LoRA-wrapped
            or embedding-tied weight: any tensor; a gradient only where it requires one).
            Or the head module itself (torch.nn.Linear; FSDP2's fully_shard or ZeRO-3
            wrapped alike, lm_head_bias None): the op runs as its forward, so the
            framework's hooks gather the weight and reduce its gradient
            (ppo_kernels/lm_head.py, docs/DISTRIBUTED.md); another module is a TypeError.
        lm_head_bias: [V] or None.
        logit_softcap: None or cap > 0: logits z = cap * tanh(x / cap) (Gemma 2).
        chunk_size: rows of [B, T] per chunk, >= 1; None: about 256 MiB of logits (in
            hidden's dtype) per chunk, or where that is more half dW's accumulator (a
            gradient into lm_head_weight) over the chunk buffers the path holds (one on
            the fused single pass, two on the others; docs/FROM_HIDDEN.md), at least 1
            row.
        tp_group, vocab_start: the head's rows split over ranks (lm_head_weight [V_r, H],
            lm_head_bias [V_r]; a DTensor head sharded with Shard(0) needs tp_group, its
            mesh's group, and no vocab_start: without it the weight could as well be
            FSDP2's shard, a ValueError): every policy loss then runs the two chunked
            passes with the statistics merged in between (one all-gather of 24 bytes per
            row) and d hidden summed over the group (one
            all-reduce); docs/DISTRIBUTED.md.
        cp_group: context parallel, as in pk.ppo_loss.
        logits_dtype: None (hidden's dtype) or torch.float32: each chunk's logits in
            float32 from bfloat16 / float16 hidden states and head (as in
            token_logprobs_from_hidden; docs/FROM_HIDDEN.md).
        accum_dtype: the dtype dW is summed in over the chunks: None (float32 for
            bfloat16 / float16 weights, else the weight's dtype), torch.float32, or the
            weight's dtype: summed in place, one rounding to it per chunk, without the
            [V, H] float32 buffer (Liger-Kernel's default; docs/FROM_HIDDEN.md, "dW's
            accumulator").
        **loss_options: every keyword of pk.ppo_loss (policy_loss, clip_eps_*, kl_*,
            entropy_*, temperature, loss_agg_mode, global counts, rollout_*, grad_scale,
            backend, ...), checked by the same code (loss.check_loss; an unknown keyword
            is a TypeError). inplace_backward is accepted and has no effect (the
            chunks' logits are always overwritten by their gradient; nothing of the
            caller's is). loss_agg_mode="none" goes through
            token_logprobs_from_hidden.
        backend: "auto" | "cpu" | "cuda" | "triton" | "torch" ("torch" materialises the
            logits and runs pk.ppo_loss(backend="torch"): the reference composite).

    Returns:
        (loss, metrics) as pk.ppo_loss; the gradient flows to hidden, lm_head_weight and
        lm_head_bias (those that require it). All of it is computed in the forward; the
        backward only rescales it by grad_output (no pass when grad_output == grad_scale).
    """
    options = dict(loss_options, old_logprobs=old_logprobs, advantages=advantages,
                   response_mask=response_mask, ref_logprobs=ref_logprobs, cp_group=cp_group)
    def checks(options):  # no collective: the ranks of tp_group / cp_group decide together
        h, w, bias, shard = head_shard(hidden, lm_head_weight, lm_head_bias, tp_group,
                                       vocab_start)
        hidden3, tokens2, flat = hidden_and_tokens(h, w, bias, tokens)
        spec, x, pending = check_loss(hidden3, None if shard else w.shape[0], tokens2, flat,
                                      options)
        require_kernels(x.be, shard)
        # one chunk buffer in the fused single pass without a soft cap, else two
        single = logit_softcap is None and spec.loss_agg_mode != "none" and \
            not two_phase(spec, x, shard)
        head = head_options(hidden3, w, logit_softcap, chunk_size, logits_dtype, accum_dtype,
                            1 if single else 2)
        return w, bias, shard, hidden3, head, spec, x, pending

    lm_head_weight, lm_head_bias, shard, hidden3, head, spec, x, pending = \
        checks_together(groups(tp_group=tp_group, cp_group=cp_group), checks,
                        lambda r: agreed_sizes(r[6]), options)
    x = weigh_loss(spec, x, pending)
    kin = x.kin  # the packed layout again, with cu_seqlens
    temp = kin.temperature(spec)
    diff = (hidden3, lm_head_weight, lm_head_bias)
    if x.replay is not None:
        _vp_given_only(x.replay, shard)
        # (the kept-set statistics chunk by chunk; the [B, T] loss by autograd on them, the
        # backward recomputing each chunk's logits; over a split vocabulary the kept
        # partials ride on each chunk's statistics all-gather)
        out = replay_from_hidden(x.be, hidden3, lm_head_weight, lm_head_bias, kin.tokens,
                                 kin.mask, temp, x.replay, head, shard)
        lp_k, ent_k, logp, ent, mass, size, missing = (x.padded(v) for v in out)
        loss, ent_sel = replay_loss(spec, x, lp_k, ent_k, logp, ent)
        return loss, loss_metrics(spec, x, lp_k.detach(), ent_sel.detach(),
                                  (logp.detach(), mass, size, missing))
    if x.weights is None:
        logp, ent = token_logprobs_from_hidden(
            hidden3, lm_head_weight, kin.tokens, kin.mask, lm_head_bias=lm_head_bias,
            logit_softcap=head.cap, temperature=temp, return_entropy=True,
            chunk_size=head.chunk, tp_group=None if shard is None else shard.group,
            vocab_start=None if shard is None else shard.start, backend=x.be.name,
            logits_dtype=head.logits_dtype, accum_dtype=head.accum_dtype)
        logp, ent = x.padded(logp), x.padded(ent)
        loss = per_token_loss(spec, x, logp, ent)
    elif not x.be.is_kernel:
        logits = materialised_logits(*diff, head.cap, kin.mask, head.logits_dtype)
        if two_phase(spec, x, shard):
            loss, logp, ent = composite_padded(spec, x, logits)
        else:
            loss, _, logp, ent = x.be.ppo_loss(logits, kin, spec)
            logp, ent = x.padded(logp), x.padded(ent)
    else:
        run = HeadLoss(HeadRows(x.be, head, kin.tokens, kin.mask, temp, x.acc, shard), spec,
                       x)
        if wants_grad(*diff):
            loss, logp, ent = LossWithGrad.apply(run, *diff)
        else:
            loss, logp, ent = run.loss(diff, (False, False, False))[0]
    return loss, loss_metrics(spec, x, logp, ent)


@accepts_head_module  # a head module: the op runs as its forward (lm_head.py)
def score_rollout_from_hidden(hidden, lm_head_weight, tokens, ref_logprobs, values, scores,
                              response_mask, *, lm_head_bias=None, logit_softcap=None,
                              chunk_size=None, kl_coef, kl_estimator="k1", gamma=1.0,
                              lam=0.95, value_lam=None, lam_alpha=None, temperature=1.0,
                              whiten=True, cu_seqlens=None, max_seqlen=None, tp_group=None,
                              vocab_start=None, backend="auto", logits_dtype=None,
                              sampling_mask=None, top_k=None, top_p=None, min_p=None,
                              kl_logprobs="full"):
    """pk.score_rollout of the logits hidden @ lm_head_weight^T (+ lm_head_bias), soft-capped
    with logit_softcap, without storing them (docs/FROM_HIDDEN.md): the log-probs come from
    token_logprobs_from_hidden (chunks of chunk_size rows, no gradient), then the same
    [B, T] steps as pk.score_rollout: KL-penalised rewards, GAE, whitening.

    Args:
        hidden: [B, T, H] or [B, T + 1, H] (the last position is ignored) of the policy
            that sampled ``tokens``; lm_head_weight [V, H], lm_head_bias [V] or None, of
            hidden's dtype and device. No gradient flows to any of them.
        tokens, ref_logprobs, values, scores, response_mask, kl_coef, kl_estimator, gamma,
        lam, value_lam, lam_alpha, temperature, whiten, cu_seqlens, max_seqlen, backend: as
            pk.score_rollout
            (cu_seqlens: hidden [1, total, H] or [total, H]).
        logit_softcap, chunk_size, tp_group, vocab_start, logits_dtype: as
            token_logprobs_from_hidden.
        sampling_mask, top_k, top_p, min_p, kl_logprobs: sampling replay as in
            pk.score_rollout (docs/SAMPLING.md); with tp_group a given sampling_mask only
            (top_k / top_p / min_p with tp_group: NotImplementedError).

    Returns:
        Rollout(logprobs, kl, rewards, advantages, returns), float32 [B, T] each, 0 where
        masked.
    """
    opts = dict(kl_coef=kl_coef, kl_estimator=kl_estimator, gamma=gamma, lam=lam,
                whiten=whiten, value_lam=value_lam, lam_alpha=lam_alpha)

    def checks():  # no collective: the ranks of tp_group decide validity together,
        # the packing's checks included
        h, w, bias, shard = head_shard(hidden, lm_head_weight, lm_head_bias, tp_group,
                                       vocab_start)
        hidden3, tokens2, flat = hidden_and_tokens(h, w, bias, tokens)
        if cu_seqlens is not None:
            checked = packed_rollout_inputs(tokens2, tokens, ref_logprobs, values, scores,
                                            response_mask, cu_seqlens, max_seqlen, opts)
            return w, bias, shard, hidden3, tokens2, checked
        packed.check_max_seqlen(max_seqlen)
        if flat:
            raise ValueError(f"hidden: score_rollout_from_hidden needs [B, T, H] or "
                             f"[B, T + 1, H] (or cu_seqlens for the packed [total, H]), got "
                             f"{list(h.shape)}")
        checked = rollout_inputs(tokens2, response_mask, ref_logprobs, values, scores,
                                 kl_coef, kl_estimator, gamma, lam, whiten, value_lam,
                                 lam_alpha)
        return w, bias, shard, hidden3, tokens2, checked

    lm_head_weight, lm_head_bias, shard, hidden3, tokens2, checked = checks_together(
        groups(tp_group=tp_group), checks,
        lambda r: {"tp_group": rollout_sizes(r[4], r[5][0] if cu_seqlens is not None
                                             else None)})
    packing = None
    if cu_seqlens is not None:
        packing, mask, ref, vals, kl_coef, gamma, lams = checked
        mask_k = packing.unpad(mask)
        temperature = packed.packed_temperature(packing, temperature)
    else:
        mask, ref, vals, kl_coef, gamma, lams = checked
        mask_k = mask
    ck.choice("kl_logprobs", kl_logprobs, sampling.KL_LOGPROBS)
    rp = sampling.check_replay(sampling_mask, top_k, top_p, min_p, tokens2,
                               None if shard is not None else lm_head_weight.shape[0], packing)
    lp_k = None
    with torch.no_grad():
        kw = dict(lm_head_bias=None if lm_head_bias is None else lm_head_bias.detach(),
                  logit_softcap=logit_softcap, temperature=temperature, chunk_size=chunk_size,
                  tp_group=None if shard is None else shard.group,
                  vocab_start=None if shard is None else shard.start, backend=backend,
                  logits_dtype=logits_dtype)
        if rp is None:
            logp = token_logprobs_from_hidden(hidden3.detach(), lm_head_weight.detach(),
                                              tokens2, mask_k, **kw)
        else:
            # (the packed layout's CSR rows and per-sequence parameters, already checked)
            lp_k, logp = _replay_no_grad(hidden3, lm_head_weight, tokens2, mask_k, rp, kw)
            if kl_logprobs == "kept":
                logp = lp_k
    pad = (lambda v: v) if packing is None else packing.pad
    r = rollout_from_logprobs(pad(logp), ref, vals, scores, mask, kl_coef, kl_estimator,
                              gamma, lams, whiten, backend)
    if lp_k is not None:
        r = r._replace(logprobs=pad(lp_k).float())
    if packing is None:
        return r
    return type(r)(*(packed.unpadded(packing, x, tokens) for x in r))


def _vp_given_only(rp, shard):
    """Over a split vocabulary only given kept sets (sampling_mask) replay: re-deriving
    top_k / top_p / min_p sets needs a global selection (not implemented)."""
    if shard is not None and rp is not None and not rp.given:
        raise NotImplementedError("top_k / top_p / min_p with tp_group: re-deriving the kept "
                                  "sets over a split vocabulary is not implemented; pass the "
                                  "engine's sampling_mask")


def _replay_no_grad(hidden3, weight, tokens2, mask, rp, kw):
    """(logp_kept, logp) for kept sets already checked (score_rollout_from_hidden)."""
    h, w, bias, shard = head_shard(hidden3.detach(), weight.detach(), kw["lm_head_bias"],
                                   kw["tp_group"], kw["vocab_start"])
    _vp_given_only(rp, shard)
    head = head_options(h, w, kw["logit_softcap"], kw["chunk_size"], kw["logits_dtype"])
    be = get_backend(kw["backend"], h.device)
    require_kernels(be, shard)
    out = replay_from_hidden(be, h, w, bias, tokens2, mask,
                             ck.temperature(kw["temperature"], h, tokens2, False, mask), rp,
                             head, shard)
    return out[0], out[2]
