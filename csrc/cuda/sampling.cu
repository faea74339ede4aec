// CUDA sampling replay (docs/SAMPLING.md; schemas in csrc/ops.cpp): the same formulas as
// csrc/cpu/sampling.cpp. UNRUN: written and compile-checked without a GPU.
//
// kept_logprobs_fwd / kept_logprobs_bwd_: one block per row; the kept set is the row's CSR
// ids (kept_ids[kept_offsets[r] .. kept_offsets[r + 1])) or the entries x_j >= threshold[r];
// the sampled token is always in it. Two block reductions per row in the forward (the kept
// max; then the non-top mass, the ties, sum e d, the count and whether the token was seen),
// one sweep in the backward adding the kept part into dlogits, or writing the row whole
// (kept_logprobs_bwd; ids unique per row, so no atomics). sampling_threshold: for bfloat16
// / float16 logits one block per row, an exact count histogram of the row's 16-bit values
// in shared memory (threshold_select.cuh); for float32 / float64 logits, or a device with
// less than its 153 KiB of shared memory a block, ATen ops on chunks of rows (a sort per
// chunk); both the rules of the CPU kernel (vLLM v1's sampler as value thresholds). The
// optional per-row `temperatures` [B, T] (csrc/ops.cpp): row r uses 1 / temperatures[r],
// taken in double and rounded once to the accumulation dtype (invt below; the scalar's 1 /
// temperature too).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <set>
#include <utility>

#include "launch.h"
#include "threshold_select.cuh"

namespace ppo_cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ T block_sum(T v, T* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  const T out = sh[0];
  __syncthreads();
  return out;
}

template <typename T>
__device__ T block_max(T v, T* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] = sh[threadIdx.x] > sh[threadIdx.x + s]
                                               ? sh[threadIdx.x] : sh[threadIdx.x + s];
    __syncthreads();
  }
  const T out = sh[0];
  __syncthreads();
  return out;
}

struct KeptRow {
  const int64_t* ids;  // CSR ids (nullptr: threshold)
  int64_t start, end;  // CSR range
  double thr;          // threshold (raw logit units)
  int64_t V;
  bool csr;
  __device__ int64_t count() const { return csr ? end - start : V; }
  // the column of slot k and whether it is in the set
  template <typename scalar_t>
  __device__ bool at(const scalar_t* x, int64_t k, int64_t* col) const {
    if (csr) {
      *col = ids[start + k];
      return true;
    }
    *col = k;
    return static_cast<double>(x[k]) >= thr;
  }
};

__device__ KeptRow kept_row(const int64_t* ids, const int64_t* offs, const double* thr,
                            bool csr, int64_t row, int64_t V) {
  KeptRow k;
  k.csr = csr;
  k.ids = ids;
  k.V = V;
  k.start = csr ? offs[row] : 0;
  k.end = csr ? offs[row + 1] : 0;
  k.thr = csr ? 0.0 : thr[row];
  return k;
}

