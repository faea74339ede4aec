// The vocabulary-row kernels shared by token_logprobs, ppo_loss and score_rollout.
//
// A "row" is one position (b, t) of logits [B, Tl, V]. Every row is reduced as the same
// fixed CHUNKS (chunk_plan: a function of V and the dtype only), each by the same number of
// threads in the same order, and the chunk results are merged by one warp in the same order.
// Two ways to schedule that work:
//
//  fused   one block per row (grid-stride over rows), `groups` groups of chunk_plan().threads
//          threads taking the chunks in turn (sweep 1); warp 0 merges the chunks and thread 0
//          computes the token's logprob, entropy and the per-token epilogue (loss, KL, ...)
//          through ppo_math.h; sweep 2 (only when a gradient is wanted) writes dlogits from
//          the row while it is still in L2, backwards. One DRAM read + one write of [N, V].
//  split   for few rows and a large V, where one block per row leaves most multiprocessors
//          idle: grid (row, chunk) blocks each write a chunk's statistics; a combine kernel
//          (one warp per row) merges them and runs the epilogue; a grad kernel (row, chunk)
//          writes dlogits. The second read is from L2 as long as the few rows fit there.
// Both give a row the same bits (batch invariance, NOTES.md): which path runs depends on
// the row count, the reduction tree does not.
//
// Masked rows: the kernels read mask first and never read the token id, logits or any
// per-token input of a masked row; its outputs are 0 and its gradient row is written 0.
// Rows t >= T get a zero gradient and nothing else. A token id outside [0, V) on a valid
// row (which the Python layer rejects before launch) is not read: its logprob is NaN.
#pragma once

#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include <cooperative_groups.h>

#include "launch.h"
#include "row_reduce.cuh"
#include "token_epilogue.cuh"

