// CUDA distill_fwd (schema in csrc/ops.cpp; the formulas of ppo_kernels/distill.py, the
// twins csrc/cpu/distill.cpp and ppo_kernels/triton_kernels/distill.py). Unrun: written
// from the same formulas, compile-checked only (no GPU on the build machine).
//
// One block per row of [B, Tl]. Pass 1: the row max. Pass 2: D = sum_v e_v with
// e_v = exp((x_v - max) / temperature), accumulated in double (the top's e is exactly 1, so
// log_sum = log1p(D - 1) keeps the non-top mass's digits). The set is gathered with the very
// same e_j (same device function): D - sum_S e_j in double is the sum of the entries
// outside the set, the student's complement without cancellation when PS -> 1, and
// log(1 - PS) = log(D - sum_S e) - log D (exactly 0 for an empty set). Pass 3 (gradient):
// alpha p_v over the row, then, after a barrier, the set's entries from their own formula.
#include <ATen/Dispatch.h>
#include <ATen/ops/dot.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "launch.h"

namespace ppo_cuda {
namespace {

using Tensor = at::Tensor;

constexpr int kThreads = 256;

template <typename V>
__device__ V block_sum(V v, V* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  V r = V(0);
  if (threadIdx.x < 32) {
    r = threadIdx.x < (blockDim.x >> 5) ? sh[threadIdx.x] : V(0);
    for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
    if (threadIdx.x == 0) sh[0] = r;
  }
  __syncthreads();
  return sh[0];
}

template <typename V>
__device__ V block_max(V v, V* sh) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    V r = threadIdx.x < (blockDim.x >> 5) ? sh[threadIdx.x] : V(-INFINITY);
    for (int o = 16; o > 0; o >>= 1) r = fmax(r, __shfl_xor_sync(0xffffffffu, r, o));
    if (threadIdx.x == 0) sh[0] = r;
  }
  __syncthreads();
  return sh[0];
}

// e_v relative to the row max: the one expression of pass 2 and of the gather
template <typename A>
__device__ __forceinline__ A e_of(A x, A mx, A inv) {
  return ppo::ppo_exp((x - mx) * inv);
}

