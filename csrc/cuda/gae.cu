// CUDA gae (schema in csrc/ops.cpp): the reverse GAE scan of gae_scan.cuh, one block per
// sequence; masked positions transparent, bootstrap values optional, outputs 0 when masked;
// lambda per sequence (lam_per_seq) and the returns' value_lam as in csrc/ops.cpp.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "gae_scan.cuh"
#include "launch.h"

namespace ppo_cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards_in,
                                            const at::Tensor& values_in,
                                            const at::Tensor& mask_in,
                                            const std::optional<at::Tensor>& bootstrap_values,
                                            double gamma, double lam,
                                            const std::optional<at::Tensor>& lam_per_seq,
                                            std::optional<double> value_lam) {
  TORCH_CHECK(rewards_in.is_cuda(), "ppo_kernels (CUDA): rewards must be a CUDA tensor, got ",
              rewards_in.device());
  const auto dt = rewards_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble,
              "ppo_kernels (CUDA): rewards must be float32 or float64, got ", dt);
  TORCH_CHECK(rewards_in.dim() == 2, "ppo_kernels (CUDA): rewards must be [B, T], got ",
              rewards_in.sizes());
  TORCH_CHECK(gamma >= 0.0 && gamma <= 1.0, "ppo_kernels (CUDA): gamma must be in [0, 1], got ",
              gamma);
  TORCH_CHECK(lam >= 0.0 && lam <= 1.0, "ppo_kernels (CUDA): lam must be in [0, 1], got ", lam);
  TORCH_CHECK(!value_lam || (*value_lam >= 0.0 && *value_lam <= 1.0),
              "ppo_kernels (CUDA): value_lam must be in [0, 1], got ", value_lam.value_or(0.0));
  const auto dev = rewards_in.device();
  const auto shape = rewards_in.sizes();
  c10::cuda::CUDAGuard guard(dev);
  const at::Tensor rewards = rewards_in.contiguous();
  const at::Tensor values = per_token(values_in, "values", dt, shape, dev);
  TORCH_CHECK(mask_in.device() == dev && mask_in.scalar_type() == at::kBool &&
                  mask_in.sizes() == shape,
              "ppo_kernels (CUDA): mask must be bool ", shape, " on ", dev, ", got ",
              mask_in.scalar_type(), " ", mask_in.sizes(), " on ", mask_in.device());
  const at::Tensor mask = mask_in.contiguous();
  const int64_t B = shape[0], T = shape[1];
  std::optional<at::Tensor> boot;
  if (bootstrap_values.has_value() && bootstrap_values->defined()) {
    boot = per_token(*bootstrap_values, "bootstrap_values", dt, {B}, dev);
  }
  // (its values in [0, 1] are the caller's to ensure: reading them here would sync)
  const std::optional<at::Tensor> lams = opt_per_token(lam_per_seq, "lam_per_seq", dt, {B}, dev);
  at::Tensor adv = at::empty({B, T}, rewards.options());
  at::Tensor ret = at::empty({B, T}, rewards.options());
  if (B * T == 0) return {adv, ret};
  TORCH_CHECK(B <= 0x7fffffff, "ppo_kernels (CUDA): too many sequences");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(dt, "gae_cuda", [&] {
    using A = scalar_t;
    GaeArgs<A> g;
    g.rewards = rewards.data_ptr<A>();
    g.rewards_out = nullptr;
    g.values = values.data_ptr<A>();
    g.mask = mask.data_ptr<bool>();
    g.bootstrap = ptr_or_null<A>(boot);
    g.scores = nullptr;
    g.adv = adv.data_ptr<A>();
    g.ret = ret.data_ptr<A>();
    g.T = T;
    g.gamma = static_cast<A>(gamma);
    g.lam = static_cast<A>(lam);
    g.lam_per_seq = ptr_or_null<A>(lams);
    g.decoupled = value_lam.has_value();
    g.value_lam = static_cast<A>(value_lam.value_or(0.0));
    gae_kernel<A><<<static_cast<unsigned>(B), gae_threads(T), 0, stream>>>(g);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {adv, ret};
}

}  // namespace
}  // namespace ppo_cuda

TORCH_LIBRARY_IMPL(ppo_kernels, CUDA, m) { m.impl("gae", &ppo_cuda::gae_cuda); }
