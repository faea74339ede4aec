// The vocabulary-row kernels shared by token_logprobs, ppo_loss and score_rollout.
//
// A "row" is one position (b, t) of logits [B, Tl, V]. Two ways to cover the rows:
//
//  fused   one block per row (grid-stride over rows). Sweep 1 reads the row once and merges
//          the online (max, sum, entropy-sum) statistics; thread 0 computes the token's
//          logprob, entropy and the per-token epilogue (loss, KL, ...) through ppo_math.h;
//          sweep 2 (only when a gradient is wanted) writes dlogits from the row while it is
//          still in L2, backwards (see grad_range). One DRAM read + one DRAM write of [N, V].
//  split   for few rows and a large V, where one block per row leaves most multiprocessors
//          idle: grid (row, chunk) blocks each write a partial statistic; a combine kernel
//          (one warp per row) merges them and runs the epilogue; a grad kernel (row, chunk)
//          writes dlogits. The second read is from L2 as long as the few rows fit there.
//
// Masked rows: the kernels read mask first and never read the token id, logits or any
// per-token input of a masked row; its outputs are 0 and its gradient row is written 0.
// Rows t >= T get a zero gradient and nothing else. A token id outside [0, V) on a valid
// row (which the Python layer rejects before launch) is not read: its logprob is NaN.
#pragma once

#include "launch.h"
#include "row_reduce.cuh"

namespace ppo_cuda {

template <typename scalar_t>
struct RowsView {
  const scalar_t* logits;
  int64_t sB, sT;  // element strides of logits over B and Tl
  scalar_t* out;          // gradient destination, or nullptr for no gradient
  int64_t oB, oT;  // element strides of out (dlogits contiguous, or logits' own in place)
  const int64_t* tokens;  // [B, T] contiguous
  const bool* mask;       // [B, T] contiguous
  int64_t B, T, Tl, V;
};

// Most threads a (row, chunk) block of the split / grad-chunk kernels is launched with.
constexpr int kChunkThreads = 256;

enum RowMode : int { kModeLogprobs = 0, kModePpo = 1, kModeScore = 2 };

// Per-token inputs and outputs of the epilogue, [B, T] contiguous, index i = b * T + t.
// A null output pointer is not written.
template <typename A>
struct TokenIO {
  int mode;
  // kModePpo
  const A* old_logp;
  const A* adv;
  const A* weights;
  const A* is_w;  // null: 1
  ppo::PolicyParams params;
  // kModePpo (when params.has_ref) and kModeScore
  const A* ref_logp;
  // kModeScore
  A kl_coef;
  int kl_estimator;
  // outputs
  A* logp;
  A* entropy;
  A* lse;
  A* loss_tok;
  A* kl;
  A* rewards;
};

template <typename A>
__device__ __forceinline__ void token_epilogue(const TokenIO<A>& io, int64_t i, A logp, A lse,
                                               A ent, A& dlogp, A& dent) {
  dlogp = A(0);
  dent = A(0);
  if (io.logp) io.logp[i] = logp;
  if (io.entropy) io.entropy[i] = ent;
  if (io.lse) io.lse[i] = lse;
  if (io.mode == kModePpo) {
    const A ref = io.params.has_ref ? io.ref_logp[i] : A(0);
    const A isw = io.is_w ? io.is_w[i] : A(1);
    const ppo::TokenLoss<A> tl =
        ppo::token_loss(logp, ent, io.old_logp[i], io.adv[i], ref, isw, io.weights[i], io.params);
    io.loss_tok[i] = tl.loss;
    dlogp = tl.dlogp;
    dent = tl.dent;
  } else if (io.mode == kModeScore) {
    const ppo::KlTerm<A> k = ppo::kl_term(logp - io.ref_logp[i], io.kl_estimator);
    io.kl[i] = k.kl;
    io.rewards[i] = -io.kl_coef * k.kl;
  }
}

template <typename A>
__device__ __forceinline__ void token_epilogue_masked(const TokenIO<A>& io, int64_t i) {
  if (io.logp) io.logp[i] = A(0);
  if (io.entropy) io.entropy[i] = A(0);
  if (io.lse) io.lse[i] = A(0);
  if (io.loss_tok) io.loss_tok[i] = A(0);
  if (io.kl) io.kl[i] = A(0);
  if (io.rewards) io.rewards[i] = A(0);
}

// ---------------------------------------------------------------- fused: one block per row

template <typename scalar_t>
__global__ void __launch_bounds__(kMaxThreads)
    fused_rows_kernel(RowsView<scalar_t> rv, TokenIO<acc_of<scalar_t>> io, acc_of<scalar_t> inv_temp) {
  using A = acc_of<scalar_t>;
  __shared__ Stats<A> red[33];
  __shared__ A bcast[5];
  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
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
    const int64_t tok = rv.tokens[i];
    const bool tok_ok = tok >= 0 && tok < rv.V;
    A xtok = A(0);
    if (tid == 0 && tok_ok) xtok = static_cast<A>(row[tok]);  // in flight early
    Stats<A> st = range_stats(row, 0, rv.V, inv_temp, tid, nthr);
    st = block_merge(st, red, inv_temp);
    if (tid == 0) {
      A dlogp, dent;
      const RowStats<A> rs = stats_finish(st, inv_temp);
      const A logp = tok_ok ? token_logp(rs, xtok, inv_temp) : quiet_nan<A>();
      token_epilogue(io, i, logp, rs.lse, rs.entropy, dlogp, dent);
      bcast[0] = rs.xmax;
      bcast[1] = rs.log_s;
      bcast[2] = rs.entropy;
      bcast[3] = dlogp;
      bcast[4] = dent;
    }
    __syncthreads();
    const A xmax = bcast[0], log_s = bcast[1], ent = bcast[2], dlogp = bcast[3],
            dent = bcast[4];
    // No barrier needed before the next row: bcast is rewritten only after the next
    // row's block_merge barriers, which every thread reaches after reading it here.
    if (orow) {
      if (dlogp == A(0) && dent == A(0)) {  // e.g. a clipped token: no need to read again
        zero_range(orow, 0, rv.V, tid, nthr);
      } else {
        grad_range(row, orow, 0, rv.V, tok, xmax, log_s, ent, dlogp, dent, inv_temp, tid,
                   nthr);
      }
    }
  }
}

