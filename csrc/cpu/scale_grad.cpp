// scale_grad_ on the CPU: the backward of the fused losses. Their forward already wrote
// dlogits pre-scaled by `applied` (grad_scale); autograd hands in grad_output, and the
// gradient must become grad_output * d loss / d logits. So grad *= grad_output / applied,
// in place (no [N, V] allocation), in the accumulation type (a bf16 gradient is widened,
// scaled and rounded once, never multiplied by a scale rounded to bf16), and nothing at all
// when the ratio is 1 (the usual loss.backward(), or (loss * grad_scale).backward() after a
// forward with that grad_scale). applied := grad_output, so a retained graph replays right.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "common.h"

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {
namespace {

template <typename scalar_t>
void scale_rows(scalar_t* base, int64_t rows, int64_t inner, int64_t V, int64_t s0, int64_t s1,
                acc_of<scalar_t> f) {
  using T = acc_of<scalar_t>;
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  at::parallel_for(0, rows, row_grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = base + (r / inner) * s0 + (r % inner) * s1;
      int64_t v = 0;
      const Vec vf(f);
      for (; v + 2 * W <= V; v += 2 * W) {
        Vec g[2];
        Lanes<scalar_t>::load(row + v, g, 2);
        g[0] = g[0] * vf;
        g[1] = g[1] * vf;
        Lanes<scalar_t>::store(g, row + v, 2);
      }
      for (; v < V; ++v) row[v] = static_cast<scalar_t>(static_cast<T>(row[v]) * f);
    }
  });
}

void scale_grad_(at::Tensor& grad, const at::Tensor& grad_output, at::Tensor& applied) {
  const at::ScalarType acc = ppo::acc_dtype(grad.scalar_type());
  TORCH_CHECK(grad_output.numel() == 1 && grad_output.scalar_type() == acc,
              "grad_output: expected one value of dtype ", acc, ", got ", grad_output.sizes(),
              " ", grad_output.scalar_type());
  TORCH_CHECK(applied.numel() == 1 && applied.scalar_type() == acc,
              "applied: expected one value of dtype ", acc);
  TORCH_CHECK(grad.dim() == 3 && (grad.stride(2) == 1 || grad.size(2) == 1),
              "grad: expected [B, Tl, V] with a unit vocabulary stride, got ", grad.sizes());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "scale_grad_",
                                  [&] {
    using T = acc_of<scalar_t>;
    const T go = *grad_output.data_ptr<T>();
    T* ap = applied.data_ptr<T>();
    if (go == *ap) return;
    TORCH_CHECK(*ap != T(0), "scale_grad_: the gradient was scaled to 0 by an earlier "
                "backward of this graph and cannot be rescaled");
    const T f = go / *ap;
    scale_rows<scalar_t>(grad.data_ptr<scalar_t>(), grad.size(0) * grad.size(1), grad.size(1),
                         grad.size(2), grad.stride(0), grad.stride(1), f);
    *ap = go;
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_kernels, CPU, m) { m.impl("scale_grad_", &scale_grad_); }

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
