// Device building blocks of the vocabulary-row kernels: the online softmax statistics of a
// range of one logits row (max, non-top mass, entropy sum), their warp/group merge, and the
// gradient / zero / scale sweeps that write a range of a dlogits row.
//
// Reduction order (batch invariance, NOTES.md): sweep 1 walks LOGICAL packs of N elements
// counted from the row's first element (N = 16 bytes / sizeof(T)), never packs counted from
// the first 16-byte boundary. So which thread adds which element, and in which order, is a
// function of V alone: the same row gives the same bits at any address phase, in any batch.
// A row that is not 16-byte aligned reads its interior packs with two aligned 16-byte loads
// and a funnel shift (ld_pack_shifted); only its first and last packs go element by element.
// The writing sweeps (gradient, zero, scale) have no reduction: they vectorize on the
// OUTPUT's alignment and fetch the matching input with the same shifted load.
//
// The per-token PPO math is NOT here: the gradient entries call ppo::dlogit_dense /
// dlogit_token (ppo_math.h).
#pragma once

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <cuda_runtime.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "ex2.cuh"
#include "ppo_math.h"

// Per-thread pieces are __host__ __device__ so that host_check/emulate_rows.cu can run
// them thread by thread on the CPU (this project's build machines have no GPU).
#define PPO_CUDA_HD __host__ __device__ __forceinline__

namespace ppo_cuda {

template <typename I>
PPO_CUDA_HD I imin(I a, I b) {
  return a < b ? a : b;
}

using ppo::acc_of;  // accumulation dtype (ppo_math.h)

constexpr int kWarpSize = 32;
constexpr int kMaxThreads = 1024;

// ---------------------------------------------------------------- math of the sweeps
//
// No --use_fast_math: every libm call keeps its documented accuracy. The one
// per-element exponential of each sweep is exp2 of a base-2 shifted logit
// d2 = (x - xmax) * inv_temp * log2(e): on the device one MUFU.EX2, the PTX
// ex2.approx.ftz.f32 (max error 2 ulp, the same instruction as CUDA's exp2f: PTX ISA,
// "ex2"), without exp2f's denormal fix-up around it (about 4 instructions per entry in
// each sweep): a p_v = 2^d2 below 2^-126 is 0, where the sums and the gradient lose
// nothing a float32 result can hold (its largest term is 1). The host emulation runs
// glibc's exp2f (< 1 ulp). Once-per-row calls stay accurate: log1pf (1 ulp), expm1f
// (1 ulp), expf (2 ulp) for the token's own entry.
PPO_CUDA_HD float vexp2(float x) { return ex2_approx(x); }  // (ex2.cuh)
PPO_CUDA_HD double vexp2(double x) { return exp2(x); }
PPO_CUDA_HD float vlog1p(float x) { return log1pf(x); }
PPO_CUDA_HD double vlog1p(double x) { return log1p(x); }
PPO_CUDA_HD float vmax(float a, float b) { return fmaxf(a, b); }
PPO_CUDA_HD double vmax(double a, double b) { return fmax(a, b); }
PPO_CUDA_HD float vfma(float a, float b, float c) { return fmaf(a, b, c); }
PPO_CUDA_HD double vfma(double a, double b, double c) { return fma(a, b, c); }
// t += 2^d d over a sweep, as one FMA: max(d, lowest) keeps a banned entry's d = -inf (whose
// 2^d is 0) from making 0 * (-inf) = NaN; a NaN d gives a NaN 2^d, so the term stays NaN.
template <typename A>
PPO_CUDA_HD A add_entropy_term(A t, A e, A d) {
  return vfma(e, vmax(d, -std::numeric_limits<A>::max()), t);
}
template <typename A>
PPO_CUDA_HD A neg_inf() {
  return -static_cast<A>(INFINITY);
}
template <typename A>
PPO_CUDA_HD A quiet_nan() {
  return static_cast<A>(NAN);
}
constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;

// The temperature as the kernels use it, computed on the host in double, rounded once:
// inv = 1 / T (the token's logp, the gradient's final scale) and inv2 = log2(e) / T (the
// base-2 shifted logits of the sweeps). inv2 is capped at the largest finite value: when
// log2(e) / T overflows while 1 / T does not, every non-max entry is 0 either way and the
// max entries keep d2 = 0 * cap = 0 (never 0 * inf).
// per_row: the ops' optional per-row temperatures [B, T] (csrc/ops.cpp), or null; with
// them each row takes its own Temp (row_temp) and inv / inv2 here are unused.
template <typename A>
struct Temp {
  A inv, inv2;
  const A* per_row = nullptr;
};

// Row i's temperature: tp itself, or the Temp of per_row[i] computed as make_temp
// (launch.h) computes the scalar's (1 / T and log2(e) / T in double, the base-2 scale
// capped at A's largest finite value, each rounded once), so that equal per-row values
// give the scalar call's bits. Read once at the top of each row.
template <typename A>
PPO_CUDA_HD Temp<A> row_temp(const Temp<A>& tp, int64_t i) {
  if (tp.per_row == nullptr) return tp;
  const double inv = 1.0 / static_cast<double>(tp.per_row[i]);
  const double cap = sizeof(A) == 8 ? DBL_MAX : static_cast<double>(FLT_MAX);
  const double inv2 = inv * kLog2e < cap ? inv * kLog2e : cap;
  Temp<A> r;
  r.inv = static_cast<A>(inv);
  r.inv2 = static_cast<A>(inv2);
  return r;
}

// ---------------------------------------------------------------- 16-byte packs

template <typename T>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T>
PPO_CUDA_HD bool aligned16(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// One aligned 16-byte block as four words; `last` = streaming (evict-first) load, for the
// final touch of a row (the gradient sweep), so it does not push other rows out of L2.
PPO_CUDA_HD uint4 ld_block(const void* p, bool last) {
#ifdef __CUDA_ARCH__
  return last ? __ldcs(reinterpret_cast<const uint4*>(p)) : *reinterpret_cast<const uint4*>(p);
#else
  (void)last;
#ifdef PPO_CUDA_HOST_CHECK_LOAD  // host_check/emulate_rows.cu: every 16-byte block read
  PPO_CUDA_HOST_CHECK_LOAD(p);   // must lie inside the row being swept
#endif
  uint4 r;
  std::memcpy(&r, p, 16);
  return r;
#endif
}

template <typename T>
PPO_CUDA_HD Pack<T> to_pack(const uint4& w) {
  Pack<T> r;
  memcpy(&r, &w, 16);  // no type punning through pointers
  return r;
}

// Aligned pack at p (p 16-byte aligned).
template <typename T>
PPO_CUDA_HD Pack<T> ld_pack(const T* p, bool last = false) {
  return to_pack<T>(ld_block(p, last));
}

PPO_CUDA_HD uint32_t funnel_r(uint32_t lo, uint32_t hi, uint32_t sh) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, sh);
#else
  return sh == 0 ? lo : (lo >> sh) | (hi << (32 - sh));
#endif
}