// ---------------------------------------------------------------- split vocabulary

// grid (B * T, S): the partial statistics of chunk blockIdx.y of row blockIdx.x.
template <typename scalar_t>
__global__ void __launch_bounds__(kChunkThreads)
    partial_stats_kernel(RowsView<scalar_t> rv, acc_of<scalar_t> inv_temp, int64_t chunk,
                         Stats<acc_of<scalar_t>>* ws) {
  using A = acc_of<scalar_t>;
  __shared__ Stats<A> red[33];
  const int64_t i = blockIdx.x;
  if (!rv.mask[i]) return;  // combine never reads a masked row's partials
  const int64_t b = i / rv.T;
  const int64_t t = i - b * rv.T;
  const scalar_t* row = rv.logits + b * rv.sB + t * rv.sT;
  const int64_t c = blockIdx.y;
  const int64_t begin = c * chunk;
  const int64_t end = min(rv.V, begin + chunk);
  Stats<A> st = range_stats(row, begin, end, inv_temp, threadIdx.x, blockDim.x);
  st = block_merge(st, red, inv_temp);
  if (threadIdx.x == 0) ws[i * gridDim.y + c] = st;
}

// Per-row values the combine kernel leaves for the grad kernel: info[i * kInfo + ...].
enum InfoSlot : int { kInfoXmax = 0, kInfoLogS, kInfoEnt, kInfoDlogp, kInfoDent, kInfo };

// One warp per row: merge the S partials, run the epilogue, leave (xmax, log s, H, dlogp,
// dent) in info[i * kInfo ..] for the grad kernel (when info is not null).
template <typename scalar_t>
__global__ void combine_kernel(RowsView<scalar_t> rv, TokenIO<acc_of<scalar_t>> io, acc_of<scalar_t> inv_temp,
                               int64_t S, const Stats<acc_of<scalar_t>>* ws, acc_of<scalar_t>* info) {
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
  Stats<A> st = stats_empty<A>();
  for (int64_t c = lane; c < S; c += kWarpSize) stats_merge(st, ws[i * S + c], inv_temp);
  st = warp_merge(st, inv_temp);
  if (lane == 0) {
    const int64_t b = i / rv.T;
    const int64_t t = i - b * rv.T;
    const int64_t tok = rv.tokens[i];
    const bool tok_ok = tok >= 0 && tok < rv.V;
    const A xtok = tok_ok ? static_cast<A>(rv.logits[b * rv.sB + t * rv.sT + tok]) : A(0);
    A dlogp, dent;
    const RowStats<A> rs = stats_finish(st, inv_temp);
    const A logp = tok_ok ? token_logp(rs, xtok, inv_temp) : quiet_nan<A>();
    token_epilogue(io, i, logp, rs.lse, rs.entropy, dlogp, dent);
    if (info) {
      info[i * kInfo + kInfoXmax] = rs.xmax;
      info[i * kInfo + kInfoLogS] = rs.log_s;
      info[i * kInfo + kInfoEnt] = rs.entropy;
      info[i * kInfo + kInfoDlogp] = dlogp;
      info[i * kInfo + kInfoDent] = dent;
    }
  }
}

