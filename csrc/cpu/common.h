// The CPU side of the op wrappers' checks: what only the host can read (token ids, per-row
// temperature values); the checks every device shares are csrc/row_args.h's.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../row_args.h"
#include "grad_buffer.h"
#include "row_kernels.h"

#include <cmath>
#include <cstdint>
#include <optional>

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {

using ppo::RowArgs;
using ppo::row_args;

// Valid rows must hold an id in [0, V); masked rows are never read. A ValueError with the
// message of ppo_kernels/_checks.py token_range, which the Python layer leaves to this check
// on the fused CPU path (one pass over the ids, no eager ops).
inline void check_tokens(const RowArgs& r) {
  const int64_t* tok = r.tokens.data_ptr<int64_t>();
  const bool* m = r.mask.data_ptr<bool>();
  for (int64_t i = 0; i < r.N(); ++i)
    TORCH_CHECK_VALUE(!m[i] || (tok[i] >= 0 && tok[i] < r.V), "tokens: ids must lie in [0, ",
                      r.V, ") on valid positions; got ", tok[i], " at position [", i / r.T,
                      ", ", i % r.T, "]");
}

// The [B, T] inputs of the ops that read no logits (gae, ppo_loss_metrics), read in place.
inline void check_per_token(const at::Tensor& x, const char* name, const at::Tensor& like,
                            at::ScalarType dtype) {
  TORCH_CHECK(x.sizes() == like.sizes(), name, ": expected shape ", like.sizes(), ", got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == dtype, name, ": expected dtype ", dtype, ", got ",
              x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), name, ": expected a contiguous tensor");
}

// The data pointer of an optional [B, T] input checked as check_per_token does against
// like and the dtype of T; null where it is absent.
template <typename T>
inline const T* opt_per_token(const std::optional<at::Tensor>& x, const at::Tensor& like,
                              const char* name) {
  if (!x.has_value()) return nullptr;
  check_per_token(*x, name, like, c10::CppTypeToScalarType<T>::value);
  return x->data_ptr<T>();
}

// An optional tensor made contiguous (a copy at most).
inline std::optional<at::Tensor> contiguous_opt(const std::optional<at::Tensor>& x) {
  return x.has_value() ? std::optional<at::Tensor>(x->contiguous()) : x;
}

// The per-row temperatures' values (row_args checked their shape, dtype and device): every
// valid row's finite, > 0, with a reciprocal finite in the accumulation dtype T (masked rows
// are never read). Read here on the host; the CUDA launchers leave this to the Python
// layer's device assertion (ppo_kernels/_checks.py temperature_values). Returns the data
// pointer, or null without the tensor (the scalar temperature then applies to every row).
template <typename T>
inline const T* row_temperatures(const RowArgs& r) {
  if (!r.temperatures.has_value()) return nullptr;
  const T* t = r.temperatures->data_ptr<T>();
  const bool* m = r.mask.data_ptr<bool>();
  for (int64_t i = 0; i < r.N(); ++i) {
    if (!m[i]) continue;
    const double v = double(t[i]);
    TORCH_CHECK(std::isfinite(v) && v > 0 && std::isfinite(T(1.0 / v)),
                "temperatures: expected a finite number > 0 whose reciprocal is finite in the "
                "accumulation dtype on every valid row, got ", v, " at flat position ", i);
  }
  return t;
}

// 1 / temperature of row i: the per-row value when there is one, rounded once from double as
// the scalar `inv` is (so a tensor of equal values gives the scalar call's bits).
template <typename T>
inline T row_inv(const T* temps, int64_t i, T inv) {
  return temps ? T(1.0 / double(temps[i])) : inv;
}

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
