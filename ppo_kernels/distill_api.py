"""pk.distill_loss: top-k distillation on logits, on one shard of the vocabulary
(ppo_kernels/distill.py: the checks, the kernel and eager terms) or on a vocabulary split
over tp_group (ppo_kernels/distill_tp.py). The from-hidden face is distill_hidden.py's."""

from __future__ import annotations

from .distill import check_call, finish_loss, kernel_terms, logits_of, metrics_of, torch_terms
from .distill_tp import distill_loss_tp


def distill_loss(logits, teacher, response_mask=None, *, tail=True, temperature=1.0,
                 loss_agg_mode="token-mean", global_num_tokens=None, global_num_seqs=None,
                 norm_length=None, grad_scale=1.0, cu_seqlens=None, max_seqlen=None,
                 tp_group=None, vocab_start=None, backend="auto"):
    """Top-k distillation loss: the forward KL from a teacher's top-k distribution to the
    student's, per position, aggregated by loss_agg_mode, with its metrics.

    kl_i = sum_{j in S_i} pT_j (log pT_j - log pS_j)
           + [tail] (1 - PT) (log(1 - PT) - log(1 - PS))
    with pS = softmax(logits / temperature), PT, PS the two masses on the set S_i (module
    docstring; GKD arXiv:2306.13649, verl / open-instruct on-policy distillation, Thinking
    Machines 2025; docs/LOSSES.md). On the kernel backends the gradient with respect to the
    logits is written in the forward pass (no [N, V] intermediate besides it) and the
    backward only scales it, as for ppo_loss.

    Args:
        logits: [B, T, V], [B, T + 1, V] (the raw output: the last position is ignored and
            gets a zero gradient) or [N, V]; float32, bfloat16, float16 or float64.
        teacher: SparseLogprobs(token_ids [nnz] int, offsets [N + 1] int64, logprobs
            [nnz] float), the teacher's log-probs on its set of ids per position, CSR over
            the N = B * T positions in row-major order; ids distinct within a position, in
            [0, V); log-probs <= 0 (or -inf), mass sum exp <= 1 (+ MASS_TOLERANCE = 1e-3)
            per position. An empty set contributes 0.
        response_mask: [B, T] (or [N]), nonzero = valid; None = all valid. Masked
            positions' sets are not read (their ids and log-probs may be anything).
        tail: add the tail bucket (1 - PT) (log(1 - PT) - log(1 - PS)); False: the sum over
            the set only (the teacher's top-k, unnormalised).
        temperature: > 0, the student's logits are divided by it.
        loss_agg_mode, global_num_tokens, global_num_seqs, norm_length: as in ppo_loss
            ("none": the per-token kl [B, T], 0 where masked, differentiable).
        grad_scale: > 0, as in ppo_loss (a hint: the gradient is written pre-scaled).
        cu_seqlens, max_seqlen: packed sequences, as in ppo_loss (logits [1, total, V] or
            [total, V], the CSR over the total positions); only the seq-mean modes and
            num_seqs read the sequences.
        tp_group, vocab_start: a vocabulary split over the ranks of tp_group: logits
            [.., V_r] are this rank's slice [vocab_start, vocab_start + V_r) (default
            rank * V_r), teacher ids stay global; a DTensor sharded on the vocabulary
            (Shard(-1)) takes the same path without them. The loss and metrics are the whole
            vocabulary's, the same on every rank; the gradient is this rank's shard's
            (ppo_kernels/distill_tp.py: torch ops on the shard, one all-gather of 9
            numbers per row; docs/DISTRIBUTED.md). Any backend.
        backend: "auto" | "cpu" | "cuda" | "triton" | "torch".

    Returns:
        (loss, metrics): loss 0-d float32 (float64 for float64 logits), or the per-token
        kl for "none"; metrics 0-d float32 tensors without gradient: kl (mean over valid
        tokens of kl_i), student_mass (mean PS), teacher_tail_mass (mean 1 - PT, 0 for a
        whole-vocabulary set), num_tokens, num_seqs.

    Raises:
        TypeError / ValueError naming the argument (teacher.token_ids out of range or
        repeated within a position, teacher.offsets not starting at 0, decreasing, not
        ending at nnz or of the wrong N, teacher.logprobs > 0, NaN or a set's mass > 1 +
        tolerance, and every ppo_loss check of the shared options). With tp_group the
        ranks decide validity together: a bad input on one rank, shards that do not tile
        the vocabulary, a teacher id in no shard, or ranks whose sets or masks differ (by
        entry count or id sum) are the same ValueError on every rank.
    """
    opts = dict(tail=tail, temperature=temperature, loss_agg_mode=loss_agg_mode,
                grad_scale=grad_scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                tp_group=tp_group, vocab_start=vocab_start, global_num_tokens=global_num_tokens,
                global_num_seqs=global_num_seqs, norm_length=norm_length, backend=backend)
    if tp_group is not None or vocab_start is not None or hasattr(logits, "to_local"):
        return distill_loss_tp(logits, teacher, response_mask, opts)
    logits3, flat = logits_of(logits)
    opts["flat"] = flat
    c, tail, temperature, gs = check_call(logits3, logits3.shape[2], teacher, response_mask,
                                          opts)
    if c.be.is_kernel:
        loss, kl, ps, tt = kernel_terms(c, logits3, tail, temperature, gs)
    else:
        loss, kl, ps, tt = torch_terms(c, logits3, tail, temperature)
    return finish_loss(c, loss, kl), metrics_of(c, kl, ps, tt)
