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
// Score mode (score_rollout): the block first finds the last valid position and adds
// scores[b] to the reward there (written back to rewards), as kl_penalized_rewards does.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace ppo_cuda {

template <typename A>
struct Affine {
  A a, c;  // x -> a + c * x
};

template <typename A>
__device__ __forceinline__ Affine<A> affine_identity() {
  return {A(0), A(1)};
}

// The map that applies `earlier` first (the part on the right), then `later`.
template <typename A>
__device__ __forceinline__ Affine<A> compose(const Affine<A>& earlier, const Affine<A>& later) {
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
  int64_t T;
  A gamma, lam;
};

constexpr int kGaeItems = 8;

template <typename A>
__global__ void __launch_bounds__(1024) gae_kernel(GaeArgs<A> g) {
  constexpr int K = kGaeItems;
  __shared__ Affine<A> sscan[64];
  __shared__ int64_t smax[33];
  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
  const int64_t T = g.T;
  const int64_t off = static_cast<int64_t>(blockIdx.x) * T;
  const bool* mask = g.mask + off;
  const A gl = g.gamma * g.lam;

  int64_t last = -1;
  A score = A(0);
  if (g.scores) {
    int64_t mine = -1;
    for (int64_t t = tid; t < T; t += nthr)
      if (mask[t]) mine = t;  // ascending per thread: the last hit is the largest
    last = block_max_i64(mine, smax);
    score = g.scores[blockIdx.x];
  }

  A carry_v = g.bootstrap ? g.bootstrap[blockIdx.x] : A(0);
  A carry_a = A(0);
  const int64_t tile = static_cast<int64_t>(nthr) * K;
  for (int64_t hi = T; hi > 0; hi -= tile) {
    const int64_t p0 = hi - static_cast<int64_t>(tid + 1) * K;  // this thread's leftmost
    A r[K], v[K];
    bool ok[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int64_t p = p0 + j;
      ok[j] = p >= 0 && mask[p];
      r[j] = A(0);
      v[j] = A(0);
      if (ok[j]) {
        r[j] = g.rewards[off + p];
        v[j] = g.values[off + p];
        if (p == last) {
          r[j] += score;
          g.rewards_out[off + p] = r[j];
        }
      }
    }
    // scan 1: the value of the next valid position on the right
    Affine<A> m = affine_identity<A>();
#pragma unroll
    for (int j = K - 1; j >= 0; --j)
      m = compose(m, ok[j] ? Affine<A>{v[j], A(0)} : affine_identity<A>());
    Affine<A> tot;
    Affine<A> e = block_exclusive_scan(m, tot, sscan);
    A x = e.a + e.c * carry_v;
    A delta[K];
#pragma unroll
    for (int j = K - 1; j >= 0; --j) {
      delta[j] = ok[j] ? r[j] + g.gamma * x - v[j] : A(0);
      if (ok[j]) x = v[j];
    }
    carry_v = tot.a + tot.c * carry_v;
    // scan 2: the advantages
    m = affine_identity<A>();
#pragma unroll
    for (int j = K - 1; j >= 0; --j)
      m = compose(m, ok[j] ? Affine<A>{delta[j], gl} : affine_identity<A>());
    e = block_exclusive_scan(m, tot, sscan);
    A y = e.a + e.c * carry_a;
#pragma unroll
    for (int j = K - 1; j >= 0; --j) {
      const int64_t p = p0 + j;
      if (p < 0) continue;
      if (ok[j]) y = delta[j] + gl * y;
      g.adv[off + p] = ok[j] ? y : A(0);
      g.ret[off + p] = ok[j] ? y + v[j] : A(0);
    }
    carry_a = tot.a + tot.c * carry_a;
  }
}

// Threads for a sequence of length T: one pack of kGaeItems per thread, 32..1024.
inline int gae_threads(int64_t T) {
  int64_t t = (T + kGaeItems - 1) / kGaeItems;
  t = (t + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > 1024 ? 1024 : t));
}

}  // namespace ppo_cuda
