// Host-side helpers of the CUDA op wrappers: device properties, launch knobs, the kernels'
// temperature; the argument checks every device shares are csrc/row_args.h's.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "ppo_math.h"
#include "row_args.h"
#include "row_reduce.cuh"

namespace ppo_cuda {

using ppo::acc_dtype;
using ppo::check_kl_estimator;
using ppo::opt_per_token;
using ppo::per_token;
using ppo::row_args;
using ppo::RowArgs;

// The CUDA launchers take logits on a CUDA device (row_args checks every other tensor is on
// the logits' device).
inline void check_cuda(const at::Tensor& logits) {
  TORCH_CHECK(logits.is_cuda(), "logits: expected a CUDA tensor, got ", logits.device());
}

// The temperature the kernels use (row_reduce.cuh, Temp): 1 / T and log2(e) / T computed in
// double and rounded once to the accumulation dtype A (after ppo::check_temperature); the base-2
// scale is capped at A's largest finite value (see Temp).
template <typename A>
inline Temp<A> make_temp(double temperature) {
  const double inv = 1.0 / temperature;
  const double inv2 = std::min(inv * kLog2e, static_cast<double>(std::numeric_limits<A>::max()));
  return {static_cast<A>(inv), static_cast<A>(inv2)};
}

template <typename A>
inline const A* ptr_or_null(const std::optional<at::Tensor>& x) {
  return x.has_value() ? x->data_ptr<A>() : nullptr;
}

// make_temp of the scalar, with the per-row temperatures attached when there are any. Their
// values are not read on the host (that would sync the stream): the Python layer checks
// them (an asynchronous device assertion, ppo_kernels/_checks.py temperature_values) and
// puts 1 on masked positions.
template <typename A>
inline Temp<A> make_row_temp(const RowArgs& r) {
  Temp<A> tp = make_temp<A>(r.temperature);
  tp.per_row = r.temperatures.has_value() ? r.temperatures->data_ptr<A>() : nullptr;
  return tp;
}

// A device attribute, cached per (attribute, device): the driver is asked once.
inline int device_attr(cudaDeviceAttr attr, int device) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, int> cache;
  const std::pair<int, int> key{static_cast<int>(attr), device};
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, device));
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = n;
  return n;
}

inline int sm_count(int device) { return device_attr(cudaDevAttrMultiProcessorCount, device); }

// Tuning knobs (row_kernels.cuh, plan_rows): PPO_CUDA_THREADS, PPO_CUDA_SPLIT,
// PPO_CUDA_ROWS_PER_SM, PPO_CUDA_CLUSTER. Read with getenv at every call ON PURPOSE: one benchmark process
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
