// Vectorised per-row softmax pieces of the CPU kernels (one vocabulary row at a time): the
// row statistics (max, log-sum, entropy) and the row gradient. The per-token formulas come
// from csrc/ppo_math.h; these loops only sweep the vocabulary with at::vec.
//
// A row is read twice: the statistics sweep (from memory) and the gradient sweep (from L2).
// The statistics sweep keeps a running max (online softmax) over chunks of kChunk entries
// held in registers, so the row is read from memory once while the exps are computed; the
// exps are kept in a per-thread scratch row, relative to the running max of their chunk,
// so the gradient sweep needs no exp. Reduced-precision rows (bf16, fp16) are widened in
// registers, never copied.
//
// Precision (confident tokens, p -> 1 in LLM policies): the top entry's exp(0) = 1 is never
// added to the sum. The sweep sums the non-top mass `rest` (entries below the max, plus
// ties) apart and log_sum = log1p(rest), so logp, the entropy and dlogits keep their
// relative digits down to 1 - p ~ 1e-12 (with 1 + rest rounded they lose everything once
// 1 - p < float32 epsilon).
//
// This file is compiled once per SIMD capability (setup.py), so it must not define
// anything with external linkage outside the CPU_CAPABILITY namespace.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

// Whether this capability has non-temporal vector stores (the gradient's, below).
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define PPO_CPU_STREAM_STORES 1
#else
#define PPO_CPU_STREAM_STORES 0
#endif
#if PPO_CPU_STREAM_STORES
#include <immintrin.h>
#include <unistd.h>
#endif

#include "ppo_math.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {

using at::vec::Vectorized;

using ppo::acc_of;  // accumulation dtype (ppo_math.h)

// Reduced-precision rows are widened to float in registers; float/double rows are read as is.
template <typename scalar_t>
constexpr bool kWiden = !std::is_same<scalar_t, acc_of<scalar_t>>::value;

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
inline T hsum(const Vectorized<T>& v) {
  return at::vec::vec_reduce_all<T>([](Vectorized<T>& a, Vectorized<T>& b) { return a + b; }, v);
}

template <typename T>
inline T hmax(const Vectorized<T>& v) {
  return at::vec::vec_reduce_all<T>(
      [](Vectorized<T>& a, Vectorized<T>& b) { return at::vec::maximum(a, b); }, v);
}

template <typename T>
struct RowStats {
  T max;      // max_v x_v, in raw logit units
  T log_sum;  // log sum_v exp(d_v), d_v = (x_v - max) / temperature, as log1p(non-top mass)
  T inv_sum;  // 1 / sum_v exp(d_v)
  T entropy;  // log_sum - sum_v p_v d_v (0 unless asked for)
};

// Loads and stores of kVecs accumulation-type vectors from / to a row of scalar_t.
template <typename scalar_t>
struct Lanes {
  using T = acc_of<scalar_t>;
  using Vec = Vectorized<T>;
  static constexpr int64_t W = Vec::size();
  static void load(const scalar_t* p, Vec* x, int n_vecs) {
    if constexpr (kWiden<scalar_t>) {
      for (int j = 0; j < n_vecs; j += 2) {
        auto [a, b] = at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(p + j * W));
        x[j] = a;
        x[j + 1] = b;
      }
    } else {
      for (int j = 0; j < n_vecs; ++j) x[j] = Vec::loadu(p + j * W);
    }
  }
  static void store(const Vec* g, scalar_t* p, int n_vecs) {
    if constexpr (kWiden<scalar_t>) {
      for (int j = 0; j < n_vecs; j += 2)
        at::vec::convert_from_float<scalar_t>(g[j], g[j + 1]).store(p + j * W);
    } else {
      for (int j = 0; j < n_vecs; ++j) g[j].store(p + j * W);
    }
  }
  // store() with non-temporal stores (no read for ownership of the destination's lines, and
  // the lines do not displace the cache); p aligned to kStreamAlign. A plain store() where
  // this capability has no such store.
  static void stream(const Vec* g, scalar_t* p, int n_vecs) {
#if PPO_CPU_STREAM_STORES
    if constexpr (kWiden<scalar_t>) {
      for (int j = 0; j < n_vecs; j += 2)
        stream_bits(at::vec::convert_from_float<scalar_t>(g[j], g[j + 1]), p + j * W);
    } else {
      for (int j = 0; j < n_vecs; ++j) stream_bits(g[j], p + j * W);
    }
#else
    store(g, p, n_vecs);
#endif
  }

 private:
#if defined(CPU_CAPABILITY_AVX512)
  template <typename V, typename P>
  static void stream_bits(const V& v, P* p) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), _mm512_loadu_si512(&v));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  template <typename V, typename P>
  static void stream_bits(const V& v, P* p) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&v)));
  }