// Where the grad kernel finds a row's (xmax, log s, H, dlogp, dent): the combine kernel's
// info, or (token_logprobs_bwd) the saved lse / entropy and the incoming gradients; from
// the lse alone it takes xmax = 0, log s = lse (logp_v = x_v * inv_temp - lse).
template <typename A>
struct GradSource {
  const A* info;     // [B * T, kInfo], or null: use the arrays below
  const A* lse;      // [B, T]
  const A* entropy;  // [B, T]; may be null when gent is null
  const A* glp;      // [B, T] d loss / d logprob
  const A* gent;     // [B, T] d loss / d entropy, or null
};

// grid (B * Tl, S): the gradient of chunk blockIdx.y of row blockIdx.x.
template <typename scalar_t>
__global__ void __launch_bounds__(kChunkThreads)
    grad_chunks_kernel(RowsView<scalar_t> rv, acc_of<scalar_t> inv_temp, int64_t chunk,
                       GradSource<acc_of<scalar_t>> src) {
  using A = acc_of<scalar_t>;
  const int64_t r = blockIdx.x;
  const int64_t b = r / rv.Tl;
  const int64_t t = r - b * rv.Tl;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t end = min(rv.V, begin + chunk);
  scalar_t* orow = rv.out + b * rv.oB + t * rv.oT;
  const int tid = threadIdx.x, nthr = blockDim.x;
  if (t >= rv.T) {
    zero_range(orow, begin, end, tid, nthr);
    return;
  }
  const int64_t i = b * rv.T + t;
  if (!rv.mask[i]) {
    zero_range(orow, begin, end, tid, nthr);
    return;
  }
  A xmax, log_s, ent, dlogp, dent;
  if (src.info) {
    xmax = src.info[i * kInfo + kInfoXmax];
    log_s = src.info[i * kInfo + kInfoLogS];
    ent = src.info[i * kInfo + kInfoEnt];
    dlogp = src.info[i * kInfo + kInfoDlogp];
    dent = src.info[i * kInfo + kInfoDent];
  } else {
    xmax = A(0);
    log_s = src.lse[i];
    dlogp = src.glp[i];
    dent = src.gent ? src.gent[i] : A(0);
    ent = (src.gent && src.entropy) ? src.entropy[i] : A(0);
  }
  if (dlogp == A(0) && dent == A(0)) {
    zero_range(orow, begin, end, tid, nthr);
    return;
  }
  const int64_t tok = rv.tokens[i];  // out of range: matches no entry (no read by token id)
  const scalar_t* row = rv.logits + b * rv.sB + t * rv.sT;
  grad_range(row, orow, begin, end, tok, xmax, log_s, ent, dlogp, dent, inv_temp, tid, nthr);
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
  int64_t S = 1;      // chunks per row (split)
  int64_t chunk = 0;  // elements per chunk (split)
  int threads = 32;
  int64_t grid = 0;  // fused grid
};