namespace ppo_cuda {

// Most threads of a fused block (512 x 64 registers leaves room for two blocks
// per multiprocessor, so one block's epilogue overlaps the other's sweep; also fp64 gets
// 128 registers and no spills).
constexpr int kFusedMaxThreads = 512;

// A block's threads as groups of cp.threads (the threads of a chunk): thread tid of nthr
// is thread lt of group `group` of `groups`, G threads each.
struct BlockGroups {
  int tid, nthr, G, groups, group, lt;
};
__device__ __forceinline__ BlockGroups block_groups(const ChunkPlan& cp) {
  BlockGroups g;
  g.tid = threadIdx.x;
  g.nthr = blockDim.x;
  g.G = cp.threads;
  g.groups = g.nthr / g.G;
  g.group = g.tid / g.G;
  g.lt = g.tid - g.group * g.G;
  return g;
}

// ---------------------------------------------------------------- fused: one block per row

// __launch_bounds__(512, 2): at most 64 registers, two blocks per multiprocessor;
// float64 (gradcheck only) gets one block and 128 registers instead of spilling.
template <typename scalar_t>
constexpr int kFusedMinBlocks = sizeof(scalar_t) == 8 ? 1 : 2;

template <typename scalar_t>
__global__ void __launch_bounds__(kFusedMaxThreads, kFusedMinBlocks<scalar_t>)
    fused_rows_kernel(RowsView<scalar_t> rv, TokenIO<acc_of<scalar_t>> io,
                      Temp<acc_of<scalar_t>> tp, ChunkPlan cp) {
  using A = acc_of<scalar_t>;
  __shared__ Stats<A> wsm[kFusedMaxThreads / kWarpSize];
  __shared__ Stats<A> cs[kMaxChunks];
  __shared__ GradRow<A> bc;
  const auto [tid, nthr, G, groups, group, lt] = block_groups(cp);
  const int64_t nrows = rv.B * rv.Tl;
  for (int64_t r = blockIdx.x; r < nrows; r += gridDim.x) {
    const int64_t b = r / rv.Tl;
    const int64_t t = r - b * rv.Tl;
    const scalar_t* row = rv.logits + b * rv.sB + t * rv.sT;
    scalar_t* orow = rv.out ? rv.out + b * rv.oB + t * rv.oT : nullptr;
    if (t >= rv.T) {  // the model's extra last position: zero gradient, nothing else
      if (orow) zero_range(orow, 0, rv.V, tid, nthr);
      continue;
    }
    const int64_t i = b * rv.T + t;
    if (!rv.mask[i]) {  // block-uniform: every thread reads the same flag
      if (tid == 0) token_epilogue_masked(io, i);
      if (orow) zero_range(orow, 0, rv.V, tid, nthr);
      continue;
    }
    const Temp<A> rt = row_temp(tp, i);  // this row's temperature
    TokenIn<A> tin{};
    if (tid == 0) tin = fetch_token(io, rv, row, i);  // in flight during sweep 1
    // Sweep 1: the groups take the chunks in turn; a uniform trip count (every thread
    // reaches group_merge's barriers), the chunk's statistics to cs[c].
    for (int64_t c0 = 0; c0 < cp.S; c0 += groups) {
      const int64_t c = c0 + group;
      Stats<A> st = stats_empty<A>();
      if (c < cp.S)
        st = range_stats(row, c * cp.chunk, imin(rv.V, (c + 1) * cp.chunk), rv.V, rt.inv2, lt, G);
      st = group_merge(st, wsm, G, rt.inv2);
      if (lt == 0 && c < cp.S) cs[c] = st;
    }
    __syncthreads();
    if (tid < kWarpSize) {
      const Stats<A> st = merge_chunks(cs, cp.S, rt.inv2);
      if (tid == 0) bc = token_epilogue(io, i, tin, stats_finish(st), rt);
    }
    __syncthreads();
    const GradRow<A> g = bc;
    // No barrier needed before the next row: cs and bc are rewritten only after the next
    // row's barriers, which every thread reaches after reading them here.
    if (orow) {
      if (grad_is_zero(g))
        zero_range(orow, 0, rv.V, tid, nthr);
      else
        grad_range(row, orow, 0, rv.V, rv.V, g, rt, tid, nthr);
    }
  }
}

// ---------------------------------------------------------------- cluster: a row on chip

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// A cluster barrier (every thread of every block arrives, then waits) after which the
// shared-memory writes of the threads with `wrote` set are visible to every thread of the
// cluster: they arrive with release semantics, the others relaxed (PTX ISA,
// "barrier.cluster": the default arrive is a release, whose fence waits for all of the
// thread's earlier stores, the gradient's included; the relaxed one does not), and the
// wait acquires.
__device__ __forceinline__ void cluster_barrier(bool wrote) {
  if (wrote)
    asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
  else
    asm volatile("barrier.cluster.arrive.relaxed;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}
#endif

// sm_90: a cluster of C blocks per row (grid-stride over rows by cluster). Block `rank`
// copies its slice of the row (row_slice: whole chunks) into dynamic shared memory
// (stage_range, one commit group per round of `groups` chunks, so the first chunks are
// reduced while the later ones land), reduces its chunks from the copy exactly as the fused
// kernel reduces them from the row, and writes each chunk's statistics into block 0's cs
// through distributed shared memory. After a cluster barrier block 0 merges the chunks
// (merge_chunks, the same order), runs the epilogue and writes the GradRow into every
// block's bc; after a second barrier each block writes its slice's gradient from its copy.
// One DRAM read and one write of [N, V]. Same bits as the fused and split paths.
// Barrier hazards: a block writes block 0's cs for row r + 1 only after passing row r's
// second barrier, which block 0 passes only after merging row r; block 0 writes bc for row
// r + 1 only after row r + 1's first barrier, which every block reaches after reading row
// r's bc into registers; the copy of row r + 1 starts after a block barrier that follows
// row r's gradient sweep.
template <typename scalar_t>
__global__ void __launch_bounds__(kFusedMaxThreads, kFusedMinBlocks<scalar_t>)
    cluster_rows_kernel(RowsView<scalar_t> rv, TokenIO<acc_of<scalar_t>> io,
                        Temp<acc_of<scalar_t>> tp, ChunkPlan cp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_of<scalar_t>;
  namespace cg = cooperative_groups;
  extern __shared__ __align__(16) unsigned char ppo_cluster_smem[];
  scalar_t* srow = reinterpret_cast<scalar_t*>(ppo_cluster_smem);
  __shared__ Stats<A> wsm[kFusedMaxThreads / kWarpSize];
  __shared__ Stats<A> cs[kMaxChunks];
  __shared__ GradRow<A> bc;
  cg::cluster_group cluster = cg::this_cluster();
  const int C = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const auto [tid, nthr, G, groups, group, lt] = block_groups(cp);
  const RowSlice sl = row_slice(cp, rv.V, C, rank);
  const int64_t rounds = (sl.c1 - sl.c0 + groups - 1) / groups;
  const int64_t nrows = rv.B * rv.Tl;
  const int64_t nclusters = gridDim.x / C;
  Stats<A>* cs0 = cluster.map_shared_rank(cs, 0);
  // Distributed shared memory may be written only once every block of the cluster runs
  // (CUDA C Programming Guide, "Distributed Shared Memory"): a barrier before the first.
  cluster.sync();
  for (int64_t r = blockIdx.x / C; r < nrows; r += nclusters) {
    const int64_t b = r / rv.Tl;
    const int64_t t = r - b * rv.Tl;
    const scalar_t* row = rv.logits + b * rv.sB + t * rv.sT;
    scalar_t* orow = rv.out + b * rv.oB + t * rv.oT;
    if (t >= rv.T) {  // cluster-uniform, like the mask below: no cluster barrier skipped
      zero_range(orow, sl.e0, sl.e1, tid, nthr);
      continue;
    }
    const int64_t i = b * rv.T + t;
    if (!rv.mask[i]) {
      if (rank == 0 && tid == 0) token_epilogue_masked(io, i);
      zero_range(orow, sl.e0, sl.e1, tid, nthr);
      continue;
    }
    const Temp<A> rt = row_temp(tp, i);
    __syncthreads();  // every thread is done reading the previous row's copy
    for (int64_t q = 0; q < rounds; ++q) {
      const int64_t e0 = sl.e0 + q * groups * cp.chunk;
      stage_range(srow + (e0 - sl.e0), row, e0, imin(sl.e1, e0 + groups * cp.chunk), rv.V, tid,
                  nthr);
      cp_async_commit();
    }
    TokenIn<A> tin{};
    if (rank == 0 && tid == 0) tin = fetch_token(io, rv, row, i);
    for (int64_t q = 0; q < rounds; ++q) {
      cp_async_wait(static_cast<int>(rounds - 1 - q));
      __syncthreads();  // round q's copies, every thread's, have landed
      const int64_t c = sl.c0 + q * groups + group;
      Stats<A> st = stats_empty<A>();
      if (c < sl.c1) {
        const int64_t cb = c * cp.chunk, ce = imin(rv.V, cb + cp.chunk);
        st = range_stats(srow + (cb - sl.e0), int64_t(0), ce - cb, ce - cb, rt.inv2, lt, G);
      }
      st = group_merge(st, wsm, G, rt.inv2);
      if (lt == 0 && c < sl.c1) cs0[c] = st;  // (lt == 0: the writers of the barrier below)
    }
    cluster_barrier(lt == 0);  // every chunk's statistics are in block 0's cs
    if (rank == 0 && tid < kWarpSize) {
      const Stats<A> st = merge_chunks(cs, cp.S, rt.inv2);
      if (tid == 0) {
        const GradRow<A> g = token_epilogue(io, i, tin, stats_finish(st), rt);
        for (int k = 0; k < C; ++k) *cluster.map_shared_rank(&bc, k) = g;
      }
    }
    cluster_barrier(rank == 0 && tid == 0);  // every block's bc holds the row's GradRow
    GradRow<A> g = bc;
    if (grad_is_zero(g)) {
      zero_range(orow, sl.e0, sl.e1, tid, nthr);
      continue;
    }
    g.tok = g.tok >= sl.e0 ? static_cast<int32_t>(g.tok - sl.e0) : -1;  // slice column
    grad_range<true>(srow, orow + sl.e0, 0, sl.e1 - sl.e0, sl.e1 - sl.e0, g, rt, tid, nthr);
  }
  cluster.sync();  // no block leaves while another may still write its shared memory
#else
  __trap();  // never launched below sm_90 (launch_cluster checks the binary)
#endif
}

// ---------------------------------------------------------------- split vocabulary

// grid (B * T, S), cp.threads threads: the statistics of chunk blockIdx.y of row blockIdx.x.
template <typename scalar_t>
__global__ void __launch_bounds__(kChunkThreads)
    partial_stats_kernel(RowsView<scalar_t> rv, Temp<acc_of<scalar_t>> tp, ChunkPlan cp,
                         Stats<acc_of<scalar_t>>* ws) {
  using A = acc_of<scalar_t>;
  __shared__ Stats<A> wsm[kChunkThreads / kWarpSize];
  const int64_t i = blockIdx.x;
  if (!rv.mask[i]) return;  // combine never reads a masked row's partials
  const int64_t b = i / rv.T;
  const int64_t t = i - b * rv.T;
  const scalar_t* row = rv.logits + b * rv.sB + t * rv.sT;
  const int64_t c = blockIdx.y;
  const Temp<A> rt = row_temp(tp, i);
  Stats<A> st = range_stats(row, c * cp.chunk, imin(rv.V, (c + 1) * cp.chunk), rv.V, rt.inv2,
                            static_cast<int>(threadIdx.x), cp.threads);
  st = group_merge(st, wsm, cp.threads, rt.inv2);
  if (threadIdx.x == 0) ws[i * cp.S + c] = st;
}

// Per-row values the combine kernel leaves for the grad kernel: info[i * kInfo + ...].
enum InfoSlot : int { kInfoXmax = 0, kInfoLogS2, kInfoEnt, kInfoDlogp, kInfoDent, kInfoGtok, kInfo };

// One warp per row: merge the S chunk statistics (merge_chunks, as the fused kernel), run
// the epilogue, leave the GradRow in info[i * kInfo ..] for the grad kernel (when not null).
template <typename scalar_t>
__global__ void combine_kernel(RowsView<scalar_t> rv, TokenIO<acc_of<scalar_t>> io,
                               Temp<acc_of<scalar_t>> tp, int64_t S,
                               const Stats<acc_of<scalar_t>>* ws, acc_of<scalar_t>* info) {
  using A = acc_of<scalar_t>;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) +
                    threadIdx.x / kWarpSize;
  if (i >= rv.B * rv.T) return;  // warp-uniform
  if (!rv.mask[i]) {
    if (lane == 0) {
      token_epilogue_masked(io, i);
      if (info)
        for (int k = 0; k < kInfo; ++k) info[i * kInfo + k] = A(0);
    }
    return;
  }
  const Temp<A> rt = row_temp(tp, i);
  const Stats<A> st = merge_chunks(ws + i * S, S, rt.inv2);
  if (lane == 0) {
    const int64_t b = i / rv.T;
    const int64_t t = i - b * rv.T;
    const TokenIn<A> tin = fetch_token(io, rv, rv.logits + b * rv.sB + t * rv.sT, i);
    const GradRow<A> g = token_epilogue(io, i, tin, stats_finish(st), rt);
    if (info) {
      A* o = info + i * kInfo;
      o[kInfoXmax] = g.xmax;
      o[kInfoLogS2] = g.log_s2;
      o[kInfoEnt] = g.entropy;
      o[kInfoDlogp] = g.dlogp;
      o[kInfoDent] = g.dent;
      o[kInfoGtok] = g.g_tok;
    }
  }
}

// Where the grad kernel finds a row's GradRow: the combine kernel's info, or
// (token_logprobs_bwd) the saved row_max / log_sum / entropy and the incoming gradients
// (the raw max and log_sum, never lse, so the max entry's d2 is exactly 0).
template <typename A>
struct GradSource {
  const A* info;     // [B * T, kInfo], or null: use the arrays below
  const A* row_max;  // [B, T]
  const A* log_sum;  // [B, T]
  const A* entropy;  // [B, T]; may be null when gent is null
  const A* glp;      // [B, T] d loss / d logprob
  const A* gent;     // [B, T] d loss / d entropy, or null
};

template <typename scalar_t, typename A>
__device__ __forceinline__ GradRow<A> grad_row_of(const GradSource<A>& src,
                                                  const RowsView<scalar_t>& rv,
                                                  const scalar_t* row, int64_t i, Temp<A> tp) {
  GradRow<A> g;
  g.tok = tok_column(rv.tokens[i], rv.V);  // out of range: -1, matches no entry
  if (src.info) {
    const A* o = src.info + i * kInfo;
    g.xmax = o[kInfoXmax];
    g.log_s2 = o[kInfoLogS2];
    g.entropy = o[kInfoEnt];
    g.dlogp = o[kInfoDlogp];
    g.dent = o[kInfoDent];
    g.g_tok = o[kInfoGtok];
    return g;
  }
  const A log_s = src.log_sum[i];
  g.xmax = src.row_max[i];
  g.log_s2 = log_s * A(kLog2e);  // the same rounding as stats_finish
  g.dlogp = src.glp[i];
  g.dent = src.gent ? src.gent[i] : A(0);
  g.entropy = (src.gent && src.entropy) ? src.entropy[i] : A(0);
  const A logp = g.tok >= 0 ? token_logp(static_cast<A>(row[g.tok]), g.xmax, log_s, tp.inv)
                            : quiet_nan<A>();
  g.g_tok = token_grad(logp, g.entropy, g.dlogp, g.dent, tp.inv);
  return g;
}

// grid (B * Tl, S): the gradient of chunk blockIdx.y of row blockIdx.x.
template <typename scalar_t>
__global__ void __launch_bounds__(kChunkThreads)
    grad_chunks_kernel(RowsView<scalar_t> rv, Temp<acc_of<scalar_t>> tp, int64_t chunk,
                       GradSource<acc_of<scalar_t>> src) {
  using A = acc_of<scalar_t>;
  const int64_t r = blockIdx.x;
  const int64_t b = r / rv.Tl;
  const int64_t t = r - b * rv.Tl;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t end = imin(rv.V, begin + chunk);
  scalar_t* orow = rv.out + b * rv.oB + t * rv.oT;
  const int tid = threadIdx.x, nthr = blockDim.x;
  const int64_t i = b * rv.T + t;
  if (t >= rv.T || !rv.mask[i]) {
    zero_range(orow, begin, end, tid, nthr);
    return;
  }
  const scalar_t* row = rv.logits + b * rv.sB + t * rv.sT;
  const Temp<A> rt = row_temp(tp, i);
  const GradRow<A> g = grad_row_of(src, rv, row, i, rt);
  if (grad_is_zero(g)) {
    zero_range(orow, begin, end, tid, nthr);
    return;
  }
  grad_range(row, orow, begin, end, rv.V, g, rt, tid, nthr);
}

// out[0] = sum_i w[i] * x[i], one block, double accumulation, a fixed order: deterministic.
template <typename A>
__global__ void __launch_bounds__(kMaxThreads)
    weighted_sum_kernel(const A* w, const A* x, int64_t n, A* out) {
  __shared__ double red[33];
  double acc = 0.0;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x)
    acc += static_cast<double>(w[k]) * static_cast<double>(x[k]);
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) *out = static_cast<A>(acc);
}

