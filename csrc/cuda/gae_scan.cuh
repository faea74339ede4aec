// Reverse GAE scan over T, one block per sequence, as two block-wide scans of affine maps.
//
// With the mask making some positions transparent (DESIGN.md, GAE), define for every t
//   NV_t = valid_t ? V_t : NV_{t+1}                (NV_T = bootstrap or 0)
//   A_t  = valid_t ? delta_t + gamma*lam * A_{t+1} : A_{t+1}     (A_T = 0)
//   delta_t = r_t + gamma * NV_{t+1} - V_t
// Both are x_t = a_t + c_t * x_{t+1}: an affine map of the value on the right, with
//   NV: (a, c) = valid ? (V_t, 0) : (0, 1)        A: (a, c) = valid ? (delta_t, gamma*lam) : (0, 1)
// Maps compose associatively, so a block scans them in parallel (Kogge-Stone in each warp,
// then across warps): thread k owns ITEMS consecutive positions, thread 0 the RIGHTMOST
// ones of a tile, so an ordinary forward scan over thread index runs right to left in t.
// Long sequences are walked in tiles of blockDim * ITEMS from the right, carrying x across.
// B = 8, T = 32768 is 8 blocks x 4 tiles of 1024 threads, not one thread per sequence.
//
// Per-sequence lambda (VAPO's length-adaptive lambda): lam_per_seq[b] replaces lam in the
// advantages' decay. Decoupled returns (VAPO's value lambda): the returns are the same
// deltas scanned with gamma * value_lam (a third block scan) plus V, not A + V.
//
// Score mode (score_rollout): the block first finds the last valid position and adds
// scores[b] to the reward there (written back to rewards), as kl_penalized_rewards does.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace ppo_cuda {

#ifndef PPO_CUDA_HD
#define PPO_CUDA_HD __host__ __device__ __forceinline__
#endif

template <typename A>
struct Affine {
  A a, c;  // x -> a + c * x
};

template <typename A>
PPO_CUDA_HD Affine<A> affine_identity() {
  return {A(0), A(1)};
}

// The map that applies `earlier` first (the part on the right), then `later`.
template <typename A>
PPO_CUDA_HD Affine<A> compose(const Affine<A>& earlier, const Affine<A>& later) {
  return {later.a + later.c * earlier.a, later.c * earlier.c};
}

template <typename A>
__device__ __forceinline__ Affine<A> warp_inclusive_scan(Affine<A> x) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    Affine<A> y;
    y.a = __shfl_up_sync(0xffffffffu, x.a, off);
    y.c = __shfl_up_sync(0xffffffffu, x.c, off);
    if (lane >= off) x = compose(y, x);
  }
  return x;
}

// Exclusive scan over thread index (thread 0 first); total = the composition of all.
// smem: 64 slots. blockDim.x a multiple of 32. Ends with a barrier: smem reusable at once.
template <typename A>
__device__ __forceinline__ Affine<A> block_exclusive_scan(Affine<A> x, Affine<A>& total,
                                                          Affine<A>* smem) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int nwarps = blockDim.x / 32;
  const Affine<A> inc = warp_inclusive_scan(x);
  Affine<A> exc;
  exc.a = __shfl_up_sync(0xffffffffu, inc.a, 1);
  exc.c = __shfl_up_sync(0xffffffffu, inc.c, 1);
  if (lane == 0) exc = affine_identity<A>();
  if (lane == 31) smem[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    Affine<A> w = lane < nwarps ? smem[lane] : affine_identity<A>();
    w = warp_inclusive_scan(w);
    smem[32 + lane] = w;
  }
  __syncthreads();
  const Affine<A> prefix = warp > 0 ? smem[32 + warp - 1] : affine_identity<A>();
  total = smem[32 + nwarps - 1];
  __syncthreads();
  return compose(prefix, exc);
}

