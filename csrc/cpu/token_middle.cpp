// The [B, T] middle of the two-phase path for the token-level policy losses (vanilla, cispo,
// sapo, dppo-tv, dppo-kl) in one op (schema and contract in csrc/ops_host.cpp): the loss
// and its gradient in the per-token log-probs, where the row statistics had to be complete
// before any gradient (a kept set, a split vocabulary), in place of autograd through the
// eager formulas (_torch_impl.py pg_terms, token_losses, aggregate: about 40 small torch
// ops). The per-token formulas are the fused kernels' own (ppo_math.h pg_term, kl_term),
// with the KL on its own log-probs where they are not the ratio's (sampling replay: the
// ratio over the kept set, the KL over the full vocabulary unless kl_logprobs="kept"):
//   pol_t = is_w_t pg(logp_t) + kl_coef kl(logp_kl_t - ref_t) (* rho_t with
//   kl_bias_correction); loss = sum_t w_t pol_t - entropy_coef sum_t w_ent_t H_t.
// Its Triton twin is triton_kernels/token_middle.py.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <tuple>

#include "../loss_args.h"
#include "../ppo_math.h"
#include "common.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

template <typename T>
const T* opt_in(const std::optional<at::Tensor>& x, const at::Tensor& mask, const char* name,
                at::ScalarType acc) {
  if (!x.has_value()) return nullptr;
  check_per_token(*x, name, mask, acc);
  return x->data_ptr<T>();
}

// lkl null: the KL reads lp, and its gradient joins dlogp (dkl unwritten).
template <typename T>
T token_middle_impl(const bool* m, int64_t n, const T* lp, const T* lkl, const T* en,
                    const T* old, const T* adv, const T* ref, const T* isw, const T* w,
                    const T* went, const ppo::PolicyParams& p, T* dlogp, T* dent, T* pol,
                    T* dkl) {
  const T kc = T(p[ppo::slot::kl_coef]), ec = T(p[ppo::slot::entropy_coef]);
  const int est = p.code(ppo::slot::kl_estimator);
  const bool bias = p.code(ppo::slot::kl_bias_correction) != 0;
  double loss = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!m[i]) {
      dlogp[i] = dent[i] = pol[i] = T(0);
      if (lkl) dkl[i] = T(0);
      continue;
    }
    // on-policy (no old): rho = exp(logp - sg(logp)) = 1, d rho / d logp = 1
    const ppo::PgTerm<T> g = ppo::pg_term<T>(lp[i], old ? old[i] : lp[i], adv[i], p);
    T term = isw ? isw[i] * g.pg : g.pg;
    T d = isw ? isw[i] * g.dpg_dlogp : g.dpg_dlogp;  // d term / d logp (the ratio's)
    T dk = T(0);                                        // d term / d logp_kl
    if (ref) {
      const ppo::KlTerm<T> k = ppo::kl_term<T>((lkl ? lkl[i] : lp[i]) - ref[i], est);
      if (bias) {  // kl * rho, rho differentiable in the ratio's logp
        term += kc * k.kl * g.ratio;
        d += kc * k.kl * g.dratio;
        dk = kc * g.ratio * k.dkl_ddelta;
      } else {
        term += kc * k.kl;
        dk = kc * k.dkl_ddelta;
      }
    }
    if (!lkl) {
      d += dk;
      dk = T(0);
    }
    // a NaN term (a NaN input on a valid token) reaches the ratio's gradient, as
    // _torch_impl.token_losses's NaN * logp and ppo_math.h token_loss
    if (term != term) d = term;
    pol[i] = term;
    dlogp[i] = w[i] * d;
    if (lkl) dkl[i] = w[i] * dk;
    loss += double(w[i] * term);
    const T we = went ? went[i] : w[i];
    // (no term at all for a coefficient of 0: 0 * NaN would be NaN)
    if (ec != T(0)) loss -= double(ec * (we * en[i]));
    dent[i] = -ec * we;
  }
  return T(loss);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_loss_grad(
    const at::Tensor& logp_in, const at::Tensor& ent_in, const at::Tensor& mask_in,
    const std::optional<at::Tensor>& old_in, const at::Tensor& adv_in,
    const std::optional<at::Tensor>& ref_in, const std::optional<at::Tensor>& isw_in,
    const at::Tensor& w_in, const std::optional<at::Tensor>& went_in,
    c10::ArrayRef<double> scalars, c10::ArrayRef<int64_t> codes,
    const std::optional<at::Tensor>& lkl_in) {
  TORCH_CHECK(mask_in.dim() == 2 && mask_in.scalar_type() == at::kBool,
              "mask: expected bool [B, T], got ", mask_in.scalar_type(), " ", mask_in.sizes());
  const ppo::PolicyParams p =
      ppo::loss_params(scalars, codes, ref_in.has_value(), isw_in.has_value());
  const at::ScalarType acc = logp_in.scalar_type();
  TORCH_CHECK(acc == at::kFloat || acc == at::kDouble,
              "logprobs: expected float32 or float64, got ", acc);
  const at::Tensor mask = mask_in.contiguous();
  const auto c = [](const std::optional<at::Tensor>& t) {
    return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : t;
  };
  const at::Tensor logp = logp_in.contiguous(), ent = ent_in.contiguous(),
                   adv = adv_in.contiguous(), w = w_in.contiguous();
  const std::optional<at::Tensor> old = c(old_in), ref = c(ref_in), isw = c(isw_in),
                                  went = c(went_in), lkl = c(lkl_in);
  at::Tensor dlogp = at::empty_like(logp), dent = at::empty_like(logp),
             pol = at::empty_like(logp), loss = at::empty({}, logp.options()),
             dkl = lkl.has_value() ? at::empty_like(logp) : at::empty({0}, logp.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "token_loss_grad", [&] {
    using T = scalar_t;
    const T* in[4];
    const char* names[4] = {"logprobs", "entropy", "advantages", "weights"};
    const at::Tensor* ts[4] = {&logp, &ent, &adv, &w};
    for (int k = 0; k < 4; ++k) {
      check_per_token(*ts[k], names[k], mask, acc);
      in[k] = ts[k]->template data_ptr<T>();
    }
    *loss.data_ptr<T>() = token_middle_impl<T>(
        mask.data_ptr<bool>(), mask.numel(), in[0], opt_in<T>(lkl, mask, "kl_logprobs", acc),
        in[1], opt_in<T>(old, mask, "old_logprobs", acc), in[2],
        opt_in<T>(ref, mask, "ref_logprobs", acc), opt_in<T>(isw, mask, "rollout_is_weights", acc),
        in[3], opt_in<T>(went, mask, "entropy_weights", acc), p, dlogp.data_ptr<T>(),
        dent.data_ptr<T>(), pol.data_ptr<T>(), lkl.has_value() ? dkl.data_ptr<T>() : nullptr);
  });
  return {dlogp, dent, loss, pol, dkl};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) { m.impl("token_loss_grad", &token_loss_grad); }

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
