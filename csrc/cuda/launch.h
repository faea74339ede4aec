// Host-side helpers shared by the CUDA op wrappers: argument checks (defence in depth: the
// Python layer validates first, with friendlier messages), device properties, launch knobs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "ppo_math.h"

namespace ppo_cuda {

// Accumulation dtype of a logits dtype (ops.cpp: float64 for float64 logits, else float32).
inline at::ScalarType acc_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_logits(const at::Tensor& logits, const at::Tensor& tokens,
                         const at::Tensor& mask) {
  TORCH_CHECK(logits.is_cuda(), "ppo_kernels (CUDA): logits must be a CUDA tensor, got ",
              logits.device());
  TORCH_CHECK(logits.dim() == 3, "ppo_kernels (CUDA): logits must be [B, Tl, V], got ",
              logits.sizes());
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kDouble,
              "ppo_kernels (CUDA): logits dtype must be float32, bfloat16, float16 or float64, "
              "got ", dt);
  TORCH_CHECK(logits.size(2) > 0, "ppo_kernels (CUDA): empty vocabulary");
  TORCH_CHECK(logits.stride(2) == 1 || logits.size(2) == 1,
              "ppo_kernels (CUDA): logits must be contiguous along the vocabulary, stride(2) = ",
              logits.stride(2));
  TORCH_CHECK(tokens.device() == logits.device(), "ppo_kernels (CUDA): tokens on ",
              tokens.device(), ", logits on ", logits.device());
  TORCH_CHECK(tokens.scalar_type() == at::kLong, "ppo_kernels (CUDA): tokens must be int64, got ",
              tokens.scalar_type());
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(0) == logits.size(0) &&
                  tokens.size(1) <= logits.size(1),
              "ppo_kernels (CUDA): tokens must be [B, T] with T <= Tl for logits ",
              logits.sizes(), ", got ", tokens.sizes());
  TORCH_CHECK(mask.device() == logits.device(), "ppo_kernels (CUDA): mask on ", mask.device(),
              ", logits on ", logits.device());
  TORCH_CHECK(mask.scalar_type() == at::kBool, "ppo_kernels (CUDA): mask must be bool, got ",
              mask.scalar_type());
  TORCH_CHECK(mask.sizes() == tokens.sizes(), "ppo_kernels (CUDA): mask must be ",
              tokens.sizes(), ", got ", mask.sizes());
}

// temperature: a finite number > 0 (every op that divides the logits by it), whose
// reciprocal is finite in the accumulation dtype of logits of dtype `dt`: a temperature so
// small that 1 / temperature overflows float32 (below ~2.9e-39) would make every shifted
// logit (x - xmax) / temperature 0 * inf = NaN. Rejected, never silent garbage.
inline void check_temperature(double temperature, at::ScalarType dt) {
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0,
              "ppo_kernels (CUDA): temperature: expected a finite number > 0, got ",
              temperature);
  const double inv = 1.0 / temperature;
  const bool ok = acc_dtype(dt) == at::kDouble ? std::isfinite(inv)
                                               : std::isfinite(static_cast<float>(inv));
  TORCH_CHECK(ok, "ppo_kernels (CUDA): temperature: expected a number whose reciprocal is "
              "finite in the accumulation dtype ", acc_dtype(dt), ", got ", temperature);
}

// 1 / temperature in the accumulation dtype A (after check_temperature).
template <typename A>
inline A inv_temperature(double temperature) {
  return static_cast<A>(1.0 / temperature);
}

// kl_estimator: the integer code of ppo_kernels/_checks.py (ppo::KlEstimator).
inline void check_kl_estimator(int64_t kl_estimator) {
  TORCH_CHECK(kl_estimator >= ppo::kK1 && kl_estimator <= ppo::kAbs,
              "ppo_kernels (CUDA): kl_estimator: expected 0 (k1), 1 (k2), 2 (k3) or 3 (abs), "
              "got ", kl_estimator);
}

// A per-token [B, T] tensor of the accumulation dtype on the logits' device, made
// contiguous (a gradient can arrive expanded, stride 0; this copy is [B, T], not [N, V]).
inline at::Tensor per_token(const at::Tensor& x, const char* name, at::ScalarType acc,
                            at::IntArrayRef shape, const at::Device& dev) {
  TORCH_CHECK(x.defined(), "ppo_kernels (CUDA): ", name, " is undefined");
  TORCH_CHECK(x.device() == dev, "ppo_kernels (CUDA): ", name, " on ", x.device(),
              ", expected ", dev);
  TORCH_CHECK(x.scalar_type() == acc, "ppo_kernels (CUDA): ", name, " must be ", acc, ", got ",
              x.scalar_type());
  TORCH_CHECK(x.sizes() == shape, "ppo_kernels (CUDA): ", name, " must be ", shape, ", got ",
              x.sizes());
  return x.contiguous();
}

inline std::optional<at::Tensor> opt_per_token(const std::optional<at::Tensor>& x,
                                               const char* name, at::ScalarType acc,
                                               at::IntArrayRef shape, const at::Device& dev) {
  if (!x.has_value() || !x->defined()) return std::nullopt;
  return per_token(*x, name, acc, shape, dev);
}

template <typename A>
inline const A* ptr_or_null(const std::optional<at::Tensor>& x) {
  return x.has_value() ? x->data_ptr<A>() : nullptr;
}

inline int sm_count(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}

// Tuning knobs, read at every call so that one benchmark process can sweep them:
//   PPO_CUDA_THREADS      threads per row block of the fused kernel (32..1024, power of 2)
//   PPO_CUDA_SPLIT        0 auto, 1 never split the vocabulary, k > 1 always split in k
//   PPO_CUDA_ROWS_PER_SM  cap the fused grid at k blocks per SM (rows loop); 0 = one per row
inline int64_t env_int(const char* name, int64_t dflt) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return dflt;
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  return (end != nullptr && *end == '\0') ? static_cast<int64_t>(v) : dflt;
}

// Threads for a block that walks nvec packs: about four packs per thread, 32..cap.
inline int threads_for(int64_t nvec, int cap) {
  int t = 32;
  while (t < cap && static_cast<int64_t>(t) * 4 < nvec) t *= 2;
  return t;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace ppo_cuda
