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
#include "middle_args.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

// in.lkl null: the KL reads lp, and its gradient joins dlogp (dkl unwritten).
template <typename T>
T token_middle_impl(int64_t n, const MiddlePtrs<T>& in, const ppo::PolicyParams& p, T* dlogp,
                    T* dent, T* pol, T* dkl) {
  const bool* m = in.m;
  const T *lp = in.lp, *en = in.ent, *old = in.old, *adv = in.adv, *ref = in.ref,
          *isw = in.isw, *w = in.w, *went = in.went, *lkl = in.lkl;
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
    const at::Tensor& logp, const at::Tensor& ent, const at::Tensor& mask,
    const std::optional<at::Tensor>& old, const at::Tensor& adv,
    const std::optional<at::Tensor>& ref, const std::optional<at::Tensor>& isw,
    const at::Tensor& w, const std::optional<at::Tensor>& went, c10::ArrayRef<double> scalars,
    c10::ArrayRef<int64_t> codes, const std::optional<at::Tensor>& lkl) {
  const MiddleArgs a = middle_args(logp, ent, mask, old, adv, ref, isw, w, went, lkl);
  const ppo::PolicyParams p = ppo::loss_params(scalars, codes, ref.has_value(), isw.has_value());
  const MiddleOut out = middle_out(a.logp);
  const at::Tensor dkl =
      lkl.has_value() ? at::empty_like(a.logp) : at::empty({0}, a.logp.options());
  AT_DISPATCH_FLOATING_TYPES(a.acc, "token_loss_grad", [&] {
    using T = scalar_t;
    *out.loss.data_ptr<T>() = token_middle_impl<T>(
        a.mask.numel(), a.ptrs<T>(), p, out.dlogp.data_ptr<T>(), out.dent.data_ptr<T>(),
        out.pol.data_ptr<T>(), lkl.has_value() ? dkl.data_ptr<T>() : nullptr);
  });
  return {out.dlogp, out.dent, out.loss, out.pol, dkl};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) { m.impl("token_loss_grad", &token_loss_grad); }

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
