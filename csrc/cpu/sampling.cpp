// Sampling replay on the CPU (docs/SAMPLING.md): the kept set of an inference engine's
// truncated sampling distribution, and the log-probs / entropy / gradient over it.
//
// A row's kept set K is either given (CSR: kept_ids[kept_offsets[i] .. kept_offsets[i+1]),
// global vocabulary ids, unique) or a value threshold on the row's raw logits (K = {j :
// x_j >= threshold_i}; sampling_threshold computes it from vLLM v1's top-k / top-p / min-p
// rules). The sampled token is always in K (added when the set lacks it: `missing`).
//
// kept_logprobs_fwd: logp_kept = z_y - log sum_{j in K} exp(z_j), z = x / temperature, and
// the entropy of the kept-set softmax, with the statistics the backward needs (kept_max,
// kept_log_sum: the convention of token_logprobs_fwd's row_max / log_sum, over K).
// kept_logprobs_bwd_: dlogits += d/dx of sum(g * logp_kept + g_H * H_kept), only on K;
// kept_logprobs_bwd: the same written whole into a new tensor (0 off K).
// One row per task. A threshold row's kept sums and gradient are vector sweeps of the
// accumulation type over the row (the row kernels' vexp, row_kernels.h; the sums in its
// lanes), a threshold's masses the vectorized float64 exp; a CSR row's sums are taken in
// double in scalar loops. Every op takes the optional per-row `temperatures` [B, T]
// (csrc/ops.cpp): row i then uses z = x / temperatures[i].
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <limits>
#include <vector>

#include "common.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// 1 / temperature of row i in double (the kept-set sums are taken in double): the per-row
// value when there is one (ops.cpp's `temperatures`), else the scalar's.
template <typename T>
inline double row_inv_d(const T* temps, int64_t i, double temperature) {
  return 1.0 / (temps ? static_cast<double>(temps[i]) : temperature);
}

using VD = Vectorized<double>;

// f(q, d, e) for the vectors d = (v_q.. - ref) * inv and e = exp(d) (Sleef's float64 exp,
// 1 ulp) over v[0, n), q the index of a vector's first entry; v is padded with -inf (e = 0)
// to whole vectors.
template <typename F>
void exp_vectors(std::vector<double>& v, int64_t n, double ref, double inv, F&& f) {
  constexpr int64_t D = VD::size();
  v.resize(((n + D - 1) / D) * D, -kInf);
  const VD vref(ref), vinv(inv);
  for (int64_t q = 0; q < n; q += D) {
    const VD d = (VD::loadu(v.data() + q) - vref) * vinv;
    f(q, d, d.exp());
  }
}

// The smallest value of the accumulation type A >= t (t a double): x >= t in double is
// x >= this in A, for every x of the logits' type.
template <typename A>
A at_least(double t) {
  A a = static_cast<A>(t);
  if (static_cast<double>(a) < t) a = std::nextafter(a, std::numeric_limits<A>::infinity());
  return a;
}

// f(j) for each j in increasing order whose lanes pass keep(g) (a vector of 2 W entries in
// the accumulation type -> a comparison vector); then the scalar tail with keep_s(x_j). The
// comparison's true lanes are all ones (non-zero), its false lanes zero. A row sweep that
// skips whole vectors where no entry passes.
template <typename scalar_t, typename VecTest, typename ScalarTest, typename F>
void for_each_passing(const scalar_t* x, int64_t V, VecTest&& keep, ScalarTest&& keep_s,
                      F&& f) {
  using L = Lanes<scalar_t>;
  constexpr int64_t W = L::W;
  constexpr uint64_t kLanes = W >= 64 ? ~uint64_t(0) : (uint64_t(1) << W) - 1;
  int64_t j = 0;
  for (; j + 2 * W <= V; j += 2 * W) {
    typename L::Vec g[2];
    L::load(x + j, g, 2);
    for (int h = 0; h < 2; ++h) {
      uint64_t bits = ~static_cast<uint64_t>(keep(g[h]).zero_mask()) & kLanes;
      while (bits) {
        f(j + h * W + __builtin_ctzll(bits));
        bits &= bits - 1;
      }
    }
  }
  for (; j < V; ++j)
    if (keep_s(static_cast<double>(x[j]))) f(j);
}

// f(j) for the entries x_j >= t in increasing j: a vectorized compare against at_least(t),
// the same entries as the comparison in double.
template <typename scalar_t, typename F>
void for_each_at_least(const scalar_t* x, int64_t V, double t, F&& f) {
  using L = Lanes<scalar_t>;
  const typename L::Vec vt(at_least<typename L::T>(t));
  for_each_passing(x, V, [&](const typename L::Vec& g) { return g >= vt; },
                   [&](double v) { return v >= t; }, f);
}

// A threshold row's kept entries K = {j : x_j >= t} in vectors of the accumulation type, two
// at a time, as the rows' sweeps do (row_kernels.h): f(j, g, keep) for each pair g of
// 2 W entries from j with the comparison vectors keep (all ones where x >= t); none(j) for
// a pair with no kept entry; then the scalar tail with tail(j) for its kept entries and
// tail_none(j) for the others.
template <typename scalar_t, typename F, typename None, typename Tail, typename TailNone>
void sweep_at_least(const scalar_t* x, int64_t V, double t, F&& f, None&& none, Tail&& tail,
                    TailNone&& tail_none) {
  using L = Lanes<scalar_t>;
  using Vec = typename L::Vec;
  constexpr int64_t W = L::W;
  constexpr uint64_t kLanes = W >= 64 ? ~uint64_t(0) : (uint64_t(1) << W) - 1;
  const Vec vt(at_least<typename L::T>(t));
  int64_t j = 0;
  for (; j + 2 * W <= V; j += 2 * W) {
    Vec g[2];
    L::load(x + j, g, 2);
    const Vec keep[2] = {g[0] >= vt, g[1] >= vt};
    if ((static_cast<uint64_t>(keep[0].zero_mask()) & static_cast<uint64_t>(keep[1].zero_mask()) &
         kLanes) == kLanes) {
      none(j);
    } else {
      f(j, g, keep);
    }
  }
  for (; j < V; ++j) {
    if (static_cast<double>(x[j]) >= t) tail(j); else tail_none(j);
  }
}