// ---------------------------------------------------------------- host side

struct RowPlan {
  bool split = false;
  int cluster = 0;   // blocks per row on the cluster path (0: not that path)
  ChunkPlan cp{};
  int threads = 32;  // fused or cluster block: groups * cp.threads
  int64_t grid = 0;  // fused grid
};

// Most shared memory a cluster block's slice may take: two blocks per multiprocessor
// (228 KB on sm_90), so one block's sweeps overlap the other's copy.
constexpr int64_t kClusterSliceBytes = 96 * 1024;

// Blocks per row of the cluster path (2, 4 or 8: the portable cluster sizes), the fewest
// whose slices fit kClusterSliceBytes; `want` (2, 4 or 8) first when it fits; 0 when none
// does (V beyond 8 x 96 KB: the fused path).
// Shared memory of a cluster block's slice: slice_chunks whole chunks.
template <typename scalar_t>
int64_t slice_bytes(const ChunkPlan& cp, int C) {
  return slice_chunks(cp, C) * cp.chunk * static_cast<int64_t>(sizeof(scalar_t));
}

template <typename scalar_t>
int cluster_blocks(const ChunkPlan& cp, int64_t want) {
  auto fits = [&](int C) { return slice_bytes<scalar_t>(cp, C) <= kClusterSliceBytes; };
  if ((want == 2 || want == 4 || want == 8) && fits(static_cast<int>(want)))
    return static_cast<int>(want);
  for (int C : {2, 4, 8})
    if (fits(C)) return C;
  return 0;
}