template <typename scalar_t, typename A>
__global__ void kept_fwd_kernel(const scalar_t* __restrict__ logits, int64_t sB, int64_t sT,
                                const int64_t* __restrict__ tokens,
                                const bool* __restrict__ mask, const int64_t* ids,
                                const int64_t* offs, const double* thr, bool csr, int64_t T,
                                int64_t V, A inv_s, const A* __restrict__ invt, A* logp,
                                A* ent, A* kmax, A* kls, int64_t* size, bool* missing) {
  __shared__ A sh[kThreads];
  const int64_t row = blockIdx.x;
  const A inv = invt ? invt[row] : inv_s;
  if (!mask[row]) {
    if (threadIdx.x == 0) {
      logp[row] = ent[row] = kmax[row] = kls[row] = A(0);
      size[row] = 0;
      missing[row] = false;
    }
    return;
  }
  const scalar_t* x = logits + (row / T) * sB + (row % T) * sT;
  const int64_t y = tokens[row];
  const A x_y = static_cast<A>(x[y]);
  const KeptRow kr = kept_row(ids, offs, thr, csr, row, V);
  const int64_t n = kr.count();
  A top = -std::numeric_limits<A>::infinity(), seen = A(0), cnt = A(0);
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    int64_t j;
    if (!kr.at(x, k, &j)) continue;
    const A v = static_cast<A>(x[j]);
    top = v > top ? v : top;
    cnt += A(1);
    if (j == y) seen += A(1);
  }
  top = block_max(top, sh);
  seen = block_sum(seen, sh);
  cnt = block_sum(cnt, sh);
  const bool miss = seen == A(0);
  if (miss) top = x_y > top ? x_y : top;
  A rest = A(0), ties = A(0), sd = A(0);
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    int64_t j;
    if (!kr.at(x, k, &j)) continue;
    const A d = (static_cast<A>(x[j]) - top) * inv;
    const A e = exp(d);
    if (d == A(0)) ties += A(1); else rest += e;
    if (e > A(0)) sd += e * d;  // (a -inf entry: 0, not NaN)
  }
  rest = block_sum(rest, sh);
  ties = block_sum(ties, sh);
  sd = block_sum(sd, sh);
  if (threadIdx.x == 0) {
    if (miss) {
      const A d = (x_y - top) * inv;
      if (d == A(0)) ties += A(1); else rest += exp(d);
      if (exp(d) > A(0)) sd += exp(d) * d;
      cnt += A(1);
    }
    rest += ties > A(1) ? ties - A(1) : A(0);
    const A ls = log1p(rest);
    logp[row] = (x_y - top) * inv - ls;
    ent[row] = ls - sd / (A(1) + rest);
    kmax[row] = top;
    kls[row] = ls;
    size[row] = static_cast<int64_t>(cnt);
    missing[row] = miss;
  }
}

// WRITE: the row is written whole, 0 off the kept set (kept_logprobs_bwd: no zero fill
// and no read of dlogits first); else the kept part is added into it (kept_logprobs_bwd_).
template <typename scalar_t, typename A, bool WRITE>
__global__ void kept_bwd_kernel(const scalar_t* __restrict__ logits, int64_t sB, int64_t sT,
                                const int64_t* __restrict__ tokens,
                                const bool* __restrict__ mask, const int64_t* ids,
                                const int64_t* offs, const double* thr, bool csr, int64_t T,
                                int64_t Tl, int64_t V, A inv_s, const A* __restrict__ invt,
                                const A* kmax, const A* kls, const A* ent, const A* glogp,
                                const A* gent, scalar_t* __restrict__ out) {
  __shared__ A sh[kThreads];
  const int64_t row = blockIdx.x;
  scalar_t* o = out + ((row / T) * Tl + (row % T)) * V;
  const A inv = invt ? invt[row] : inv_s;
  const A g = glogp[row], gh = gent ? gent[row] : A(0), h = gent ? ent[row] : A(0);
  if (!mask[row] || (g == A(0) && gh == A(0))) {
    if (WRITE)
      for (int64_t k = threadIdx.x; k < V; k += blockDim.x) o[k] = scalar_t(0);
    return;
  }
  const scalar_t* x = logits + (row / T) * sB + (row % T) * sT;
  const int64_t y = tokens[row];
  const A top = kmax[row], ls = kls[row];
  const KeptRow kr = kept_row(ids, offs, thr, csr, row, V);
  const int64_t n = kr.count();
  if (WRITE && csr) {  // the kept ids are written over the zeros
    for (int64_t k = threadIdx.x; k < V; k += blockDim.x) o[k] = scalar_t(0);
    __syncthreads();
  }
  A seen = A(0);
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    int64_t j;
    if (!kr.at(x, k, &j)) {
      if (WRITE) o[j] = scalar_t(0);  // (a threshold row's entry off the set)
      continue;
    }
    const A lp = (static_cast<A>(x[j]) - top) * inv - ls;
    const A p = exp(lp);
    A dz = j == y ? -g * expm1(lp) : -g * p;
    if (p > A(0)) dz -= gh * p * (lp + h);
    o[j] = static_cast<scalar_t>((WRITE ? A(0) : static_cast<A>(o[j])) + dz * inv);
    if (j == y) seen += A(1);
  }
  seen = block_sum(seen, sh);  // (its barriers order the sweep's writes before the token's)
  if (threadIdx.x == 0 && seen == A(0)) {  // the token, added to a set that lacked it
    const A lp = (static_cast<A>(x[y]) - top) * inv - ls;
    const A p = exp(lp);
    const A dz = -g * expm1(lp) - gh * p * (lp + h);
    o[y] = static_cast<scalar_t>((WRITE ? A(0) : static_cast<A>(o[y])) + dz * inv);
  }
}