// The row's largest value in double, NaN entries ignored (as std::max(mx, v) in order
// does; of +0 and -0 either may come back).
template <typename scalar_t>
double row_max_of(const scalar_t* x, int64_t V) {
  using L = Lanes<scalar_t>;
  using A = typename L::T;
  constexpr int64_t W = L::W;
  typename L::Vec m(-std::numeric_limits<A>::infinity());
  int64_t j = 0;
  for (; j + 2 * W <= V; j += 2 * W) {
    typename L::Vec g[2];
    L::load(x + j, g, 2);
    m = L::Vec::blendv(m, g[0], g[0] > m);
    m = L::Vec::blendv(m, g[1], g[1] > m);
  }
  A lanes[W];
  m.store(lanes);
  double mx = -kInf;
  for (int64_t h = 0; h < W; ++h) mx = std::max(mx, static_cast<double>(lanes[h]));
  for (; j < V; ++j) mx = std::max(mx, static_cast<double>(x[j]));
  return mx;
}

// The kept set of row i, walked by `each(j)` (the sampled token once, even when absent).
struct KeptSet {
  bool csr = false;                 // CSR ids (else a threshold)
  const int64_t* ids = nullptr;     // (nullptr for nnz = 0)
  const int64_t* offsets = nullptr;
  const double* thr = nullptr;      // per-row threshold (raw logit units), or nullptr
  int64_t V = 0;

  template <typename scalar_t, typename F>
  bool each(const scalar_t* x, int64_t i, int64_t y, F&& f) const {
    bool found = false;
    if (csr) {
      for (int64_t k = offsets[i]; k < offsets[i + 1]; ++k) {
        const int64_t j = ids[k];
        found |= (j == y);
        f(j);
      }
    } else {
      for_each_at_least(x, V, thr[i], [&](int64_t j) {
        found |= (j == y);
        f(j);
      });
    }
    if (!found) f(y);
    return !found;
  }
};

KeptSet kept_set(const std::optional<at::Tensor>& ids, const std::optional<at::Tensor>& offs,
                 const std::optional<at::Tensor>& thr, int64_t N, int64_t V,
                 at::Tensor& ids_c, at::Tensor& offs_c, at::Tensor& thr_c) {
  KeptSet s;
  s.V = V;
  TORCH_CHECK(ids.has_value() == offs.has_value(),
              "kept_ids / kept_offsets: give both or neither");
  TORCH_CHECK(ids.has_value() != thr.has_value(),
              "sampling mask: give exactly one of (kept_ids, kept_offsets) and threshold");
  if (ids.has_value()) {
    ids_c = ids->contiguous();
    offs_c = offs->contiguous();
    TORCH_CHECK(ids_c.scalar_type() == at::kLong && ids_c.dim() == 1,
                "kept_ids: expected int64 [nnz]");
    TORCH_CHECK(offs_c.scalar_type() == at::kLong && offs_c.dim() == 1 &&
                    offs_c.size(0) == N + 1,
                "kept_offsets: expected int64 [N + 1] with N = ", N, ", got ", offs_c.sizes());
    s.csr = true;
    s.ids = ids_c.data_ptr<int64_t>();
    s.offsets = offs_c.data_ptr<int64_t>();
    TORCH_CHECK(s.offsets[0] == 0 && s.offsets[N] == ids_c.size(0),
                "kept_offsets: must start at 0 and end at nnz = ", ids_c.size(0));
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(s.offsets[i] <= s.offsets[i + 1], "kept_offsets: not non-decreasing at ", i);
    for (int64_t k = 0; k < ids_c.size(0); ++k)
      TORCH_CHECK(s.ids[k] >= 0 && s.ids[k] < V, "kept_ids: id ", s.ids[k], " out of [0, ", V,
                  ")");
  } else {
    thr_c = thr->contiguous();
    TORCH_CHECK(thr_c.scalar_type() == at::kDouble && thr_c.numel() == N,
                "threshold: expected float64 [B, T]");
    s.thr = thr_c.data_ptr<double>();
  }
  return s;
}

// A threshold row's kept statistics over K = {j : x_j >= t} (sweep_at_least: vectors of
// the accumulation type, the rows' vexp): the kept max and count, then with the top value
// `top` (the caller's: the kept max, or the token where the set lacks it) the non-top mass
// apart from the entries at the top (ties: row_kernels.h's log1p(rest)) and sum e d.
struct KeptSums {
  double max = -kInf;  // the kept max (-inf: K is empty)
  int64_t n = 0;       // |K|
  double rest = 0.0, ties = 0.0, sd = 0.0;
};

