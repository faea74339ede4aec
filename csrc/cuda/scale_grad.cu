// CUDA scale_grad_(Tensor(a!) grad, Tensor grad_output, Tensor(b!) applied) -> ()
// (schema in csrc/ops.cpp; docs/DESIGN.md, Precision): autograd's backward of ppo_loss.
//
// The forward wrote dlogits already multiplied by `applied` (its grad_scale). The backward
// must hand out grad_output * d loss / d logits, i.e. grad * f with f = grad_output / applied,
// WITHOUT reading anything on the host (CUDA-graph capture):
//   1. scale_grad_kernel: every block reads the two scalars; f == 1 (the usual case:
//      (loss * grad_scale).backward()) -> it returns at once, grad is not touched. Else it
//      multiplies its part of grad by f in the accumulation type, rounded once, in place.
//   2. set_applied_kernel (1 thread, stream-ordered after 1, so no block of 1 can read the
//      new value): applied := grad_output when f != 1, so that a second call with the same
//      grad_output is again a no-op.
// No allocation, no sync: capturable.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "row_kernels.cuh"

namespace ppo_cuda {
namespace {

template <typename A>
__device__ __forceinline__ A scale_factor(const A* grad_output, const A* applied) {
  return *grad_output / *applied;
}

// grid (B * Tl, S), kChunkThreads threads: chunk blockIdx.y of row blockIdx.x.
template <typename scalar_t>
__global__ void __launch_bounds__(kChunkThreads)
    scale_grad_kernel(scalar_t* grad, int64_t Tl, int64_t V, int64_t sB, int64_t sT,
                      int64_t chunk, const acc_of<scalar_t>* grad_output,
                      const acc_of<scalar_t>* applied) {
  using A = acc_of<scalar_t>;
  const A f = scale_factor(grad_output, applied);
  if (f == A(1)) return;
  const int64_t r = blockIdx.x;
  const int64_t b = r / Tl;
  const int64_t t = r - b * Tl;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t end = imin(V, begin + chunk);
  scale_range(grad + b * sB + t * sT, begin, end, V, f, static_cast<int>(threadIdx.x),
              static_cast<int>(blockDim.x));
}

template <typename A>
__global__ void set_applied_kernel(const A* grad_output, A* applied) {
  if (scale_factor(grad_output, applied) != A(1)) *applied = *grad_output;
}

void scale_grad_cuda(at::Tensor& grad, const at::Tensor& grad_output, at::Tensor& applied) {
  TORCH_CHECK(grad.is_cuda(), "ppo_kernels (CUDA): scale_grad_: grad must be a CUDA tensor");
  TORCH_CHECK(grad.dim() == 3, "ppo_kernels (CUDA): scale_grad_: grad must be [B, Tl, V], got ",
              grad.sizes());
  const auto dt = grad.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kDouble,
              "ppo_kernels (CUDA): scale_grad_: unsupported dtype ", dt);
  TORCH_CHECK(grad.stride(2) == 1 || grad.size(2) <= 1,
              "ppo_kernels (CUDA): scale_grad_: grad must be contiguous along the vocabulary");
  const auto acc = acc_dtype(dt);
  const at::Tensor* scalars[2] = {&grad_output, &applied};
  for (const at::Tensor* s : scalars) {
    TORCH_CHECK(s->device() == grad.device() && s->scalar_type() == acc && s->numel() == 1,
                "ppo_kernels (CUDA): scale_grad_: grad_output and applied must be one-element ",
                acc, " tensors on ", grad.device(), ", got ", s->scalar_type(), " ",
                s->sizes(), " on ", s->device());
  }
  TORCH_CHECK(applied.is_contiguous() || applied.dim() == 0,
              "ppo_kernels (CUDA): scale_grad_: applied must be contiguous");
  c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor go = grad_output.contiguous();  // 1 element: at most a tiny copy
  const int64_t B = grad.size(0), Tl = grad.size(1), V = grad.size(2);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "scale_grad_cuda", [&] {
    using A = acc_of<scalar_t>;
    if (B * Tl > 0 && V > 0) {
      TORCH_CHECK(B * Tl <= 0x7fffffff, "ppo_kernels (CUDA): scale_grad_: too many rows");
      const ChunkPlan cp = chunk_plan<scalar_t>(V);
      scale_grad_kernel<scalar_t>
          <<<dim3(static_cast<unsigned>(B * Tl), static_cast<unsigned>(cp.S)), kChunkThreads, 0,
             stream>>>(grad.data_ptr<scalar_t>(), Tl, V, grad.stride(0), grad.stride(1),
                       cp.chunk, go.data_ptr<A>(), applied.data_ptr<A>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    set_applied_kernel<A><<<1, 1, 0, stream>>>(go.data_ptr<A>(), applied.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace ppo_cuda

TORCH_LIBRARY_IMPL(ppo_kernels, CUDA, m) {
  m.impl("scale_grad_", &ppo_cuda::scale_grad_cuda);
}