// The N elements at p, p NOT 16-byte aligned, from the two aligned blocks around it. Both
// blocks must be readable (the caller's interior() test): no byte outside the row is read,
// so memcheck/initcheck see nothing. The word offset q is selected with two levels of
// selects, not a runtime array index (which would put w[] in local memory).
template <typename T>
PPO_CUDA_HD Pack<T> ld_pack_shifted(const T* p, bool last) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  const uintptr_t a = addr & ~uintptr_t(15);
  const uint32_t off = static_cast<uint32_t>(addr - a);  // bytes, sizeof(T) | off, 0 < off < 16
  const uint4 b0 = ld_block(reinterpret_cast<const void*>(a), last);
  const uint4 b1 = ld_block(reinterpret_cast<const void*>(a + 16), last);
  const uint32_t w[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
  const uint32_t q = off >> 2, sh = (off & 3) * 8;
  uint32_t u[6], v[5];
#pragma unroll
  for (int i = 0; i < 6; ++i) u[i] = (q & 2) ? w[i + 2] : w[i];
#pragma unroll
  for (int i = 0; i < 5; ++i) v[i] = (q & 1) ? u[i + 1] : u[i];
  uint4 r;
  r.x = funnel_r(v[0], v[1], sh);
  r.y = funnel_r(v[1], v[2], sh);
  r.z = funnel_r(v[2], v[3], sh);
  r.w = funnel_r(v[3], v[4], sh);
  return to_pack<T>(r);
}

// May the N elements at row element e0 be read with ld_pack_shifted? Its two blocks stay
// inside the row when a whole pack precedes e0 and two whole packs start at e0.
template <typename T>
PPO_CUDA_HD bool interior(int64_t e0, int64_t V) {
  constexpr int N = Pack<T>::N;
  return e0 >= N && e0 + 2 * N <= V;
}

