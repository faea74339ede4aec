// Scalar PPO math shared by the CPU and CUDA kernels: the one C++ place for each formula.
//
// Everything here is per token: a logprob of the sampled token in, the loss terms and their
// derivative with respect to that logprob out. The vocabulary-wide parts (logsumexp,
// entropy, dlogits) live in the kernels, which call dlogit_dense / dlogit below.
//
// Sources: clipped surrogate, Schulman et al. 2017 "Proximal Policy Optimization
// Algorithms", eq. 7; dual clip, Ye et al. 2020 "Mastering Complex Control in MOBA Games
// with Deep RL", eq. 5; KL estimators k1/k2/k3, J. Schulman, "Approximating KL
// Divergence" (2020). The numpy float64 oracle is ppo_kernels/reference.py.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PPO_HD __host__ __device__ __forceinline__
#else
#define PPO_HD inline
#endif

namespace ppo {

// The name <-> id tables of ppo_kernels/spec.py (POLICY_LOSSES, KL_ESTIMATORS; compared by
// tests/test_spec.py). The "+" estimators are verl's straight-through ones: the value of
// k1 / k3, the gradient of k2.
enum KlEstimator : int { kK1 = 0, kK2 = 1, kK3 = 2, kAbs = 3, kK1Plus = 4, kK3Plus = 5 };

// The fused kernels run the token-level policy losses; the sequence-level ones (gspo,
// gspo-token, vespo) need every token's logp of a sequence before any gradient and never
// reach a kernel (ppo_kernels/_two_phase.py runs them).
enum PolicyLoss : int {
  kVanilla = 0,
  kCispo = 1,
  kSapo = 2,
  kDppoTv = 3,
  kDppoKl = 4,
  kGspo = 5,
  kGspoToken = 6,
  kVespo = 7
};

// Whether the fused kernels run policy loss id pl (pg_term has its case).
PPO_HD bool kernel_policy_loss(int pl) { return pl >= kVanilla && pl <= kDppoKl; }

// The slots of the ppo_loss ops' `float[] scalars` and `int[] codes` (csrc/ops.cpp), named
// as ppo_kernels/spec.py names them (FLOAT_SLOTS, INT_SLOTS; compared by tests/test_spec.py).
// dual_clip_c <= 0: no dual clip; kl_bias_correction 0 / 1.
namespace slot {
enum Float : int {
  clip_eps_low,
  clip_eps_high,
  dual_clip_c,
  kl_coef,
  entropy_coef,
  temperature,
  grad_scale,
  sapo_tau_pos,
  sapo_tau_neg,
  kNumFloat
};
enum Int : int { policy_loss, kl_estimator, kl_bias_correction, kNumInt };
}  // namespace slot

// |log-ratio| beyond this is clamped: exp(20) ~ 4.9e8 still fits float32 comfortably,
// and a token that moved that far carries no trustworthy gradient anyway.
constexpr double kLogRatioClamp = 20.0;

// Accumulation type of a logits dtype: float for float/bf16/half, double for double
// (float64 logits keep float64 so that gradcheck can run; DESIGN.md, dtypes).
template <typename scalar_t>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};
template <typename scalar_t>
using acc_of = typename AccOf<scalar_t>::type;

PPO_HD float ppo_exp(float x) { return expf(x); }
PPO_HD double ppo_exp(double x) { return exp(x); }
PPO_HD float ppo_expm1(float x) { return expm1f(x); }
PPO_HD double ppo_expm1(double x) { return expm1(x); }
PPO_HD float ppo_log1p(float x) { return log1pf(x); }
PPO_HD double ppo_log1p(double x) { return log1p(x); }
PPO_HD float ppo_log(float x) { return logf(x); }
PPO_HD double ppo_log(double x) { return log(x); }

