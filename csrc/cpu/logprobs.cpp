// token_logprobs forward/backward on the CPU: one vocabulary row per token, rows spread
// over threads with at::parallel_for, each row swept with at::vec (row_kernels.h).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "common.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs_fwd(
    const at::Tensor& logits, const at::Tensor& tokens_in, const at::Tensor& mask_in,
    double temperature, bool return_entropy) {
  const at::Tensor tokens = tokens_in.contiguous(), mask = mask_in.contiguous();
  const Rows r(logits, tokens, mask);
  check_temperature(temperature);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const bool* m = mask.data_ptr<bool>();
  r.check_tokens(tok, m);
  const auto opts = logits.options().dtype(acc_type(logits));
  at::Tensor logp = at::empty({r.B, r.T}, opts);
  at::Tensor ent = return_entropy ? at::empty({r.B, r.T}, opts) : at::empty({0}, opts);
  at::Tensor lse = at::empty({r.B, r.T}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "token_logprobs_fwd", [&] {
    using T = acc_of<scalar_t>;
    const scalar_t* L = logits.data_ptr<scalar_t>();
    T* lp = logp.data_ptr<T>();
    T* en = return_entropy ? ent.data_ptr<T>() : nullptr;
    T* ls = lse.data_ptr<T>();
    const T inv = T(1.0 / temperature);
    at::parallel_for(0, r.B * r.T, row_grain(r.V), [&](int64_t begin, int64_t end) {
      RowScratch<scalar_t> sc(r.V, false);
      for (int64_t i = begin; i < end; ++i) {
        if (!m[i]) {
          lp[i] = ls[i] = T(0);
          if (en) en[i] = T(0);
          continue;
        }
        const T* x = sc.load(L + r.offset(i), r.V);
        const RowStats<T> st = row_stats<T>(x, r.V, inv, return_entropy, nullptr);
        lp[i] = row_logp(x, tok[i], inv, st);
        ls[i] = st.lse;
        if (en) en[i] = st.entropy;
      }
    });
  });
  return {logp, ent, lse};
}

// dlogits of sum(grad_logprobs * logp + grad_entropy * H), shaped like logits, contiguous.
at::Tensor token_logprobs_bwd(const at::Tensor& grad_logprobs,
                              const std::optional<at::Tensor>& grad_entropy,
                              const at::Tensor& logits, const at::Tensor& tokens_in,
                              const at::Tensor& mask_in, const at::Tensor& lse,
                              const at::Tensor& entropy, double temperature) {
  const at::Tensor tokens = tokens_in.contiguous(), mask = mask_in.contiguous();
  const Rows r(logits, tokens, mask);
  check_temperature(temperature);
  const at::ScalarType acc = acc_type(logits);
  check_per_token(grad_logprobs, "grad_logprobs", tokens, acc);
  check_per_token(lse, "lse", tokens, acc);
  const bool has_ge = grad_entropy.has_value();
  if (has_ge) {
    check_per_token(*grad_entropy, "grad_entropy", tokens, acc);
    check_per_token(entropy, "entropy", tokens, acc);
  }
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const bool* m = mask.data_ptr<bool>();
  r.check_tokens(tok, m);
  at::Tensor out = at::empty(logits.sizes(), logits.options());
  advise_huge_pages(out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "token_logprobs_bwd", [&] {
    using T = acc_of<scalar_t>;
    const scalar_t* L = logits.data_ptr<scalar_t>();
    scalar_t* O = out.data_ptr<scalar_t>();
    const T* gl = grad_logprobs.data_ptr<T>();
    const T* ge = has_ge ? grad_entropy->data_ptr<T>() : nullptr;
    const T* H = has_ge ? entropy.data_ptr<T>() : nullptr;
    const T* ls = lse.data_ptr<T>();
    const T inv = T(1.0 / temperature);
    // every row of out, t >= T included (zeros), i = b * Tl + t
    at::parallel_for(0, r.B * r.Tl, row_grain(r.V), [&](int64_t begin, int64_t end) {
      RowScratch<scalar_t> sc(r.V, kWiden<scalar_t>);
      for (int64_t o = begin; o < end; ++o) {
        const int64_t b = o / r.Tl, t = o % r.Tl, i = b * r.T + t;
        scalar_t* orow = O + o * r.V;
        if (t >= r.T || !m[i]) {
          zero_row(orow, r.V);
          continue;
        }
        const T* x = sc.load(L + b * r.sB + t * r.sT, r.V);
        // only the saved lse is known here: max = 0, log_sum = lse
        const RowStats<T> st{T(0), ls[i], T(0), ls[i], H ? H[i] : T(0)};
        write_row_grad<scalar_t, T>(x, nullptr, sc.e.data(), r.V, inv, st, gl[i],
                                    ge ? ge[i] : T(0), tok[i], orow);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) {
  m.impl("token_logprobs_fwd", &token_logprobs_fwd);
  m.impl("token_logprobs_bwd", &token_logprobs_bwd);
}

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