// The N elements row[e0 .. e0 + N): one aligned load, two aligned loads and a shift, or
// (first / last pack of a misaligned row) element by element. `row_aligned`: row is
// 16-byte aligned and N | e0.
template <typename T>
PPO_CUDA_HD Pack<T> ld_elems(const T* row, int64_t e0, int64_t V, bool row_aligned,
                             bool last) {
  if (row_aligned) return ld_pack(row + e0, last);
  if (interior<T>(e0, V)) return ld_pack_shifted(row + e0, last);
  Pack<T> r;
#pragma unroll
  for (int k = 0; k < Pack<T>::N; ++k) r.v[k] = row[e0 + k];
  return r;
}

// The N elements at p one by one (any alignment).
template <typename T>
PPO_CUDA_HD Pack<T> ld_each(const T* p) {
  Pack<T> r;
#pragma unroll
  for (int k = 0; k < Pack<T>::N; ++k) r.v[k] = p[k];
  return r;
}

// Streaming (evict-first) store of a pack at an aligned address.
template <typename T>
PPO_CUDA_HD void st_pack_stream(T* p, const Pack<T>& v) {
  uint4 w;
  memcpy(&w, &v, 16);
#ifdef __CUDA_ARCH__
  __stcs(reinterpret_cast<uint4*>(p), w);
#else
  std::memcpy(p, &w, 16);
#endif
}

// A pack's elements in the accumulation dtype A. bfloat16 -> float is a bit placement: a
// 32-bit word holds two elements (the lower half first), the high one is the word with its
// low 16 bits cleared, the low one the word shifted up by 16: one instruction an element,
// where the element-wise conversion extracts each half first (PRMT, then a shift). The same
// values, NaN payloads included.
PPO_CUDA_HD float bits_float(uint32_t w) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(w);
#else
  float f;
  std::memcpy(&f, &w, 4);
  return f;
#endif
}

template <typename T, typename A>
PPO_CUDA_HD void unpack(const Pack<T>& x, A (&z)[Pack<T>::N]) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<A, float>) {
    uint32_t w[4];
    memcpy(w, &x, 16);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      z[2 * i] = bits_float(w[i] << 16);
      z[2 * i + 1] = bits_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < Pack<T>::N; ++k) z[k] = static_cast<A>(x.v[k]);
  }
}

// Elements before the first 16-byte boundary at or after p (0 when p is aligned).
template <typename T>
PPO_CUDA_HD int64_t head_len(const T* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return static_cast<int64_t>(((16 - (a & 15)) & 15) / sizeof(T));
}

// ---------------------------------------------------------------- the reduction tree

// Most threads of a chunk (and of every (row, chunk) block); at most 64 chunks per row.
constexpr int kChunkThreads = 256;
constexpr int kMaxChunks = 64;
// How a row of V entries of type T is reduced: S chunks of `chunk` elements (a multiple of
// the pack size N, so every chunk starts at a logical pack), `threads` threads per chunk
// (about four packs each). A function of (T, V) only.
struct ChunkPlan {
  int threads;
  int64_t chunk;
  int64_t S;
};

template <typename T>
PPO_CUDA_HD ChunkPlan chunk_plan(int64_t V) {
  constexpr int64_t N = Pack<T>::N;
  const int64_t nvec = (V + N - 1) / N;
  ChunkPlan p;
  p.threads = kWarpSize;
  while (p.threads < kChunkThreads && static_cast<int64_t>(p.threads) * 4 < nvec) p.threads *= 2;
  p.chunk = static_cast<int64_t>(p.threads) * 4 * N;
  p.S = (V + p.chunk - 1) / p.chunk;
  if (p.S > kMaxChunks) {  // very large V: longer chunks (more packs per thread)
    p.chunk = ((V + kMaxChunks - 1) / kMaxChunks + N - 1) / N * N;
    p.S = (V + p.chunk - 1) / p.chunk;
  }
  return p;
}

// ---------------------------------------------------------------- softmax statistics
//
// Statistics of a set of entries x (RAW logits) relative to its max m (raw units), in base 2:
//   d2_v = (x_v - m) * inv2          exactly 0 for the entries equal to m
//   rest = sum_v 2^d2_v - 1          computed WITHOUT adding the top entry's 1: the first
//                                    entry equal to m adds 0, every other entry 2^d2
//   t2   = sum_v 2^d2_v * d2_v       (0 for the top entries and for -inf entries)
// so log_sum = log1p(rest), H = log_sum - ln2 t2 / (1 + rest), logp = d_tok - log_sum
// (docs/DESIGN.md, Precision, with t = ln2 t2). Why rest and not s = 1 + rest: when
// 1 - p_top is below float epsilon, log(s) with s rounded drops rest, so the confident
// token's logp came back 0 and the entropy lost percents; log1p(rest) keeps their relative
// digits down to 1 - p ~ 1e-12.
// Empty set: m = -inf, rest = -1, t2 = 0 (rest == -1 marks it: a non-empty set has rest >= 0;
// a NaN rest is not empty, so NaN propagates through every merge).
template <typename A>
struct Stats {
  A m, rest, t;
};