// Path and launch shape. None of it changes a row's bits: the knobs only move work around.
//   PPO_CUDA_SPLIT       0 auto, 1 never split, >= 2 always split (the chunks are
//                        chunk_plan's either way: the value no longer sets their number)
//   PPO_CUDA_CLUSTER     0 auto, 1 never, 2 / 4 / 8 that many blocks per row (the fewest that
//                        fit when that many do not) on the cluster path, whenever a gradient
//                        is written on sm_90 and the path is not split
//   PPO_CUDA_THREADS     fused block size, rounded to a multiple of chunk_plan().threads
//                        (1 .. 512 / threads groups); default: min(S, 512 / threads) groups
//   PPO_CUDA_ROWS_PER_SM cap the fused grid at k blocks per SM (rows loop); 0 = one per row
// Auto takes the cluster path when a gradient is written and the rows the fused path keeps
// in flight (two blocks per multiprocessor, one row each) exceed half the L2: its gradient
// sweep would re-read them from DRAM (three passes over [N, V] instead of two).
// cluster_ok = false: not the cluster path (launch_cluster's fallback).
template <typename scalar_t>
RowPlan plan_rows(int64_t B, int64_t Tn, int64_t Tl, int64_t V, bool grad, int device,
                  bool cluster_ok = true) {
  RowPlan p;
  p.cp = chunk_plan<scalar_t>(V);
  const int64_t sms = sm_count(device);
  const int64_t nrows = B * Tn;
  const int64_t forced = env_int("PPO_CUDA_SPLIT", 0);
  if (forced >= 2) {
    p.split = true;
  } else if (forced == 0 && nrows > 0 && p.cp.S >= 2) {
    // With a gradient the grad kernel re-reads the rows: split only while they are so few
    // that they (mostly) stay in L2. Without one there is no re-read.
    p.split = nrows <= (grad ? sms : 2 * sms);
  }
  p.threads = p.cp.threads;
  if (p.split) return p;
  const int64_t max_groups = kFusedMaxThreads / p.cp.threads;
  const int64_t want_c = env_int("PPO_CUDA_CLUSTER", 0);
  if (grad && cluster_ok && want_c != 1 &&
      device_attr(cudaDevAttrComputeCapabilityMajor, device) >= 9) {
    const int64_t in_flight = 2 * sms * V * static_cast<int64_t>(sizeof(scalar_t));
    if (want_c >= 2 || 2 * in_flight > device_attr(cudaDevAttrL2CacheSize, device)) {
      p.cluster = cluster_blocks<scalar_t>(p.cp, want_c);
      if (p.cluster > 0) {
        const int64_t per = slice_chunks(p.cp, p.cluster);
        p.threads = static_cast<int>(std::min(per, max_groups) * p.cp.threads);
        return p;
      }
    }
  }
  const int64_t want = env_int("PPO_CUDA_THREADS", 0);
  const int64_t groups = want > 0 ? std::max<int64_t>(1, want / p.cp.threads)
                                  : std::min<int64_t>(p.cp.S, max_groups);
  p.threads = static_cast<int>(std::min(groups, max_groups) * p.cp.threads);
  p.grid = B * Tl;
  const int64_t cap = env_int("PPO_CUDA_ROWS_PER_SM", 0);
  if (cap > 0) p.grid = std::min(p.grid, cap * sms);
  p.grid = std::min<int64_t>(p.grid, 0x7fffffff);
  return p;
}