// e^u - 1 - u without cancellation. expm1(u) - u loses the digits of a result ~u^2/2 that
// is far smaller than either term (12% off at |u| = 1e-6 in float32), so below a cut a
// Horner series of 11 terms (u^2/2! .. u^12/12!); beyond it expm1(u) - u, within a few ulp
// there. The cut is |u| = 1 in float32 (truncation < 1e-9 relative, below float32's
// rounding) and 0.1 in float64 (truncation < 1e-20; at |u| = 1 it would be 4e-10). Used by
// k3 (u = -delta) and by the approx_kl metric (u = log-ratio).
template <typename T>
PPO_HD T expm1_minus_x(T u) {
  const T cut = sizeof(T) == 8 ? T(0.1) : T(1);
  if (u > -cut && u < cut) {
    T p = T(1.0 / 479001600.0);                 // 1/12!
    p = p * u + T(1.0 / 39916800.0);            // 1/11!
    p = p * u + T(1.0 / 3628800.0);             // 1/10!
    p = p * u + T(1.0 / 362880.0);              // 1/9!
    p = p * u + T(1.0 / 40320.0);               // 1/8!
    p = p * u + T(1.0 / 5040.0);                // 1/7!
    p = p * u + T(1.0 / 720.0);                 // 1/6!
    p = p * u + T(1.0 / 120.0);                 // 1/5!
    p = p * u + T(1.0 / 24.0);                  // 1/4!
    p = p * u + T(1.0 / 6.0);                   // 1/3!
    p = p * u + T(0.5);                         // 1/2!
    return u * u * p;
  }
  return ppo_expm1(u) - u;
}

