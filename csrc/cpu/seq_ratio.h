// The sequence ratio of the sequence-level policy losses over one sequence's valid tokens,
// as _torch_impl.pg_terms forms it; one definition for the metrics op (metrics.cpp) and
// GSPO's middle (seq_loss.cpp), so that the seq_ratio_* metrics describe the ratio the
// loss used, bit for bit.
//   gspo, gspo-token (Zheng et al. 2025, "Group Sequence Policy Optimization"):
//     s = exp(clamp(mean_t (logp_t - old_t), -20, 20));
//   vespo (TRL's get_gamma_weights): w = exp(clamp(sum_t clamp(logp_t - old_t, -20, 20),
//     log 1e-8, 20)).
// The sum is taken in double and rounded once to T.
#pragma once

#include <cstdint>

#include "../ppo_math.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {

// VESPO's lower clamp of the sequence log-ratio (TRL's get_gamma_weights: log 1e-8)
constexpr double kVespoLogWMin = -18.420680743952367;

template <typename T>
struct SeqRatio {
  T ratio;      // s (or VESPO's w)
  int64_t len;  // the sequence's valid tokens
  bool live;    // the log-ratio was not clamped (nor NaN): d s / d logp_t = s / max(len, 1)
};

// Over positions [0, n) of one sequence: lp, old (null: on-policy, old = logp) and m.
template <typename T>
SeqRatio<T> seq_ratio(const T* lp, const T* old, const bool* m, int64_t n, bool vespo) {
  const T lim = T(ppo::kLogRatioClamp);
  double acc = 0;
  int64_t len = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (!m[t]) continue;
    ++len;
    const T d = lp[t] - (old ? old[t] : lp[t]);
    acc += vespo ? double(ppo::clampv(d, -lim, lim)) : double(d);
  }
  if (vespo) return {ppo::ppo_exp(ppo::clampv(T(acc), T(kVespoLogWMin), lim)), len, false};
  const T raw = T(acc) / T(len > 0 ? len : 1);
  const T ls = ppo::clampv(raw, -lim, lim);
  return {ppo::ppo_exp(ls), len, ls == raw};
}

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