__device__ __forceinline__ int64_t block_max_i64(int64_t x, int64_t* smem) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int nwarps = blockDim.x / 32;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const int64_t y = __shfl_xor_sync(0xffffffffu, x, off);
    x = y > x ? y : x;
  }
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < nwarps ? smem[lane] : int64_t(-1);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const int64_t y = __shfl_xor_sync(0xffffffffu, w, off);
      w = y > w ? y : w;
    }
    if (lane == 0) smem[32] = w;
  }
  __syncthreads();
  const int64_t r = smem[32];
  __syncthreads();
  return r;
}

template <typename A>
struct GaeArgs {
  const A* rewards;    // [B, T]
  A* rewards_out;      // score mode: rewards with the score added (may alias rewards)
  const A* values;     // [B, T]
  const bool* mask;    // [B, T]
  const A* bootstrap;  // [B] or null (V after the last valid token: 0)
  const A* scores;     // [B] or null (score mode when not null)
  A* adv;              // [B, T]
  A* ret;              // [B, T]
  const A* lam_per_seq;  // [B] or null (lam for every sequence)
  int64_t T;
  A gamma, lam;
  bool decoupled;  // returns from value_lam's scan, not adv + values
  A value_lam;
};

constexpr int kGaeItems = 8;

// Per-thread phases of one tile (host-callable: host_check/emulate_gae.cu drives them with
// an emulated block scan). Thread tid of a tile ending at hi owns positions
// p0 .. p0 + K - 1 with p0 = hi - (tid + 1) * K; positions p < 0 are identity maps.
template <typename A>
struct GaeThread {
  static constexpr int K = kGaeItems;
  int64_t p0;
  A r[K], v[K], delta[K];
  bool ok[K];
};

// Loads this thread's positions of sequence `seq`; adds the score at the last valid one.
template <typename A>
PPO_CUDA_HD void gae_load(const GaeArgs<A>& g, int64_t seq, int64_t hi, int tid, int64_t last,
                          A score, GaeThread<A>& th) {
  constexpr int K = kGaeItems;
  const int64_t off = seq * g.T;
  th.p0 = hi - static_cast<int64_t>(tid + 1) * K;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const int64_t p = th.p0 + j;
    th.ok[j] = p >= 0 && g.mask[off + p];
    th.r[j] = A(0);
    th.v[j] = A(0);
    if (th.ok[j]) {
      th.r[j] = g.rewards[off + p];
      th.v[j] = g.values[off + p];
      if (p == last) {
        th.r[j] += score;
        g.rewards_out[off + p] = th.r[j];
      }
    }
  }
}

// Scan 1's map of this thread: the value of the next valid position, right to left.
template <typename A>
PPO_CUDA_HD Affine<A> gae_next_value_map(const GaeThread<A>& th) {
  Affine<A> m = affine_identity<A>();
#pragma unroll
  for (int j = kGaeItems - 1; j >= 0; --j)
    m = compose(m, th.ok[j] ? Affine<A>{th.v[j], A(0)} : affine_identity<A>());
  return m;
}

// Scan 2's map (and the decoupled returns' scan, with gl = gamma * value_lam): the deltas of
// this thread's positions, right to left, each decayed by gl.
template <typename A>
PPO_CUDA_HD Affine<A> gae_delta_map(const GaeThread<A>& th, A gl) {
  Affine<A> m = affine_identity<A>();
#pragma unroll
  for (int j = kGaeItems - 1; j >= 0; --j)
    m = compose(m, th.ok[j] ? Affine<A>{th.delta[j], gl} : affine_identity<A>());
  return m;
}

// x_in: the next valid value to the right of this thread's positions. Fills delta and
// returns scan 2's map.
template <typename A>
PPO_CUDA_HD Affine<A> gae_deltas(GaeThread<A>& th, A x_in, A gamma, A gl) {
  A x = x_in;
#pragma unroll
  for (int j = kGaeItems - 1; j >= 0; --j) {
    th.delta[j] = th.ok[j] ? th.r[j] + gamma * x - th.v[j] : A(0);
    if (th.ok[j]) x = th.v[j];
  }
  return gae_delta_map(th, gl);
}