template <typename A>
PPO_CUDA_HD Stats<A> stats_empty() {
  return {neg_inf<A>(), A(-1), A(0)};
}

template <typename A>
PPO_CUDA_HD bool stats_is_empty(const Stats<A>& s) {
  return s.rest == A(-1);
}

// Rebases a non-top part of mass s = 1 + rest, entropy sum t, from max m_old to m_new > m_old
// (al = 2^dm2 < 1, dm2 = (m_old - m_new) inv2): s' = al s, t' = al (t + dm2 s). When al
// underflows to 0 (dm2 may be -inf: finfo.min entries) t' is 0 without 0 * inf.
// A NaN s stays NaN (al * NaN), also when al is 0.
template <typename A>
PPO_CUDA_HD void rebase(A& s, A& t, A m_old, A m_new, A inv2) {
  const A dm = (m_old - m_new) * inv2;
  const A al = vexp2(dm);
  t = al > A(0) ? al * (t + dm * s) : A(0);
  s = al * s;
}

// Adds K raw entries x[0..K) to st. A -inf entry (banned token) adds nothing
// (add_entropy_term keeps 0 * (-inf) out of t). A NaN entry makes rest NaN (loud, never
// dropped).
template <typename A, int K>
PPO_CUDA_HD void stats_add(Stats<A>& st, const A (&x)[K], A inv2) {
  A cmax = x[0];
#pragma unroll
  for (int k = 1; k < K; ++k) cmax = vmax(cmax, x[k]);
  if (cmax == neg_inf<A>()) {
    // All -inf (nothing to add) or -inf mixed with NaN (fmax drops NaN: re-check here).
    bool nan = false;
#pragma unroll
    for (int k = 0; k < K; ++k) nan |= x[k] != x[k];
    if (nan) st.rest = quiet_nan<A>();
    return;
  }
  if (cmax > st.m) {
    // A new max (rare after a thread's first packs). The old set's whole mass 1 + rest is
    // rebased to cmax (for the empty set: 0 * 0 = 0); the first entry equal to cmax becomes
    // the top and adds 0, every other entry adds 2^d2.
    A s = st.rest + A(1);
    A t = st.t;
    rebase(s, t, st.m, cmax, inv2);
    bool top_seen = false;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const A d = (x[k] - cmax) * inv2;
      const A e = vexp2(d);
      const bool is_top = !top_seen && d == A(0);
      top_seen |= is_top;
      s += is_top ? A(0) : e;
      t = add_entropy_term(t, e, d);
    }
    st.m = cmax;
    st.rest = s;
    st.t = t;
    return;
  }
  // No new max: every entry adds 2^d2 (a tie with the max adds exactly 1).
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const A d = (x[k] - st.m) * inv2;
    const A e = vexp2(d);
    st.rest += e;
    st.t = add_entropy_term(st.t, e, d);
  }
}

// a := a merged with b (spec section 2). Symmetric bit for bit (merge(a, b) == merge(b, a):
// the larger max is always the base, sums commute), so butterfly lanes agree exactly.
template <typename A>
PPO_CUDA_HD void stats_merge(Stats<A>& a, const Stats<A>& b, A inv2) {
  if (stats_is_empty(b)) return;
  if (stats_is_empty(a)) {
    a = b;
    return;
  }
  if (a.m == b.m) {  // both tops count: one of them is no longer "the" top
    a.rest = a.rest + b.rest + A(1);
    a.t = a.t + b.t;
    return;
  }
  // Select values, not references: a reference select would put both structs in local memory.
  const bool a_hi = a.m > b.m;
  const A hm = a_hi ? a.m : b.m, hr = a_hi ? a.rest : b.rest, ht = a_hi ? a.t : b.t;
  const A lm = a_hi ? b.m : a.m;
  A s = A(1) + (a_hi ? b.rest : a.rest), t = a_hi ? b.t : a.t;
  rebase(s, t, lm, hm, inv2);
  a.m = hm;
  a.rest = hr + s;
  a.t = ht + t;
}