template <typename scalar_t>
KeptSums kept_max_count(const scalar_t* x, int64_t V, double t) {
  using L = Lanes<scalar_t>;
  using A = typename L::T;
  using Vec = typename L::Vec;
  constexpr int64_t W = L::W;
  constexpr uint64_t kLanes = W >= 64 ? ~uint64_t(0) : (uint64_t(1) << W) - 1;
  const Vec ninf(-std::numeric_limits<A>::infinity());
  Vec m = ninf;
  KeptSums k;
  sweep_at_least(
      x, V, t,
      [&](int64_t, const Vec* g, const Vec* keep) {
        for (int h = 0; h < 2; ++h) {
          m = at::vec::maximum(m, Vec::blendv(ninf, g[h], keep[h]));
          k.n += __builtin_popcountll(~static_cast<uint64_t>(keep[h].zero_mask()) & kLanes);
        }
      },
      [](int64_t) {},
      [&](int64_t j) {
        k.max = std::max(k.max, static_cast<double>(x[j]));
        ++k.n;
      },
      [](int64_t) {});
  k.max = std::max(k.max, static_cast<double>(hmax(m)));
  return k;
}

template <typename scalar_t>
void kept_mass_sums(const scalar_t* x, int64_t V, double t, double top, double inv,
                    KeptSums& k) {
  using L = Lanes<scalar_t>;
  using A = typename L::T;
  using Vec = typename L::Vec;
  const Vec zero(A(0)), one(A(1)), vtop(static_cast<A>(top)), vinv(static_cast<A>(inv));
  Vec rest = zero, ties = zero, sd = zero;
  auto add = [&](const Vec& g, const Vec& keep) {
    const Vec at_top = keep & (g == vtop);
    const Vec d = Vec::blendv((g - vtop) * vinv, zero, at_top);
    const Vec e = Vec::blendv(zero, vexp(d), keep & ~at_top);
    rest = rest + e;
    ties = ties + (at_top & one);
    sd = sd + Vec::blendv(zero, e * d, e > zero);
  };
  sweep_at_least(
      x, V, t,
      [&](int64_t, const Vec* g, const Vec* keep) {
        add(g[0], keep[0]);
        add(g[1], keep[1]);
      },
      [](int64_t) {},
      [&](int64_t j) {
        const double v = static_cast<double>(x[j]);
        if (v == top) {
          k.ties += 1.0;
          return;
        }
        const double d = (v - top) * inv, e = std::exp(d);
        k.rest += e;
        if (e > 0) k.sd += e * d;
      },
      [](int64_t) {});
  k.rest += hsum(rest);
  k.ties += hsum(ties);
  k.sd += hsum(sd);
}

// The kept part of a threshold row's gradient, o_j (+)= dz_j / T on K = {j : x_j >= t}
// (sweep_at_least), with dz_j = -g p_j - g_H p_j (log p_j + H) in vectors (the token's own
// formula is the caller's: its entry is rewritten after), the scalar tail's entries by the
// caller's dz_of(j) (dz_j / T in double): ACCUMULATE adds it into o (the entries off K left
// as they are), else writes it and 0 off K.
template <bool ACCUMULATE, typename scalar_t, typename DzOf>
void kept_grad_sweep(const scalar_t* x, scalar_t* o, int64_t V, double t, double top,
                     double inv, double log_sum, double g, double gh, double h, DzOf&& dz_of) {
  using L = Lanes<scalar_t>;
  using A = typename L::T;
  using Vec = typename L::Vec;
  constexpr int64_t W = L::W;
  const Vec zero(A(0)), vtop(static_cast<A>(top)), vinv(static_cast<A>(inv)),
      vls(static_cast<A>(log_sum)), vg(static_cast<A>(g)), vgh(static_cast<A>(gh)),
      vh(static_cast<A>(h));
  auto val = [&](const Vec& xv, const Vec& keep) {
    const Vec lp = (xv - vtop) * vinv - vls;
    const Vec p = vexp(lp);
    Vec dz = zero - vg * p;
    if (gh != 0.0) dz = dz - Vec::blendv(zero, vgh * p * (lp + vh), p > zero);
    return Vec::blendv(zero, dz * vinv, keep);
  };
  auto scalar = [&](int64_t j) {
    o[j] = static_cast<scalar_t>((ACCUMULATE ? static_cast<double>(o[j]) : 0.0) + dz_of(j));
  };
  sweep_at_least(
      x, V, t,
      [&](int64_t j, const Vec* gx, const Vec* keep) {
        Vec v[2] = {val(gx[0], keep[0]), val(gx[1], keep[1])};
        if constexpr (ACCUMULATE) {
          Vec old[2];
          L::load(o + j, old, 2);
          v[0] = v[0] + old[0];
          v[1] = v[1] + old[1];
        }
        L::store(v, o + j, 2);
      },
      [&](int64_t j) {
        if constexpr (!ACCUMULATE) zero_row(o + j, 2 * W);
      },
      scalar,
      [&](int64_t j) {
        if constexpr (!ACCUMULATE) o[j] = scalar_t(0);
      });
}

// Rows per task: a CSR row is k entries (tiny: one thread takes many rows, no wake-up of
// the pool for a few thousand reads), a threshold row a sweep of V.
int64_t kept_grain(const KeptSet& s, int64_t N) {
  if (!s.csr || N == 0) return 1;
  const int64_t mean_k = 1 + s.offsets[N] / N;
  return std::max<int64_t>(1, 16384 / mean_k);
}

// ------------------------------------------------------------------ sampling_threshold

// top-p's mass histogram: buckets of (v - max) / T over the kTopPSpan nats below the max
constexpr int kTopPBuckets = 512;
constexpr double kTopPSpan = 48.0;
// top-k's radix select: the count histogram of a float key's top kKeyBits bits (sign, the 8
// exponent bits and 3 mantissa bits: 1/8 of a binade a bucket), two interleaved copies of
// 16 KiB (consecutive entries in one bucket would wait on each other's increment)
constexpr int kKeyBits = 12;
constexpr uint32_t kKeyBins = 1u << kKeyBits;  // and one more: the NaN entries'