template <typename scalar_t, typename A>
__global__ void distill_kernel(const scalar_t* __restrict__ logits, int64_t sB, int64_t sT,
                               const bool* __restrict__ mask, const int64_t* __restrict__ off,
                               const int64_t* __restrict__ ids, const A* __restrict__ lt,
                               const A* __restrict__ w, A* __restrict__ kl_out,
                               A* __restrict__ ps_out, A* __restrict__ tt_out,
                               scalar_t* __restrict__ grad, int64_t gB, int64_t gT, int64_t T,
                               int64_t TG, int64_t V, A inv, A grad_scale, bool tail) {
  __shared__ double shd[32];
  __shared__ A sha[32];
  const int64_t row = blockIdx.x;
  const int64_t b = row / TG, t = row % TG;
  const bool in_seq = t < T;
  const int64_t idx = b * T + t;
  const bool valid = in_seq && mask[idx];
  scalar_t* g_row = grad ? grad + b * gB + t * gT : nullptr;
  if (!valid) {
    if (in_seq && threadIdx.x == 0) kl_out[idx] = ps_out[idx] = tt_out[idx] = A(0);
    if (g_row)
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) g_row[v] = scalar_t(0);
    return;
  }
  const scalar_t* x = logits + b * sB + t * sT;
  A m = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) m = fmax(m, A(x[v]));
  m = block_max<A>(m, sha);
  if (m == A(-INFINITY)) m = A(0);
  double d = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) d += double(e_of<A>(A(x[v]), m, inv));
  const double D = block_sum<double>(d, shd);
  const A log_sum = A(log1p(D - 1.0));
  const int64_t o0 = off[idx], o1 = off[idx + 1];
  double se = 0.0;
  A kl = A(0), pt_sum = A(0);
  for (int64_t a = o0 + threadIdx.x; a < o1; a += blockDim.x) {
    const int64_t j = ids[a];
    const A xj = (j >= 0 && j < V) ? A(x[j]) : A(-INFINITY);
    se += double(e_of<A>(xj, m, inv));
    const A lps = (xj - m) * inv - log_sum;
    const A pt = ppo::ppo_exp(lt[a]);
    pt_sum += pt;
    if (pt > A(0)) kl += pt * (lt[a] - lps);
  }
  const double SE = block_sum<double>(se, shd);
  kl = block_sum<A>(kl, sha);
  pt_sum = block_sum<A>(pt_sum, sha);
  const double comp = fmax(D - SE, 0.0);
  const bool whole = (o1 - o0) == V;
  A tail_t = whole ? A(0) : A(1) - pt_sum;
  if (!(tail_t > A(0))) tail_t = A(0);
  A alpha = pt_sum;
  if (tail) {
    A r = A(0);
    if (tail_t > A(0)) {
      const A diff = A(log(double(tail_t)) - (log(comp) - log(D)));
      kl += tail_t * diff;
      r = ppo::ppo_exp(diff);
    }
    alpha = A(1) - r;
  }
  if (threadIdx.x == 0) {
    kl_out[idx] = kl;
    ps_out[idx] = A(SE / D);
    tt_out[idx] = tail_t;
  }
  if (g_row) {
    const A c = w[idx] * grad_scale * inv;
    const A ca = c * alpha;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
      g_row[v] = scalar_t(ca * ppo::ppo_exp((A(x[v]) - m) * inv - log_sum));
    __syncthreads();  // the set's entries are written after the dense sweep of every thread
    for (int64_t a = o0 + threadIdx.x; a < o1; a += blockDim.x) {
      const int64_t j = ids[a];
      if (j < 0 || j >= V) continue;
      const A ps = ppo::ppo_exp((A(x[j]) - m) * inv - log_sum);
      const A pt = ppo::ppo_exp(lt[a]);
      g_row[j] = scalar_t(c * (tail ? ps - pt : alpha * ps - pt));
    }
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> distill_fwd_cuda(
    const Tensor& logits, const Tensor& mask_in, const Tensor& offsets_in, const Tensor& ids_in,
    const Tensor& lt_in, const Tensor& weights, double temperature, double grad_scale,
    bool tail, bool compute_grad) {
  check_cuda(logits);
  c10::cuda::CUDAGuard guard(logits.device());
  // distillation reads no sampled token: the mask gives T
  const RowArgs r = row_args(logits, std::nullopt, mask_in, temperature, std::nullopt);
  TORCH_CHECK(std::isfinite(grad_scale) && grad_scale > 0,
              "grad_scale: expected a finite number > 0, got ", grad_scale);
  const Tensor& mask = r.mask;
  const auto acc = r.acc;
  const auto dev = logits.device();
  const int64_t B = r.B, Tl = r.Tl, V = r.V, T = r.T;
  const Tensor offsets = offsets_in.contiguous(), ids = ids_in.contiguous();
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.numel() == B * T + 1 &&
                  offsets.device() == dev,
              "offsets: expected int64 [B * T + 1] on the logits' device");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.device() == dev,
              "token_ids: expected int64 [nnz] on the logits' device");
  const Tensor lt = per_token(lt_in, "teacher_logprobs", acc, ids.sizes(), dev);
  const Tensor w = r.per_token(weights, "weights");
  const auto acc_opts = r.acc_opts;
  Tensor kl = at::empty({B, T}, acc_opts), ps = at::empty({B, T}, acc_opts),
         tt = at::empty({B, T}, acc_opts);
  Tensor dl = compute_grad ? at::empty(logits.sizes(), logits.options())
                           : at::empty({0}, logits.options());
  const int64_t TG = compute_grad ? Tl : T;
  const int64_t rows = B * TG;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (rows > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                    "distill_fwd_cuda", [&] {
      using A = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      scalar_t* g = compute_grad ? dl.data_ptr<scalar_t>() : nullptr;
      distill_kernel<scalar_t, A><<<rows, kThreads, 0, stream>>>(
          logits.data_ptr<scalar_t>(), logits.stride(0), logits.stride(1),
          mask.data_ptr<bool>(), offsets.data_ptr<int64_t>(), ids.data_ptr<int64_t>(),
          lt.data_ptr<A>(), w.data_ptr<A>(), kl.data_ptr<A>(), ps.data_ptr<A>(),
          tt.data_ptr<A>(), g, compute_grad ? dl.stride(0) : 0, compute_grad ? dl.stride(1) : 0,
          T, TG, V, A(1.0 / temperature), A(grad_scale), tail);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  Tensor loss = at::dot(w.reshape(-1), kl.reshape(-1));
  return {loss, kl, ps, tt, dl};
}

}  // namespace
}  // namespace ppo_cuda

TORCH_LIBRARY_IMPL(ppo_kernels, CUDA, m) { m.impl("distill_fwd", &ppo_cuda::distill_fwd_cuda); }