#endif
};

// Alignment the non-temporal stores need: one vector of this capability (the default
// capability streams nothing).
#if defined(CPU_CAPABILITY_AVX512)
constexpr uintptr_t kStreamAlign = 64;
#elif defined(CPU_CAPABILITY_AVX2)
constexpr uintptr_t kStreamAlign = 32;
#else
constexpr uintptr_t kStreamAlign = 0;
#endif

// Orders the non-temporal stores before what follows (an sfence).
inline void stream_fence() {
#if PPO_CPU_STREAM_STORES
  _mm_sfence();
#endif
}

// Whether a kernel writing `bytes` of gradient should write them with non-temporal stores:
// when they exceed the last-level cache, a plain store reads every destination line from
// memory first (read for ownership) only to overwrite it, and the lines would be evicted
// before anyone reads them again: one pass over memory of three (fp32 N 4096, V 32768
// fwd+bwd: 1.65x -> 1.15-1.37x the copy floor on a 2-core Xeon). Smaller gradients stay in
// the cache for the op that reads them next. The bound is the last-level cache's size, or
// PPO_KERNELS_CPU_STREAM_BYTES (read once; the tests set it to 0 to stream small shapes).
// The values written are the same either way.
inline bool stream_gradient(int64_t bytes) {
#if PPO_CPU_STREAM_STORES
  static const int64_t bound = [] {
    if (const char* env = std::getenv("PPO_KERNELS_CPU_STREAM_BYTES"))
      return int64_t(std::atoll(env));
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return l3 > 0 ? int64_t(l3) : int64_t(32) << 20;
  }();
  return bytes > bound;
#else
  (void)bytes;
  return false;
#endif
}

template <typename scalar_t>
void zero_row(scalar_t* row, int64_t V) {
  std::memset(static_cast<void*>(row), 0, sizeof(scalar_t) * V);
}

// Per-thread worker for rows of V entries of dtype scalar_t: scratch for the exps of the
// statistics sweep (relative to each chunk's running max, recorded per chunk) and the two
// sweeps. The row is processed in chunks of kChunk = kVecs vectors; the last, partial chunk
// is copied into a -inf padded buffer and goes through the same vector code.
template <typename scalar_t>
class RowWorker {
 public:
  using T = acc_of<scalar_t>;
  using Vec = Vectorized<T>;
  static constexpr int kVecs = 8;  // 8 registers of x, the rest for the accumulators
  static constexpr int64_t kChunk = kVecs * Vec::size();
  static constexpr int kAllLanes = (1 << Vec::size()) - 1;  // zero_mask() of an all-zero vector

  // stream_out: grad() writes rows whose start is aligned with non-temporal stores
  // (stream_gradient: the whole gradient is larger than the last-level cache).
  RowWorker(int64_t V, bool keep_exps, bool stream_out = false)
      : V_(V), nfull_(V / kChunk), tail_(V % kChunk), nchunks_(nfull_ + (tail_ ? 1 : 0)),
        stream_out_(stream_out) {
    if (keep_exps) {
      e_.resize(nchunks_ * kChunk);
      cmax_.resize(nchunks_);
    }
  }

  // A zero gradient row (a masked token, a clipped one without KL or entropy terms), written
  // as grad() writes its rows.
  void zero(scalar_t* out) const {
    if (!streams(out)) return zero_row(out, V_);
    Vec g[kVecs];
    for (int j = 0; j < kVecs; ++j) g[j] = Vec(T(0));
    for (int64_t k = 0; k < nfull_; ++k) Lanes<scalar_t>::stream(g, out + k * kChunk, kVecs);
    zero_row(out + nfull_ * kChunk, tail_);
    stream_fence();
  }

  // Statistics of one row (raw logits, unit stride); keeps the exps when the worker was
  // made with keep_exps. kEntropy: also the entropy.
  template <bool kEntropy>
  RowStats<T> stats(const scalar_t* row, T inv) {
    Online st;
    const bool keep = !e_.empty();
    Vec x[kVecs];
    for (int64_t k = 0; k < nchunks_; ++k) {
      prefetch(row, k + kPrefetchChunks);
      load_chunk(row, k, x);
      absorb<kEntropy>(st, x, inv, keep ? e_.data() + k * kChunk : nullptr);
      if (keep) cmax_[k] = st.m;
    }
    return finish<kEntropy>(st);
  }

  // log p of entry v: the shifted difference (x_v - max) / temperature - log_sum keeps the
  // digits that z_v - lse would lose at large |z| (fp16 logits near 65504) and gives
  // exactly -log_sum for the max entry at any temperature.
  static T logp(const scalar_t* row, int64_t v, T inv, const RowStats<T>& st) {
    return (static_cast<T>(row[v]) - st.max) * inv - st.log_sum;
  }