// y_in: the advantage carried in from the right. Writes the advantages (0 masked) and, unless
// g.decoupled, the returns A + V.
template <typename A>
PPO_CUDA_HD void gae_store(const GaeArgs<A>& g, int64_t seq, const GaeThread<A>& th, A y_in,
                           A gl) {
  const int64_t off = seq * g.T;
  A y = y_in;
#pragma unroll
  for (int j = kGaeItems - 1; j >= 0; --j) {
    const int64_t p = th.p0 + j;
    if (p < 0) continue;
    if (th.ok[j]) y = th.delta[j] + gl * y;
    g.adv[off + p] = th.ok[j] ? y : A(0);
    if (!g.decoupled) g.ret[off + p] = th.ok[j] ? y + th.v[j] : A(0);
  }
}

// Decoupled returns: y_in, the value_lam advantage carried in from the right; glv = gamma *
// value_lam. Writes returns = that advantage + V (0 masked).
template <typename A>
PPO_CUDA_HD void gae_store_returns(const GaeArgs<A>& g, int64_t seq, const GaeThread<A>& th,
                                   A y_in, A glv) {
  const int64_t off = seq * g.T;
  A y = y_in;
#pragma unroll
  for (int j = kGaeItems - 1; j >= 0; --j) {
    const int64_t p = th.p0 + j;
    if (p < 0) continue;
    if (th.ok[j]) y = th.delta[j] + glv * y;
    g.ret[off + p] = th.ok[j] ? y + th.v[j] : A(0);
  }
}

// The advantages' lambda of sequence seq.
template <typename A>
PPO_CUDA_HD A gae_lambda(const GaeArgs<A>& g, int64_t seq) {
  return g.lam_per_seq ? g.lam_per_seq[seq] : g.lam;
}

// Last valid position of sequence seq in this thread's share (ascending: the last hit wins).
template <typename A>
PPO_CUDA_HD int64_t gae_last_valid(const GaeArgs<A>& g, int64_t seq, int tid, int nthr) {
  int64_t mine = -1;
  for (int64_t t = tid; t < g.T; t += nthr)
    if (g.mask[seq * g.T + t]) mine = t;
  return mine;
}

template <typename A>
__global__ void __launch_bounds__(1024) gae_kernel(GaeArgs<A> g) {
  __shared__ Affine<A> sscan[64];
  __shared__ int64_t smax[33];
  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
  const int64_t seq = blockIdx.x;
  const A gl = g.gamma * gae_lambda(g, seq);
  const A glv = g.gamma * g.value_lam;
  int64_t last = -1;
  A score = A(0);
  if (g.scores) {  // block-uniform
    last = block_max_i64(gae_last_valid(g, seq, tid, nthr), smax);
    score = g.scores[seq];
  }
  A carry_v = g.bootstrap ? g.bootstrap[seq] : A(0);
  A carry_a = A(0), carry_g = A(0);
  const int64_t tile = static_cast<int64_t>(nthr) * kGaeItems;
  for (int64_t hi = g.T; hi > 0; hi -= tile) {
    GaeThread<A> th;
    gae_load(g, seq, hi, tid, last, score, th);
    Affine<A> tot;
    Affine<A> e = block_exclusive_scan(gae_next_value_map(th), tot, sscan);
    const Affine<A> m2 = gae_deltas(th, e.a + e.c * carry_v, g.gamma, gl);
    carry_v = tot.a + tot.c * carry_v;
    e = block_exclusive_scan(m2, tot, sscan);
    gae_store(g, seq, th, e.a + e.c * carry_a, gl);
    carry_a = tot.a + tot.c * carry_a;
    if (g.decoupled) {  // block-uniform
      e = block_exclusive_scan(gae_delta_map(th, glv), tot, sscan);
      gae_store_returns(g, seq, th, e.a + e.c * carry_g, glv);
      carry_g = tot.a + tot.c * carry_g;
    }
  }
}

// Threads for a sequence of length T: one pack of kGaeItems per thread, 32..1024.
inline int gae_threads(int64_t T) {
  int64_t t = (T + kGaeItems - 1) / kGaeItems;
  t = (t + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > 1024 ? 1024 : t));
}

}  // namespace ppo_cuda
