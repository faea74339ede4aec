// The [B, T]-sized parts of a ppo_loss call on the CPU (schemas in csrc/ops_host.cpp): the
// metrics vector and the loss_agg_mode weights, each one op instead of a chain of eager
// element-wise ops (ppo_kernels/_torch_impl.py metrics / agg_weights and
// rollout_correction.metrics hold the same formulas, which the other backends run).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "../loss_args.h"
#include "../ppo_math.h"
#include "common.h"
#include "seq_ratio.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

// The slots of the metrics vector: ppo_kernels/loss.py METRIC_SLOTS, in this order.
enum Metric : int {
  kNumTokens, kNumSeqs, kClipFrac, kClipFracHigh, kClipFracLow, kDualClipFrac, kApproxKl,
  kKlRef, kEntropy, kRatioMean, kRatioMax, kCispoClipFrac, kSeqClipFrac, kSeqRatioMean,
  kSeqRatioMax, kRolloutRatioMean, kRolloutRatioMax, kRolloutRatioMin,
  kRolloutRatioOutsideFrac, kRolloutKlK3, kRolloutChi2, kRolloutIsMean, kRolloutIsMax,
  kRolloutMaskedFrac, kNumMetrics
};

// max with NaN propagation (torch.max's)
template <typename T>
inline T nan_max(T a, T b) {
  return (a != a || b != b) ? std::numeric_limits<T>::quiet_NaN() : (b > a ? b : a);
}
template <typename T>
inline T nan_min(T a, T b) {
  return (a != a || b != b) ? std::numeric_limits<T>::quiet_NaN() : (b < a ? b : a);
}

// DPPO's mask, as ppo_math.h pg_dppo decides it (and _torch_impl.dppo_masked)
template <typename T>
bool dppo_masked(T logp, T old_logp, T adv, bool kl, const ppo::PolicyParams& p) {
  const T pn = ppo::ppo_exp(logp), po = ppo::ppo_exp(old_logp);
  T div;
  if (kl) {
    const T lo = old_logp < T(0) ? old_logp : T(0), ln = logp < T(0) ? logp : T(0);
    const T q_old = T(0) - ppo::ppo_expm1(lo);
    const T tail = q_old == T(0) ? T(0) : q_old * (ppo::log1m_exp(lo) - ppo::log1m_exp(ln));
    div = ppo::ppo_exp(lo) * (lo - ln) + tail;
  } else {
    div = pn > po ? pn - po : po - pn;
  }
  return adv > T(0) ? (pn > po && div > T(p[ppo::slot::clip_eps_high]))
                    : (pn < po && div > T(p[ppo::slot::clip_eps_low]));
}

