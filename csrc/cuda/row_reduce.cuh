// Device building blocks of the vocabulary-row kernels: the online softmax statistics of a
// range of one logits row (max, sum of exp, entropy sum), their warp/block merge, and the
// gradient / zero sweeps that write a range of a dlogits row.
//
// Every routine works on an arbitrary range [begin, end) of a row whose start may have any
// alignment: it walks a scalar head up to the first 16-byte boundary, then 16-byte packs
// (8 bf16/half, 4 float, 2 double per load), then a scalar tail. So a row of an odd V, or a
// strided view such as logits[:, :-1], is read in place with wide loads on its body.
//
// The per-token PPO math is NOT here: the gradient sweep calls ppo::dlogit (ppo_math.h).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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

PPO_CUDA_HD float vlog(float x) { return logf(x); }
PPO_CUDA_HD double vlog(double x) { return log(x); }
PPO_CUDA_HD float vmax(float a, float b) { return fmaxf(a, b); }
PPO_CUDA_HD double vmax(double a, double b) { return fmax(a, b); }
template <typename A>
PPO_CUDA_HD A neg_inf() {
  return -static_cast<A>(INFINITY);
}
template <typename A>
PPO_CUDA_HD A quiet_nan() {
  return static_cast<A>(NAN);
}

// ---------------------------------------------------------------- 16-byte packs

template <typename T>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

// Default-cached load: the first sweep wants the row to stay in L2 for the second one.
template <typename T>
PPO_CUDA_HD Pack<T> ld_pack(const T* p) {
  return *reinterpret_cast<const Pack<T>*>(p);
}
// Streaming (evict-first) load and store for the last touch of a row: the gradient sweep's
// reads and every dlogits write, so that they do not push other rows' logits out of L2
// before those rows' own second sweep.
template <typename T>
PPO_CUDA_HD Pack<T> ld_pack_last(const T* p) {
#ifdef __CUDA_ARCH__
  uint4 r = __ldcs(reinterpret_cast<const uint4*>(p));
  return *reinterpret_cast<Pack<T>*>(&r);
#else
  return *reinterpret_cast<const Pack<T>*>(p);
#endif
}
template <typename T>
PPO_CUDA_HD void st_pack_stream(T* p, const Pack<T>& v) {
#ifdef __CUDA_ARCH__
  __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
#else
  *reinterpret_cast<Pack<T>*>(p) = v;
#endif
}

// Elements before the first 16-byte boundary at or after p (0 when p is aligned).
template <typename T>
PPO_CUDA_HD int64_t head_len(const T* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return static_cast<int64_t>(((16 - (a & 15)) & 15) / sizeof(T));
}

// ---------------------------------------------------------------- softmax statistics

// Online statistics of a set of entries x (RAW logits, before the temperature), relative
// to their running max m, itself kept in raw logit units:
//   d = (x - m) * inv_temp,  s = sum exp(d),  t = sum exp(d) * d
// so with log_s = log s: logp_v = d_v - log_s, lse = m * inv_temp + log_s and
// H = log_s - t / s. The raw max is subtracted BEFORE scaling: the max entry gets d = 0
// exactly (no FMA-contraction residue of x * inv_temp - m, which is +inf at temperature
// 1e-10), and logp never goes through lse, whose rounding at |z| ~ 65504 (fp16) or 3e38
// would swamp it. Keeping t relative to m (not sum e*z) avoids the cancellation
// lse - sum p z. Empty: m = -inf, s = 0.
template <typename A>
struct Stats {
  A m, s, t;
};

template <typename A>
PPO_CUDA_HD Stats<A> stats_empty() {
  return {neg_inf<A>(), A(0), A(0)};
}

// Rescale (s, t) from reference max m_old to m_new >= m_old: dm = (m_old - m_new) * inv_temp,
// a = exp(dm), t' = a (t + dm s), s' = a s. When a underflows to 0 (dm may be -inf when
// m_old - m_new overflows) t' is 0 without evaluating 0 * inf; s' = a * s keeps a NaN s.
template <typename A>
PPO_CUDA_HD void stats_rescale(A& s, A& t, A m_old, A m_new, A inv_temp) {
  const A dm = (m_old - m_new) * inv_temp;
  const A a = ppo::ppo_exp(dm);
  t = a > A(0) ? a * (t + dm * s) : A(0);
  s = a * s;
}