// Up to this k a size-k heap beats the radix select (2 cores, AVX2, V = 32,768 and 151,936:
// at k = 50 the heap 0.035 / 0.113 ms a row, the radix 0.045 / 0.203; at k = 1,024 the heap
// 0.36 / 0.59, the radix 0.05 / 0.22)
constexpr int64_t kHeapK = 128;

// A float32 value's bits as an integer that orders like the value (negative values' bits
// flipped); -0 and +0 are two keys of one value (a cut between them keeps the same set).
inline uint32_t float_key(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The k-th largest value of a row of float-accumulated logits (1 <= k; ties counted, NaN
// entries left out; -inf when the row has no more than k values): the bucket of the k-th
// entry from a count histogram of the keys' top bits (computed in a branch-free loop),
// then std::nth_element over that bucket's entries only. The same
// value as a sort of the row.
template <typename scalar_t>
double kth_largest(const scalar_t* x, int64_t V, int64_t k, std::vector<uint32_t>& hist,
                   std::vector<uint16_t>& idx, std::vector<double>& w) {
  constexpr int kShift = 32 - kKeyBits;
  idx.resize(V);
  for (int64_t j = 0; j < V; ++j) {
    const float v = static_cast<float>(x[j]);
    idx[j] = static_cast<uint16_t>(v == v ? float_key(v) >> kShift : kKeyBins);
  }
  hist.assign(2 * (kKeyBins + 1), 0u);
  uint32_t* h0 = hist.data();
  uint32_t* h1 = hist.data() + kKeyBins + 1;
  int64_t j = 0;
  for (; j + 1 < V; j += 2) {
    ++h0[idx[j]];
    ++h1[idx[j + 1]];
  }
  if (j < V) ++h0[idx[j]];
  const int64_t n = V - h0[kKeyBins] - h1[kKeyBins];
  if (k >= n) return -kInf;  // no more values than k: nothing cut
  int64_t above = 0;
  uint32_t b = kKeyBins - 1;
  for (; b > 0 && above + h0[b] + h1[b] < k; --b) above += h0[b] + h1[b];
  w.clear();
  for (int64_t q = 0; q < V; ++q)
    if (idx[q] == b) w.push_back(static_cast<double>(x[q]));
  const int64_t r = k - above - 1;  // 0-based rank within the bucket
  std::nth_element(w.begin(), w.begin() + r, w.end(), std::greater<double>());
  return w[r];
}

// The per-row value threshold of vLLM v1's sampler on z = x / temperature (docs/SAMPLING.md):
// min-p keeps exp(z_j - z_max) >= min_p; top-k keeps x_j >= the k-th largest x (ties kept);
// top-p, over the survivors S of both, keeps j iff the mass of S strictly above x_j is
// < top_p * mass(S) (the top group always). Returns the smallest kept value, or -inf when
// nothing is cut. Top-k: a radix select (kth_largest) for float-accumulated logits and
// k > kHeapK; else a size-k min-heap for k <= V / 8 (one comparison for most entries),
// std::nth_element beyond. Top-p: the survivors' masses exp((x - max) / T) in float64,
// vectorized, and summed in a fixed order; a histogram of them over the nats below the max
// picks the bucket the boundary group lies in, whose entries alone are sorted and summed
// group by group.
template <typename scalar_t>
double row_threshold(const scalar_t* x, int64_t V, double inv, int64_t k, double p,
                     double min_p, std::vector<double>& w, std::vector<double>& e,
                     std::vector<uint32_t>& hist, std::vector<uint16_t>& bi) {
  const double mx = row_max_of(x, V);
  if (!std::isfinite(mx)) return -kInf;
  double t = -kInf;
  auto d = [&](double v) { return (v - mx) * inv; };
  if (min_p > 0.0) {
    const double lo = std::log(min_p);
    double smallest = mx;
    for (int64_t j = 0; j < V; ++j) {
      const double v = static_cast<double>(x[j]);
      if (d(v) >= lo && v < smallest) smallest = v;
    }
    t = smallest;
  }
  if (k > 0 && k < V) {
    if (!std::is_same_v<acc_of<scalar_t>, double> && k > kHeapK) {
      t = std::max(t, kth_largest(x, V, k, hist, bi, w));
    } else if (k <= V / 8) {
      // the k largest in a min-heap of the first k entries, then every later entry above
      // its least (in order: a vector's lanes above the least at its start are each
      // checked against the least of their time, which only grows)
      w.clear();
      w.reserve(k);
      for (int64_t j = 0; j < k; ++j) {
        w.push_back(static_cast<double>(x[j]));
        std::push_heap(w.begin(), w.end(), std::greater<double>());
      }
      using L = Lanes<scalar_t>;
      const scalar_t* rest = x + k;
      auto consider = [&](int64_t j) {
        const double v = static_cast<double>(rest[j]);
        if (v > w.front()) {
          std::pop_heap(w.begin(), w.end(), std::greater<double>());
          w.back() = v;
          std::push_heap(w.begin(), w.end(), std::greater<double>());
        }
      };
      for_each_passing(
          rest, V - k,
          [&](const typename L::Vec& g) {
            // w.front() is a logit: exact in the accumulation type
            return g > typename L::Vec(static_cast<typename L::T>(w.front()));
          },
          [&](double v) { return v > w.front(); }, consider);
      t = std::max(t, w.front());
    } else {
      w.resize(V);
      for (int64_t j = 0; j < V; ++j) w[j] = static_cast<double>(x[j]);
      std::nth_element(w.begin(), w.begin() + (k - 1), w.end(), std::greater<double>());
      t = std::max(t, w[k - 1]);
    }
  }
  if (p < 1.0) {
    // the survivors and their masses e = exp(d) (exp_vectors), summed lane by lane then
    // across the lanes: a fixed order for a given row
    w.clear();
    if (t == -kInf) {  // every non-NaN entry survives
      w.resize(V);
      int64_t q = 0;
      for (int64_t j = 0; j < V; ++j) {
        const double v = static_cast<double>(x[j]);
        w[q] = v;
        q += v == v;
      }
      w.resize(q);
    } else {
      for_each_at_least(x, V, t, [&](int64_t j) { w.push_back(static_cast<double>(x[j])); });
    }
    const int64_t n = static_cast<int64_t>(w.size());
    e.resize(n + VD::size());
    VD vz(0.0);
    exp_vectors(w, n, mx, inv, [&](int64_t q, const VD&, const VD& eq) {
      eq.store(e.data() + q);
      vz = vz + eq;
    });
    const double target = p * hsum(vz);
    // the survivors' masses in kTopPBuckets buckets of d = (v - max) / T (kTopPSpan nats
    // below the max, the rest in the last), four interleaved histograms added in a fixed
    // order (consecutive entries in one bucket would wait on each other's add)
    bi.resize(n);
    for (int64_t j = 0; j < n; ++j)  // (a branch-free loop)
      bi[j] = static_cast<uint16_t>(
          std::min((mx - w[j]) * inv * (kTopPBuckets / kTopPSpan), kTopPBuckets - 1.0));
    std::array<std::array<double, kTopPBuckets>, 4> part{};
    for (int64_t j = 0; j < n; ++j) part[j & 3][bi[j]] += e[j];
    // the first bucket whose cumulative mass reaches the target holds the first group
    // whose cumulative mass does: only its entries are sorted and summed group by group,
    // from the mass of the buckets above it (a group is one value: it lies in one bucket).
    // Where the group sums fall short of the bucket's (float64 rounding of another
    // order), the walk goes on into the next non-empty bucket.
    double above = 0.0;
    int b = 0;
    for (; b < kTopPBuckets; ++b) {
      const double m = ((part[0][b] + part[1][b]) + part[2][b]) + part[3][b];
      if (above + m >= target) break;
      above += m;
    }
    if (b == kTopPBuckets) {  // not reached (rounding): every survivor is kept
      t = std::max(t, *std::min_element(w.begin(), w.begin() + n));
      return t;
    }
    std::vector<std::pair<double, double>> grp;  // (value, mass) of one bucket's entries
    double lastv = w[0];
    for (bool cut = false; !cut && b < kTopPBuckets; ++b) {
      grp.clear();
      for (int64_t j = 0; j < n; ++j)
        if (bi[j] == b) grp.emplace_back(w[j], e[j]);
      std::sort(grp.begin(), grp.end(),
                [](const auto& a, const auto& c) { return a.first > c.first; });
      const int64_t m = static_cast<int64_t>(grp.size());
      for (int64_t j = 0; j < m;) {
        if (above >= target) {  // this group and everything below it are cut
          cut = true;
          break;
        }
        int64_t q = j;
        double g = 0.0;
        while (q < m && grp[q].first == grp[j].first) g += grp[q++].second;
        above += g;
        lastv = grp[j].first;
        j = q;
      }
      if (above >= target) cut = true;  // the next group is cut
    }
    t = std::max(t, lastv);
  }
  return t;
}

// The per-row rules of the re-derived sets (csrc/ops.cpp): top_k int64, top_p and min_p
// float64, each [B, T] or absent (nullptr).
struct Rules {
  at::Tensor k_c, p_c, mp_c;
  const int64_t* K = nullptr;
  const double *P = nullptr, *MP = nullptr;

  Rules(const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
        const std::optional<at::Tensor>& min_p, int64_t N) {
    if (top_k.has_value()) {
      k_c = top_k->contiguous();
      TORCH_CHECK(k_c.scalar_type() == at::kLong && k_c.numel() == N,
                  "top_k: expected int64 [B, T]");
      K = k_c.data_ptr<int64_t>();
    }
    if (top_p.has_value()) {
      p_c = top_p->contiguous();
      TORCH_CHECK(p_c.scalar_type() == at::kDouble && p_c.numel() == N,
                  "top_p: expected float64 [B, T]");
      P = p_c.data_ptr<double>();
    }
    if (min_p.has_value()) {
      mp_c = min_p->contiguous();
      TORCH_CHECK(mp_c.scalar_type() == at::kDouble && mp_c.numel() == N,
                  "min_p: expected float64 [B, T]");
      MP = mp_c.data_ptr<double>();
    }
  }
};

// The scratch of row_threshold, one per task.
struct ThresholdScratch {
  std::vector<double> w, e;
  std::vector<uint32_t> hist;
  std::vector<uint16_t> bi;
};

// Row i's threshold (-inf on a masked row).
template <typename scalar_t>
double rule_threshold(const scalar_t* x, int64_t V, bool valid, double inv, const Rules& ru,
                      int64_t i, ThresholdScratch& sc) {
  if (!valid) return -kInf;
  return row_threshold(x, V, inv, ru.K ? ru.K[i] : 0, ru.P ? ru.P[i] : 1.0,
                       ru.MP ? ru.MP[i] : 0.0, sc.w, sc.e, sc.hist, sc.bi);
}

at::Tensor sampling_threshold(const at::Tensor& logits, const at::Tensor& mask_in,
                              double temperature, const std::optional<at::Tensor>& top_k,
                              const std::optional<at::Tensor>& top_p,
                              const std::optional<at::Tensor>& min_p,
                              const std::optional<at::Tensor>& temperatures) {
  const RowArgs r = row_args(logits, std::nullopt, mask_in, temperature, temperatures);
  const int64_t N = r.N();
  const Rules ru(top_k, top_p, min_p, N);
  const bool* m = r.mask.data_ptr<bool>();
  at::Tensor out = at::empty({r.B, r.T}, logits.options().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "sampling_threshold", [&] {
    const scalar_t* L = logits.data_ptr<scalar_t>();
    const acc_of<scalar_t>* tt = row_temperatures<acc_of<scalar_t>>(r);
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      ThresholdScratch sc;
      for (int64_t i = begin; i < end; ++i)
        o[i] = rule_threshold(L + r.offset(i), r.V, m[i], row_inv_d(tt, i, temperature), ru, i,
                              sc);
    });
  });
  return out;
}

