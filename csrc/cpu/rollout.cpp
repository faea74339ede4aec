// Rollout side on the CPU: the reverse GAE scan (one sequence per task) and score_rollout
// (logprob sweep over the logits, KL-penalised rewards, then the scan).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "common.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

// Reverse scan of one row; masked positions are transparent (V_next, A_next carried over).
// decoupled: the returns are the GAE of value_lam (its own A_next, the same deltas) + V;
// else A + V.
template <typename T>
void gae_row(const T* r, const T* v, const bool* m, T v_next, int64_t n, T gamma, T lam,
             bool decoupled, T value_lam, T* adv, T* ret) {
  T a_next = T(0), g_next = T(0);
  for (int64_t j = n - 1; j >= 0; --j) {
    if (!m[j]) {
      adv[j] = ret[j] = T(0);
      continue;
    }
    a_next = ppo::gae_step(r[j], v[j], v_next, a_next, gamma, lam);
    if (decoupled) g_next = ppo::gae_step(r[j], v[j], v_next, g_next, gamma, value_lam);
    v_next = v[j];
    adv[j] = a_next;
    ret[j] = (decoupled ? g_next : a_next) + v[j];
  }
}

// The GAE options of gae / score_rollout (schema comment in csrc/ops.cpp): lambda per
// sequence (lam_per_seq, else lam) and the returns' value_lam.
struct Lambdas {
  const at::Tensor* per_seq = nullptr;
  bool decoupled = false;
  double value_lam = 0.0;
  Lambdas(const std::optional<at::Tensor>& lam_per_seq, std::optional<double> value_lam_in,
          int64_t B, at::ScalarType dtype) {
    if (lam_per_seq.has_value() && lam_per_seq->defined()) {
      per_seq = &*lam_per_seq;
      TORCH_CHECK(per_seq->dim() == 1 && per_seq->size(0) == B && per_seq->is_contiguous() &&
                      per_seq->scalar_type() == dtype,
                  "lam_per_seq: expected contiguous [", B, "] of dtype ", dtype, ", got ",
                  per_seq->scalar_type(), " ", per_seq->sizes());
      AT_DISPATCH_FLOATING_TYPES(dtype, "lam_per_seq", [&] {
        const scalar_t* l = per_seq->data_ptr<scalar_t>();
        for (int64_t b = 0; b < B; ++b)
          TORCH_CHECK(l[b] >= 0 && l[b] <= 1, "lam_per_seq: expected values in [0, 1], got ",
                      l[b], " at ", b);
      });
    }
    if (value_lam_in.has_value()) {
      decoupled = true;
      value_lam = *value_lam_in;
      TORCH_CHECK(value_lam >= 0 && value_lam <= 1, "value_lam: expected a value in [0, 1], got ",
                  value_lam);
    }
  }
  template <typename T>
  T of(int64_t b, double lam) const {
    return per_seq ? per_seq->data_ptr<T>()[b] : T(lam);
  }
};