struct KeptArgs {
  bool csr;
  at::Tensor ids, offs, thr;
};

KeptArgs kept_args(const at::Tensor& logits, const std::optional<at::Tensor>& kept_ids,
                   const std::optional<at::Tensor>& kept_offsets,
                   const std::optional<at::Tensor>& threshold, int64_t N) {
  TORCH_CHECK(kept_ids.has_value() == kept_offsets.has_value(),
              "kept_ids / kept_offsets: give both or neither");
  TORCH_CHECK(kept_ids.has_value() != threshold.has_value(),
              "sampling mask: give exactly one of (kept_ids, kept_offsets) and threshold");
  KeptArgs a;
  a.csr = kept_ids.has_value();
  auto dummy_l = at::zeros({1}, logits.options().dtype(at::kLong));
  if (a.csr) {
    a.ids = kept_ids->numel() ? kept_ids->contiguous() : dummy_l;
    a.offs = kept_offsets->contiguous();
    TORCH_CHECK(a.offs.numel() == N + 1 && a.offs.scalar_type() == at::kLong,
                "kept_offsets: expected int64 [N + 1]");
    a.thr = at::zeros({1}, logits.options().dtype(at::kDouble));
  } else {
    a.ids = a.offs = dummy_l;
    a.thr = threshold->contiguous();
    TORCH_CHECK(a.thr.numel() == N && a.thr.scalar_type() == at::kDouble,
                "threshold: expected float64 [B, T]");
  }
  return a;
}

// The per-row 1 / temperature of ACC (rounded once from double), or an undefined tensor
// without `temperatures` (the scalar applies). A bad value on a valid row is the Python
// layer's to reject (ppo_kernels/_checks.py temperature_values: no host read here).
at::Tensor inv_temperatures(const RowArgs& r) {
  if (!r.temperatures.has_value()) return at::Tensor();
  return r.temperatures->to(at::kDouble).reciprocal().to(r.acc).contiguous();
}