// ------------------------------------------------------------------ kept log-probs

// The outputs of the kept-set forward ([B, T] each; T the accumulation type).
template <typename T>
struct KeptOut {
  at::Tensor logp, ent, kmax, kls, size, missing;
  T *lp, *en, *mx, *ls;
  int64_t* sz;
  bool* miss;

  KeptOut(const RowArgs& r) {
    const auto opts = r.acc_opts;
    logp = at::empty({r.B, r.T}, opts), ent = at::empty({r.B, r.T}, opts);
    kmax = at::empty({r.B, r.T}, opts), kls = at::empty({r.B, r.T}, opts);
    size = at::empty({r.B, r.T}, opts.dtype(at::kLong));
    missing = at::empty({r.B, r.T}, opts.dtype(at::kBool));
    lp = logp.data_ptr<T>(), en = ent.data_ptr<T>(), mx = kmax.data_ptr<T>(),
    ls = kls.data_ptr<T>();
    sz = size.data_ptr<int64_t>();
    miss = missing.data_ptr<bool>();
  }

  // row i's statistics of its kept set (ks) on the row x, token y, 1 / temperature inv; a
  // masked row's are 0
  template <typename scalar_t>
  void row(const KeptSet& ks, const scalar_t* x, int64_t V, int64_t i, bool valid, int64_t y,
           double inv) {
    if (!valid) {
      lp[i] = en[i] = mx[i] = ls[i] = T(0);
      sz[i] = 0;
      miss[i] = false;
      return;
    }
    double top = -kInf;
    int64_t top_j = -1, n = 0;
    // the top entry's exp(0) = 1 is kept apart: log_sum = log1p(rest) (row_kernels.h)
    double rest = 0.0, sd = 0.0;
    if (!ks.csr) {
      // a threshold row (often thousands of entries): two vector sweeps over the row
      // (kept_max_count, kept_mass_sums); the token where the set lacks it (x_y < t, or
      // NaN) joins as each() adds it
      const double t = ks.thr[i], v = static_cast<double>(x[y]);
      KeptSums k = kept_max_count(x, V, t);
      miss[i] = !(v >= t);
      top = k.max;
      n = k.n;
      if (miss[i] && (n == 0 || v > top || std::isnan(v))) top = v;
      if (k.n > 0) kept_mass_sums(x, V, t, top, inv, k);
      if (miss[i]) {
        ++n;
        const double dy = (v - top) * inv, e = std::exp(dy);
        if (v == top) k.ties += 1.0; else k.rest += e;
        if (e > 0 && v != top) k.sd += e * dy;
      }
      rest = k.rest + std::max(k.ties - 1.0, 0.0);
      sd = k.sd;
    } else {
      miss[i] = ks.each(x, i, y, [&](int64_t j) {
        const double v = static_cast<double>(x[j]);
        if (top_j < 0 || v > top || std::isnan(v)) top = v, top_j = j;
        ++n;
      });
      bool skipped = false;
      ks.each(x, i, y, [&](int64_t j) {
        const double dj = (static_cast<double>(x[j]) - top) * inv;
        const double e = std::exp(dj);
        if (j == top_j && !skipped) {
          skipped = true;
        } else {
          rest += e;
        }
        if (e > 0) sd += e * dj;
      });
    }
    sz[i] = n;
    const double log_sum = std::log1p(rest);
    const double dy = (static_cast<double>(x[y]) - top) * inv;
    lp[i] = static_cast<T>(dy - log_sum);
    en[i] = static_cast<T>(log_sum - sd / (1.0 + rest));
    mx[i] = static_cast<T>(top);
    ls[i] = static_cast<T>(log_sum);
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tensors()
      const {
    return {logp, ent, kmax, kls, size, missing};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
kept_logprobs_fwd(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& mask,
                  double temperature, const std::optional<at::Tensor>& kept_ids,
                  const std::optional<at::Tensor>& kept_offsets,
                  const std::optional<at::Tensor>& threshold,
                  const std::optional<at::Tensor>& temperatures) {
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  check_tokens(r);
  const int64_t* tok = r.tokens.data_ptr<int64_t>();
  const bool* m = r.mask.data_ptr<bool>();
  at::Tensor ids_c, offs_c, thr_c;
  const KeptSet ks = kept_set(kept_ids, kept_offsets, threshold, r.B * r.T, r.V, ids_c, offs_c,
                              thr_c);
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "kept_logprobs_fwd", [&] {
    using T = acc_of<scalar_t>;
    KeptOut<T> o(r);
    const scalar_t* L = logits.data_ptr<scalar_t>();
    const T* tt = row_temperatures<T>(r);
    at::parallel_for(0, r.B * r.T, kept_grain(ks, r.B * r.T), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        o.row(ks, L + r.offset(i), r.V, i, m[i], tok[i], row_inv_d(tt, i, temperature));
    });
    out = o.tensors();
  });
  return out;
}

// sampling_threshold and then kept_logprobs_fwd on its threshold, row by row in one task
// (the row's second read from the cache): (logp_kept, H_kept, kept_max, kept_log_sum,
// kept_size, missing, threshold).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
threshold_kept_fwd(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& mask,
                   double temperature, const std::optional<at::Tensor>& top_k,
                   const std::optional<at::Tensor>& top_p,
                   const std::optional<at::Tensor>& min_p,
                   const std::optional<at::Tensor>& temperatures) {
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  check_tokens(r);
  const int64_t N = r.N();
  const Rules ru(top_k, top_p, min_p, N);
  const int64_t* tok = r.tokens.data_ptr<int64_t>();
  const bool* m = r.mask.data_ptr<bool>();
  at::Tensor thr = at::empty({r.B, r.T}, logits.options().dtype(at::kDouble));
  double* th = thr.data_ptr<double>();
  KeptSet ks;
  ks.thr = th;
  ks.V = r.V;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "threshold_kept_fwd", [&] {
    using T = acc_of<scalar_t>;
    KeptOut<T> o(r);
    const scalar_t* L = logits.data_ptr<scalar_t>();
    const T* tt = row_temperatures<T>(r);
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      ThresholdScratch sc;
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* x = L + r.offset(i);
        const double inv = row_inv_d(tt, i, temperature);
        th[i] = rule_threshold(x, r.V, m[i], inv, ru, i, sc);
        o.row(ks, x, r.V, i, m[i], tok[i], inv);
      }
    });
    out = o.tensors();
  });
  auto [a, b, c, d, e, f] = out;
  return {a, b, c, d, e, f, thr};
}