std::tuple<at::Tensor, at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values,
                                       const at::Tensor& mask_in,
                                       const std::optional<at::Tensor>& bootstrap,
                                       double gamma, double lam,
                                       const std::optional<at::Tensor>& lam_per_seq,
                                       std::optional<double> value_lam) {
  TORCH_CHECK(rewards.dim() == 2 && rewards.is_contiguous(), "rewards: expected contiguous [B, T]");
  TORCH_CHECK(rewards.scalar_type() == at::kFloat || rewards.scalar_type() == at::kDouble,
              "rewards: expected float32 or float64");
  check_per_token(values, "values", rewards, rewards.scalar_type());
  const at::Tensor mask = mask_in.contiguous();
  TORCH_CHECK(mask.sizes() == rewards.sizes() && mask.scalar_type() == at::kBool,
              "mask: expected bool [B, T]");
  const int64_t B = rewards.size(0), T = rewards.size(1);
  TORCH_CHECK(gamma >= 0 && gamma <= 1 && lam >= 0 && lam <= 1,
              "gamma, lam: expected values in [0, 1], got ", gamma, ", ", lam);
  if (bootstrap) {
    TORCH_CHECK(bootstrap->dim() == 1 && bootstrap->size(0) == B && bootstrap->is_contiguous() &&
                    bootstrap->scalar_type() == rewards.scalar_type(),
                "bootstrap_values: expected contiguous [B] of the rewards' dtype");
  }
  const Lambdas lams(lam_per_seq, value_lam, B, rewards.scalar_type());
  at::Tensor adv = at::empty_like(rewards), ret = at::empty_like(rewards);
  AT_DISPATCH_FLOATING_TYPES(rewards.scalar_type(), "gae", [&] {
    const scalar_t* boot = bootstrap ? bootstrap->data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, B, std::max<int64_t>(1, 4096 / std::max<int64_t>(T, 1)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        gae_row<scalar_t>(rewards.data_ptr<scalar_t>() + b * T, values.data_ptr<scalar_t>() + b * T,
                          mask.data_ptr<bool>() + b * T, boot ? boot[b] : scalar_t(0), T,
                          scalar_t(gamma), lams.of<scalar_t>(b, lam), lams.decoupled,
                          scalar_t(lams.value_lam), adv.data_ptr<scalar_t>() + b * T,
                          ret.data_ptr<scalar_t>() + b * T);
      }
    });
  });
  return {adv, ret};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> score_rollout(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& mask,
    const at::Tensor& ref_in, const at::Tensor& values_in, const at::Tensor& scores_in,
    double kl_coef, int64_t kl_estimator, double gamma, double lam, double temperature,
    const std::optional<at::Tensor>& lam_per_seq, std::optional<double> value_lam,
    const std::optional<at::Tensor>& temperatures) {
  TORCH_CHECK(logits.scalar_type() != at::kDouble, "logits: score_rollout runs in float32");
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  ppo::check_kl_estimator(kl_estimator);
  const at::Tensor ref_logprobs = r.per_token(ref_in, "ref_logprobs");
  const at::Tensor values = r.per_token(values_in, "values");
  const at::Tensor scores =
      ppo::per_token(scores_in, "scores", at::kFloat, {r.B}, logits.device());
  check_tokens(r);
  const int64_t* tok = r.tokens.data_ptr<int64_t>();
  const bool* m = r.mask.data_ptr<bool>();
  TORCH_CHECK(gamma >= 0 && gamma <= 1 && lam >= 0 && lam <= 1,
              "gamma, lam: expected values in [0, 1], got ", gamma, ", ", lam);
  const Lambdas lams(lam_per_seq, value_lam, r.B, at::kFloat);
  const float* tt = row_temperatures<float>(r);
  const auto opts = ref_logprobs.options();
  at::Tensor logp = at::empty({r.B, r.T}, opts), kl = at::empty({r.B, r.T}, opts),
             rew = at::empty({r.B, r.T}, opts), adv = at::empty({r.B, r.T}, opts),
             ret = at::empty({r.B, r.T}, opts);
  float* lp = logp.data_ptr<float>();
  float* klp = kl.data_ptr<float>();
  float* rw = rew.data_ptr<float>();
  const float* ref = ref_logprobs.data_ptr<float>();
  auto logprob_sweep = [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* L = logits.data_ptr<scalar_t>();
    const float inv0 = float(1.0 / temperature);
    at::parallel_for(0, r.B * r.T, row_grain(r.V), [&](int64_t begin, int64_t end) {
      RowWorker<scalar_t> worker(r.V, false);
      for (int64_t i = begin; i < end; ++i) {
        if (!m[i]) {
          lp[i] = klp[i] = rw[i] = 0.f;
          continue;
        }
        const float inv = row_inv(tt, i, inv0);
        const scalar_t* x = L + r.offset(i);
        lp[i] = worker.logp(x, tok[i], inv, worker.template stats<false>(x, inv));
        klp[i] = ppo::kl_term<float>(lp[i] - ref[i], int(kl_estimator)).kl;
        rw[i] = float(-kl_coef) * klp[i];
      }
    });
  };
  switch (logits.scalar_type()) {  // float32 accumulation: no float64 instance
    case at::kFloat: logprob_sweep(float(0)); break;
    case at::kBFloat16: logprob_sweep(at::BFloat16(0)); break;
    case at::kHalf: logprob_sweep(at::Half(0)); break;
    default: TORCH_CHECK(false, "logits: expected float32, bfloat16 or float16");
  }
  const float* sc = scores.data_ptr<float>();
  at::parallel_for(0, r.B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t t = r.T - 1; t >= 0; --t) {  // the score goes on the LAST valid token
        if (m[b * r.T + t]) {
          rw[b * r.T + t] += sc[b];
          break;
        }
      }
      gae_row<float>(rw + b * r.T, values.data_ptr<float>() + b * r.T, m + b * r.T, 0.f, r.T,
                     float(gamma), lams.of<float>(b, lam), lams.decoupled,
                     float(lams.value_lam), adv.data_ptr<float>() + b * r.T,
                     ret.data_ptr<float>() + b * r.T);
    }
  });
  return {logp, kl, rew, adv, ret};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) {
  m.impl("gae", &gae);
  m.impl("score_rollout", &score_rollout);
}

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
