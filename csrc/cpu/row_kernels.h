// Vectorised per-row softmax pieces of the CPU kernels (one vocabulary row at a time):
// logsumexp + entropy (row_stats) and the row gradient (row_grad). The per-token formulas
// come from csrc/ppo_math.h; these loops only sweep the vocabulary with at::vec.
//
// A row is read three times while it sits in L2 (max, exp-sum, gradient); the exps of the
// second sweep are kept in a per-thread scratch row so the gradient sweep needs no exp.
// This file is compiled once per SIMD capability (setup.py), so it must not define
// anything with external linkage outside the CPU_CAPABILITY namespace.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ppo_math.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {

using at::vec::Vectorized;

using ppo::acc_of;  // accumulation dtype (ppo_math.h)

// Reduced-precision rows are widened to float once into scratch; float/double rows are
// read in place.
template <typename scalar_t>
constexpr bool kWiden = !std::is_same<scalar_t, acc_of<scalar_t>>::value;

template <typename scalar_t>
void widen(const scalar_t* src, float* dst, int64_t n) {
  using VecR = Vectorized<scalar_t>;
  using VecF = Vectorized<float>;
  int64_t v = 0;
  for (; v + VecR::size() <= n; v += VecR::size()) {
    auto [a, b] = at::vec::convert_to_float<scalar_t>(VecR::loadu(src + v));
    a.store(dst + v);
    b.store(dst + v + VecF::size());
  }
  for (; v < n; ++v) dst[v] = static_cast<float>(src[v]);
}

template <typename scalar_t>
void narrow(const float* src, scalar_t* dst, int64_t n) {
  using VecR = Vectorized<scalar_t>;
  using VecF = Vectorized<float>;
  int64_t v = 0;
  for (; v + VecR::size() <= n; v += VecR::size()) {
    at::vec::convert_from_float<scalar_t>(VecF::loadu(src + v), VecF::loadu(src + v + VecF::size()))
        .store(dst + v);
  }
  for (; v < n; ++v) dst[v] = static_cast<scalar_t>(src[v]);
}

// exp of the vocabulary sweeps: ATen's polynomial exp_u20 (max error 20 ulp, about 1.2e-6
// relative; inputs below ln(FLT_MIN) give 0, so -inf gives 0) instead of Sleef's 1-ulp exp:
// the exp is most of the arithmetic of a row, and the error stays far below the 1e-5
// float32 tolerance. float64 rows (gradcheck) keep the exact exp.
template <typename T>
inline Vectorized<T> vexp(const Vectorized<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

template <typename T>
struct RowStats {
  T max;      // max_v x_v, in raw logit units
  T log_sum;  // log sum_v exp(d_v), d_v = (x_v - max) / temperature
  T inv_sum;  // 1 / sum_v exp(d_v)
  T lse;      // logsumexp_v z_v = max / temperature + log_sum
  T entropy;  // log_sum - sum_v p_v d_v (0 unless asked for)
};

// log p of entry v, as the shifted difference d_v - log_sum: subtracting the raw max
// before scaling keeps the digits that z_v - lse would lose when |z| is large (fp16 logits
// near 65504) and gives exactly 0 for the max entry at any temperature.
template <typename T>
inline T row_logp(const T* x, int64_t v, T inv_temp, const RowStats<T>& st) {
  return (x[v] - st.max) * inv_temp - st.log_sum;
}

// x: raw logits of one row (T = float or double, unit stride).
// e: if not null, receives exp(d_v) for row_grad.
template <typename T, bool kEntropy, bool kStoreExp>
RowStats<T> row_stats_impl(const T* x, int64_t V, T inv_temp, T* e) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const T xmax = at::vec::reduce_all<T>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, V);
  const Vec vinv(inv_temp), vmax(xmax);
  // d is -inf on a banned entry; exp gives 0 and clamping d to the lowest finite value
  // keeps that 0 out of 0 * -inf = NaN in the entropy sum.
  const Vec vlow(std::numeric_limits<T>::lowest());
  Vec vs(T(0)), vt(T(0));
  int64_t v = 0;
  for (; v + W <= V; v += W) {
    const Vec d = (Vec::loadu(x + v) - vmax) * vinv;
    const Vec ev = vexp(d);
    vs = vs + ev;
    if constexpr (kEntropy) vt = vt + ev * at::vec::maximum(d, vlow);
    if constexpr (kStoreExp) ev.store(e + v);
  }
  T s = at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, vs);
  T t = kEntropy ? at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, vt) : T(0);
  for (; v < V; ++v) {
    const T d = (x[v] - xmax) * inv_temp;
    const T ev = ppo::ppo_exp(d);
    s += ev;
    if constexpr (kEntropy) t += ev * std::max(d, std::numeric_limits<T>::lowest());
    if constexpr (kStoreExp) e[v] = ev;
  }
  const T log_s = std::log(s);
  return {xmax, log_s, T(1) / s, xmax * inv_temp + log_s, kEntropy ? log_s - t / s : T(0)};
}