// The kept statistics' outputs: logp, H, kept max, kept log-sum ([B, T], the accumulation
// dtype), kept size (int64), missing (bool).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
kept_outputs(const RowArgs& r) {
  const auto opts = r.acc_opts;
  auto acc = [&] { return at::empty({r.B, r.T}, opts); };
  return {acc(), acc(), acc(), acc(), at::empty({r.B, r.T}, opts.dtype(at::kLong)),
          at::empty({r.B, r.T}, opts.dtype(at::kBool))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
kept_logprobs_fwd_cuda(const at::Tensor& logits, const at::Tensor& tokens,
                       const at::Tensor& mask, double temperature,
                       const std::optional<at::Tensor>& kept_ids,
                       const std::optional<at::Tensor>& kept_offsets,
                       const std::optional<at::Tensor>& threshold,
                       const std::optional<at::Tensor>& temperatures) {
  check_cuda(logits);
  c10::cuda::CUDAGuard guard(logits.device());
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  const int64_t B = r.B, T = r.T, V = r.V;
  auto [lp, en, mx, ls, size, miss] = kept_outputs(r);
  if (B * T == 0) return {lp, en, mx, ls, size, miss};
  const KeptArgs a = kept_args(logits, kept_ids, kept_offsets, threshold, B * T);
  const at::Tensor invt = inv_temperatures(r);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "kept_logprobs_fwd_cuda", [&] {
    using A = acc_of<scalar_t>;
    kept_fwd_kernel<scalar_t, A><<<B * T, kThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), logits.stride(0), logits.stride(1),
        r.tokens.data_ptr<int64_t>(), r.mask.data_ptr<bool>(), a.ids.data_ptr<int64_t>(),
        a.offs.data_ptr<int64_t>(), a.thr.data_ptr<double>(), a.csr, T, V,
        static_cast<A>(1.0 / temperature), invt.defined() ? invt.data_ptr<A>() : nullptr,
        lp.data_ptr<A>(), en.data_ptr<A>(),
        mx.data_ptr<A>(), ls.data_ptr<A>(), size.data_ptr<int64_t>(), miss.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {lp, en, mx, ls, size, miss};
}

// The kept part of the gradient into dlogits: added (kept_logprobs_bwd_) or, with WRITE,
// written whole (kept_logprobs_bwd; the rows T..Tl-1 zeroed here).
template <bool WRITE>
void kept_grad_cuda(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
                    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& mask,
                    const at::Tensor& kept_max, const at::Tensor& kept_log_sum,
                    const at::Tensor& entropy, double temperature,
                    const std::optional<at::Tensor>& kept_ids,
                    const std::optional<at::Tensor>& kept_offsets,
                    const std::optional<at::Tensor>& threshold, at::Tensor& dlogits,
                    const std::optional<at::Tensor>& temperatures) {
  check_cuda(logits);
  c10::cuda::CUDAGuard guard(logits.device());
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  TORCH_CHECK(dlogits.sizes() == logits.sizes() && dlogits.is_contiguous() &&
                  dlogits.scalar_type() == logits.scalar_type(),
              "dlogits: expected a contiguous tensor of the logits' shape and dtype");
  const int64_t B = r.B, T = r.T, Tl = r.Tl, V = r.V;
  if (WRITE && Tl > T) dlogits.narrow(1, T, Tl - T).zero_();
  if (B * T == 0) return;
  const at::Tensor gl = r.per_token(grad_logprobs, "grad_logprobs");
  const at::Tensor mx = r.per_token(kept_max, "kept_max");
  const at::Tensor ls = r.per_token(kept_log_sum, "kept_log_sum");
  const bool has_ge = grad_entropy.has_value();
  const at::Tensor ge = has_ge ? r.per_token(*grad_entropy, "grad_entropy") : gl;
  const at::Tensor en = has_ge ? r.per_token(entropy, "entropy") : gl;
  const KeptArgs a = kept_args(logits, kept_ids, kept_offsets, threshold, B * T);
  const at::Tensor invt = inv_temperatures(r);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(),
                                  "kept_logprobs_bwd_cuda", [&] {
    using A = acc_of<scalar_t>;
    kept_bwd_kernel<scalar_t, A, WRITE><<<B * T, kThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), logits.stride(0), logits.stride(1),
        r.tokens.data_ptr<int64_t>(), r.mask.data_ptr<bool>(), a.ids.data_ptr<int64_t>(),
        a.offs.data_ptr<int64_t>(), a.thr.data_ptr<double>(), a.csr, T, Tl, V,
        static_cast<A>(1.0 / temperature), invt.defined() ? invt.data_ptr<A>() : nullptr,
        mx.data_ptr<A>(), ls.data_ptr<A>(),
        en.data_ptr<A>(), gl.data_ptr<A>(), has_ge ? ge.data_ptr<A>() : nullptr,
        dlogits.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void kept_logprobs_bwd_cuda_(const at::Tensor& grad_logprobs,
                             const std::optional<at::Tensor>& grad_entropy,
                             const at::Tensor& logits, const at::Tensor& tokens,
                             const at::Tensor& mask, const at::Tensor& kept_max,
                             const at::Tensor& kept_log_sum, const at::Tensor& entropy,
                             double temperature, const std::optional<at::Tensor>& kept_ids,
                             const std::optional<at::Tensor>& kept_offsets,
                             const std::optional<at::Tensor>& threshold, at::Tensor& dlogits,
                             const std::optional<at::Tensor>& temperatures) {
  kept_grad_cuda<false>(grad_logprobs, grad_entropy, logits, tokens, mask, kept_max,
                        kept_log_sum, entropy, temperature, kept_ids, kept_offsets, threshold,
                        dlogits, temperatures);
}

at::Tensor kept_logprobs_bwd_cuda(const at::Tensor& grad_logprobs,
                                  const std::optional<at::Tensor>& grad_entropy,
                                  const at::Tensor& logits, const at::Tensor& tokens,
                                  const at::Tensor& mask, const at::Tensor& kept_max,
                                  const at::Tensor& kept_log_sum, const at::Tensor& entropy,
                                  double temperature, const std::optional<at::Tensor>& kept_ids,
                                  const std::optional<at::Tensor>& kept_offsets,
                                  const std::optional<at::Tensor>& threshold,
                                  const std::optional<at::Tensor>& temperatures) {
  at::Tensor out = at::empty(logits.sizes(), logits.options().memory_format(
                                                 at::MemoryFormat::Contiguous));
  kept_grad_cuda<true>(grad_logprobs, grad_entropy, logits, tokens, mask, kept_max,
                       kept_log_sum, entropy, temperature, kept_ids, kept_offsets, threshold,
                       out, temperatures);
  return out;
}

// The per-row threshold with ATen ops on chunks of rows (docs/SAMPLING.md's rules; the
// twin of ppo_kernels/sampling.py threshold_torch).
// temps: the rows' per-row temperature (float64 [C]) or undefined (the scalar).
at::Tensor threshold_rows(const at::Tensor& x, const at::Tensor& m, double temperature,
                          const at::Tensor& temps, const std::optional<at::Tensor>& top_k,
                          const std::optional<at::Tensor>& top_p,
                          const std::optional<at::Tensor>& min_p) {
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t V = x.size(1);
  const at::Tensor xs = std::get<0>(at::where(m.unsqueeze(1), x, 0.0).sort(1, true));
  const at::Tensor d = temps.defined() ? (xs - xs.narrow(1, 0, 1)) / temps.unsqueeze(1)
                                       : (xs - xs.narrow(1, 0, 1)) / temperature;
  at::Tensor keep = at::ones_like(xs, xs.options().dtype(at::kBool));
  if (min_p.has_value()) keep = keep & (d >= at::log(*min_p).unsqueeze(1));
  if (top_k.has_value()) {
    const at::Tensor kth = xs.gather(1, (top_k->clamp(1, V) - 1).unsqueeze(1));
    keep = keep & (xs >= kth);
  }
  if (top_p.has_value()) {
    const at::Tensor e = at::where(keep, at::exp(d), 0.0);
    const at::Tensor z = e.sum(1, true);
    const at::Tensor excl = e.cumsum(1) - e;
    const at::Tensor neg = (-xs).contiguous();
    const at::Tensor first = at::searchsorted(neg, neg, false, false);
    const at::Tensor above = excl.gather(1, first);
    const at::Tensor p = top_p->unsqueeze(1);
    keep = keep & ((above < p * z) | (p >= 1.0));
  }
  at::Tensor thr = std::get<0>(at::where(keep, xs, inf).min(1));
  thr = at::where(keep.all(1), -inf, thr);
  return at::where(m, thr, -inf);
}

// One block per row of 16-bit logits: select::row_threshold (threshold_select.cuh). The
// per-row parameters are optional [N] arrays (top_k int64, V = off; top_p float64, 1 = off;
// min_p float64, 0 = off); temps the rows' temperatures in the accumulation dtype (float).
template <class Fmt>
__global__ void __launch_bounds__(select::kThreads)
threshold_select_kernel(const uint16_t* __restrict__ logits, int64_t sB, int64_t sT,
                        int64_t T, int64_t V, const bool* __restrict__ mask,
                        double inv_s, const float* __restrict__ temps,
                        const int64_t* __restrict__ K, const double* __restrict__ P,
                        const double* __restrict__ MP, double* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  select::Smem& s = *reinterpret_cast<select::Smem*>(smem_raw);
  const int64_t row = blockIdx.x;
  if (!mask[row]) {
    if (threadIdx.x == 0) out[row] = -std::numeric_limits<double>::infinity();
    return;
  }
  const double inv = temps ? 1.0 / static_cast<double>(temps[row]) : inv_s;
  select::DeviceBlock blk;
  const double t = select::row_threshold<Fmt>(blk, s, logits + (row / T) * sB + (row % T) * sT,
                                              V, inv, K ? K[row] : 0, P ? P[row] : 1.0,
                                              MP ? MP[row] : 0.0);
  if (threadIdx.x == 0) out[row] = t;
}

// threshold_select_kernel, then the row's kept statistics on that threshold in the same
// block, written as kept_fwd_kernel writes them (select::kept_stats: from the histogram's
// bins where they hold the kept set, the top-p rows and cuts among the non-negatives, with
// no further read of the row; else the row read again while much of it is still in L2,
// with the max from the histogram's sweep).
template <class Fmt>
__global__ void __launch_bounds__(select::kThreads)
threshold_kept_kernel(const uint16_t* __restrict__ logits, int64_t sB, int64_t sT, int64_t T,
                      int64_t V, const int64_t* __restrict__ tokens,
                      const bool* __restrict__ mask, double inv_s,
                      const float* __restrict__ temps, const int64_t* __restrict__ K,
                      const double* __restrict__ P, const double* __restrict__ MP,
                      double* __restrict__ thr, float* logp, float* ent, float* kmax,
                      float* kls, int64_t* size, bool* missing) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  select::Smem& s = *reinterpret_cast<select::Smem*>(smem_raw);
  const int64_t row = blockIdx.x;
  if (!mask[row]) {
    if (threadIdx.x == 0) {
      thr[row] = -std::numeric_limits<double>::infinity();
      logp[row] = ent[row] = kmax[row] = kls[row] = 0.0f;
      size[row] = 0;
      missing[row] = false;
    }
    return;
  }
  const double inv = temps ? 1.0 / static_cast<double>(temps[row]) : inv_s;
  const uint16_t* x = logits + (row / T) * sB + (row % T) * sT;
  select::DeviceBlock blk;
  double mx = std::numeric_limits<double>::quiet_NaN();
  select::Resident res;
  const double t = select::row_threshold<Fmt>(blk, s, x, V, inv, K ? K[row] : 0,
                                              P ? P[row] : 1.0, MP ? MP[row] : 0.0, &mx, &res);
  const uint16_t yb = x[tokens[row]];
  const select::KeptRowStats k = select::kept_stats<Fmt>(blk, s, x, V, t, mx, inv, yb, res);
  if (threadIdx.x == 0) {
    const double ls = log1p(k.rest);
    thr[row] = t;
    logp[row] = static_cast<float>((k.xy - k.top) * inv - ls);
    ent[row] = static_cast<float>(ls - k.sd / (1.0 + k.rest));
    kmax[row] = static_cast<float>(k.top);
    kls[row] = static_cast<float>(ls);
    size[row] = k.size;
    missing[row] = k.missing;
  }
}

// Whether the device gives a block select::Smem (opt-in shared memory: 227 KiB on Hopper,
// 163 KiB on the A100, 99 KiB on Ada), for bfloat16 / float16 logits.
bool threshold_select_fits(const at::Tensor& logits) {
  const auto st = logits.scalar_type();
  if (st != at::kBFloat16 && st != at::kHalf) return false;
  if (logits.size(2) >= (int64_t(1) << 31)) return false;  // counts are uint32
  return static_cast<size_t>(device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                         logits.get_device())) >= sizeof(select::Smem);
}

// A kernel's shared-memory opt-in for select::Smem, once per kernel and device (the
// attribute belongs to the kernel, on the current device).
void opt_in_smem(const void* kernel, int device) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mu);
  if (done.insert({kernel, device}).second)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(sizeof(select::Smem))));
}

