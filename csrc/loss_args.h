// The ppo_loss ops' `float[] scalars` and `int[] codes` (csrc/ops.cpp) as the PolicyParams of
// the per-token math, with the checks every backend makes of them (the Python layer has
// already checked each value against its keyword: these catch a direct call of the op).
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "ppo_math.h"

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
  TORCH_CHECK(est >= kK1 && est <= kK3Plus,
              "kl_estimator: expected 0 (k1), 1 (k2), 2 (k3), 3 (abs), 4 (k1+) or 5 (k3+), got ",
              est);
  TORCH_CHECK(kernel_policy_loss(pl),
              "policy_loss: expected the id of a token-level policy loss (ppo_kernels/spec.py "
              "KERNEL_POLICY_LOSSES), got ", pl);
  const double t = p[slot::temperature], gs = p[slot::grad_scale];
  TORCH_CHECK(std::isfinite(t) && t > 0, "temperature: expected a finite number > 0, got ", t);
  TORCH_CHECK(std::isfinite(gs) && gs > 0, "grad_scale: expected a finite number > 0, got ", gs);
  if (pl == kSapo) {
    const double a = p[slot::sapo_tau_pos], b = p[slot::sapo_tau_neg];
    TORCH_CHECK(std::isfinite(a) && a > 0 && std::isfinite(b) && b > 0,
                "sapo_tau_pos / sapo_tau_neg: expected finite numbers > 0, got ", a, " / ", b);
  }
  return p;
}

}  // namespace ppo