// The kept part of the gradient, d/dlogits of sum(grad_logprobs * logp_kept + grad_entropy
// * H_kept) on the kept entries of each valid row: added into dlogits (ACCUMULATE), or for
// threshold sets written whole with 0 off the kept sets, on masked rows and on the rows
// T..Tl-1 (no zero fill and no read of the destination first). dlogits: logits' shape and
// dtype, contiguous.
template <bool ACCUMULATE>
void kept_grad(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
               const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& mask,
               const at::Tensor& kept_max_in, const at::Tensor& kept_log_sum_in,
               const at::Tensor& entropy_in, double temperature,
               const std::optional<at::Tensor>& kept_ids,
               const std::optional<at::Tensor>& kept_offsets,
               const std::optional<at::Tensor>& threshold, at::Tensor& dlogits,
               const std::optional<at::Tensor>& temperatures) {
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  const at::Tensor grad_lp = r.per_token(grad_logprobs, "grad_logprobs");
  const at::Tensor kept_max = r.per_token(kept_max_in, "kept_max");
  const at::Tensor kept_log_sum = r.per_token(kept_log_sum_in, "kept_log_sum");
  const std::optional<at::Tensor> grad_ent = r.per_token(grad_entropy, "grad_entropy");
  const bool has_ge = grad_ent.has_value();
  const at::Tensor entropy = has_ge ? r.per_token(entropy_in, "entropy") : at::Tensor();
  TORCH_CHECK(dlogits.sizes() == logits.sizes() && dlogits.scalar_type() == logits.scalar_type()
                  && dlogits.is_contiguous(),
              "dlogits: expected a contiguous tensor of the logits' shape and dtype");
  const int64_t* tok = r.tokens.data_ptr<int64_t>();
  const bool* m = r.mask.data_ptr<bool>();
  at::Tensor ids_c, offs_c, thr_c;
  const KeptSet ks = kept_set(kept_ids, kept_offsets, threshold, r.B * r.T, r.V, ids_c, offs_c,
                              thr_c);
  TORCH_INTERNAL_ASSERT(ACCUMULATE || !ks.csr, "kept_grad: CSR sets are added into zeros");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "kept_logprobs_bwd", [&] {
    using T = acc_of<scalar_t>;
    const scalar_t* L = logits.data_ptr<scalar_t>();
    scalar_t* O = dlogits.data_ptr<scalar_t>();
    const T* gl = grad_lp.data_ptr<T>();
    const T* ge = has_ge ? grad_ent->data_ptr<T>() : nullptr;
    const T* H = has_ge ? entropy.data_ptr<T>() : nullptr;
    const T *mx = kept_max.data_ptr<T>(), *ls = kept_log_sum.data_ptr<T>();
    const T* tt = row_temperatures<T>(r);
    if (!ACCUMULATE)  // the rows past the tokens' T
      for (int64_t b = 0; b < r.B; ++b)
        zero_row(O + (b * r.Tl + r.T) * r.V, (r.Tl - r.T) * r.V);
    // (threshold rows written whole: every row a sweep of V, about 2^18 entries a task)
    const int64_t grain = ACCUMULATE ? kept_grain(ks, r.B * r.T)
                                     : std::max<int64_t>(1, (int64_t(1) << 18) / r.V);
    at::parallel_for(0, r.B * r.T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* o = O + ((i / r.T) * r.Tl + (i % r.T)) * r.V;
        const double g = gl[i], gh = ge ? static_cast<double>(ge[i]) : 0.0;
        if (!m[i] || (g == 0.0 && gh == 0.0)) {
          if (!ACCUMULATE) zero_row(o, r.V);
          continue;
        }
        const scalar_t* x = L + r.offset(i);
        const int64_t y = tok[i];
        const double top = mx[i], log_sum = ls[i], h = H ? static_cast<double>(H[i]) : 0.0;
        const double inv = row_inv_d(tt, i, temperature);
        // d logp_y / d z_j = 1[j = y] - p_j (1 - p_y as -expm1(log p_y)); d H / d z_j =
        // -p_j (log p_j + H)
        auto dz_of = [&](int64_t j) {
          const double lpj = (static_cast<double>(x[j]) - top) * inv - log_sum;
          const double pj = std::exp(lpj);
          double dz = (j == y ? -g * std::expm1(lpj) : -g * pj);
          if (gh != 0.0 && pj > 0) dz -= gh * pj * (lpj + h);
          return dz * inv;
        };
        if (ks.csr) {
          ks.each(x, i, y, [&](int64_t j) {
            o[j] = static_cast<scalar_t>(static_cast<double>(o[j]) + dz_of(j));
          });
        } else {
          // the sweep gives the token's entry the others' formula where it is kept: its
          // own value is written after, from the entry as it was before the sweep
          const double old_y = ACCUMULATE ? static_cast<double>(o[y]) : 0.0;
          kept_grad_sweep<ACCUMULATE>(x, o, r.V, ks.thr[i], top, inv, log_sum, g, gh, h,
                                      dz_of);
          o[y] = static_cast<scalar_t>(old_y + dz_of(y));
        }
      }
    });
  });
}

