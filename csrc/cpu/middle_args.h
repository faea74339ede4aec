// The inputs of the two-phase path's [B, T] middle ops (seq_loss.cpp: GSPO's,
// token_middle.cpp: the token-level losses'; schemas in csrc/ops_host.cpp), checked once
// and made contiguous, and their outputs.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <optional>

#include "common.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {

// The data pointers of the inputs for one accumulation dtype T; null where an optional
// input is absent (old: on-policy; went: the weights; lkl: the KL reads lp).
template <typename T>
struct MiddlePtrs {
  const bool* m;
  const T *lp, *ent, *old, *adv, *ref, *isw, *w, *went, *lkl;
};

struct MiddleArgs {
  at::Tensor mask, logp, ent, adv, w;
  std::optional<at::Tensor> old, ref, isw, went, lkl;
  at::ScalarType acc;

  // Every input of the accumulation dtype and the mask's shape (a RuntimeError naming it).
  template <typename T>
  MiddlePtrs<T> ptrs() const {
    const auto req = [&](const at::Tensor& x, const char* name) {
      check_per_token(x, name, mask, acc);
      return x.data_ptr<T>();
    };
    return {mask.data_ptr<bool>(),
            req(logp, "logprobs"),
            req(ent, "entropy"),
            opt_per_token<T>(old, mask, "old_logprobs"),
            req(adv, "advantages"),
            opt_per_token<T>(ref, mask, "ref_logprobs"),
            opt_per_token<T>(isw, mask, "rollout_is_weights"),
            req(w, "weights"),
            opt_per_token<T>(went, mask, "entropy_weights"),
            opt_per_token<T>(lkl, mask, "kl_logprobs")};
  }
};

inline MiddleArgs middle_args(const at::Tensor& logp, const at::Tensor& ent,
                              const at::Tensor& mask, const std::optional<at::Tensor>& old,
                              const at::Tensor& adv, const std::optional<at::Tensor>& ref,
                              const std::optional<at::Tensor>& isw, const at::Tensor& w,
                              const std::optional<at::Tensor>& went,
                              const std::optional<at::Tensor>& lkl = std::nullopt) {
  TORCH_CHECK(mask.dim() == 2 && mask.scalar_type() == at::kBool,
              "mask: expected bool [B, T], got ", mask.scalar_type(), " ", mask.sizes());
  const at::ScalarType acc = logp.scalar_type();
  TORCH_CHECK(acc == at::kFloat || acc == at::kDouble,
              "logprobs: expected float32 or float64, got ", acc);
  return {mask.contiguous(), logp.contiguous(), ent.contiguous(), adv.contiguous(),
          w.contiguous(), contiguous_opt(old), contiguous_opt(ref), contiguous_opt(isw),
          contiguous_opt(went), contiguous_opt(lkl), acc};
}

// dlogprobs, dentropy and pol [B, T] and the 0-d loss, of logp's dtype.
struct MiddleOut {
  at::Tensor dlogp, dent, pol, loss;
};

inline MiddleOut middle_out(const at::Tensor& logp) {
  return {at::empty_like(logp), at::empty_like(logp), at::empty_like(logp),
          at::empty({}, logp.options())};
}

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