// Butterfly merge over a warp: every lane ends with the same bits (stats_merge symmetric).
template <typename A>
__device__ __forceinline__ Stats<A> warp_merge(Stats<A> st, A inv2) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    Stats<A> o;
    o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
    o.rest = __shfl_xor_sync(0xffffffffu, st.rest, off);
    o.t = __shfl_xor_sync(0xffffffffu, st.t, off);
    stats_merge(st, o, inv2);
  }
  return st;
}

// The merge of a group of G threads (G a multiple of 32, the group's threads consecutive
// and starting at group * G): warp butterflies, then the group's first warp merges its
// warps' results in warp order (lanes >= #warps empty) by another butterfly. Every block
// that reduces a chunk calls exactly this (fused_rows_kernel with several groups per block,
// partial_stats_kernel with one), so a chunk's statistics have the same bits in both paths.
// Valid in lane 0 of the group's first warp. wsm: one slot per warp of the block. When
// G > 32 it holds two barriers: every thread of the block must call it.
template <typename A>
__device__ __forceinline__ Stats<A> group_merge(Stats<A> st, Stats<A>* wsm, int G, A inv2) {
  st = warp_merge(st, inv2);
  if (G == kWarpSize) return st;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int gw = G / kWarpSize;     // warps per group
  const int first = warp / gw * gw; // the group's first warp
  if (lane == 0) wsm[warp] = st;
  __syncthreads();
  if (warp == first) {
    Stats<A> w = lane < gw ? wsm[first + lane] : stats_empty<A>();
    st = warp_merge(w, inv2);
  }
  __syncthreads();  // wsm may be rewritten at once
  return st;
}

// Merges the S chunk statistics of a row as one warp does it (lane l merges chunks l, l + 32,
// ... in order, then a butterfly): combine_kernel and fused_rows_kernel both call this.
template <typename A>
__device__ __forceinline__ Stats<A> merge_chunks(const Stats<A>* cs, int64_t S, A inv2) {
  const int lane = threadIdx.x % kWarpSize;
  Stats<A> st = stats_empty<A>();
  for (int64_t c = lane; c < S; c += kWarpSize) stats_merge(st, cs[c], inv2);
  return warp_merge(st, inv2);
}

// What a row's merged statistics give: the raw max, log_sum = log1p(rest), the same in
// base 2 for the gradient sweep's exp2 (rounded once), and the entropy.
template <typename A>
struct RowStats {
  A xmax, log_s, log_s2, entropy;
};

template <typename A>
PPO_CUDA_HD RowStats<A> stats_finish(const Stats<A>& st) {
  RowStats<A> r;
  r.xmax = st.m;
  r.log_s = vlog1p(st.rest);
  r.log_s2 = r.log_s * A(kLog2e);
  r.entropy = r.log_s - (A(kLn2) * st.t) / (A(1) + st.rest);
  return r;
}

// logp of the token whose raw logit is x_tok: the shifted difference first (exactly 0 at the
// max: no FMA residue of x * inv - m), then log_sum.
template <typename A>
PPO_CUDA_HD A token_logp(A x_tok, A xmax, A log_s, A inv) {
  return (x_tok - xmax) * inv - log_s;
}

// The token's own dlogits entry, computed once per row (not per vocabulary lane): 1 - p as
// -expm1(logp) (ppo::dlogit_token), times 1 / temperature.
template <typename A>
PPO_CUDA_HD A token_grad(A logp, A entropy, A dlogp, A dent, A inv) {
  return ppo::dlogit_token(logp, ppo::ppo_exp(logp), entropy, dlogp, dent) * inv;
}

// ppo::dlogit_dense(logp_v, p_v, H, dlogp, dent) / T with logp_v = ln2 l2_v, its row
// constants folded once per row: p_v (a l2_v + b), a = -dent ln2 / T, b = -(dlogp + dent H)
// / T (two instructions per entry instead of six; the same value to float rounding).
template <typename A>
struct DenseCoef {
  A a, b;
};
template <typename A>
PPO_CUDA_HD DenseCoef<A> dense_coef(A entropy, A dlogp, A dent, A inv) {
  return {-(dent * A(kLn2)) * inv, -(dlogp + dent * entropy) * inv};
}

// A dense dlogits entry: l2 = log2 p_v = (x - xmax) inv2 - log_s2, p_v = 2^l2. A banned
// entry (x = -inf) has l2 = -inf and p_v = 0: the floor (2^-2048 is 0 in float and double)
// keeps a * l2 finite, so it gets 0, never 0 * inf = NaN.
template <typename A>
PPO_CUDA_HD A dense_l2(A x, A xmax, A log_s2, A inv2) {
  return (x - xmax) * inv2 - log_s2;
}
template <typename A>
PPO_CUDA_HD A dense_grad(A x, A xmax, A log_s2, A inv2, DenseCoef<A> c) {
  const A l2 = dense_l2(x, xmax, log_s2, inv2);
  return vexp2(l2) * vfma(c.a, vmax(l2, A(-2048)), c.b);
}