void kept_logprobs_bwd_(const at::Tensor& grad_logprobs,
                        const std::optional<at::Tensor>& grad_entropy, const at::Tensor& logits,
                        const at::Tensor& tokens, const at::Tensor& mask,
                        const at::Tensor& kept_max, const at::Tensor& kept_log_sum,
                        const at::Tensor& entropy, double temperature,
                        const std::optional<at::Tensor>& kept_ids,
                        const std::optional<at::Tensor>& kept_offsets,
                        const std::optional<at::Tensor>& threshold, at::Tensor& dlogits,
                        const std::optional<at::Tensor>& temperatures) {
  kept_grad<true>(grad_logprobs, grad_entropy, logits, tokens, mask, kept_max, kept_log_sum,
                  entropy, temperature, kept_ids, kept_offsets, threshold, dlogits,
                  temperatures);
}

// The same gradient in a new tensor (the CPU kernels' recycled gradient memory,
// grad_buffer.h), every entry written once.
at::Tensor kept_logprobs_bwd(const at::Tensor& grad_logprobs,
                             const std::optional<at::Tensor>& grad_entropy,
                             const at::Tensor& logits, const at::Tensor& tokens,
                             const at::Tensor& mask, const at::Tensor& kept_max,
                             const at::Tensor& kept_log_sum, const at::Tensor& entropy,
                             double temperature, const std::optional<at::Tensor>& kept_ids,
                             const std::optional<at::Tensor>& kept_offsets,
                             const std::optional<at::Tensor>& threshold,
                             const std::optional<at::Tensor>& temperatures) {
  // a CSR row's few ids are added into zeros (new_zero_grad: a MiB a task, as one row's
  // memset each would not), a threshold row is written whole by its sweep
  if (kept_ids.has_value()) {
    at::Tensor out = new_zero_grad(logits.sizes(), logits.options());
    kept_grad<true>(grad_logprobs, grad_entropy, logits, tokens, mask, kept_max, kept_log_sum,
                    entropy, temperature, kept_ids, kept_offsets, threshold, out, temperatures);
    return out;
  }
  at::Tensor out = new_grad_buffer(logits.sizes(), logits.options());
  kept_grad<false>(grad_logprobs, grad_entropy, logits, tokens, mask, kept_max, kept_log_sum,
                   entropy, temperature, kept_ids, kept_offsets, threshold, out, temperatures);
  return out;
}