// Adds K raw entries x[0..K) to st. A -inf entry (banned token) has p = 0 and adds nothing;
// the select keeps 0 * (-inf) out of t. A NaN entry makes s NaN (loud, never dropped).
template <typename A, int K>
PPO_CUDA_HD void stats_add(Stats<A>& st, const A (&x)[K], A inv_temp) {
  A cmax = x[0];
#pragma unroll
  for (int k = 1; k < K; ++k) cmax = vmax(cmax, x[k]);
  if (cmax == neg_inf<A>()) {
    // All -inf (nothing to add) or -inf mixed with NaN (fmax drops NaN: re-check here).
    bool nan = false;
#pragma unroll
    for (int k = 0; k < K; ++k) nan |= x[k] != x[k];
    if (nan) st.s = quiet_nan<A>();
    return;
  }
  if (cmax > st.m) {
    if (st.s > A(0)) stats_rescale(st.s, st.t, st.m, cmax, inv_temp);
    st.m = cmax;
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const A d = (x[k] - st.m) * inv_temp;
    const A e = ppo::ppo_exp(d);
    st.s += e;
    st.t += e > A(0) ? e * d : A(0);
  }
}

// a := a merged with b (both relative to their own raw max).
template <typename A>
PPO_CUDA_HD void stats_merge(Stats<A>& a, const Stats<A>& b, A inv_temp) {
  if (b.s == A(0)) return;  // b empty (a NaN s is not 0: it propagates below)
  if (a.s == A(0)) {
    a = b;
    return;
  }
  const A m = vmax(a.m, b.m);
  A sa = a.s, ta = a.t, sb = b.s, tb = b.t;
  stats_rescale(sa, ta, a.m, m, inv_temp);
  stats_rescale(sb, tb, b.m, m, inv_temp);
  a.s = sa + sb;
  a.t = ta + tb;
  a.m = m;
}

template <typename A>
__device__ __forceinline__ Stats<A> warp_merge(Stats<A> st, A inv_temp) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    Stats<A> o;
    o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
    o.s = __shfl_xor_sync(0xffffffffu, st.s, off);
    o.t = __shfl_xor_sync(0xffffffffu, st.t, off);
    stats_merge(st, o, inv_temp);
  }
  return st;
}

// Block-wide merge; every thread gets the result. blockDim.x a multiple of 32, <= 1024.
// smem: 33 slots. Ends with a barrier-protected broadcast so smem can be reused at once.
template <typename A>
__device__ __forceinline__ Stats<A> block_merge(Stats<A> st, Stats<A>* smem, A inv_temp) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
  st = warp_merge(st, inv_temp);
  if (nwarps == 1) return st;  // every lane already holds the merge
  if (lane == 0) smem[warp] = st;
  __syncthreads();
  if (warp == 0) {
    Stats<A> w = lane < nwarps ? smem[lane] : stats_empty<A>();
    w = warp_merge(w, inv_temp);
    if (lane == 0) smem[32] = w;
  }
  __syncthreads();
  return smem[32];
}

// What a row's merged statistics give: the raw max and log s (the gradient sweep's
// logp_v = (x_v - xmax) * inv_temp - log_s), lse = xmax * inv_temp + log_s (saved for
// token_logprobs_bwd) and the entropy.
template <typename A>
struct RowStats {
  A xmax, log_s, lse, entropy;
};

template <typename A>
PPO_CUDA_HD RowStats<A> stats_finish(const Stats<A>& st, A inv_temp) {
  RowStats<A> r;
  r.xmax = st.m;
  r.log_s = vlog(st.s);
  r.lse = st.m * inv_temp + r.log_s;
  r.entropy = r.log_s - st.t / st.s;
  return r;
}

