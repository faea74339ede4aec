// CUDA score_rollout (schema in csrc/ops.cpp): the rollout side in two launches.
//  1. one pass over the logits (row_kernels.cuh, no gradient): logprob of each sampled
//     token, kl_t = kl_estimator(logp - ref_logp) and the reward -kl_coef * kl_t (0 masked);
//  2. the GAE scan (gae_scan.cuh), which first adds scores[b] to the reward at the LAST
//     VALID position of sequence b, then computes advantages and returns (A + V, or the
//     GAE of value_lam + V; lambda per sequence with lam_per_seq: csrc/ops.cpp).
// No whitening here: the Python layer whitens the advantages after the returns are taken.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "gae_scan.cuh"
#include "row_kernels.cuh"

namespace ppo_cuda {
namespace {

using Tensor = at::Tensor;

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> score_rollout_cuda(
    const Tensor& logits, const Tensor& tokens, const Tensor& mask,
    const Tensor& ref_logprobs, const Tensor& values_in, const Tensor& scores_in,
    double kl_coef, int64_t kl_estimator, double gamma, double lam, double temperature,
    const std::optional<Tensor>& lam_per_seq, std::optional<double> value_lam,
    const std::optional<at::Tensor>& temperatures) {
  check_cuda(logits);
  c10::cuda::CUDAGuard guard(logits.device());
  const RowArgs r = row_args(logits, tokens, mask, temperature, temperatures);
  check_kl_estimator(kl_estimator);
  TORCH_CHECK(gamma >= 0.0 && gamma <= 1.0, "gamma: expected a value in [0, 1], got ", gamma);
  TORCH_CHECK(lam >= 0.0 && lam <= 1.0, "lam: expected a value in [0, 1], got ", lam);
  TORCH_CHECK(!value_lam || (*value_lam >= 0.0 && *value_lam <= 1.0),
              "value_lam: expected a value in [0, 1], got ", value_lam.value_or(0.0));
  const auto acc = r.acc;
  const auto dev = logits.device();
  const int64_t B = r.B, T = r.T;
  const Tensor ref = r.per_token(ref_logprobs, "ref_logprobs");
  const Tensor values = r.per_token(values_in, "values");
  const Tensor scores = per_token(scores_in, "scores", acc, {B}, dev);
  const std::optional<Tensor> lams = opt_per_token(lam_per_seq, "lam_per_seq", acc, {B}, dev);
  const auto acc_opts = logits.options().dtype(acc);
  Tensor logp = at::empty({B, T}, acc_opts);
  Tensor kl = at::empty({B, T}, acc_opts);
  Tensor rewards = at::empty({B, T}, acc_opts);
  Tensor adv = at::empty({B, T}, acc_opts);
  Tensor ret = at::empty({B, T}, acc_opts);
  if (B * T == 0) return {logp, kl, rewards, adv, ret};
  TORCH_CHECK(B <= 0x7fffffff, "logits: too many sequences for one launch (", B, ")");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int device = dev.index();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "score_rollout_cuda", [&] {
        using A = acc_of<scalar_t>;
        RowsView<scalar_t> rv = make_view<scalar_t>(logits, r);
        TokenIO<A> io = empty_io<A>(kModeScore);
        io.ref_logp = ref.data_ptr<A>();
        io.kl_coef = static_cast<A>(kl_coef);
        io.kl_estimator = static_cast<int>(kl_estimator);
        io.logp = logp.data_ptr<A>();
        io.kl = kl.data_ptr<A>();
        io.rewards = rewards.data_ptr<A>();
        run_rows<scalar_t>(rv, io, make_row_temp<A>(r), acc_opts, device, stream);

        GaeArgs<A> g;
        g.rewards = rewards.data_ptr<A>();
        g.rewards_out = rewards.data_ptr<A>();
        g.values = values.data_ptr<A>();
        g.mask = r.mask.data_ptr<bool>();
        g.bootstrap = nullptr;
        g.scores = scores.data_ptr<A>();
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
  return {logp, kl, rewards, adv, ret};
}

}  // namespace
}  // namespace ppo_cuda

TORCH_LIBRARY_IMPL(ppo_kernels, CUDA, m) {
  m.impl("score_rollout", &ppo_cuda::score_rollout_cuda);
}
