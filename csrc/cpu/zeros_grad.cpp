// zeros_grad on the CPU: a zero gradient of like's shape and dtype, taken from the recycled
// gradient memory (grad_buffer.h) and zeroed by the pool's threads. It starts the gradient
// pass of sampling replay without a dense part (ppo_kernels/rows.py: the kept set's entries
// are then added in place): torch.zeros_like would map a fresh [N, V] buffer and fault every
// page in on one thread, slower than the dense pass it replaces.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "common.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

at::Tensor zeros_grad(const at::Tensor& like) {
  TORCH_CHECK(like.device().is_cpu(), "zeros_grad: expected a CPU tensor, got ", like.device());
  at::Tensor out = new_grad_buffer(like.sizes(), like.options());
  char* p = static_cast<char*>(out.data_ptr());
  const int64_t bytes = out.numel() * static_cast<int64_t>(out.element_size());
  constexpr int64_t kGrain = int64_t(1) << 20;  // a MiB a task: the pool's wake-up pays off
  at::parallel_for(0, bytes, kGrain, [&](int64_t begin, int64_t end) {
    std::memset(p + begin, 0, static_cast<size_t>(end - begin));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) { m.impl("zeros_grad", &zeros_grad); }

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