// The per-row rules as flat [N] tensors on the logits' device (undefined: off).
struct RuleArgs {
  at::Tensor K, P, MP;
  RuleArgs(const at::Tensor& logits, int64_t N, const std::optional<at::Tensor>& top_k,
           const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p) {
    auto flat = [&](const std::optional<at::Tensor>& p, at::ScalarType dt, const char* name) {
      if (!p.has_value()) return at::Tensor();
      TORCH_CHECK(p->scalar_type() == dt && p->numel() == N && p->device() == logits.device(),
                  name, ": expected ", dt, " [B, T] on ", logits.device());
      return p->reshape({N}).contiguous();
    };
    K = flat(top_k, at::kLong, "top_k");
    P = flat(top_p, at::kDouble, "top_p");
    MP = flat(min_p, at::kDouble, "min_p");
  }
  const int64_t* k() const { return K.defined() ? K.data_ptr<int64_t>() : nullptr; }
  const double* p() const { return P.defined() ? P.data_ptr<double>() : nullptr; }
  const double* mp() const { return MP.defined() ? MP.data_ptr<double>() : nullptr; }
};

template <class Fmt>
void launch_threshold_select(const at::Tensor& logits, const RowArgs& r, double temperature,
                             const RuleArgs& ru, at::Tensor& out) {
  auto kernel = threshold_select_kernel<Fmt>;
  opt_in_smem(reinterpret_cast<const void*>(kernel), logits.get_device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  kernel<<<r.N(), select::kThreads, sizeof(select::Smem), stream>>>(
      reinterpret_cast<const uint16_t*>(logits.data_ptr()), r.sB, r.sT, r.T, r.V,
      r.mask.data_ptr<bool>(), 1.0 / temperature,
      r.temperatures.has_value() ? r.temperatures->data_ptr<float>() : nullptr, ru.k(), ru.p(),
      ru.mp(), out.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor sampling_threshold_cuda(const at::Tensor& logits, const at::Tensor& mask_in,
                                   double temperature, const std::optional<at::Tensor>& top_k,
                                   const std::optional<at::Tensor>& top_p,
                                   const std::optional<at::Tensor>& min_p,
                                   const std::optional<at::Tensor>& temperatures) {
  check_cuda(logits);
  c10::cuda::CUDAGuard guard(logits.device());
  const RowArgs r = row_args(logits, std::nullopt, mask_in, temperature, temperatures);
  const at::Tensor& mask = r.mask;
  const int64_t B = r.B, T = r.T, V = r.V, N = r.N();
  at::Tensor out = at::empty({N}, logits.options().dtype(at::kDouble));
  if (N == 0) return out.view({B, T});
  if (threshold_select_fits(logits)) {
    const RuleArgs ru(logits, N, top_k, top_p, min_p);
    if (logits.scalar_type() == at::kBFloat16) {
      launch_threshold_select<select::Bf16Bits>(logits, r, temperature, ru, out);
    } else {
      launch_threshold_select<select::HalfBits>(logits, r, temperature, ru, out);
    }
    return out.view({B, T});
  }
  const at::Tensor rows = logits.narrow(1, 0, T).reshape({N, V});
  const at::Tensor m = mask.reshape({N});
  const int64_t chunk = std::max<int64_t>(1, (int64_t(64) << 20) / (V * 8 * 4));
  auto part = [&](const std::optional<at::Tensor>& p, int64_t r0, int64_t c)
      -> std::optional<at::Tensor> {
    if (!p.has_value()) return std::nullopt;
    return p->reshape({N}).narrow(0, r0, c);
  };
  const at::Tensor temps =
      r.temperatures.has_value() ? r.temperatures->reshape({N}).to(at::kDouble) : at::Tensor();
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t c = std::min(chunk, N - r0);
    out.narrow(0, r0, c).copy_(threshold_rows(rows.narrow(0, r0, c).to(at::kDouble),
                                              m.narrow(0, r0, c), temperature,
                                              temps.defined() ? temps.narrow(0, r0, c) : temps,
                                              part(top_k, r0, c), part(top_p, r0, c),
                                              part(min_p, r0, c)));
  }
  return out.view({B, T});
}

// sampling_threshold_cuda, then kept_logprobs_fwd_cuda on its threshold: for bfloat16 /
// float16 logits on a device that fits select::Smem one kernel (threshold_kept_kernel), else
// the two ops.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
threshold_kept_fwd_cuda(const at::Tensor& logits, const at::Tensor& tokens,
                        const at::Tensor& mask, double temperature,
                        const std::optional<at::Tensor>& top_k,
                        const std::optional<at::Tensor>& top_p,
                        const std::optional<at::Tensor>& min_p,
                        const std::optional<at::Tensor>& temperatures) {
  check_cuda(logits);
  c10::cuda::CUDAGuard guard(logits.device());
  if (!threshold_select_fits(logits)) {
    const at::Tensor thr =
        sampling_threshold_cuda(logits, mask, temperature, top_k, top_p, min_p, temperatures);
    auto [a, b, c, d, e, f] = kept_logprobs_fwd_cuda(logits, tokens, mask, temperature,
                                                     std::nullopt, std::nullopt, thr,
                                                     temperatures);
    return {a, b, c, d, e, f, thr};
  }
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  const int64_t B = r.B, T = r.T, N = r.N();
  auto [lp, en, mx, ls, size, miss] = kept_outputs(r);  // (float for 16-bit logits)
  at::Tensor thr = at::empty({B, T}, logits.options().dtype(at::kDouble));
  if (N == 0) return {lp, en, mx, ls, size, miss, thr};
  const RuleArgs ru(logits, N, top_k, top_p, min_p);
  auto launch = [&](auto kernel) {
    opt_in_smem(reinterpret_cast<const void*>(kernel), logits.get_device());
    kernel<<<N, select::kThreads, sizeof(select::Smem), c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const uint16_t*>(logits.data_ptr()), r.sB, r.sT, T, r.V,
        r.tokens.data_ptr<int64_t>(), r.mask.data_ptr<bool>(), 1.0 / temperature,
        r.temperatures.has_value() ? r.temperatures->data_ptr<float>() : nullptr, ru.k(),
        ru.p(), ru.mp(), thr.data_ptr<double>(), lp.data_ptr<float>(), en.data_ptr<float>(),
        mx.data_ptr<float>(), ls.data_ptr<float>(), size.data_ptr<int64_t>(),
        miss.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (logits.scalar_type() == at::kBFloat16) {
    launch(threshold_kept_kernel<select::Bf16Bits>);
  } else {
    launch(threshold_kept_kernel<select::HalfBits>);
  }
  return {lp, en, mx, ls, size, miss, thr};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CUDA, m) {
  m.impl("sampling_threshold", &sampling_threshold_cuda);
  m.impl("kept_logprobs_fwd", &kept_logprobs_fwd_cuda);
  m.impl("threshold_kept_fwd", &threshold_kept_fwd_cuda);
  m.impl("kept_logprobs_bwd_", &kept_logprobs_bwd_cuda_);
  m.impl("kept_logprobs_bwd", &kept_logprobs_bwd_cuda);
}

}  // namespace ppo_cuda
