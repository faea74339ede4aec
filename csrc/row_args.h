// The host-side arguments of the row ops (token_logprobs, ppo_loss, kept_logprobs,
// sampling_threshold, score_rollout, distill; schemas in csrc/ops.cpp), filled and checked
// once by row_args() and shared by the CPU and CUDA launchers: the pattern of
// flash-attention's Flash_fwd_params / set_params_fprop
// (https://github.com/Dao-AILab/flash-attention/blob/main/csrc/flash_attn/flash_api.cpp).
// The Python layer validates every argument first (ppo_kernels/_checks.py); these checks are
// the defence for direct callers of torch.ops.ppo_kernels.*, with one rule set for every
// device: each message names the argument; per-token inputs must have the shape, dtype and
// device asked for and are made contiguous here (a [B, T] copy at most, never [N, V]).
// What only one device can check (token ids and per-row temperature values read on the
// host) stays in cpu/common.h; cuda/launch.h keeps the launch helpers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "ppo_math.h"

namespace ppo {

// Accumulation dtype of a logits dtype (ops.cpp: float64 for float64 logits, else float32).
inline at::ScalarType acc_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// temperature: a finite number > 0 whose reciprocal is finite in the accumulation dtype
// `acc`: a temperature so small that 1 / temperature overflows float32 (below ~2.9e-39)
// would make every shifted logit (x - xmax) / temperature 0 * inf = NaN.
inline void check_temperature(double temperature, at::ScalarType acc) {
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0,
              "temperature: expected a finite number > 0, got ", temperature);
  const double inv = 1.0 / temperature;
  TORCH_CHECK(acc == at::kDouble ? std::isfinite(inv) : std::isfinite(static_cast<float>(inv)),
              "temperature: expected a number whose reciprocal is finite in the accumulation "
              "dtype ", acc, ", got ", temperature);
}

// kl_estimator: the id of ppo_kernels/spec.py KL_ESTIMATORS (ppo::KlEstimator).
inline void check_kl_estimator(int64_t kl_estimator) {
  TORCH_CHECK(kl_estimator >= kK1 && kl_estimator <= kK3Plus,
              "kl_estimator: expected 0 (k1), 1 (k2), 2 (k3), 3 (abs), 4 (k1+) or 5 (k3+), got ",
              kl_estimator);
}

// A tensor input of `dtype` and `shape` on `device`, made contiguous (a per-token [B, T]
// copy at most: a gradient can arrive expanded, stride 0).
inline at::Tensor per_token(const at::Tensor& x, const char* name, at::ScalarType dtype,
                            at::IntArrayRef shape, const at::Device& device) {
  TORCH_CHECK(x.defined(), name, ": expected a tensor");
  TORCH_CHECK(x.device() == device, name, ": expected a tensor on ", device, ", got ",
              x.device());
  TORCH_CHECK(x.scalar_type() == dtype, name, ": expected dtype ", dtype, ", got ",
              x.scalar_type());
  TORCH_CHECK(x.sizes() == shape, name, ": expected shape ", shape, ", got ", x.sizes());
  return x.contiguous();
}

inline std::optional<at::Tensor> opt_per_token(const std::optional<at::Tensor>& x,
                                               const char* name, at::ScalarType dtype,
                                               at::IntArrayRef shape, const at::Device& device) {
  if (!x.has_value() || !x->defined()) return std::nullopt;
  return per_token(*x, name, dtype, shape, device);
}

// logits [B, Tl, V] read through its batch / time strides; tokens and mask [B, T].
struct RowArgs {
  int64_t B = 0, T = 0, Tl = 0, V = 0;
  int64_t sB = 0, sT = 0;  // the logits' batch / time strides (the vocabulary's is 1)
  at::ScalarType acc = at::kFloat;
  at::TensorOptions acc_opts;  // the logits' device, the accumulation dtype
  at::Tensor tokens, mask;     // contiguous (tokens undefined for distill_fwd)
  double temperature = 1.0;
  std::optional<at::Tensor> temperatures;  // the per-row [B, T], contiguous, or none

  int64_t N() const { return B * T; }
  // element offset of flat row i = b * T + t in the logits
  int64_t offset(int64_t i) const { return (i / T) * sB + (i % T) * sT; }

  // A per-token input: [B, T] of the accumulation dtype on the logits' device, contiguous.
  at::Tensor per_token(const at::Tensor& x, const char* name) const {
    return ppo::per_token(x, name, acc, {B, T}, acc_opts.device());
  }
  std::optional<at::Tensor> per_token(const std::optional<at::Tensor>& x,
                                      const char* name) const {
    if (!x.has_value() || !x->defined()) return std::nullopt;
    return per_token(*x, name);
  }
};

// Fills and checks the arguments every row op shares. tokens: int64 [B, T] (nullopt: the
// op reads no sampled token, T is the mask's); mask: bool [B, T]; T <= Tl; temperature and
// the optional per-row temperatures (csrc/ops.cpp; their values are read where the device
// allows it: cpu/common.h).
inline RowArgs row_args(const at::Tensor& logits, const std::optional<at::Tensor>& tokens,
                        const at::Tensor& mask, double temperature,
                        const std::optional<at::Tensor>& temperatures) {
  TORCH_CHECK(logits.dim() == 3, "logits: expected [B, Tl, V], got ", logits.sizes());
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kDouble,
              "logits: expected float32, bfloat16, float16 or float64, got ", dt);
  TORCH_CHECK(logits.size(2) > 0, "logits: empty vocabulary (V = 0)");
  TORCH_CHECK(logits.stride(2) == 1 || logits.size(2) == 1,
              "logits: the vocabulary stride must be 1, got ", logits.stride(2));
  RowArgs r;
  r.B = logits.size(0), r.Tl = logits.size(1), r.V = logits.size(2);
  r.sB = logits.stride(0), r.sT = logits.stride(1);
  r.acc = acc_dtype(dt);
  r.acc_opts = logits.options().dtype(r.acc);
  const at::Tensor& shaped = tokens.has_value() ? *tokens : mask;  // gives T
  const char* shaped_name = tokens.has_value() ? "tokens" : "mask";
  TORCH_CHECK(shaped.dim() == 2 && shaped.size(0) == r.B && shaped.size(1) <= r.Tl,
              shaped_name, ": expected [B, T] with T <= Tl for logits ", logits.sizes(),
              ", got ", shaped.sizes());
  r.T = shaped.size(1);
  if (tokens.has_value()) {
    TORCH_CHECK(tokens->scalar_type() == at::kLong, "tokens: expected int64, got ",
                tokens->scalar_type());
    TORCH_CHECK(tokens->device() == logits.device(), "tokens: expected a tensor on ",
                logits.device(), ", got ", tokens->device());
    r.tokens = tokens->contiguous();
  }
  TORCH_CHECK(mask.scalar_type() == at::kBool, "mask: expected bool, got ", mask.scalar_type());
  TORCH_CHECK(mask.device() == logits.device(), "mask: expected a tensor on ", logits.device(),
              ", got ", mask.device());
  TORCH_CHECK(mask.sizes() == shaped.sizes(), "mask: expected shape ", shaped.sizes(), ", got ",
              mask.sizes());
  r.mask = mask.contiguous();
  check_temperature(temperature, r.acc);
  r.temperature = temperature;
  r.temperatures = r.per_token(temperatures, "temperatures");
  return r;
}

}  // namespace ppo
