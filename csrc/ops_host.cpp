// Schemas of the ops that only the CPU kernels implement: the [B, T]-sized work of a
// ppo_loss call beside the fused pass (ppo_kernels/loss.py), in one op each so that a small
// call dispatches no chain of eager element-wise ops. On a CUDA device their twins are
// Triton launches (triton_kernels/metrics.py, weights.py, seq_loss.py); elsewhere the
// eager torch formulas run (ppo_kernels/_torch_impl.py), whose values these ops give up to
// the summation order.
//   ppo_loss_metrics: the metrics of ppo_loss (docs/DESIGN.md, Metrics) as one float32
//   [len(slots)] vector, entry k the metric slots[k] of ppo_kernels/loss.py METRIC_SLOTS
//   (each slot in [0, len(METRIC_SLOTS))), from logp, entropy
//   (the per-token outputs of the loss, [B, T] of the accumulation dtype), mask bool
//   [B, T], the per-token inputs (old_logprobs None: on-policy), rollout_logprobs and
//   rollout_is_weights for the rollout_* metrics (read only with old_logprobs; weights
//   None: 1), and scalars / codes as ppo_loss_fwd's (every policy_loss id, the
//   sequence-level ones included); kl_logprobs: the log-probs kl_ref reads where they are
//   not logprobs (sampling replay: logprobs over the kept set, these the full ones). Only
//   valid positions are read. Means over valid tokens
//   (or non-empty sequences) are summed in double, divided in the accumulation dtype.
//   agg_weights: the loss_agg_mode weights w [B, T] of the accumulation dtype (0 where
//   masked): mode 0 token-mean (w = 1 / denom, or 1 / max(valid tokens, 1) for
//   denom <= 0), 1 token-sum (w = 1), 2 a constant denominator (w = 1 / denom, denom
//   rounded once to the dtype), 3 seq-mean-token-mean (w = 1 / (max(len_b, 1) * n),
//   n = denom, or max(non-empty sequences, 1) for denom <= 0).
//   seq_loss_grad: GSPO's [B, T] middle (csrc/cpu/seq_loss.cpp; its Triton twin
//   triton_kernels/seq_loss.py): from logprobs, entropy, the per-token inputs as
//   ppo_loss_fwd's (old_logprobs None: on-policy) and scalars / codes with the policy_loss id
//   of gspo or gspo-token, (dlogprobs, dentropy, loss, pol): d loss / d logp and d loss / d H
//   [B, T] (0 where masked), the loss (0-d), the policy part of each token's loss [B, T]
//   (0 where masked), all of the accumulation dtype; sums in double.
//   check_kept_ids: a given kept set's CSR (token_ids int64 [nnz], offsets int64 [N + 1];
//   csrc/ops.cpp, sampling replay) checked on the host in one pass: offsets from 0 to nnz
//   and non-decreasing, ids in [0, vocab) (vocab < 0: not checked), no id twice within a
//   row; the first rule broken is a ValueError naming sampling_mask.offsets or
//   sampling_mask.token_ids (csrc/cpu/sampling.cpp).
//   token_loss_grad: the same middle for the token-level policy losses (the policy_loss id
//   of vanilla, cispo, sapo, dppo-tv or dppo-kl; csrc/cpu/token_middle.cpp, its Triton twin
//   triton_kernels/token_middle.py), the KL on kl_logprobs where given (else on
//   logprobs): (dlogprobs, dentropy, loss, pol, dkl_logprobs), d loss / d kl_logprobs
//   [B, T] where kl_logprobs is given (its part then not in dlogprobs), else empty [0].
//   zeros_grad: a zero tensor of like's shape and dtype, contiguous, from the CPU kernels'
//   recycled gradient memory (csrc/cpu/grad_buffer.h), zeroed in parallel: the start of
//   sampling replay's gradient pass without a dense part (ppo_kernels/rows.py; on a device
//   torch.zeros one fill).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(ppo_kernels, m) {
  m.def(
      "ppo_loss_metrics(Tensor logprobs, Tensor entropy, Tensor mask, Tensor? old_logprobs, "
      "Tensor advantages, Tensor? ref_logprobs, Tensor? rollout_logprobs, "
      "Tensor? rollout_is_weights, float[] scalars, int[] codes, int[] slots, "
      "Tensor? kl_logprobs=None) -> Tensor");
  m.def("agg_weights(Tensor mask, int mode, float denom, bool float64) -> Tensor");
  m.def("check_kept_ids(Tensor token_ids, Tensor offsets, int vocab) -> ()");
  m.def("zeros_grad(Tensor like) -> Tensor");
  m.def(
      "seq_loss_grad(Tensor logprobs, Tensor entropy, Tensor mask, Tensor? old_logprobs, "
      "Tensor advantages, Tensor? ref_logprobs, Tensor? rollout_is_weights, Tensor weights, "
      "Tensor? entropy_weights, float[] scalars, int[] codes) "
      "-> (Tensor dlogprobs, Tensor dentropy, Tensor loss, Tensor pol)");
  m.def(
      "token_loss_grad(Tensor logprobs, Tensor entropy, Tensor mask, Tensor? old_logprobs, "
      "Tensor advantages, Tensor? ref_logprobs, Tensor? rollout_is_weights, Tensor weights, "
      "Tensor? entropy_weights, float[] scalars, int[] codes, Tensor? kl_logprobs=None) "
      "-> (Tensor dlogprobs, Tensor dentropy, Tensor loss, Tensor pol, Tensor dkl_logprobs)");
}