// Everything the gradient sweep needs of one row.
template <typename A>
struct GradRow {
  A xmax, log_s2, entropy, dlogp, dent;
  A g_tok;      // the token's own entry (token_grad)
  int32_t tok;  // the token's column (tok_column): -1, out of [0, V), matches no entry
};

// A token id as GradRow::tok: its column where it is in [0, V), else -1. 32 bits, so the
// sweep's per-entry compare is one instruction, not a 64-bit pair (the launchers check
// V < 2^31, so every column fits).
PPO_CUDA_HD int32_t tok_column(int64_t tok, int64_t V) {
  return tok >= 0 && tok < V ? static_cast<int32_t>(tok) : -1;
}

// Block sum in double (deterministic order for a given block size). smem: 33 doubles.
__device__ __forceinline__ double block_sum(double x, double* smem) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  if (nwarps == 1) return x;
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  if (warp == 0) {
    double w = lane < nwarps ? smem[lane] : 0.0;
#pragma unroll
    for (int off = kWarpSize / 2; off > 0; off >>= 1) w += __shfl_xor_sync(0xffffffffu, w, off);
    if (lane == 0) smem[32] = w;
  }
  __syncthreads();
  return smem[32];
}

// ---------------------------------------------------------------- range sweeps

template <typename T, typename A>
PPO_CUDA_HD void add_pack(Stats<A>& st, const Pack<T>& x, A inv2) {
  A z[Pack<T>::N];
  unpack(x, z);
  stats_add(st, z, inv2);
}