// Launches cluster_rows_kernel with p.cluster blocks per row and as many clusters as the
// device holds at once (grid-stride over the rows). Returns false, launching nothing, when
// the kernel was not compiled for sm_90 or later (a build for an older GPU, its PTX
// JIT-compiled here, has an empty body) or no such cluster fits the device: the caller
// runs the fused path.
template <typename scalar_t>
bool launch_cluster(const RowPlan& p, const RowsView<scalar_t>& rv,
                    const TokenIO<acc_of<scalar_t>>& io, Temp<acc_of<scalar_t>> tp, int device,
                    cudaStream_t stream) {
  auto* kernel = cluster_rows_kernel<scalar_t>;
  const int64_t smem = slice_bytes<scalar_t>(p.cp, p.cluster);
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(p.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(static_cast<unsigned>(p.threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  // Once per (device, kernel, cluster, smem, threads): the binary's architecture, the
  // shared-memory opt-in (to the largest slice any call takes, kClusterSliceBytes, so that
  // no later call's opt-in lowers an earlier one's) and the co-resident clusters. An error
  // of the queries (an unsupported cluster shape) leaves the fused path to run.
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, int64_t, int>, int> active;
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), p.cluster,
                                   smem, p.threads);
  int n = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = active.find(key);
    if (it != active.end()) {
      n = it->second;
    } else {
      cudaFuncAttributes fa{};
      C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
      cfg.gridDim = dim3(static_cast<unsigned>(p.cluster));
      bool ok = true;
      if (fa.ptxVersion >= 90) {
        ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(kClusterSliceBytes)) == cudaSuccess &&
             cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) == cudaSuccess;
        if (!ok) {
          (void)cudaGetLastError();  // the failed query's own (not sticky) error
          n = 0;
        }
      }
      if (ok) active[key] = n;  // a failed query is asked again next call
    }
  }
  if (n <= 0) return false;
  const int64_t clusters = std::min<int64_t>(rv.B * rv.Tl, n);
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * p.cluster));
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, rv, io, tp, p.cp);
  if (err == cudaSuccess) return true;
  // A launch the device refuses for its shape (cluster or shared-memory resources: an
  // error of the call, nothing ran) falls back to the fused path, for good on this key;
  // any other error is raised.
  if (err != cudaErrorInvalidClusterSize &&
      err != cudaErrorInvalidConfiguration && err != cudaErrorLaunchOutOfResources)
    C10_CUDA_CHECK(err);
  (void)cudaGetLastError();
  std::lock_guard<std::mutex> lock(mu);
  active[key] = 0;
  return false;
}

