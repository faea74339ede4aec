// The ppo_loss ops' arguments beyond the rows (csrc/row_args.h): `float[] scalars` and
// `int[] codes` (csrc/ops.cpp) as the PolicyParams of the per-token math, and the per-token
// tensors as one LossTensors, with the checks every backend makes of them (the Python layer
// has already checked each value against its keyword: these catch a direct call of the op).
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "ppo_math.h"
#include "row_args.h"

namespace ppo {

inline PolicyParams loss_params(c10::ArrayRef<double> scalars, c10::ArrayRef<int64_t> codes,
                                bool has_ref, bool has_is_weights) {
  TORCH_CHECK(scalars.size() == static_cast<size_t>(slot::kNumFloat), "scalars: expected ",
              static_cast<int>(slot::kNumFloat),
              " numbers in the slot order of ppo_kernels/spec.py FLOAT_SLOTS, got ",
              scalars.size());
  TORCH_CHECK(codes.size() == static_cast<size_t>(slot::kNumInt), "codes: expected ",
              static_cast<int>(slot::kNumInt),
              " integers in the slot order of ppo_kernels/spec.py INT_SLOTS, got ", codes.size());
  const PolicyParams p = policy_params(scalars.data(), codes.data(), has_ref, has_is_weights);
  const int est = p.code(slot::kl_estimator), pl = p.code(slot::policy_loss);
  check_kl_estimator(est);
  TORCH_CHECK(kernel_policy_loss(pl),
              "policy_loss: expected the id of a token-level policy loss (ppo_kernels/spec.py "
              "KERNEL_POLICY_LOSSES), got ", pl);
  const double gs = p[slot::grad_scale];
  TORCH_CHECK(std::isfinite(gs) && gs > 0, "grad_scale: expected a finite number > 0, got ", gs);
  if (pl == kSapo) {
    const double a = p[slot::sapo_tau_pos], b = p[slot::sapo_tau_neg];
    TORCH_CHECK(std::isfinite(a) && a > 0 && std::isfinite(b) && b > 0,
                "sapo_tau_pos / sapo_tau_neg: expected finite numbers > 0, got ", a, " / ", b);
  }
  return p;
}

// The per-token inputs of ppo_loss_fwd / ppo_loss_fwd_inplace: [B, T] of the accumulation
// dtype, contiguous. old_logprobs none: on-policy; entropy_weights none: weights.
struct LossTensors {
  std::optional<at::Tensor> old_logprobs;
  at::Tensor advantages, weights;
  std::optional<at::Tensor> ref_logprobs, rollout_is_weights, entropy_weights;
};

// The one reading of the ppo_loss ops' arguments: (rows, per-token tensors, options), each
// checked once (the temperature is the scalars' slot).
struct LossArgs {
  RowArgs rows;
  LossTensors in;
  PolicyParams params;
};

inline LossArgs loss_args(const at::Tensor& logits, const at::Tensor& tokens,
                          const at::Tensor& mask, const std::optional<at::Tensor>& old_logprobs,
                          const at::Tensor& advantages, const at::Tensor& weights,
                          const std::optional<at::Tensor>& ref_logprobs,
                          const std::optional<at::Tensor>& rollout_is_weights,
                          const std::optional<at::Tensor>& entropy_weights,
                          c10::ArrayRef<double> scalars, c10::ArrayRef<int64_t> codes,
                          const std::optional<at::Tensor>& temperatures) {
  const PolicyParams p = loss_params(scalars, codes, ref_logprobs.has_value(),
                                     rollout_is_weights.has_value());
  RowArgs r = row_args(logits, tokens, mask, p[slot::temperature], temperatures);
  LossTensors in{r.per_token(old_logprobs, "old_logprobs"),
                 r.per_token(advantages, "advantages"),
                 r.per_token(weights, "weights"),
                 r.per_token(ref_logprobs, "ref_logprobs"),
                 r.per_token(rollout_is_weights, "rollout_is_weights"),
                 r.per_token(entropy_weights, "entropy_weights")};
  return {std::move(r), std::move(in), p};
}

}  // namespace ppo