template <typename scalar_t>
RowPlan plan_rows(int64_t B, int64_t Tn, int64_t Tl, int64_t V, bool grad, int device) {
  constexpr int64_t N = Pack<scalar_t>::N;
  RowPlan p;
  const int64_t sms = sm_count(device);
  const int64_t nrows = B * Tn;
  const int64_t forced = env_int("PPO_CUDA_SPLIT", 0);
  int64_t S = 1;
  if (forced > 1) {
    S = forced;
  } else if (forced == 0 && nrows > 0 && V >= 8192) {
    // With a gradient the grad kernel re-reads the rows: split only while they are so few
    // that they (mostly) stay in L2. Without one there is no re-read.
    const int64_t limit = grad ? sms : 2 * sms;
    if (nrows <= limit) S = std::min(ceil_div(4 * sms, nrows), ceil_div(V, 2048));
  }
  if (S >= 2) {
    int64_t chunk = ceil_div(ceil_div(V, S), N) * N;
    chunk = std::max(chunk, ceil_div(ceil_div(V, int64_t(65535)), N) * N);  // gridDim.y
    p.split = true;
    p.chunk = chunk;
    p.S = ceil_div(V, chunk);
    p.threads = threads_for(ceil_div(chunk, N), kChunkThreads);
    return p;
  }
  const int64_t forced_threads = env_int("PPO_CUDA_THREADS", 0);
  p.threads = forced_threads >= 32 && forced_threads <= kMaxThreads
                  ? static_cast<int>(forced_threads / 32 * 32)
                  : threads_for(ceil_div(V, N), kMaxThreads);
  p.grid = B * Tl;
  const int64_t cap = env_int("PPO_CUDA_ROWS_PER_SM", 0);
  if (cap > 0) p.grid = std::min(p.grid, cap * sms);
  p.grid = std::min<int64_t>(p.grid, 0x7fffffff);
  return p;
}

// Runs the row pass: per-token outputs through io, and the gradient into rv.out when it is
// not null. acc_opts: tensor options of the accumulation dtype on the right device.
template <typename scalar_t>
void run_rows(const RowsView<scalar_t>& rv, const TokenIO<acc_of<scalar_t>>& io, acc_of<scalar_t> inv_temp,
              const at::TensorOptions& acc_opts, int device, cudaStream_t stream) {
  using A = acc_of<scalar_t>;
  const bool grad = rv.out != nullptr;
  const int64_t nrows = rv.B * rv.T;
  if (rv.B * rv.Tl == 0) return;
  const RowPlan p = plan_rows<scalar_t>(rv.B, rv.T, rv.Tl, rv.V, grad, device);
  if (!p.split) {
    fused_rows_kernel<scalar_t><<<static_cast<unsigned>(p.grid), p.threads, 0, stream>>>(rv, io,
                                                                                  inv_temp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  TORCH_CHECK(p.S <= 65535, "ppo_kernels (CUDA): internal: too many vocabulary chunks");
  at::Tensor ws, info;
  if (nrows > 0) {
    static_assert(sizeof(Stats<A>) == 3 * sizeof(A), "Stats must be three packed scalars");
    ws = at::empty({nrows * p.S * 3}, acc_opts);
    if (grad) info = at::empty({nrows * kInfo}, acc_opts);
    auto* wsp = reinterpret_cast<Stats<A>*>(ws.data_ptr<A>());
    partial_stats_kernel<scalar_t><<<dim3(static_cast<unsigned>(nrows), static_cast<unsigned>(p.S)),
                              p.threads, 0, stream>>>(rv, inv_temp, p.chunk, wsp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    constexpr int kCombineThreads = 256;
    constexpr int kRowsPerBlock = kCombineThreads / kWarpSize;
    combine_kernel<scalar_t><<<static_cast<unsigned>(ceil_div(nrows, kRowsPerBlock)), kCombineThreads,
                        0, stream>>>(rv, io, inv_temp, p.S, wsp,
                                     grad ? info.data_ptr<A>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (grad) {
    GradSource<A> src{nrows > 0 ? info.data_ptr<A>() : nullptr, nullptr, nullptr, nullptr,
                      nullptr};
    // With T == 0 every row is t >= T: the kernel only writes zeros and never reads src.
    grad_chunks_kernel<scalar_t><<<dim3(static_cast<unsigned>(rv.B * rv.Tl),
                                 static_cast<unsigned>(p.S)),
                            p.threads, 0, stream>>>(rv, inv_temp, p.chunk, src);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename scalar_t>
RowsView<scalar_t> make_view(const at::Tensor& logits, const at::Tensor& tokens,
                      const at::Tensor& mask) {
  RowsView<scalar_t> rv;
  rv.logits = logits.data_ptr<scalar_t>();
  rv.sB = logits.stride(0);
  rv.sT = logits.stride(1);
  rv.out = nullptr;
  rv.oB = rv.oT = 0;
  rv.tokens = tokens.data_ptr<int64_t>();
  rv.mask = mask.data_ptr<bool>();
  rv.B = logits.size(0);
  rv.Tl = logits.size(1);
  rv.T = tokens.size(1);
  rv.V = logits.size(2);
  return rv;
}

template <typename A>
TokenIO<A> empty_io(int mode) {
  TokenIO<A> io{};
  io.mode = mode;
  return io;
}

}  // namespace ppo_cuda
