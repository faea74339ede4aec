// GSPO's [B, T] middle on the CPU in one op (schema and contract in csrc/ops_host.cpp): the
// loss of the sequence-ratio losses (gspo, gspo-token) and its gradient in the per-token
// log-probs and entropies, which the two-phase path (ppo_kernels/_two_phase.py
// middle_grad) would otherwise differentiate by autograd through the eager formulas
// (_torch_impl.py pg_terms, token_losses, aggregate): about 60 small torch ops. The same
// formulas as the Triton twin triton_kernels/seq_loss.py, which documents them:
//   s = exp(clamp(mean_t (logp_t - old_t), -20, 20)) per sequence (seq_ratio.h);
//   pol_t = is_w_t pg(s, A_t) + kl_coef kl_t (* s with kl_bias_correction), pg PPO's
//   clipped surrogate of s (Schulman et al. 2017, eq. 7) with the dual clip (Ye et al.
//   2020, eq. 5); loss = sum_t w_t pol_t - entropy_coef sum_t w_ent_t H_t;
//   gspo: d s / d logp_t = s / n on every valid token of the sequence; gspo-token: s on the
//   token itself; neither where the mean log-ratio was clamped.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <tuple>

#include "../loss_args.h"
#include "../ppo_math.h"
#include "middle_args.h"
#include "seq_ratio.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

// (pg, d pg / d s) of the clipped surrogate of s at advantage a, as autograd differentiates
// _torch_impl._clip_surrogate: the unclipped branch on ties; through the clipped branch
// where s lies in the band (a tie but for a NaN advantage); 0 where the dual clip's cap is
// the value. lo / hi: the band's edges, cap_c = -dual_clip_c (has_dual: c > 0).
template <typename T>
inline void pg_of_seq_ratio(T s, T a, T lo, T hi, bool has_dual, T cap_c, T& pg, T& dpg) {
  const T unclipped = -s * a;
  const T sc = ppo::clampv(s, lo, hi);
  const T clipped = -sc * a;
  const bool active = unclipped >= clipped;
  pg = active ? unclipped : clipped;
  dpg = (active || sc == s) ? -a : T(0);
  if (has_dual && a < T(0) && pg > cap_c * a) {
    pg = cap_c * a;
    dpg = T(0);
  }
}

template <typename T>
T seq_loss_impl(int64_t B, int64_t Tn, const MiddlePtrs<T>& in, const ppo::PolicyParams& p,
                bool token, T* dlogp, T* dent, T* pol) {
  const bool* m = in.m;
  const T *lp = in.lp, *en = in.ent, *old = in.old, *adv = in.adv, *ref = in.ref,
          *isw = in.isw, *w = in.w, *went = in.went;
  // the option scalars as torch combines them with a tensor: the Python double rounded
  // once to T (the band's edges as 1 - eps_low, 1 + eps_high in double first)
  const T lo = T(1.0 - p[ppo::slot::clip_eps_low]), hi = T(1.0 + p[ppo::slot::clip_eps_high]);
  const bool has_dual = p[ppo::slot::dual_clip_c] > 0;
  const T cap_c = T(-p[ppo::slot::dual_clip_c]);
  const T kc = T(p[ppo::slot::kl_coef]), ec = T(p[ppo::slot::entropy_coef]);
  const int est = p.code(ppo::slot::kl_estimator);
  const bool bias = p.code(ppo::slot::kl_bias_correction) != 0;
  double loss = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = b * Tn;
    const SeqRatio<T> sr = seq_ratio<T>(lp + row, old ? old + row : nullptr, m + row, Tn,
                                        false);
    const T s = sr.ratio;
    double g_seq = 0;  // gspo: sum_t d loss / d s_t, s being every token's ratio
    for (int64_t t = 0; t < Tn; ++t) {
      const int64_t i = row + t;
      if (!m[i]) {
        dlogp[i] = dent[i] = pol[i] = T(0);
        continue;
      }
      T pg, dpg;
      pg_of_seq_ratio(s, adv[i], lo, hi, has_dual, cap_c, pg, dpg);
      if (!sr.live) dpg = T(0);
      T term = isw ? isw[i] * pg : pg;
      T d_s = isw ? isw[i] * dpg : dpg;  // d term / d s
      T d_own = T(0);                      // d term / d logp_t besides through s
      if (ref) {
        const ppo::KlTerm<T> k = ppo::kl_term<T>(lp[i] - ref[i], est);
        if (bias) {
          term += kc * k.kl * s;
          if (sr.live) d_s += kc * k.kl;
          d_own = kc * s * k.dkl_ddelta;
        } else {
          term += kc * k.kl;
          d_own = kc * k.dkl_ddelta;
        }
      }
      d_s *= w[i];
      d_own *= w[i];
      // a NaN term (a NaN input on a valid token) reaches its own gradient, as
      // _torch_impl.token_losses's NaN * logp
      if (term != term) d_own = term;
      pol[i] = term;
      loss += double(w[i] * term);
      const T we = went ? went[i] : w[i];
      // (no term at all for a coefficient of 0: 0 * NaN would be NaN)
      if (ec != T(0)) loss -= double(ec * (we * en[i]));
      dent[i] = -ec * we;
      if (token) {
        dlogp[i] = d_s * s + d_own;
      } else {
        g_seq += double(d_s);
        dlogp[i] = d_own;
      }
    }
    if (!token) {  // every valid token's share of d loss / d s: d s / d logp_t = s / n
      const T g = T(g_seq) * (s / T(sr.len > 0 ? sr.len : 1));
      for (int64_t t = 0; t < Tn; ++t)
        if (m[row + t]) dlogp[row + t] += g;
    }
  }
  return T(loss);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> seq_loss_grad(
    const at::Tensor& logp, const at::Tensor& ent, const at::Tensor& mask,
    const std::optional<at::Tensor>& old, const at::Tensor& adv,
    const std::optional<at::Tensor>& ref, const std::optional<at::Tensor>& isw,
    const at::Tensor& w, const std::optional<at::Tensor>& went, c10::ArrayRef<double> scalars,
    c10::ArrayRef<int64_t> codes) {
  const MiddleArgs a = middle_args(logp, ent, mask, old, adv, ref, isw, w, went);
  const ppo::PolicyParams p = ppo::slot_params(scalars, codes, ref.has_value(), isw.has_value());
  const int pl = p.code(ppo::slot::policy_loss);
  TORCH_CHECK_VALUE(pl == ppo::kGspo || pl == ppo::kGspoToken,
                    "policy_loss: expected the id of gspo or gspo-token (ppo_kernels/spec.py "
                    "POLICY_LOSSES), got ", pl);
  const MiddleOut out = middle_out(a.logp);
  AT_DISPATCH_FLOATING_TYPES(a.acc, "seq_loss_grad", [&] {
    using T = scalar_t;
    *out.loss.data_ptr<T>() = seq_loss_impl<T>(
        a.mask.size(0), a.mask.size(1), a.ptrs<T>(), p, pl == ppo::kGspoToken,
        out.dlogp.data_ptr<T>(), out.dent.data_ptr<T>(), out.pol.data_ptr<T>());
  });
  return {out.dlogp, out.dent, out.loss, out.pol};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) { m.impl("seq_loss_grad", &seq_loss_grad); }

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