  // The row gradient g_v = d loss / d logits_v (ppo::dlogit_dense, ppo::dlogit_token) into
  // out (dtype scalar_t; may be the row itself: each entry is read before it is written).
  // use_exps: the exps of the last stats() call of this worker are those of this row (else
  // p_v is recomputed from st.max and st.log_sum, as the token_logprobs backward does).
  void grad(const scalar_t* row, T inv, const RowStats<T>& st, T dlogp, T dent, int64_t token,
            bool use_exps, scalar_t* out) {
    // the token's entry is written last, from its own formula; read it before out (which
    // may be the row itself) is written
    const T logp_tok = logp(row, token, inv, st);
    Vec x[kVecs], g[kVecs];
    const bool simple = use_exps && dent == T(0);
    const Vec vinv(inv), vmax(st.max), vls(st.log_sum), vH(st.entropy), vdl(dlogp), vde(dent),
        vzero(T(0));
    const bool stream = streams(out);
    for (int64_t k = 0; k < nchunks_; ++k) {
      // p_v = e_v * scale: the chunk's exps were taken against its running max
      const T scale = use_exps ? chunk_factor(k, st, inv) * st.inv_sum : T(0);
      if (simple) {
        // no entropy term: g_v = -p_v dlogp / temperature, one multiply per entry
        const Vec c(-dlogp * scale * inv);
        const T* e = e_.data() + k * kChunk;
        for (int j = 0; j < kVecs; ++j) g[j] = Vec::loadu(e + j * Vec::size()) * c;
      } else {
        load_chunk(row, k, x);
        const Vec vsc(scale);
        for (int j = 0; j < kVecs; ++j) {
          const Vec logp_v = (x[j] - vmax) * vinv - vls;
          const Vec pv = use_exps ? Vec::loadu(e_.data() + k * kChunk + j * Vec::size()) * vsc
                                  : vexp(logp_v);
          const Vec gj = ppo::dlogit_dense(logp_v, pv, vH, vdl, vde) * vinv;
          g[j] = Vec::blendv(gj, vzero, pv == vzero);  // p = 0 (a banned entry): exactly 0
        }
      }
      if (stream && k < nfull_) {
        Lanes<scalar_t>::stream(g, out + k * kChunk, kVecs);
      } else {
        store_chunk(g, k, out);
      }
    }
    // the non-temporal stores are weakly ordered: fence them before the token's entry
    // (which may lie in a line just streamed) and before another thread reads the row
    if (stream) stream_fence();
    out[token] = static_cast<scalar_t>(
        ppo::dlogit_token(logp_tok, ppo::ppo_exp(logp_tok), st.entropy, dlogp, dent) * inv);
  }

 private:
  bool streams(const scalar_t* out) const {
    if constexpr (kStreamAlign == 0) {
      return false;
    } else {
      return stream_out_ && reinterpret_cast<uintptr_t>(out) % kStreamAlign == 0;
    }
  }

  // Lane-wise partial sums relative to the running raw max m: s = sum of exp(d) over entries
  // with d != 0, n = number of entries with d == 0 (the top and its ties), t = sum exp(d) d.
  struct Online {
    Vec s{T(0)}, n{T(0)}, t{T(0)};
    T m = -std::numeric_limits<T>::infinity();
    bool nan = false;
  };

  // The sweep computes as it streams the row from memory; the hardware prefetcher alone
  // left it waiting (compute and memory time added up). A software prefetch a few chunks
  // ahead overlaps them.
  static constexpr int64_t kPrefetchChunks = 8;
  void prefetch(const scalar_t* row, int64_t k) const {
    if (k >= nfull_) return;
    const char* p = reinterpret_cast<const char*>(row + k * kChunk);
    for (int64_t b = 0; b < int64_t(kChunk * sizeof(scalar_t)); b += 64)
      __builtin_prefetch(p + b, 0, 3);
  }

  void load_chunk(const scalar_t* row, int64_t k, Vec* x) const {
    if (k < nfull_) {
      Lanes<scalar_t>::load(row + k * kChunk, x, kVecs);
      return;
    }
    alignas(64) T pad[kChunk];
    for (int64_t v = 0; v < kChunk; ++v)
      pad[v] = v < tail_ ? static_cast<T>(row[k * kChunk + v])
                         : -std::numeric_limits<T>::infinity();
    for (int j = 0; j < kVecs; ++j) x[j] = Vec::loadu(pad + j * Vec::size());
  }

