// The ppo_loss ops' arguments beyond the rows (csrc/row_args.h): `float[] scalars` and
// `int[] codes` (csrc/ops.cpp) as the PolicyParams of the per-token math, and the per-token
// tensors as one LossTensors, with the checks every backend makes of them (the Python layer
// has already checked each value against its keyword: these catch a direct call of the op).
// The CPU and CUDA kernels of these ops are boxed (torch::CppFunction::makeFromBoxedFunction):
// they read their arguments by schema name from the dispatcher's stack (OpArgs), so the
// schema in csrc/ops.cpp is the one positional list of them, and an argument added there is
// read here once for both devices.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

#include "ppo_math.h"
#include "row_args.h"

namespace ppo {

// The float[] / int[] of the loss ops in slot order, checked for what every one of them
// reads: their counts, codes that fit the kernels' int (a truncated 2^32 + 5 would pass for
// 5), a known KL estimator, kl_bias_correction 0 or 1. The policy loss is each op's to check.
inline PolicyParams slot_params(c10::ArrayRef<double> scalars, c10::ArrayRef<int64_t> codes,
                                bool has_ref, bool has_is_weights) {
  TORCH_CHECK(scalars.size() == static_cast<size_t>(slot::kNumFloat), "scalars: expected ",
              static_cast<int>(slot::kNumFloat),
              " numbers in the slot order of ppo_kernels/spec.py FLOAT_SLOTS, got ",
              scalars.size());
  TORCH_CHECK(codes.size() == static_cast<size_t>(slot::kNumInt), "codes: expected ",
              static_cast<int>(slot::kNumInt),
              " integers in the slot order of ppo_kernels/spec.py INT_SLOTS, got ", codes.size());
  static const char* const names[slot::kNumInt] = {"policy_loss", "kl_estimator",
                                                   "kl_bias_correction"};
  for (int k = 0; k < slot::kNumInt; ++k)
    TORCH_CHECK(codes[k] >= INT32_MIN && codes[k] <= INT32_MAX, names[k],
                ": expected an id of ppo_kernels/spec.py, got ", codes[k]);
  const PolicyParams p = policy_params(scalars.data(), codes.data(), has_ref, has_is_weights);
  check_kl_estimator(p.code(slot::kl_estimator));
  TORCH_CHECK(p.code(slot::kl_bias_correction) == 0 || p.code(slot::kl_bias_correction) == 1,
              "kl_bias_correction: expected 0 or 1, got ", p.code(slot::kl_bias_correction));
  return p;
}

inline PolicyParams loss_params(c10::ArrayRef<double> scalars, c10::ArrayRef<int64_t> codes,
                                bool has_ref, bool has_is_weights) {
  const PolicyParams p = slot_params(scalars, codes, has_ref, has_is_weights);
  const int pl = p.code(slot::policy_loss);
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

// The arguments of one call of a boxed kernel, read by their schema names (a name the
// schema lacks is a TORCH_CHECK naming it). Valid until the stack changes: read everything,
// then hand the outputs back with `ret`.
class OpArgs {
 public:
  OpArgs(const c10::OperatorHandle& op, const torch::jit::Stack* stack)
      : schema_(op.schema()), args_(torch::jit::last(stack, schema_.arguments().size())) {}

  const c10::IValue& operator[](const char* name) const {
    const std::optional<int> i = schema_.argumentIndexWithName(name);
    TORCH_CHECK(i.has_value(), schema_.name(), ": no argument named ", name);
    return args_[static_cast<size_t>(*i)];
  }
  at::Tensor tensor(const char* name) const { return (*this)[name].toTensor(); }
  // None, or an undefined tensor (a C++ caller's), is absent: as row_args takes it, so
  // that a flag read from presence (PolicyParams::has_ref) agrees with the checked tensor
  std::optional<at::Tensor> opt_tensor(const char* name) const {
    const c10::IValue& v = (*this)[name];
    if (v.isNone() || !v.toTensor().defined()) return std::nullopt;
    return v.toTensor();
  }

  // The call's outputs in the schema's order, in place of its arguments on the stack.
  template <typename... Outs>
  void ret(torch::jit::Stack* stack, Outs&&... outs) const {
    torch::jit::drop(stack, args_.size());
    torch::jit::push(stack, std::forward<Outs>(outs)...);
  }

 private:
  const c10::FunctionSchema& schema_;
  c10::ArrayRef<c10::IValue> args_;
};

// The one reading of the ppo_loss ops' arguments: (rows, per-token tensors, options), each
// checked once (the temperature is the scalars' slot).
struct LossArgs {
  RowArgs rows;
  LossTensors in;
  PolicyParams params;
};

inline LossArgs loss_args(const OpArgs& a) {
  const std::optional<at::Tensor> ref = a.opt_tensor("ref_logprobs"),
                                  isw = a.opt_tensor("rollout_is_weights");
  const PolicyParams p = loss_params(a["scalars"].toDoubleVector(), a["codes"].toIntVector(),
                                     ref.has_value(), isw.has_value());
  RowArgs r = row_args(a.tensor("logits"), a.tensor("tokens"), a.tensor("mask"),
                       p[slot::temperature], a.opt_tensor("temperatures"));
  const auto need = [&](const char* name) { return r.per_token(a.tensor(name), name); };
  const auto opt = [&](const char* name) { return r.per_token(a.opt_tensor(name), name); };
  LossTensors in{opt("old_logprobs"),
                 need("advantages"),
                 need("weights"),
                 r.per_token(ref, "ref_logprobs"),
                 r.per_token(isw, "rollout_is_weights"),
                 opt("entropy_weights")};
  return {std::move(r), std::move(in), p};
}

}  // namespace ppo