// Runs the row pass: per-token outputs through io, and the gradient into rv.out when it is
// not null. acc_opts: tensor options of the accumulation dtype on the right device.
template <typename scalar_t>
void run_rows(const RowsView<scalar_t>& rv, const TokenIO<acc_of<scalar_t>>& io,
              Temp<acc_of<scalar_t>> tp, const at::TensorOptions& acc_opts, int device,
              cudaStream_t stream) {
  using A = acc_of<scalar_t>;
  const bool grad = rv.out != nullptr;
  const int64_t nrows = rv.B * rv.T;
  if (rv.B * rv.Tl == 0) return;
  RowPlan p = plan_rows<scalar_t>(rv.B, rv.T, rv.Tl, rv.V, grad, device);
  if (p.cluster > 0) {
    if (launch_cluster(p, rv, io, tp, device, stream)) return;
    p = plan_rows<scalar_t>(rv.B, rv.T, rv.Tl, rv.V, grad, device, false);
  }
  if (!p.split) {
    fused_rows_kernel<scalar_t>
        <<<static_cast<unsigned>(p.grid), p.threads, 0, stream>>>(rv, io, tp, p.cp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  TORCH_CHECK(rv.B * rv.Tl <= 0x7fffffff, "ppo_kernels (CUDA): too many rows for the split path");
  at::Tensor ws, info;
  if (nrows > 0) {
    static_assert(sizeof(Stats<A>) == 3 * sizeof(A), "Stats must be three packed scalars");
    ws = at::empty({nrows * p.cp.S * 3}, acc_opts);
    if (grad) info = at::empty({nrows * kInfo}, acc_opts);
    auto* wsp = reinterpret_cast<Stats<A>*>(ws.data_ptr<A>());
    partial_stats_kernel<scalar_t>
        <<<dim3(static_cast<unsigned>(nrows), static_cast<unsigned>(p.cp.S)), p.cp.threads, 0,
           stream>>>(rv, tp, p.cp, wsp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    constexpr int kCombineThreads = 256;
    constexpr int kRowsPerBlock = kCombineThreads / kWarpSize;
    combine_kernel<scalar_t>
        <<<static_cast<unsigned>(ceil_div(nrows, kRowsPerBlock)), kCombineThreads, 0, stream>>>(
            rv, io, tp, p.cp.S, wsp, grad ? info.data_ptr<A>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (grad) {
    GradSource<A> src{nrows > 0 ? info.data_ptr<A>() : nullptr, nullptr, nullptr, nullptr,
                      nullptr, nullptr};
    // With T == 0 every row is t >= T: the kernel only writes zeros and never reads src.
    grad_chunks_kernel<scalar_t>
        <<<dim3(static_cast<unsigned>(rv.B * rv.Tl), static_cast<unsigned>(p.cp.S)),
           p.cp.threads, 0, stream>>>(rv, tp, p.cp.chunk, src);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename scalar_t>
RowsView<scalar_t> make_view(const at::Tensor& logits, const RowArgs& r) {
  // (GradRow::tok holds a column in 32 bits)
  TORCH_CHECK_VALUE(r.V <= std::numeric_limits<int32_t>::max(), "logits: a vocabulary of ",
                    r.V, " entries (2^31 or more) is not supported by the CUDA kernels");
  RowsView<scalar_t> rv;
  rv.logits = logits.data_ptr<scalar_t>();
  rv.sB = r.sB;
  rv.sT = r.sT;
  rv.out = nullptr;
  rv.oB = rv.oT = 0;
  rv.tokens = r.tokens.data_ptr<int64_t>();
  rv.mask = r.mask.data_ptr<bool>();
  rv.B = r.B;
  rv.Tl = r.Tl;
  rv.T = r.T;
  rv.V = r.V;
  return rv;
}

template <typename A>
TokenIO<A> empty_io(int mode) {
  TokenIO<A> io{};
  io.mode = mode;
  io.grad_scale = A(1);
  return io;
}

}  // namespace ppo_cuda