// ------------------------------------------------------------------ check_kept_ids

// A given kept set's CSR (contract in csrc/ops_host.cpp) checked in one pass, the first
// failing rule a ValueError with ppo_kernels/sampling.py check_replay's message: offsets
// from 0 to nnz, non-decreasing; ids in [0, vocab) (vocab < 0: not checked here); no id
// twice within a row (each row's ids sorted in a scratch copy).
void check_kept_ids(const at::Tensor& ids_in, const at::Tensor& offs_in, int64_t vocab) {
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong && offs_in.dim() == 1 &&
                  offs_in.scalar_type() == at::kLong && offs_in.numel() >= 1,
              "check_kept_ids: expected int64 token_ids [nnz] and offsets [N + 1]");
  const at::Tensor ids_t = ids_in.contiguous(), offs_t = offs_in.contiguous();
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  const int64_t* offs = offs_t.data_ptr<int64_t>();
  const int64_t n = offs_t.numel() - 1, nnz = ids_t.numel();
  TORCH_CHECK_VALUE(offs[0] == 0 && offs[n] == nnz,
                    "sampling_mask.offsets: must start at 0 and end at nnz = len(token_ids)");
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK_VALUE(offs[r + 1] >= offs[r], "sampling_mask.offsets: must be non-decreasing");
  if (vocab >= 0)
    for (int64_t j = 0; j < nnz; ++j)
      TORCH_CHECK_VALUE(ids[j] >= 0 && ids[j] < vocab,
                        "sampling_mask.token_ids: ids must lie in [0, V) = [0, ", vocab, ")");
  std::vector<int64_t> row;
  for (int64_t r = 0; r < n; ++r) {
    row.assign(ids + offs[r], ids + offs[r + 1]);
    std::sort(row.begin(), row.end());
    TORCH_CHECK_VALUE(std::adjacent_find(row.begin(), row.end()) == row.end(),
                      "sampling_mask.token_ids: an id repeats within a row (the sets must be "
                      "sets)");
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) {
  m.impl("check_kept_ids", &check_kept_ids);
  m.impl("sampling_threshold", &sampling_threshold);
  m.impl("kept_logprobs_fwd", &kept_logprobs_fwd);
  m.impl("threshold_kept_fwd", &threshold_kept_fwd);
  m.impl("kept_logprobs_bwd_", &kept_logprobs_bwd_);
  m.impl("kept_logprobs_bwd", &kept_logprobs_bwd);
}

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
