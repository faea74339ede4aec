// The fused PPO policy loss on the CPU. Per token row: logsumexp + entropy (one sweep with
// the exps kept in scratch), the per-token loss and d loss / d logp from ppo_math.h, then,
// when a gradient is wanted, dlogits in a last sweep while the row is still in L2. The
// logits are read from memory once and dlogits written once; backward only scales.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../loss_args.h"
#include "common.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

// out: where dlogits go (null: no gradient), with its own batch/time strides.
template <typename scalar_t>
void fused_rows(const at::Tensor& logits, const ppo::LossArgs& a, scalar_t* out, int64_t oB,
                int64_t oT, at::Tensor& loss_tok, at::Tensor& logp, at::Tensor& ent) {
  using T = acc_of<scalar_t>;
  const RowArgs& r = a.rows;
  const ppo::LossTensors& in = a.in;
  const ppo::PolicyParams p = a.params;
  const scalar_t* L = logits.data_ptr<scalar_t>();
  const int64_t* tok = r.tokens.data_ptr<int64_t>();
  const bool* m = r.mask.data_ptr<bool>();
  // null: on-policy, old = logp
  const T* old = in.old_logprobs ? in.old_logprobs->data_ptr<T>() : nullptr;
  const T* adv = in.advantages.data_ptr<T>();
  const T* w = in.weights.data_ptr<T>();
  const T* w_ent = in.entropy_weights ? in.entropy_weights->data_ptr<T>() : w;
  const T* ref = p.has_ref ? in.ref_logprobs->data_ptr<T>() : nullptr;
  const T* isw = p.has_is_weights ? in.rollout_is_weights->data_ptr<T>() : nullptr;
  T* lt = loss_tok.data_ptr<T>();
  T* lp = logp.data_ptr<T>();
  T* en = ent.data_ptr<T>();
  const T inv0 = T(1.0 / r.temperature);
  const T* tt = row_temperatures<T>(r);
  const T gs = T(p[ppo::slot::grad_scale]);
  const bool stream = out && stream_gradient(r.B * r.T * r.V * int64_t(sizeof(scalar_t)));
  at::parallel_for(0, r.B * r.T, row_grain(r.V), [&](int64_t begin, int64_t end) {
    RowWorker<scalar_t> rw(r.V, out != nullptr, stream);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / r.T, t = i % r.T;
      scalar_t* orow = out ? out + b * oB + t * oT : nullptr;
      if (!m[i]) {
        lt[i] = lp[i] = en[i] = T(0);
        if (orow) rw.zero(orow);
        continue;
      }
      const T inv = row_inv(tt, i, inv0);
      const scalar_t* x = L + r.offset(i);
      const RowStats<T> st = rw.template stats<true>(x, inv);
      const T logp_i = rw.logp(x, tok[i], inv, st);
      const ppo::TokenLoss<T> tl = ppo::token_loss<T>(
          logp_i, st.entropy, old ? old[i] : logp_i, adv[i], ref ? ref[i] : T(0),
          isw ? isw[i] : T(1), w[i], w_ent[i], p);
      lt[i] = tl.loss;
      lp[i] = logp_i;
      en[i] = st.entropy;
      if (orow) {
        if (tl.dlogp == T(0) && tl.dent == T(0)) {
          rw.zero(orow);  // e.g. a clipped token without KL or entropy terms
        } else {
          rw.grad(x, inv, st, gs * tl.dlogp, gs * tl.dent, tok[i], true, orow);
        }
      }
    }
  });
  if (out) {  // positions t >= T of [B, T + 1, V] logits get a zero gradient
    for (int64_t b = 0; b < r.B; ++b)
      for (int64_t t = r.T; t < r.Tl; ++t) zero_row(out + b * oB + t * oT, r.V);
  }
}

// loss = sum_i w_i loss_i, summed in double whatever the dtype.
at::Tensor weighted_sum(const at::Tensor& w, const at::Tensor& loss_tok) {
  at::Tensor loss = at::empty({}, loss_tok.options());
  AT_DISPATCH_FLOATING_TYPES(loss_tok.scalar_type(), "weighted_sum", [&] {
    const scalar_t* a = w.data_ptr<scalar_t>();
    const scalar_t* l = loss_tok.data_ptr<scalar_t>();
    double s = 0.0;
    for (int64_t i = 0; i < loss_tok.numel(); ++i) s += double(a[i]) * double(l[i]);
    *loss.data_ptr<scalar_t>() = scalar_t(s);
  });
  return loss;
}

// Shared by the functional and the inplace op. dlogits: an output buffer, or undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run(
    const at::Tensor& logits, const ppo::LossArgs& a, const at::Tensor& dlogits) {
  const RowArgs& r = a.rows;
  check_tokens(r);
  const auto opts = r.acc_opts;
  at::Tensor loss_tok = at::empty({r.B, r.T}, opts), logp = at::empty({r.B, r.T}, opts),
             ent = at::empty({r.B, r.T}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "ppo_loss_fwd", [&] {
    scalar_t* out = dlogits.defined() ? dlogits.data_ptr<scalar_t>() : nullptr;
    const int64_t oB = dlogits.defined() ? dlogits.stride(0) : 0;
    const int64_t oT = dlogits.defined() ? dlogits.stride(1) : 0;
    fused_rows<scalar_t>(logits, a, out, oB, oT, loss_tok, logp, ent);
  });
  return {weighted_sum(a.in.weights, loss_tok), loss_tok, logp, ent};
}

// Boxed kernels (csrc/loss_args.h: the arguments read by schema name).
void ppo_loss_fwd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const ppo::OpArgs args(op, stack);
  const ppo::LossArgs a = ppo::loss_args(args);
  const at::Tensor logits = args.tensor("logits");
  const bool compute_grad = args["compute_grad"].toBool();
  at::Tensor dlogits = compute_grad ? new_grad_buffer(logits.sizes(), logits.options())
                                    : at::empty({0}, logits.options());
  auto [loss, loss_tok, logp, ent] = run(logits, a, compute_grad ? dlogits : at::Tensor());
  args.ret(stack, loss, loss_tok, logp, ent, dlogits);
}

void ppo_loss_fwd_inplace(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const ppo::OpArgs args(op, stack);
  const at::Tensor logits = args.tensor("logits");
  // each row is read (its exps kept) before its gradient overwrites it
  auto [loss, loss_tok, logp, ent] = run(logits, ppo::loss_args(args), logits);
  args.ret(stack, loss, loss_tok, logp, ent);
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) {
  m.impl("ppo_loss_fwd", torch::CppFunction::makeFromBoxedFunction<&ppo_loss_fwd>());
  m.impl("ppo_loss_fwd_inplace",
         torch::CppFunction::makeFromBoxedFunction<&ppo_loss_fwd_inplace>());
}

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
