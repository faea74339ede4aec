// Operator schemas of ppo_kernels; the kernels register implementations per device
// (csrc/cpu/*.cpp for CPU, csrc/cuda/*.cu for CUDA) and ppo_kernels/_autograd.py registers the
// fake (meta) and autograd formulas. Shapes and conventions, shared by every backend:
//   logits [B, Tl, V] with stride(2) == 1 and Tl >= T (Tl = T + 1 for the model's raw
//   output; the positions t >= T are ignored and get a zero gradient); tokens int64 [B, T];
//   mask bool [B, T]; every other per-token tensor [B, T] of the accumulation dtype
//   (float64 for float64 logits, else float32); per-token outputs of that dtype; dlogits
//   the shape and dtype of logits, contiguous. scalars / codes: the loss options in the
//   slot order of ppo_kernels/spec.py (FLOAT_SLOTS, INT_SLOTS; ppo::slot in ppo_math.h);
//   dual_clip_c <= 0 means no dual clip. weights are the loss_agg_mode weights w_i,
//   entropy_weights those of entropy_agg_mode (None: weights). old_logprobs None is
//   on-policy: old = logp (rho = 1, d rho / d logp = 1). The policy_loss and kl_estimator
//   codes are the ids of ppo_kernels/spec.py (POLICY_LOSSES, KL_ESTIMATORS); the kernels run
//   the token-level losses 0 vanilla, 1 cispo, 2 sapo. score_rollout's kl_estimator too.
//   row_max / log_sum: the raw max logit of a row and log sum_v exp((x_v - row_max) /
//   temperature), taken as log1p of the non-top mass (what the backward needs to rebuild
//   log p_v = (x_v - row_max) / temperature - log_sum with every digit). grad_scale: the
//   written dlogits are grad_scale * d loss / d logits (the loss itself is unscaled);
//   scale_grad_ is the backward's in-place rescale (see ppo_kernels/_autograd.py).
//   gae / score_rollout's GAE (ppo_kernels/advantages.py): the advantages use lambda_b =
//   lam_per_seq[b] ([B] of the accumulation dtype, each in [0, 1]; VAPO's length-adaptive
//   lambda) when given, else lam; returns = the GAE of value_lam (a second scan, VAPO's
//   decoupled lambda) + values when value_lam is given, else advantages + values.
//   temperatures: the per-row temperature, [B, T] of the accumulation dtype (float32 for
//   score_rollout), contiguous; None: the float `temperature` (or the temperature slot of
//   scalars) for every row. When given, row i divides its logits by temperatures[i] (1 /
//   temperatures[i] taken in double and rounded once, as the scalar's) and the scalar is
//   ignored; masked rows are not read. The Python layer expands a per-sequence [B]
//   temperature to [B, T] and fills masked positions with 1. A new per-row tensor option of
//   the ppo_loss ops goes at the end of both schemas, `Tensor? name=None` (a call without
//   it is unchanged); the Python layer hands them over in that order
//   (loss.KernelInputs.row_tensors), the kernels read them by name (csrc/loss_args.h).
// Sampling replay (docs/SAMPLING.md): a row's kept set is given either as CSR kept_ids
//   (int64 [nnz], global vocabulary ids, unique per row) + kept_offsets (int64 [B * T + 1],
//   rows in row-major order) or as threshold (float64 [B, T], raw logit units: the kept set
//   is {j : logits_j >= threshold}, -inf keeps every entry); exactly one of the two. The
//   sampled token is always kept (missing: it was added). sampling_threshold: vLLM v1's
//   min-p, top-k, top-p set of each row as that threshold (top_k int64 [B, T], V or more
//   = off; top_p float64 [B, T], 1 = off; min_p float64 [B, T], 0 = off). kept_max /
//   kept_log_sum: row_max / log_sum over the kept set; kept_logprobs_bwd_ adds its
//   gradient into dlogits (contiguous, the logits' shape and dtype), kept_logprobs_bwd
//   returns it as a new tensor (0 off the kept sets, on masked rows and rows T..Tl-1).
//   temperatures: as above (the threshold of a row is taken on that row's
//   temperature-scaled logits; 1 / temperatures[i] in double, as the scalar's 1 /
//   temperature).
#include <torch/library.h>

