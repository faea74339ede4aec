// zeros_grad on the CPU: a zero gradient of like's shape and dtype, taken from the recycled
// gradient memory (grad_buffer.h) and zeroed by the pool's threads. It starts the gradient
// pass of sampling replay without a dense part over a split vocabulary (ppo_kernels/rows.py:
// the shard's kept entries are then added in place): torch.zeros_like would map a fresh
// [N, V] buffer and fault every page in on one thread, slower than the pass it starts.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "common.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

at::Tensor zeros_grad(const at::Tensor& like) {
  TORCH_CHECK(like.device().is_cpu(), "zeros_grad: expected a CPU tensor, got ", like.device());
  return new_zero_grad(like.sizes(), like.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) { m.impl("zeros_grad", &zeros_grad); }

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