template <typename T>
RowStats<T> row_stats(const T* x, int64_t V, T inv_temp, bool entropy, T* e) {
  if (entropy)
    return e ? row_stats_impl<T, true, true>(x, V, inv_temp, e)
             : row_stats_impl<T, true, false>(x, V, inv_temp, e);
  return e ? row_stats_impl<T, false, true>(x, V, inv_temp, e)
           : row_stats_impl<T, false, false>(x, V, inv_temp, e);
}

// Row gradient g_v = d loss / d logits_v (ppo::dlogit_dense, ppo::dlogit_token) into out.
// e: exp(d) from row_stats, or null to recompute p from st.max and st.log_sum (a caller
// that only has the lse passes max = 0, log_sum = lse). out may alias e or x.
template <typename T>
void row_grad(const T* x, const T* e, int64_t V, T inv_temp, const RowStats<T>& st, T dlogp,
              T dent, int64_t token, T* out) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  // the token's entry is written last, from its own formula; read it before out (which may
  // be the row itself) is written
  const T logp_tok = row_logp(x, token, inv_temp, st);
  int64_t v = 0;
  if (e != nullptr && dent == T(0)) {
    // no entropy term: g_v = -p_v dlogp / temperature, one multiply per entry
    const T c = -dlogp * st.inv_sum * inv_temp;
    const Vec vc(c);
    for (; v + W <= V; v += W) (Vec::loadu(e + v) * vc).store(out + v);
    for (; v < V; ++v) out[v] = e[v] * c;
  } else {
    const Vec vinv(inv_temp), vmax(st.max), vls(st.log_sum), vH(st.entropy), vdl(dlogp),
        vde(dent), vis(st.inv_sum), vzero(T(0));
    for (; v + W <= V; v += W) {
      const Vec logp_v = (Vec::loadu(x + v) - vmax) * vinv - vls;
      const Vec pv = e ? Vec::loadu(e + v) * vis : vexp(logp_v);
      const Vec g = ppo::dlogit_dense(logp_v, pv, vH, vdl, vde) * vinv;
      // p = 0 (a banned entry): exactly 0, not 0 * inf
      Vec::blendv(g, vzero, pv == vzero).store(out + v);
    }
    for (; v < V; ++v) {
      const T logp_v = row_logp(x, v, inv_temp, st);
      const T pv = e ? e[v] * st.inv_sum : ppo::ppo_exp(logp_v);
      out[v] = pv == T(0) ? T(0) : ppo::dlogit_dense(logp_v, pv, st.entropy, dlogp, dent) * inv_temp;
    }
  }
  out[token] = ppo::dlogit_token(logp_tok, ppo::ppo_exp(logp_tok), st.entropy, dlogp, dent) *
               inv_temp;
}

// Per-thread scratch for one row: the widened row (reduced dtypes) and a T row for the
// exps / the float gradient before narrowing.
template <typename scalar_t>
struct RowScratch {
  using T = acc_of<scalar_t>;
  std::vector<T> xw, e;
  RowScratch(int64_t V, bool need_e) : xw(kWiden<scalar_t> ? V : 0), e(need_e ? V : 0) {}
  // The row as T values: in place for float/double, widened into scratch otherwise.
  const T* load(const scalar_t* row, int64_t V) {
    if constexpr (kWiden<scalar_t>) {
      widen(row, xw.data(), V);
      return xw.data();
    } else {
      return row;
    }
  }
};

// Writes the gradient of one row into out (dtype scalar_t). exps: the row's exps from
// row_stats or null; tmp: a T row for reduced dtypes (may alias exps). out may be the row
// itself (inplace_backward): each entry is read before it is written.
template <typename scalar_t, typename T>
void write_row_grad(const T* x, const T* exps, T* tmp, int64_t V, T inv_temp,
                    const RowStats<T>& st, T dlogp, T dent, int64_t token, scalar_t* out) {
  if constexpr (kWiden<scalar_t>) {
    row_grad<T>(x, exps, V, inv_temp, st, dlogp, dent, token, tmp);
    narrow(tmp, out, V);
  } else {
    row_grad<T>(x, exps, V, inv_temp, st, dlogp, dent, token, out);
  }
}

// Rows of [B, Tl, V] visited as i = b * T + t for t < T; grain sized so a task holds
// about 64K vocabulary entries.
inline int64_t row_grain(int64_t V) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(V, 1)); }

template <typename scalar_t>
void zero_row(scalar_t* row, int64_t V) {
  std::memset(static_cast<void*>(row), 0, sizeof(scalar_t) * V);
}

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