TORCH_LIBRARY(ppo_kernels, m) {
  m.def(
      "token_logprobs_fwd(Tensor logits, Tensor tokens, Tensor mask, float temperature, "
      "bool return_entropy, Tensor? temperatures=None) -> (Tensor logprobs, Tensor entropy, "
      "Tensor row_max, Tensor log_sum)");
  m.def(
      "token_logprobs_bwd(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, "
      "Tensor tokens, Tensor mask, Tensor row_max, Tensor log_sum, Tensor entropy, "
      "float temperature, Tensor? temperatures=None) -> Tensor");
  m.def(
      "ppo_loss_fwd(Tensor logits, Tensor tokens, Tensor mask, Tensor? old_logprobs, "
      "Tensor advantages, Tensor weights, Tensor? ref_logprobs, Tensor? rollout_is_weights, "
      "Tensor? entropy_weights, float[] scalars, int[] codes, bool compute_grad, "
      "Tensor? temperatures=None) "
      "-> (Tensor loss, Tensor loss_tok, Tensor logprobs, Tensor entropy, Tensor dlogits)");
  // Same as ppo_loss_fwd with compute_grad, but the gradient overwrites the logits.
  m.def(
      "ppo_loss_fwd_inplace(Tensor(a!) logits, Tensor tokens, Tensor mask, "
      "Tensor? old_logprobs, Tensor advantages, Tensor weights, Tensor? ref_logprobs, "
      "Tensor? rollout_is_weights, Tensor? entropy_weights, float[] scalars, int[] codes, "
      "Tensor? temperatures=None) "
      "-> (Tensor loss, Tensor loss_tok, Tensor logprobs, Tensor entropy)");
  // grad := grad * (grad_output / applied) and applied := grad_output, decided on the
  // device (no host read): nothing is written when the ratio is 1.
  m.def("scale_grad_(Tensor(a!) grad, Tensor grad_output, Tensor(b!) applied) -> ()");
  m.def(
      "sampling_threshold(Tensor logits, Tensor mask, float temperature, Tensor? top_k, "
      "Tensor? top_p, Tensor? min_p, Tensor? temperatures=None) -> Tensor");
  m.def(
      "kept_logprobs_fwd(Tensor logits, Tensor tokens, Tensor mask, float temperature, "
      "Tensor? kept_ids, Tensor? kept_offsets, Tensor? threshold, Tensor? temperatures=None) "
      "-> (Tensor logprobs, "
      "Tensor entropy, Tensor kept_max, Tensor kept_log_sum, Tensor kept_size, "
      "Tensor missing)");
  // sampling_threshold, then kept_logprobs_fwd on that threshold: one op (a row read while
  // it is in cache or on chip), its threshold the last output
  m.def(
      "threshold_kept_fwd(Tensor logits, Tensor tokens, Tensor mask, float temperature, "
      "Tensor? top_k, Tensor? top_p, Tensor? min_p, Tensor? temperatures=None) "
      "-> (Tensor logprobs, Tensor entropy, Tensor kept_max, Tensor kept_log_sum, "
      "Tensor kept_size, Tensor missing, Tensor threshold)");
  m.def(
      "kept_logprobs_bwd_(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, "
      "Tensor tokens, Tensor mask, Tensor kept_max, Tensor kept_log_sum, Tensor entropy, "
      "float temperature, Tensor? kept_ids, Tensor? kept_offsets, Tensor? threshold, "
      "Tensor(a!) dlogits, Tensor? temperatures=None) -> ()");
  m.def(
      "kept_logprobs_bwd(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, "
      "Tensor tokens, Tensor mask, Tensor kept_max, Tensor kept_log_sum, Tensor entropy, "
      "float temperature, Tensor? kept_ids, Tensor? kept_offsets, Tensor? threshold, "
      "Tensor? temperatures=None) -> Tensor");
  m.def(
      "gae(Tensor rewards, Tensor values, Tensor mask, Tensor? bootstrap_values, "
      "float gamma, float lam, Tensor? lam_per_seq=None, float? value_lam=None) "
      "-> (Tensor advantages, Tensor returns)");
  m.def(
      "score_rollout(Tensor logits, Tensor tokens, Tensor mask, Tensor ref_logprobs, "
      "Tensor values, Tensor scores, float kl_coef, int kl_estimator, float gamma, "
      "float lam, float temperature, Tensor? lam_per_seq=None, float? value_lam=None, "
      "Tensor? temperatures=None) "
      "-> (Tensor logprobs, Tensor kl, Tensor rewards, Tensor advantages, Tensor returns)");
}

// Top-k distillation (ppo_kernels.distill_loss, ppo_kernels/distill.py): logits [B, Tl, V]
// as above, mask bool [B, T]; the teacher's sets in CSR over the N = B * T positions in
// row-major order: offsets int64 [N + 1] (non-decreasing indices into token_ids: the
// whole CSR starts at 0 and ends at nnz, a chunk's view of it anywhere), token_ids
// int64 [nnz] (distinct within a position, in [0, V)), teacher_logprobs [nnz] of the
// accumulation dtype; weights [B, T] the loss_agg_mode weights. Per position kl (the forward
// KL from the teacher's top-k distribution to the student's, plus the tail bucket when
// tail), student_mass (sum of the student's p on the set), teacher_tail (1 - the teacher's
// mass, 0 for a whole-vocabulary set); loss = sum_i weights_i kl_i; dlogits =
// grad_scale * d loss / d logits (compute_grad), as ppo_loss_fwd's.
TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.def(
      "distill_fwd(Tensor logits, Tensor mask, Tensor offsets, Tensor token_ids, "
      "Tensor teacher_logprobs, Tensor weights, float temperature, float grad_scale, "
      "bool tail, bool compute_grad) -> (Tensor loss, Tensor kl, Tensor student_mass, "
      "Tensor teacher_tail, Tensor dlogits)");
}
