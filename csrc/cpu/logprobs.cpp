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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_logprobs_fwd(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& mask,
    double temperature, bool return_entropy, const std::optional<at::Tensor>& temperatures) {
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  check_tokens(r);
  const int64_t* tok = r.tokens.data_ptr<int64_t>();
  const bool* m = r.mask.data_ptr<bool>();
  const auto opts = r.acc_opts;
  at::Tensor logp = at::empty({r.B, r.T}, opts);
  at::Tensor ent = return_entropy ? at::empty({r.B, r.T}, opts) : at::empty({0}, opts);
  at::Tensor row_max = at::empty({r.B, r.T}, opts), log_sum = at::empty({r.B, r.T}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "token_logprobs_fwd", [&] {
    using T = acc_of<scalar_t>;
    const scalar_t* L = logits.data_ptr<scalar_t>();
    T* lp = logp.data_ptr<T>();
    T* en = return_entropy ? ent.data_ptr<T>() : nullptr;
    T* mx = row_max.data_ptr<T>();
    T* ls = log_sum.data_ptr<T>();
    const T inv0 = T(1.0 / temperature);
    const T* tt = row_temperatures<T>(r);
    at::parallel_for(0, r.B * r.T, row_grain(r.V), [&](int64_t begin, int64_t end) {
      RowWorker<scalar_t> rw(r.V, false);
      for (int64_t i = begin; i < end; ++i) {
        if (!m[i]) {
          lp[i] = mx[i] = ls[i] = T(0);
          if (en) en[i] = T(0);
          continue;
        }
        const T inv = row_inv(tt, i, inv0);
        const scalar_t* x = L + r.offset(i);
        const RowStats<T> st = en ? rw.template stats<true>(x, inv)
                                  : rw.template stats<false>(x, inv);
        lp[i] = rw.logp(x, tok[i], inv, st);
        mx[i] = st.max;
        ls[i] = st.log_sum;
        if (en) en[i] = st.entropy;
      }
    });
  });
  return {logp, ent, row_max, log_sum};
}

// dlogits of sum(grad_logprobs * logp + grad_entropy * H), shaped like logits, contiguous.
// row_max and log_sum are the forward's: log p_v = (x_v - row_max) / temperature - log_sum
// is rebuilt with every digit (from the lse alone it lost them at small temperatures and
// large logits).
at::Tensor token_logprobs_bwd(const at::Tensor& grad_logprobs,
                              const std::optional<at::Tensor>& grad_entropy,
                              const at::Tensor& logits, const at::Tensor& tokens,
                              const at::Tensor& mask, const at::Tensor& row_max_in,
                              const at::Tensor& log_sum_in, const at::Tensor& entropy_in,
                              double temperature,
                              const std::optional<at::Tensor>& temperatures) {
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  const at::Tensor grad_lp = r.per_token(grad_logprobs, "grad_logprobs");
  const at::Tensor row_max = r.per_token(row_max_in, "row_max");
  const at::Tensor log_sum = r.per_token(log_sum_in, "log_sum");
  const std::optional<at::Tensor> grad_ent = r.per_token(grad_entropy, "grad_entropy");
  const bool has_ge = grad_ent.has_value();
  // the entropy is read only for the entropy term of the gradient
  const at::Tensor entropy = has_ge ? r.per_token(entropy_in, "entropy") : at::Tensor();
  check_tokens(r);
  const int64_t* tok = r.tokens.data_ptr<int64_t>();
  const bool* m = r.mask.data_ptr<bool>();
  at::Tensor out = new_grad_buffer(logits.sizes(), logits.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "token_logprobs_bwd", [&] {
    using T = acc_of<scalar_t>;
    const scalar_t* L = logits.data_ptr<scalar_t>();
    scalar_t* O = out.data_ptr<scalar_t>();
    const T* gl = grad_lp.data_ptr<T>();
    const T* ge = has_ge ? grad_ent->data_ptr<T>() : nullptr;
    const T* H = has_ge ? entropy.data_ptr<T>() : nullptr;
    const T* mx = row_max.data_ptr<T>();
    const T* ls = log_sum.data_ptr<T>();
    const T inv0 = T(1.0 / temperature);
    const T* tt = row_temperatures<T>(r);
    // every row of out, t >= T included (zeros), i = b * Tl + t
    const bool stream = stream_gradient(r.B * r.Tl * r.V * int64_t(sizeof(scalar_t)));
    at::parallel_for(0, r.B * r.Tl, row_grain(r.V), [&](int64_t begin, int64_t end) {
      RowWorker<scalar_t> rw(r.V, false, stream);
      for (int64_t o = begin; o < end; ++o) {
        const int64_t b = o / r.Tl, t = o % r.Tl, i = b * r.T + t;
        scalar_t* orow = O + o * r.V;
        const T g_ent = (t < r.T && ge) ? ge[i] : T(0);
        if (t >= r.T || !m[i] || (gl[i] == T(0) && g_ent == T(0))) {
          rw.zero(orow);
          continue;
        }
        const RowStats<T> st{mx[i], ls[i], T(0), H ? H[i] : T(0)};
        rw.grad(L + b * r.sB + t * r.sT, row_inv(tt, i, inv0), st, gl[i], g_ent, tok[i],
                false, orow);
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
