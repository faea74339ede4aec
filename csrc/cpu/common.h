// Input checks and row layout shared by the CPU op wrappers. The Python layer validates
// every argument first (ppo_kernels/_checks.py); these TORCH_CHECKs are the defence for
// direct callers of torch.ops.ppo_kernels.*.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "grad_buffer.h"
#include "row_kernels.h"

#include <cmath>
#include <cstdint>
#include <optional>

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {

// logits [B, Tl, V] read through its batch/time strides; tokens/mask [B, T].
struct Rows {
  int64_t B, T, Tl, V, sB, sT;
  Rows(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& mask) {
    TORCH_CHECK(logits.dim() == 3, "logits: expected [B, Tl, V], got ", logits.sizes());
    TORCH_CHECK(logits.stride(2) == 1, "logits: the vocabulary stride must be 1");
    TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong,
                "tokens: expected int64 [B, T], got ", tokens.scalar_type(), " ", tokens.sizes());
    TORCH_CHECK(mask.sizes() == tokens.sizes() && mask.scalar_type() == at::kBool,
                "mask: expected bool of the tokens' shape");
    B = logits.size(0), Tl = logits.size(1), V = logits.size(2), T = tokens.size(1);
    TORCH_CHECK(tokens.size(0) == B && T <= Tl, "tokens: ", tokens.sizes(),
                " does not match logits ", logits.sizes());
    TORCH_CHECK(V > 0, "logits: empty vocabulary");
    sB = logits.stride(0), sT = logits.stride(1);
  }
  int64_t offset(int64_t i) const { return (i / T) * sB + (i % T) * sT; }
  // Valid rows must hold an id in [0, V); masked rows are never read.
  // A ValueError with the message of ppo_kernels/_checks.py token_range, which the Python
  // layer leaves to this check on the fused CPU path (one pass over the ids, no eager ops).
  void check_tokens(const int64_t* tok, const bool* m) const {
    for (int64_t i = 0; i < B * T; ++i)
      TORCH_CHECK_VALUE(!m[i] || (tok[i] >= 0 && tok[i] < V), "tokens: ids must lie in [0, ",
                        V, ") on valid positions; got ", tok[i], " at position [", i / T, ", ",
                        i % T, "]");
  }
};

inline void check_per_token(const at::Tensor& x, const char* name, const at::Tensor& like,
                            at::ScalarType dtype) {
  TORCH_CHECK(x.sizes() == like.sizes(), name, ": expected shape ", like.sizes(), ", got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == dtype, name, ": expected dtype ", dtype, ", got ",
              x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), name, ": expected a contiguous tensor");
}

inline void check_temperature(double temperature) {
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0,
              "temperature: expected a finite number > 0, got ", temperature);
}

// The optional per-row temperatures (csrc/ops.cpp): [B, T] of the accumulation dtype T,
// contiguous; every valid row's value finite, > 0, with a reciprocal finite in T (masked
// rows are never read). Returns the data pointer, or null without the tensor (the scalar
// temperature then applies to every row).
template <typename T>
inline const T* row_temperatures(const std::optional<at::Tensor>& temps, const at::Tensor& tokens,
                                 const bool* m) {
  if (!temps.has_value()) return nullptr;
  check_per_token(*temps, "temperatures", tokens, c10::CppTypeToScalarType<T>::value);
  const T* t = temps->data_ptr<T>();
  for (int64_t i = 0; i < tokens.numel(); ++i) {
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

inline void check_kl_estimator(int64_t kl_estimator) {
  TORCH_CHECK(kl_estimator >= ppo::kK1 && kl_estimator <= ppo::kK3Plus,
              "kl_estimator: expected 0 (k1), 1 (k2), 2 (k3), 3 (abs), 4 (k1+) or 5 (k3+), got ",
              kl_estimator);
}

inline at::ScalarType acc_type(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
