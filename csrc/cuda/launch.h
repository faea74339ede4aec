// Host-side helpers shared by the CUDA op wrappers: argument checks (defence in depth: the
// Python layer validates first, with friendlier messages), device properties, launch knobs.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "ppo_math.h"
#include "row_reduce.cuh"

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

// The temperature the kernels use (row_reduce.cuh, Temp): 1 / T and log2(e) / T computed in
// double and rounded once to the accumulation dtype A (after check_temperature); the base-2
// scale is capped at A's largest finite value (see Temp).
template <typename A>
inline Temp<A> make_temp(double temperature) {
  const double inv = 1.0 / temperature;
  const double inv2 = std::min(inv * kLog2e, static_cast<double>(std::numeric_limits<A>::max()));
  return {static_cast<A>(inv), static_cast<A>(inv2)};
}

// kl_estimator: the integer code of ppo_kernels/_checks.py (ppo::KlEstimator).
inline void check_kl_estimator(int64_t kl_estimator) {
  TORCH_CHECK(kl_estimator >= ppo::kK1 && kl_estimator <= ppo::kK3Plus,
              "ppo_kernels (CUDA): kl_estimator: expected 0 (k1), 1 (k2), 2 (k3), 3 (abs), "
              "4 (k1+) or 5 (k3+), got ", kl_estimator);
}

// policy_loss: the integer code of ppo_kernels/_checks.py (ppo::PolicyLoss); the sequence
// losses (gspo, gspo-token, vespo) never reach the fused kernels.
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

// The ops' optional per-row temperatures (csrc/ops.cpp): [B, T] of the accumulation dtype on
// the logits' device, contiguous, or nullopt. Their values are not read on the host (that
// would sync the stream): the Python layer checks them (an asynchronous device assertion,
// ppo_kernels/_checks.py temperature_values) and puts 1 on masked positions.
inline std::optional<at::Tensor> row_temperatures(const std::optional<at::Tensor>& temps,
                                                  at::ScalarType acc, at::IntArrayRef shape,
                                                  const at::Device& dev) {
  if (!temps.has_value() || !temps->defined()) return std::nullopt;
  return per_token(*temps, "temperatures", acc, shape, dev);
}

// make_temp of the scalar, with the per-row temperatures attached when there are any.
template <typename A>
inline Temp<A> make_row_temp(double temperature, const std::optional<at::Tensor>& temps) {
  Temp<A> tp = make_temp<A>(temperature);
  tp.per_row = temps.has_value() ? temps->data_ptr<A>() : nullptr;
  return tp;
}

// Multiprocessor count of a device, cached per device. Relaxed atomics: two
// threads may both query the driver once, never race on the value.
inline int sm_count(int device) {
  static std::atomic<int> cached[64] = {};
  const bool slot = device >= 0 && device < 64;
  if (slot) {
    const int c = cached[device].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (slot) cached[device].store(n, std::memory_order_relaxed);
  return n;
}

// Tuning knobs (row_kernels.cuh, plan_rows): PPO_CUDA_THREADS, PPO_CUDA_SPLIT,
// PPO_CUDA_ROWS_PER_SM. Read with getenv at every call ON PURPOSE: one benchmark process
// sweeps them (gpu_bench.py --cuda-variants). getenv is thread-safe as long as nobody calls
// setenv concurrently, and costs ~100 ns next to a launch. None of them changes any bit of
// the results (the reduction tree is a function of V only).
inline int64_t env_int(const char* name, int64_t dflt) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return dflt;
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  return (end != nullptr && *end == '\0') ? static_cast<int64_t>(v) : dflt;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace ppo_cuda