template <typename T>
void metrics_impl(const at::Tensor& logp_t, const at::Tensor& ent_t, const at::Tensor& mask_t,
                  const std::optional<at::Tensor>& old_t, const at::Tensor& adv_t,
                  const std::optional<at::Tensor>& ref_t,
                  const std::optional<at::Tensor>& roll_t,
                  const std::optional<at::Tensor>& isw_t,
                  const std::optional<at::Tensor>& lkl_t, const ppo::PolicyParams& p,
                  float* out) {
  const int64_t B = mask_t.size(0), Tn = mask_t.size(1);
  const T* lp = logp_t.data_ptr<T>();
  const T* en = ent_t.data_ptr<T>();
  const bool* m = mask_t.data_ptr<bool>();
  const T* old = opt_per_token<T>(old_t, mask_t, "old_logprobs");
  const T* adv = adv_t.data_ptr<T>();
  const T* ref = opt_per_token<T>(ref_t, mask_t, "ref_logprobs");
  const T* roll = old ? opt_per_token<T>(roll_t, mask_t, "rollout_logprobs") : nullptr;
  const T* isw = roll ? opt_per_token<T>(isw_t, mask_t, "rollout_is_weights") : nullptr;
  const T* lkl = opt_per_token<T>(lkl_t, mask_t, "kl_logprobs");  // (null: the KL reads lp)
  const int pl = p.code(ppo::slot::policy_loss), est = p.code(ppo::slot::kl_estimator);
  const bool seq = pl == ppo::kGspo || pl == ppo::kGspoToken || pl == ppo::kVespo;
  const bool surrogate = pl == ppo::kVanilla || pl == ppo::kGspo || pl == ppo::kGspoToken;
  const double el = p[ppo::slot::clip_eps_low], eh = p[ppo::slot::clip_eps_high];
  const double c = p[ppo::slot::dual_clip_c];
  // the thresholds as torch compares with them: the Python double, rounded once to T
  const T hi = T(1.0 + eh), lo = T(1.0 - el), cap_c = T(-c);
  const T lim = T(ppo::kLogRatioClamp);
  double n_tok = 0, n_seq = 0, clip_any = 0, clip_hi = 0, clip_lo = 0, dual = 0, akl = 0,
         kl = 0, ent = 0, rho_sum = 0, cispo = 0, seq_clip = 0, seq_sum = 0;
  T rho_max = T(0), seq_max = T(0);
  double r_mean = 0, r_out = 0, r_k3 = 0, r_chi = 0, w_mean = 0, w_zero = 0;
  T r_max = T(0), r_min = std::numeric_limits<T>::infinity(), w_max = T(0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = b * Tn;
    // the sequence ratio of the sequence-level losses (seq_ratio.h)
    T s = T(1);
    int64_t len = 0;
    if (seq) {
      const SeqRatio<T> sr = seq_ratio<T>(lp + row, old ? old + row : nullptr, m + row, Tn,
                                          pl == ppo::kVespo);
      s = sr.ratio;
      len = sr.len;
    } else {
      for (int64_t t = 0; t < Tn; ++t) len += m[row + t] ? 1 : 0;
    }
    if (len > 0) {
      n_seq += 1;
      if (seq) {
        seq_sum += double(s);
        seq_max = nan_max(seq_max, s);
        if (pl != ppo::kVespo && (s > hi || s < lo)) seq_clip += 1;
      }
    }
    for (int64_t t = 0; t < Tn; ++t) {
      const int64_t i = row + t;
      if (!m[i]) continue;
      n_tok += 1;
      const T l = lp[i], o = old ? old[i] : l, a = adv[i];
      const T d = ppo::clampv(l - o, -lim, lim);
      const T rho = ppo::ppo_exp(d);
      bool ch = false, cl = false, du = false;
      if (surrogate) {
        const T r = seq ? s : rho;
        const T unclipped = -r * a;
        const T clipped = -ppo::clampv(r, lo, hi) * a;
        const T pg = unclipped >= clipped ? unclipped : clipped;
        ch = r > hi && a > T(0);
        cl = r < lo && a < T(0);
        du = c > 0 && a < T(0) && pg > cap_c * a;
      } else if (pl == ppo::kCispo) {
        const bool above = rho > hi, below = rho < lo;
        ch = above && a > T(0);
        cl = below && a < T(0);
        if (above || below) cispo += 1;
      } else if (pl == ppo::kDppoTv || pl == ppo::kDppoKl) {
        const bool mk = dppo_masked<T>(l, o, a, pl == ppo::kDppoKl, p);
        ch = mk && a > T(0);
        cl = mk && a < T(0);
        du = c > 0 && !mk && rho > T(c);
      }
      clip_hi += ch;
      clip_lo += cl;
      clip_any += ch || cl;
      dual += du;
      akl += double(ppo::expm1_minus_x(d));
      if (ref) kl += double(ppo::kl_term<T>((lkl ? lkl[i] : l) - ref[i], est).kl);
      ent += double(en[i]);
      rho_sum += double(rho);
      rho_max = nan_max(rho_max, rho);
      if (roll) {  // rollout_correction.metrics
        const T lr = ppo::clampv(o - roll[i], -lim, lim);
        const T raw = ppo::ppo_exp(lr);
        r_mean += double(raw);
        r_max = nan_max(r_max, raw);
        r_min = nan_min(r_min, raw);
        r_out += (raw < T(0.9) || raw > T(1.1));
        r_k3 += double(ppo::expm1_minus_x(lr));
        r_chi += double(ppo::ppo_exp(T(2) * lr));
        const T w = isw ? isw[i] : T(1);
        w_mean += double(w);
        w_max = nan_max(w_max, w);
        w_zero += w == T(0);
      }
    }
  }
  const T n = T(n_tok > 1 ? n_tok : 1), ns = T(n_seq > 1 ? n_seq : 1);
  auto mean = [&](double x) { return float(T(x) / n); };
  for (int k = 0; k < kNumMetrics; ++k) out[k] = 0.0f;
  out[kNumTokens] = float(n_tok);
  out[kNumSeqs] = float(n_seq);
  out[kClipFrac] = mean(clip_any);
  out[kClipFracHigh] = mean(clip_hi);
  out[kClipFracLow] = mean(clip_lo);
  out[kDualClipFrac] = mean(dual);
  out[kApproxKl] = mean(akl);
  out[kKlRef] = ref ? mean(kl) : 0.0f;
  out[kEntropy] = mean(ent);
  out[kRatioMean] = mean(rho_sum);
  out[kRatioMax] = float(rho_max);
  out[kCispoClipFrac] = mean(cispo);
  if (seq) {
    out[kSeqClipFrac] = float(T(seq_clip) / ns);
    out[kSeqRatioMean] = float(T(seq_sum) / ns);
    out[kSeqRatioMax] = float(seq_max);
  }
  if (roll) {
    out[kRolloutRatioMean] = mean(r_mean);
    out[kRolloutRatioMax] = float(r_max);
    out[kRolloutRatioMin] = std::isinf(r_min) && r_min > 0 ? 0.0f : float(r_min);
    out[kRolloutRatioOutsideFrac] = mean(r_out);
    out[kRolloutKlK3] = mean(r_k3);
    out[kRolloutChi2] = mean(r_chi) - (n_tok > 0 ? 1.0f : 0.0f);
    out[kRolloutIsMean] = mean(w_mean);
    out[kRolloutIsMax] = float(w_max);
    out[kRolloutMaskedFrac] = mean(w_zero);
  }
}