  void store_chunk(const Vec* g, int64_t k, scalar_t* out) const {
    if (k < nfull_) {
      Lanes<scalar_t>::store(g, out + k * kChunk, kVecs);
      return;
    }
    alignas(64) T pad[kChunk];
    for (int j = 0; j < kVecs; ++j) g[j].store(pad + j * Vec::size());
    for (int64_t v = 0; v < tail_; ++v) out[k * kChunk + v] = static_cast<scalar_t>(pad[v]);
  }

  // exp((m_k - max) / temperature): what the exps of chunk k are multiplied by to be
  // relative to the row's max (1 for the chunks after the last rise of the max).
  T chunk_factor(int64_t k, const RowStats<T>& st, T inv) const {
    const T mk = cmax_[k];
    return mk == st.max ? T(1) : ppo::ppo_exp((mk - st.max) * inv);
  }

  // Adds one chunk of entries x (kVecs vectors, -inf padded) to the running statistics;
  // e_out (if not null) receives their exps relative to the running max after the chunk.
  template <bool kEntropy>
  static void absorb(Online& st, const Vec* x, T inv, T* e_out) {
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    Vec cm = x[0];
    for (int j = 1; j < kVecs; ++j) cm = at::vec::maximum(cm, x[j]);  // NaN propagates
    // the usual chunk lies below the running max: one compare, no horizontal reduction
    if ((cm <= Vec(st.m)).zero_mask() != 0) {  // a lane above it, or a NaN
      const T m = hmax(cm);
      if (m != m) {
        st.nan = true;
      } else if (m > st.m) {
        rescale(st, m, inv);
        st.m = m;
      }
    }
    const Vec vzero(T(0));
    if (st.m == kNegInf) {  // nothing finite yet: adds nothing
      if (e_out)
        for (int j = 0; j < kVecs; ++j) vzero.store(e_out + j * Vec::size());
      return;
    }
    const Vec vinv(inv), vm(st.m), vlow(std::numeric_limits<T>::lowest());
    // Entries equal to the running max (d == 0: the top and its ties) can only sit in a
    // chunk whose max is the running max. Only such chunks pay for keeping their exp(0) = 1
    // out of s (counted in n instead); the others add every exp to s.
    const bool has_top = (cm == vm).zero_mask() != kAllLanes;
    for (int j = 0; j < kVecs; ++j) {
      const Vec d = (x[j] - vm) * vinv;
      const Vec e = vexp(d);
      if (has_top) {
        const Vec top = d == vzero;
        st.s = st.s + Vec::blendv(e, vzero, top);
        st.n = st.n + (top & Vec(T(1)));
      } else {
        st.s = st.s + e;
      }
      // d is -inf on a banned entry; exp gives 0 and clamping d to the lowest finite value
      // keeps that 0 out of 0 * -inf = NaN in the entropy sum
      if constexpr (kEntropy) st.t = at::vec::fmadd(e, at::vec::clamp_min(d, vlow), st.t);
      if (e_out) e.store(e_out + j * Vec::size());
    }
  }

  // The max rose from st.m to m: the old sums, top included, become non-top mass
  // exp((st.m - m) / temperature) times smaller. When that underflows (or the raw
  // difference overflows to -inf) they become 0 without forming 0 * inf.
  static void rescale(Online& st, T m, T inv) {
    const T dm = (st.m - m) * inv;
    const T a = ppo::ppo_exp(dm);
    if (a > T(0)) {
      const Vec old = st.s + st.n;
      st.t = Vec(a) * (st.t + Vec(dm) * old);
      st.s = Vec(a) * old;
    } else {
      st.t = st.s = Vec(T(0));
    }
    st.n = Vec(T(0));
  }

  template <bool kEntropy>
  static RowStats<T> finish(const Online& st) {
    const T nan = std::numeric_limits<T>::quiet_NaN();
    if (st.nan || st.m == -std::numeric_limits<T>::infinity()) {
      // a NaN logit, or a row of -inf only: NaN, loudly
      return {st.m == st.m ? st.m : nan, nan, nan, nan};
    }
    const T rest = hsum(st.s) + (hsum(st.n) - T(1));
    const T log_sum = ppo::ppo_log1p(rest);
    const T inv_sum = T(1) / (T(1) + rest);
    return {st.m, log_sum, inv_sum, kEntropy ? log_sum - hsum(st.t) * inv_sum : T(0)};
  }

  int64_t V_, nfull_, tail_, nchunks_;
  bool stream_out_;
  std::vector<T> e_;     // exps of the last row's stats sweep, chunk by chunk
  std::vector<T> cmax_;  // running max each chunk's exps were taken against
};

// Rows of [B, Tl, V] visited as i = b * T + t for t < T; grain sized so a task holds
// about 64K vocabulary entries.
inline int64_t row_grain(int64_t V) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(V, 1)); }

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