// Thread lt's share (of G) of the statistics of row[v] over v in [begin, end), begin a
// multiple of N (a chunk start). Logical packs p = begin / N + j, j = lt, lt + G, ... in
// increasing order, then the elements after the last whole pack of the range (the row's
// tail, V % N elements, in the last chunk only). Four packs are loaded before the first is
// used (the kernels size a chunk as four packs per thread), which keeps ~32 KB in flight
// per 512-thread block.
template <typename T, typename A>
PPO_CUDA_HD Stats<A> range_stats(const T* row, int64_t begin, int64_t end, int64_t V, A inv2,
                                 int lt, int G) {
  constexpr int N = Pack<T>::N;
  constexpr int U = 4;
  Stats<A> st = stats_empty<A>();
  const int64_t n = end - begin;
  if (n <= 0) return st;
  const int64_t nv = n / N;
  // One loop for aligned rows (plain 16-byte loads only) and one for the others, so the
  // alignment test and the shifted loads stay out of the hot loop: the same packs in the
  // same order either way.
  auto packs = [&](auto aligned) {
    constexpr bool kAligned = decltype(aligned)::value;
    int64_t j = lt;
    for (; j + (U - 1) * static_cast<int64_t>(G) < nv; j += U * static_cast<int64_t>(G)) {
      Pack<T> x[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        x[u] = ld_elems(row, begin + (j + u * static_cast<int64_t>(G)) * N, V, kAligned, false);
#pragma unroll
      for (int u = 0; u < U; ++u) add_pack(st, x[u], inv2);
    }
    for (; j < nv; j += G) add_pack(st, ld_elems(row, begin + j * N, V, kAligned, false), inv2);
  };
  if (aligned16(row))
    packs(std::true_type{});
  else
    packs(std::false_type{});
  for (int64_t k = begin + nv * N + lt; k < end; k += G) {
    const A x[1] = {static_cast<A>(row[k])};
    stats_add(st, x, inv2);
  }
  return st;
}

// Applies f(x) -> y to out[k] for k in [begin, end) (k relative to the row), x = in_row[k]
// in A, except out[given] = given_value (given: a column of the row, or -1 for none: the
// gradient's token entry, checked once a pack, not per entry); packs aligned to OUT (the
// input fetched with ld_elems' shifted load when its phase differs). `backwards`: the
// gradient sweep runs from the end of the range (the first sweep read it forwards, so its
// last entries are the likeliest to still be in L2). out may alias in (in place): each
// element is read, then written, by one thread. Two packs are in flight per thread. No
// reduction here: the thread split does not change any output bit.
// kSharedIn: in_row is a staged copy in shared memory (stage_range), 16-byte aligned at
// begin: plain loads (the streaming hint is a global-memory load), element by element where
// the output's phase differs.
template <typename T, typename A, bool kSharedIn = false, typename F>
PPO_CUDA_HD void map_range(const T* in_row, T* out_row, int64_t begin, int64_t end, int64_t V,
                           int tid, int nthr, bool backwards, F f, int64_t given = -1,
                           A given_value = A(0)) {
  constexpr int N = Pack<T>::N;
  const int64_t n = end - begin;
  if (n <= 0) return;
  T* out = out_row + begin;
  const int64_t h = imin(n, head_len(out));
  const int64_t nv = (n - h) / N;
  const int64_t tail0 = h + nv * N;
  const bool same_phase = (((reinterpret_cast<uintptr_t>(in_row + begin) ^
                             reinterpret_cast<uintptr_t>(out)) & 15) == 0);
  auto one = [&](int64_t k) {  // k relative to begin
    out[k] = static_cast<T>(begin + k == given ? given_value
                                               : f(static_cast<A>(in_row[begin + k])));
  };
  // One sweep for an input in the output's phase (plain 16-byte loads) and one for the
  // others, so the phase test and the shifted loads stay out of the hot loop.
  auto sweep = [&](auto same) {
    constexpr bool kSame = decltype(same)::value;
    auto load = [&](int64_t j) {
      const int64_t e0 = begin + h + j * N;
      if constexpr (kSame) return ld_pack(in_row + e0, !kSharedIn);
      else if constexpr (kSharedIn) return ld_each(in_row + e0);
      else return ld_elems(in_row, e0, V, false, true);
    };
    auto store = [&](int64_t j, const Pack<T>& x) {
      Pack<T> y;
      const int64_t e0 = begin + h + j * N;
      A z[N];
      unpack(x, z);
#pragma unroll
      for (int k = 0; k < N; ++k) y.v[k] = static_cast<T>(f(z[k]));
      st_pack_stream(out + h + j * N, y);
      // the given entry, when in this pack (one pack of the row): overwritten by the same
      // thread, after (program order), as a scalar store, not a select per entry
      if (static_cast<uint64_t>(given - e0) < static_cast<uint64_t>(N))
        out[given - begin] = static_cast<T>(given_value);
    };
    if (backwards) {
      int64_t j = nv - 1 - tid;
      for (; j - nthr >= 0; j -= 2 * static_cast<int64_t>(nthr)) {
        const Pack<T> x0 = load(j), x1 = load(j - nthr);
        store(j, x0);
        store(j - nthr, x1);
      }
      if (j >= 0) store(j, load(j));
    } else {
      int64_t j = tid;
      for (; j + nthr < nv; j += 2 * static_cast<int64_t>(nthr)) {
        const Pack<T> x0 = load(j), x1 = load(j + nthr);
        store(j, x0);
        store(j + nthr, x1);
      }
      if (j < nv) store(j, load(j));
    }
  };
  for (int64_t k = tail0 + tid; k < n; k += nthr) one(k);
  if (same_phase)
    sweep(std::true_type{});
  else
    sweep(std::false_type{});
  for (int64_t k = tid; k < h; k += nthr) one(k);
}

// Writes zeros over out[begin, end) (masked rows, positions t >= T, rows whose gradient
// coefficients are both 0): no read of the logits at all.
template <typename T>
PPO_CUDA_HD void zero_range(T* out_row, int64_t begin, int64_t end, int tid, int nthr) {
  constexpr int N = Pack<T>::N;
  T* out = out_row + begin;
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t h = imin(n, head_len(out));
  const int64_t nv = (n - h) / N;
  const int64_t tail0 = h + nv * N;
  const T zero = static_cast<T>(0.0f);
  for (int64_t k = tid; k < h; k += nthr) out[k] = zero;
  for (int64_t k = tail0 + tid; k < n; k += nthr) out[k] = zero;
  Pack<T> zp;
#pragma unroll
  for (int k = 0; k < N; ++k) zp.v[k] = zero;
  T* vout = out + h;
  for (int64_t j = tid; j < nv; j += nthr) st_pack_stream(vout + j * N, zp);
}

// The gradient of one row over [begin, end): dense_grad for every entry, g.g_tok for the
// token's own (ppo_math.h holds the formulas), written backwards (map_range). Without an
// entropy term (c.a == 0, the common case) dense_grad is p_v * c.b: the same bits for a
// nonzero b, two instructions an entry fewer (no clamp of l2, no FMA). kSharedIn: row is a staged copy in
// shared memory (map_range).
template <bool kSharedIn = false, typename T, typename A>
PPO_CUDA_HD void grad_range(const T* row, T* out_row, int64_t begin, int64_t end, int64_t V,
                            const GradRow<A>& g, Temp<A> tp, int tid, int nthr) {
  const DenseCoef<A> c = dense_coef(g.entropy, g.dlogp, g.dent, tp.inv);
  if (c.a == A(0) && c.b != A(0)) {  // (b = -0: the FMA's +0, kept bit for bit)
    map_range<T, A, kSharedIn>(
        row, out_row, begin, end, V, tid, nthr, true,
        [&](A x) { return vexp2(dense_l2(x, g.xmax, g.log_s2, tp.inv2)) * c.b; }, g.tok, g.g_tok);
    return;
  }
  map_range<T, A, kSharedIn>(
      row, out_row, begin, end, V, tid, nthr, true,
      [&](A x) { return dense_grad(x, g.xmax, g.log_s2, tp.inv2, c); }, g.tok, g.g_tok);
}

// row[v] *= f over [begin, end) in A, rounded once (scale_grad_), in place.
template <typename T, typename A>
PPO_CUDA_HD void scale_range(T* row, int64_t begin, int64_t end, int64_t V, A f, int tid,
                             int nthr) {
  map_range<T, A>(row, row, begin, end, V, tid, nthr, false, [&](A x) { return x * f; });
}

// ---------------------------------------------------------------- rows held on chip
//
// The cluster path (row_kernels.cuh, cluster_rows_kernel) reads each row from DRAM once:
// the C blocks of a thread-block cluster (sm_90) each copy a contiguous slice of the row's
// chunks into shared memory, reduce their chunks from that copy, merge through distributed
// shared memory and write the gradient from the same copy. A slice starts at a chunk start
// (a multiple of N), so the copy's logical packs are 16-byte aligned and range_stats over
// the copy walks the same packs in the same order as over the row: the same bits.

// Block `rank` of C holds chunks [c0, c1) of the row, elements [e0, e1) (per chunks each,
// the last blocks fewer or none). A function of (ChunkPlan, V, C) only.
struct RowSlice {
  int64_t c0, c1, e0, e1;
};

PPO_CUDA_HD int64_t slice_chunks(const ChunkPlan& cp, int C) { return (cp.S + C - 1) / C; }

PPO_CUDA_HD RowSlice row_slice(const ChunkPlan& cp, int64_t V, int C, int rank) {
  const int64_t per = slice_chunks(cp, C);
  RowSlice s;
  s.c0 = imin(cp.S, rank * per);
  s.c1 = imin(cp.S, s.c0 + per);
  s.e0 = imin(V, s.c0 * cp.chunk);
  s.e1 = imin(V, s.c1 * cp.chunk);
  return s;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// 16 bytes global -> shared without registers (PTX cp.async.cg: cached in L2 only); the
// copies of a thread complete in commit-group order (cp_async_commit / cp_async_wait).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
#endif

// Ends a group of this thread's asynchronous copies (no-op on the host, where copies are
// synchronous).
PPO_CUDA_HD void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `pending` of this thread's most recent copy groups are still in flight
// (PTX wants the count as an immediate: a switch over the small counts, all of them beyond).
PPO_CUDA_HD void cp_async_wait(int pending) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_all;\n" ::: "memory"); break;
  }
#else
  (void)pending;
#endif
}

// s[k] = row[begin + k] for k in [0, end - begin), by thread tid of nthr; s 16-byte aligned,
// begin a multiple of N. A 16-byte aligned row is copied with cp.async on the device (wait
// with cp_async_wait, then a barrier); otherwise (and on the host) through registers with
// the streaming load (the only read of these bytes) and ld_elems' shifted loads.
template <typename T>
PPO_CUDA_HD void stage_range(T* s, const T* row, int64_t begin, int64_t end, int64_t V, int tid,
                             int nthr) {
  constexpr int N = Pack<T>::N;
  const int64_t n = end - begin;
  const int64_t nv = n / N;
  const bool al = aligned16(row);
  for (int64_t j = tid; j < nv; j += nthr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (al) {
      cp_async16(s + j * N, row + begin + j * N);
      continue;
    }
#endif
    *reinterpret_cast<Pack<T>*>(s + j * N) = ld_elems(row, begin + j * N, V, al, true);
  }
  for (int64_t k = nv * N + tid; k < n; k += nthr) s[k] = row[begin + k];
}

}  // namespace ppo_cuda