at::Tensor ppo_loss_metrics(const at::Tensor& logp_in, const at::Tensor& ent_in,
                            const at::Tensor& mask_in, const std::optional<at::Tensor>& old,
                            const at::Tensor& adv_in, const std::optional<at::Tensor>& ref,
                            const std::optional<at::Tensor>& roll,
                            const std::optional<at::Tensor>& isw,
                            c10::ArrayRef<double> scalars, c10::ArrayRef<int64_t> codes,
                            c10::ArrayRef<int64_t> slots,
                            const std::optional<at::Tensor>& kl_logprobs) {
  TORCH_CHECK(mask_in.dim() == 2 && mask_in.scalar_type() == at::kBool,
              "mask: expected bool [B, T], got ", mask_in.scalar_type(), " ", mask_in.sizes());
  const ppo::PolicyParams p = ppo::slot_params(scalars, codes, ref.has_value(), isw.has_value());
  TORCH_CHECK(p.code(ppo::slot::policy_loss) >= ppo::kVanilla &&
                  p.code(ppo::slot::policy_loss) <= ppo::kVespo,
              "policy_loss: expected an id of ppo_kernels/spec.py POLICY_LOSSES, got ",
              p.code(ppo::slot::policy_loss));
  const at::Tensor mask = mask_in.contiguous();
  const at::ScalarType acc = logp_in.scalar_type();
  TORCH_CHECK(acc == at::kFloat || acc == at::kDouble,
              "logprobs: expected float32 or float64, got ", acc);
  for (const auto& [x, name] : {std::pair<const at::Tensor*, const char*>{&logp_in, "logprobs"},
                                {&ent_in, "entropy"}, {&adv_in, "advantages"}})
    TORCH_CHECK(x->sizes() == mask.sizes() && x->scalar_type() == acc, name, ": expected ", acc,
                " of the mask's shape ", mask.sizes(), ", got ", x->scalar_type(), " ",
                x->sizes());
  for (const int64_t k : slots)
    TORCH_CHECK(k >= 0 && k < kNumMetrics, "slots: expected indices in [0, ", int(kNumMetrics),
                "), got ", k);
  float all[kNumMetrics];
  AT_DISPATCH_FLOATING_TYPES(acc, "ppo_loss_metrics", [&] {
    metrics_impl<scalar_t>(logp_in.contiguous(), ent_in.contiguous(), mask,
                           contiguous_opt(old), adv_in.contiguous(), contiguous_opt(ref),
                           contiguous_opt(roll), contiguous_opt(isw),
                           contiguous_opt(kl_logprobs), p, all);
  });
  at::Tensor out = at::empty({static_cast<int64_t>(slots.size())},
                             mask.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (size_t k = 0; k < slots.size(); ++k) o[k] = all[slots[k]];
  return out;
}

at::Tensor agg_weights(const at::Tensor& mask_in, int64_t mode, double denom, bool float64) {
  TORCH_CHECK(mask_in.dim() == 2 && mask_in.scalar_type() == at::kBool,
              "mask: expected bool [B, T], got ", mask_in.scalar_type(), " ", mask_in.sizes());
  TORCH_CHECK(mode >= 0 && mode <= 3, "mode: expected 0, 1, 2 or 3, got ", mode);
  const at::Tensor mask = mask_in.contiguous();
  const int64_t B = mask.size(0), Tn = mask.size(1);
  const bool* m = mask.data_ptr<bool>();
  at::Tensor w = at::empty({B, Tn}, mask.options().dtype(float64 ? at::kDouble : at::kFloat));
  AT_DISPATCH_FLOATING_TYPES(w.scalar_type(), "agg_weights", [&] {
    using T = scalar_t;
    T* out = w.data_ptr<T>();
    std::vector<int64_t> lens(B, 0);
    int64_t n_tok = 0, n_seq = 0;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < Tn; ++t) lens[b] += m[b * Tn + t] ? 1 : 0;
      n_tok += lens[b];
      n_seq += lens[b] > 0;
    }
    T one = T(1);  // mode 1
    if (mode == 0) one = T(1) / (denom > 0 ? T(denom) : T(n_tok > 1 ? n_tok : 1));
    if (mode == 2) one = T(1) / T(denom);
    const T n = denom > 0 ? T(denom) : T(n_seq > 1 ? n_seq : 1);
    for (int64_t b = 0; b < B; ++b) {
      const T wb = mode == 3 ? T(1) / (T(lens[b] > 1 ? lens[b] : 1) * n) : one;
      for (int64_t t = 0; t < Tn; ++t) out[b * Tn + t] = m[b * Tn + t] ? wb : T(0);
    }
  });
  return w;
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) {
  m.impl("ppo_loss_metrics", &ppo_loss_metrics);
  m.impl("agg_weights", &agg_weights);
}

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