template <typename T>
PPO_HD T clampv(T x, T lo, T hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// The options of the loss as the kernels receive them once: the scalars and codes in slot
// order, and which optional per-token inputs are present. A new option is a slot above and
// a read here (f[slot::x] or code(slot::x)) where its formula uses it.
struct PolicyParams {
  double f[slot::kNumFloat];
  int64_t i[slot::kNumInt];
  bool has_ref;
  bool has_is_weights;

  PPO_HD double operator[](slot::Float s) const { return f[s]; }
  PPO_HD int code(slot::Int s) const { return static_cast<int>(i[s]); }
};

// From the ops' float[] / int[] (sizes checked by the caller: kNumFloat, kNumInt).
inline PolicyParams policy_params(const double* scalars, const int64_t* codes, bool has_ref,
                                  bool has_is_weights) {
  PolicyParams p{};
  for (int k = 0; k < slot::kNumFloat; ++k) p.f[k] = scalars[k];
  for (int k = 0; k < slot::kNumInt; ++k) p.i[k] = codes[k];
  p.has_ref = has_ref;
  p.has_is_weights = has_is_weights;
  return p;
}

// Clipped-surrogate policy-gradient term of one token and d pg / d logp.
//   d   = clamp(logp - old_logp, -20, 20), rho = exp(d)
//   pg  = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)
//   pg  = min(pg, -c A) where A < 0 and c > 1 (dual clip)
// The unclipped branch is the active one on ties (rho inside the band or on its edge).
template <typename T>
struct PgTerm {
  T pg;         // the loss term (before rollout IS weights)
  T dpg_dlogp;  // its derivative with respect to logp
  T ratio;      // rho
  T dratio;     // d rho / d logp: rho, or 0 where the log-ratio was clamped
};

// Vanilla PPO clip (Schulman et al. 2017, eq. 7) with the dual clip (Ye et al. 2020, eq. 5).
template <typename T>
PPO_HD PgTerm<T> pg_vanilla(T rho, bool clamped, T adv, const PolicyParams& p) {
  const T unclipped = -rho * adv;
  const T clipped = -clampv(rho, T(1) - T(p[slot::clip_eps_low]), T(1) + T(p[slot::clip_eps_high])) * adv;
  const bool unclipped_active = unclipped >= clipped;
  T pg = unclipped_active ? unclipped : clipped;
  T grad = unclipped_active ? -rho * adv : T(0);
  if (p[slot::dual_clip_c] > 0 && adv < T(0)) {
    const T cap = -T(p[slot::dual_clip_c]) * adv;
    if (pg > cap) {
      pg = cap;
      grad = T(0);
    }
  }
  if (clamped) grad = T(0);
  return {pg, grad, rho, clamped ? T(0) : rho};
}

// CISPO (MiniMax-M1 technical report, MiniMax 2025): -sg(clip(rho, 1 - eps_low, 1 + eps_high)) A
// logp. The clipped ratio is a constant weight, so every token keeps the gradient -w A (the
// log-ratio clamp only bounds w). TRL's cap min(rho, epsilon_high) is eps_low = 1,
// eps_high = epsilon_high - 1.
template <typename T>
PPO_HD PgTerm<T> pg_cispo(T logp, T rho, bool clamped, T adv, const PolicyParams& p) {
  const T w = clampv(rho, T(1) - T(p[slot::clip_eps_low]), T(1) + T(p[slot::clip_eps_high]));
  return {-w * adv * logp, -w * adv, rho, clamped ? T(0) : rho};
}

// SAPO (soft adaptive policy optimisation; TRL loss_type="sapo", verl loss_mode="sapo"):
// the hard clip replaced by a sigmoid gate, -(4 / tau) sigmoid(tau (rho - 1)) A with
// tau = tau_pos where A > 0, else tau_neg; d / d logp = -4 s (1 - s) rho A (s the gate),
// 0 where the log-ratio was clamped. 1 - s is sigmoid(-z) of its own exp: as 1 - s it
// cancels where the gate saturates (s = 0.9995 at rho 8.7 loses 11 bits in float32).
template <typename T>
PPO_HD PgTerm<T> pg_sapo(T rho, bool clamped, T adv, const PolicyParams& p) {
  const T tau = adv > T(0) ? T(p[slot::sapo_tau_pos]) : T(p[slot::sapo_tau_neg]);
  const T z = tau * (rho - T(1));
  const T s = T(1) / (T(1) + ppo_exp(-z));
  const T s_minus = T(1) / (T(1) + ppo_exp(z));  // 1 - s
  const T grad = clamped ? T(0) : T(-4) * s * s_minus * rho * adv;
  return {-(T(4) / tau) * s * adv, grad, rho, clamped ? T(0) : rho};
}

// log(1 - e^x) for x <= 0 without cancellation (Maechler 2012, "Accurately computing
// log(1 - exp(-|a|))"): log(-expm1(x)) near 0, log1p(-e^x) below -log 2; -inf at x = 0.
template <typename T>
PPO_HD T log1m_exp(T x) {
  return x > T(-0.6931471805599453) ? ppo_log(-ppo_expm1(x)) : ppo_log1p(-ppo_exp(x));
}

// DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
// arXiv 2602.04879; verl loss_mode "dppo_tv" / "dppo_kl", TRL's experimental DPPOTrainer
// divergence_type "binary_tv" / "binary_kl"): with p = e^logp, p_old = e^old_logp the
// token's divergence D is the binary total variation |p - p_old| or the binary KL
// KL(Bernoulli(p_old) || Bernoulli(p)) = p_old (old - logp) + (1 - p_old) (log(1 - p_old) -
// log(1 - p)) (log-probs above 0 taken as 0); a token is masked (M = 0) where it left the region in the direction A
// pushes: A > 0 and p > p_old and D > eps_high, or A <= 0 and p < p_old and D > eps_low.
//   pg = -M sg(min(rho, c)) A logp,  d pg / d logp = -M min(rho, c) A
// c = dual_clip_c (verl's / TRL's clip_ratio_c), no cap when 0. The ratio is a constant
// weight (as CISPO's), so the log-ratio clamp only bounds it.
template <typename T>
PPO_HD PgTerm<T> pg_dppo(T logp, T old_logp, T rho, bool clamped, T adv, bool kl,
                         const PolicyParams& p) {
  const T pn = ppo_exp(logp), po = ppo_exp(old_logp);
  T div;
  if (kl) {
    // log-probs above 0 (rounding) count as 0 here: p, p_old <= 1 keep the KL defined
    const T lo = old_logp < T(0) ? old_logp : T(0), ln = logp < T(0) ? logp : T(0);
    const T q_old = T(0) - ppo_expm1(lo);  // 1 - p_old, keeping its digits
    // (1 - p_old) log((1 - p_old) / (1 - p)); 0 when p_old = 1 (0 log 0 = 0)
    const T tail = q_old == T(0) ? T(0) : q_old * (log1m_exp(lo) - log1m_exp(ln));
    div = ppo_exp(lo) * (lo - ln) + tail;
  } else {
    div = pn > po ? pn - po : po - pn;
  }
  const bool masked = adv > T(0) ? (pn > po && div > T(p[slot::clip_eps_high]))
                                 : (pn < po && div > T(p[slot::clip_eps_low]));
  const T c = T(p[slot::dual_clip_c]);
  const T w = masked ? T(0) : (c > T(0) && rho > c ? c : rho);
  return {-w * adv * logp, -w * adv, rho, clamped ? T(0) : rho};
}

// The policy-gradient term of one token and d pg / d logp, for the policy_loss code:
//   d = clamp(logp - old_logp, -20, 20), rho = exp(d), then the loss's own formula.
template <typename T>
PPO_HD PgTerm<T> pg_term(T logp, T old_logp, T adv, const PolicyParams& p) {
  const T lim = T(kLogRatioClamp);
  const T d_raw = logp - old_logp;
  const bool clamped = d_raw < -lim || d_raw > lim;
  const T rho = ppo_exp(clampv(d_raw, -lim, lim));
  switch (p.code(slot::policy_loss)) {
    case kCispo:
      return pg_cispo(logp, rho, clamped, adv, p);
    case kSapo:
      return pg_sapo(rho, clamped, adv, p);
    case kDppoTv:
      return pg_dppo(logp, old_logp, rho, clamped, adv, false, p);
    case kDppoKl:
      return pg_dppo(logp, old_logp, rho, clamped, adv, true, p);
    default:
      return pg_vanilla(rho, clamped, adv, p);
  }
}

// KL estimator of pi_theta against pi_ref from one sample, delta = logp - ref_logp,
// and its derivative with respect to delta.
template <typename T>
struct KlTerm {
  T kl;
  T dkl_ddelta;
};

template <typename T>
PPO_HD KlTerm<T> kl_term(T delta, int estimator) {
  switch (estimator) {
    case kK1:
      return {delta, T(1)};
    case kK2:
      return {T(0.5) * delta * delta, delta};
    case kAbs:
      return {delta < T(0) ? -delta : delta, delta > T(0) ? T(1) : (delta < T(0) ? T(-1) : T(0))};
    case kK1Plus:  // value of k1, gradient of k2
      return {delta, delta};
    case kK3Plus: {  // value of k3, gradient of k2 (no recursive call: it stays inlined)
      const T lim = T(kLogRatioClamp);
      return {expm1_minus_x(-clampv(delta, -lim, lim)), delta};
    }
    default: {  // kK3: exp(-c) - 1 + c, c = clamp(delta); only k3 has an exp to guard
      // both the value and its derivative 1 - exp(-c) cancel at small c: written as
      // expm1_minus_x(-c) and -expm1(-c) they keep their digits down to |c| ~ 1e-30
      const T lim = T(kLogRatioClamp);
      const bool clamped = delta < -lim || delta > lim;
      const T c = clampv(delta, -lim, lim);
      return {expm1_minus_x(-c), clamped ? T(0) : T(0) - ppo_expm1(-c)};
    }
  }
}

// Everything the fused loss needs from one token, given its logprob and entropy.
template <typename T>
struct TokenLoss {
  T loss;  // is_w * pg + kl_coef * kl (* rho) - entropy_coef * H
  T dlogp; // w * (is_w * d pg / d logp + kl_coef * d kl (rho) / d logp): d loss_agg / d logp
  T dent;  // -w_ent * entropy_coef: d loss_agg / d H
};

// w is the token's weight under loss_agg_mode (0 on masked tokens), w_ent its weight under
// entropy_agg_mode, is_w its rollout importance weight (1 when none), ref_logp ignored
// unless p.has_ref. With kl_bias_correction the KL term is kl * rho (DeepSeek-V3.2; TRL's
// use_bias_correction_kl), rho differentiable: d / d logp = rho d kl / d delta + kl d rho.
template <typename T>
PPO_HD TokenLoss<T> token_loss(T logp, T entropy, T old_logp, T adv, T ref_logp, T is_w, T w,
                               T w_ent, const PolicyParams& p) {
  const PgTerm<T> g = pg_term(logp, old_logp, adv, p);
  T loss = is_w * g.pg - T(p[slot::entropy_coef]) * entropy;
  T dlogp = is_w * g.dpg_dlogp;
  if (p.has_ref) {
    const KlTerm<T> k = kl_term(logp - ref_logp, p.code(slot::kl_estimator));
    if (p.code(slot::kl_bias_correction)) {
      loss += T(p[slot::kl_coef]) * k.kl * g.ratio;
      dlogp += T(p[slot::kl_coef]) * (g.ratio * k.dkl_ddelta + k.kl * g.dratio);
    } else {
      loss += T(p[slot::kl_coef]) * k.kl;
      dlogp += T(p[slot::kl_coef]) * k.dkl_ddelta;
    }
  }
  // a NaN loss (a NaN logit or input on a valid token) must reach the gradient too: the
  // branch selects above would otherwise hand out a finite 0 (and a skipped row), hiding it
  if (loss != loss) dlogp = loss;
  return {loss, w * dlogp, -w_ent * T(p[slot::entropy_coef])};
}

// Row gradient. With z = logits / temperature, p_v = exp(z_v - lse), H the entropy:
//   d logp / d z_v = 1[v = token] - p_v
//   d H    / d z_v = -p_v (log p_v + H)
// so d loss / d z_v = dlogp (1[v = token] - p_v) + dent * (-p_v (log p_v + H)), i.e.
//   dlogit_dense (every v but the token) and dlogit_token (the token), all divided by the
//   temperature.
// Generic in T so the CPU kernels can run it on at::vec::Vectorized lanes.
template <typename T>
PPO_HD T dlogit_dense(T logp_v, T pv, T entropy, T dlogp, T dent) {
  return T(0) - pv * (dlogp + dent * (logp_v + entropy));
}

// The sampled token's own entry, dlogp (1 - p) - dent p (log p + H), with 1 - p taken as
// -expm1(log p): a confident token (p -> 1, common in LLM policies) keeps its digits, and
// V = 1 gives exactly 0. A token whose logit is -inf (p = 0) gets dlogp, never NaN.
template <typename T>
PPO_HD T dlogit_token(T logp, T p, T entropy, T dlogp, T dent) {
  const T ent_part = p == T(0) ? T(0) : p * dent * (logp + entropy);
  return T(0) - dlogp * ppo_expm1(logp) - ent_part;
}

// The whole entry for one v. A banned entry (z_v = -inf) has p_v = 0 and gets exactly 0,
// never 0 * inf = NaN.
template <typename T>
PPO_HD T dlogit(T z, T lse, T entropy, T dlogp, T dent, T inv_temp, bool is_token) {
  const T logp_v = z - lse;
  const T pv = ppo_exp(logp_v);
  if (is_token) return dlogit_token(logp_v, pv, entropy, dlogp, dent) * inv_temp;
  return (pv == T(0) ? T(0) : dlogit_dense(logp_v, pv, entropy, dlogp, dent)) * inv_temp;
}

// One step of the reverse GAE scan (Schulman et al. 2016, eq. 16) at a valid token:
//   delta_t = r_t + gamma V_next - V_t,  A_t = delta_t + gamma lam A_next.
// Masked tokens are skipped by the caller (V_next, A_next carried unchanged).
template <typename T>
PPO_HD T gae_step(T reward, T value, T v_next, T a_next, T gamma, T lam) {
  return reward + gamma * v_next - value + gamma * lam * a_next;
}

}  // namespace ppo