// logp of the token whose raw logit is x_tok: the shifted difference first, then log s.
template <typename A>
PPO_CUDA_HD A token_logp(const RowStats<A>& r, A x_tok, A inv_temp) {
  return (x_tok - r.xmax) * inv_temp - r.log_s;
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

// This thread's share (thread tid of nthr) of the statistics of row[v] / temperature over
// v in [begin, end). Four 16-byte loads are issued before the first is used, so that a
// 1024-thread block keeps ~64 KB in flight per multiprocessor (enough for HBM3e latency).
template <typename T, typename A>
PPO_CUDA_HD Stats<A> range_stats(const T* row, int64_t begin, int64_t end,
                                                A inv_temp, int tid, int nthr) {
  constexpr int N = Pack<T>::N;
  constexpr int U = 4;
  Stats<A> st = stats_empty<A>();
  const T* in = row + begin;
  const int64_t n = end - begin;
  if (n <= 0) return st;
  const int64_t h = imin(n, head_len(in));
  const int64_t nv = (n - h) / N;
  const int64_t tail0 = h + nv * N;
  for (int64_t k = tid; k < h; k += nthr) {
    const A x[1] = {static_cast<A>(in[k])};
    stats_add(st, x, inv_temp);
  }
  for (int64_t k = tail0 + tid; k < n; k += nthr) {
    const A x[1] = {static_cast<A>(in[k])};
    stats_add(st, x, inv_temp);
  }
  const T* vin = in + h;
  int64_t j = tid;
  for (; j + (U - 1) * static_cast<int64_t>(nthr) < nv; j += U * static_cast<int64_t>(nthr)) {
    Pack<T> x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) x[u] = ld_pack(vin + (j + u * static_cast<int64_t>(nthr)) * N);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      A z[N];
#pragma unroll
      for (int k = 0; k < N; ++k) z[k] = static_cast<A>(x[u].v[k]);
      stats_add(st, z, inv_temp);
    }
  }
  for (; j < nv; j += nthr) {
    const Pack<T> x = ld_pack(vin + j * N);
    A z[N];
#pragma unroll
    for (int k = 0; k < N; ++k) z[k] = static_cast<A>(x.v[k]);
    stats_add(st, z, inv_temp);
  }
  return st;
}

// Writes zeros over out[begin, end) (masked rows, positions t >= T, rows whose gradient
// coefficients are both 0): no read of the logits at all.
template <typename T>
PPO_CUDA_HD void zero_range(T* out_row, int64_t begin, int64_t end, int tid,
                                           int nthr) {
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

// The gradient of one row over [begin, end): with d_v = (row[v] - xmax) * inv_temp,
// out[v] = ppo::dlogit(d_v, log_s, ...) (logp_v = d_v - log_s; ppo_math.h holds the formula),
// with the per-token coefficients dlogp, dent of this row. Callers that only have the saved
// lse (token_logprobs_bwd) pass xmax = 0, log_s = lse: logp_v = row[v] * inv_temp - lse.
// The sweep runs BACKWARDS through the range: the first sweep read it forwards, so the
// entries it read last are the likeliest to still be in L2 and are re-read first.
// out may alias row (in-place backward): each element is read, then written, by one thread.
// When row and out differ in their 16-byte phase no common pack split exists: scalar path.
template <typename T, typename A>
PPO_CUDA_HD void grad_range(const T* row, T* out_row, int64_t begin,
                                           int64_t end, int64_t tok, A xmax, A log_s, A entropy,
                                           A dlogp, A dent, A inv_temp, int tid, int nthr) {
  constexpr int N = Pack<T>::N;
  const T* in = row + begin;
  T* out = out_row + begin;
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t tok_rel = tok - begin;  // outside [0, n) when the token is not in range
  auto one = [&](int64_t k) {
    const A d = (static_cast<A>(in[k]) - xmax) * inv_temp;
    out[k] = static_cast<T>(ppo::dlogit(d, log_s, entropy, dlogp, dent, inv_temp, k == tok_rel));
  };
  if (((reinterpret_cast<uintptr_t>(in) ^ reinterpret_cast<uintptr_t>(out)) & 15) != 0) {
    for (int64_t k = n - 1 - tid; k >= 0; k -= nthr) one(k);
    return;
  }
  const int64_t h = imin(n, head_len(in));
  const int64_t nv = (n - h) / N;
  const int64_t tail0 = h + nv * N;
  for (int64_t k = tail0 + tid; k < n; k += nthr) one(k);
  const T* vin = in + h;
  T* vout = out + h;
  auto pack = [&](int64_t j, const Pack<T>& x) {
    Pack<T> y;
    const int64_t k0 = h + j * N;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const A d = (static_cast<A>(x.v[k]) - xmax) * inv_temp;
      y.v[k] = static_cast<T>(
          ppo::dlogit(d, log_s, entropy, dlogp, dent, inv_temp, k0 + k == tok_rel));
    }
    st_pack_stream(vout + j * N, y);
  };
  int64_t j = nv - 1 - tid;
  // two packs in flight per thread (the reads mostly hit L2, whose latency is shorter)
  for (; j - nthr >= 0; j -= 2 * static_cast<int64_t>(nthr)) {
    const Pack<T> x0 = ld_pack_last(vin + j * N);
    const Pack<T> x1 = ld_pack_last(vin + (j - nthr) * N);
    pack(j, x0);
    pack(j - nthr, x1);
  }
  if (j >= 0) pack(j, ld_pack_last(vin + j * N));
  for (int64_t k = tid; k < h; k += nthr) one(k);
}

}  // namespace ppo_cuda
